// SPDX-License-Identifier: Apache-2.0
#include "fsdp-train/model.hpp"

#include <torch/torch.h>

#include <cmath>
#include <stdexcept>

#include "fsdp/script_module.hpp"

namespace fsdp_train {
namespace {

void init_linear(torch::nn::Linear& l, double std) {
  torch::NoGradGuard g;
  l->weight.normal_(0.0, std);
  if (l->bias.defined()) l->bias.zero_();
}

torch::nn::Linear linear(std::int64_t in, std::int64_t out, bool bias, double std) {
  torch::nn::Linear l(torch::nn::LinearOptions(in, out).bias(bias));
  init_linear(l, std);
  return l;
}

torch::nn::Embedding embedding(std::int64_t n, std::int64_t dim) {
  torch::nn::Embedding e(n, dim);
  torch::NoGradGuard g;
  e->weight.normal_(0.0, 0.02);
  return e;
}

struct EmbedImpl : torch::nn::Module {
  EmbedImpl(const ModelShape& s, bool positions) {
    wte = register_module("wte", embedding(s.vocab_size, s.n_embd));
    if (positions) wpe = register_module("wpe", embedding(s.block_size, s.n_embd));
  }
  torch::Tensor forward(const torch::Tensor& idx) {
    torch::Tensor x = wte(idx);
    if (wpe) x = x + wpe(torch::arange(idx.size(-1), torch::TensorOptions().dtype(torch::kLong)));
    return x;
  }
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
};
TORCH_MODULE(Embed);

struct AttentionImpl : torch::nn::Module {
  explicit AttentionImpl(const ModelShape& s) : n_head(s.n_head) {
    const double proj_std = 0.02 / std::sqrt(2.0 * s.n_layer);
    c_attn = register_module("c_attn", linear(s.n_embd, 3 * s.n_embd, true, 0.02));
    c_proj = register_module("c_proj", linear(s.n_embd, s.n_embd, true, proj_std));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const std::int64_t B = x.size(0), T = x.size(1), C = x.size(2), hd = C / n_head;
    auto qkv = c_attn(x).split(C, 2);
    auto heads = [&](const torch::Tensor& t) { return t.view({B, T, n_head, hd}).transpose(1, 2); };
    torch::Tensor q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
    torch::Tensor att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(hd)));
    torch::Tensor mask = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool)).tril();
    att = att.masked_fill(mask.logical_not(), -std::numeric_limits<float>::infinity()).softmax(-1);
    torch::Tensor y = torch::matmul(att, v).transpose(1, 2).contiguous().view({B, T, C});
    return c_proj(y);
  }
  std::int64_t n_head;
  torch::nn::Linear c_attn{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(Attention);

struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(const ModelShape& s) {
    c_fc = register_module("c_fc", linear(s.n_embd, 4 * s.n_embd, true, 0.02));
    c_proj = register_module("c_proj", linear(4 * s.n_embd, s.n_embd, true, 0.02 / std::sqrt(2.0 * s.n_layer)));
  }
  torch::Tensor forward(const torch::Tensor& x) { return c_proj(torch::gelu(c_fc(x))); }
  torch::nn::Linear c_fc{nullptr}, c_proj{nullptr};
};
TORCH_MODULE(Mlp);

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const ModelShape& s) {
    ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.n_embd})));
    attn = register_module("attn", Attention(s));
    ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.n_embd})));
    mlp = register_module("mlp", Mlp(s));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = x + attn(ln_1(x));
    return h + mlp(ln_2(h));
  }
  torch::nn::LayerNorm ln_1{nullptr}, ln_2{nullptr};
  Attention attn{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(Block);

// A bias-free linear layer over a given weight (the tied head's: the embedding's own Parameter).
struct TiedLinearImpl : torch::nn::Module {
  explicit TiedLinearImpl(const torch::Tensor& w) { weight = register_parameter("weight", w); }
  torch::Tensor forward(const torch::Tensor& x) { return torch::linear(x, weight); }
  torch::Tensor weight;
};
TORCH_MODULE(TiedLinear);

struct HeadImpl : torch::nn::Module {
  /// `tied`: the embedding's weight, which lm_head then uses as its own.
  HeadImpl(const ModelShape& s, const torch::Tensor& tied) {
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({s.n_embd})));
    if (tied.defined()) tied_head = register_module("lm_head", TiedLinear(tied));
    else lm_head = register_module("lm_head", linear(s.n_embd, s.vocab_size, false, 0.02));
  }
  torch::Tensor forward(const torch::Tensor& x) { return lm_head ? lm_head(ln_f(x)) : tied_head(ln_f(x)); }
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear lm_head{nullptr};
  TiedLinear tied_head{nullptr};
};
TORCH_MODULE(Head);

}  // namespace

torch::nn::Sequential make_model(const std::string& kind, const ModelShape& s) {
  torch::nn::Sequential seq;
  if (kind == "gpt") {
    if (s.n_embd % s.n_head != 0) {
      throw std::invalid_argument("--n-embd " + std::to_string(s.n_embd) + " is not a multiple of --n-head " + std::to_string(s.n_head));
    }
    Embed embed(s, true);
    seq->push_back("embed", embed);
    for (int i = 0; i < s.n_layer; ++i) seq->push_back("block" + std::to_string(i), Block(s));
    seq->push_back("head", Head(s, s.tie_weights ? embed->wte->weight : torch::Tensor()));
  } else if (kind == "mlp") {
    if (s.tie_weights) throw std::invalid_argument("--tie-weights is for --model gpt");
    seq->push_back("embed", Embed(s, false));
    seq->push_back("fc", linear(s.n_embd, 4 * s.n_embd, true, 0.02));
    seq->push_back("act", torch::nn::GELU());
    seq->push_back("out", linear(4 * s.n_embd, s.vocab_size, true, 0.02));
  } else if (kind == "script") {
    seq->push_back("script", fsdp::load_script_module(s.script));
  } else {
    throw std::invalid_argument("unknown model '" + kind + "' (gpt or mlp)");
  }
  return seq;
}

}  // namespace fsdp_train
