// SPDX-License-Identifier: Apache-2.0
#include "fsdp-train/model.hpp"

#include <torch/torch.h>

#include <cmath>
#include <stdexcept>

#include "fsdp/fully_sharded.hpp"
#include "fsdp/script_module.hpp"
#include "fsdp/sharded_module.hpp"

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

// Hugging Face transformers' LlamaForCausalLM (models/llama/modeling_llama.py), eager attention,
// no biases; tests/train/llama.py is the same computation in PyTorch.

// LlamaRMSNorm: computed in float32, the weight applied in the input's dtype.
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(std::int64_t dim, double eps_) : eps(eps_) { weight = register_parameter("weight", torch::ones({dim})); }
  torch::Tensor forward(const torch::Tensor& x) {
    const torch::Tensor h = x.to(torch::kFloat);
    return weight * (h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(x.scalar_type());
  }
  double eps;
  torch::Tensor weight;
};
TORCH_MODULE(RMSNorm);

// The rotate-half convention: the first and second halves of each head's dimensions pair up.
torch::Tensor rotate_half(const torch::Tensor& x) {
  const std::int64_t h = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

// The dtype's lowest finite value (torch.finfo(dtype).min).
double lowest(c10::ScalarType t) {
  switch (t) {
    case torch::kHalf: return -65504.0;
    case torch::kBFloat16: return -3.38953139e38;
    case torch::kDouble: return std::numeric_limits<double>::lowest();
    default: return std::numeric_limits<float>::lowest();
  }
}

struct LlamaAttentionImpl : torch::nn::Module {
  explicit LlamaAttentionImpl(const ModelShape& s)
      : n_head(s.n_head), n_kv_head(s.n_kv_head > 0 ? s.n_kv_head : s.n_head), head_dim(s.n_embd / s.n_head), theta(s.rope_theta) {
    q_proj = register_module("q_proj", linear(s.n_embd, n_head * head_dim, false, 0.02));
    k_proj = register_module("k_proj", linear(s.n_embd, n_kv_head * head_dim, false, 0.02));
    v_proj = register_module("v_proj", linear(s.n_embd, n_kv_head * head_dim, false, 0.02));
    o_proj = register_module("o_proj", linear(n_head * head_dim, s.n_embd, false, 0.02));
  }
  /// `cos` and `sin` [B, T, head_dim] (float32) of each token's position; `mask` [B, 1, T, T], in
  /// x's dtype: added to the attention scores, 0 where a query attends to a key and the dtype's
  /// lowest value where it does not (Hugging Face's eager 4-d mask).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos_f32, const torch::Tensor& sin_f32, const torch::Tensor& mask) {
    const std::int64_t B = x.size(0), T = x.size(1);
    auto heads = [&](const torch::Tensor& t, std::int64_t n) { return t.view({B, T, n, head_dim}).transpose(1, 2); };
    torch::Tensor q = heads(q_proj(x), n_head), k = heads(k_proj(x), n_kv_head), v = heads(v_proj(x), n_kv_head);
    const torch::Tensor cos = cos_f32.unsqueeze(1).to(q.scalar_type()), sin = sin_f32.unsqueeze(1).to(q.scalar_type());
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    // Grouped-query attention: each key and value head serves n_head / n_kv_head query heads (repeat_kv).
    const std::int64_t rep = n_head / n_kv_head;
    auto repeated = [&](const torch::Tensor& t) {
      return rep == 1 ? t : t.unsqueeze(2).expand({B, n_kv_head, rep, T, head_dim}).reshape({B, n_head, T, head_dim});
    };
    k = repeated(k);
    v = repeated(v);
    torch::Tensor att = torch::matmul(q, k.transpose(2, 3)) / std::sqrt(static_cast<double>(head_dim)) + mask;
    att = att.softmax(-1, torch::kFloat).to(q.scalar_type());
    return o_proj(torch::matmul(att, v).transpose(1, 2).contiguous().reshape({B, T, n_head * head_dim}));
  }
  std::int64_t n_head, n_kv_head, head_dim;
  double theta;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};
TORCH_MODULE(LlamaAttention);

// SwiGLU: down(silu(gate(x)) * up(x)).
struct LlamaMlpImpl : torch::nn::Module {
  explicit LlamaMlpImpl(const ModelShape& s) {
    const std::int64_t hidden = llama_ffn_hidden(s.n_embd, s.ffn_hidden);
    gate_proj = register_module("gate_proj", linear(s.n_embd, hidden, false, 0.02));
    up_proj = register_module("up_proj", linear(s.n_embd, hidden, false, 0.02));
    down_proj = register_module("down_proj", linear(hidden, s.n_embd, false, 0.02));
  }
  torch::Tensor forward(const torch::Tensor& x) { return down_proj(torch::silu(gate_proj(x)) * up_proj(x)); }
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMlp);

struct LlamaDecoderLayerImpl : torch::nn::Module {
  explicit LlamaDecoderLayerImpl(const ModelShape& s) {
    input_layernorm = register_module("input_layernorm", RMSNorm(s.n_embd, s.norm_eps));
    self_attn = register_module("self_attn", LlamaAttention(s));
    post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(s.n_embd, s.norm_eps));
    mlp = register_module("mlp", LlamaMlp(s));
  }
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& mask) {
    const torch::Tensor h = x + self_attn(input_layernorm(x), cos, sin, mask);
    return h + mlp(post_attention_layernorm(h));
  }
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  LlamaAttention self_attn{nullptr};
  LlamaMlp mlp{nullptr};
};
using ShardedLayer = fsdp::Sharded<LlamaDecoderLayerImpl>;

// LlamaModel: the embedding, the layers (each an FSDP unit under `--auto-wrap block`), the final norm.
struct LlamaModelImpl : torch::nn::Module {
  explicit LlamaModelImpl(const ModelShape& s)
      : head_dim(s.n_embd / s.n_head), theta(s.rope_theta), embed_tokens(register_module("embed_tokens", embedding(s.vocab_size, s.n_embd))) {
    auto list = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < s.n_layer; ++i) {
      layers.push_back(std::make_shared<ShardedLayer>(s));
      list->push_back(layers.back());
    }
    norm = register_module("norm", RMSNorm(s.n_embd, s.norm_eps));
  }
  torch::Tensor forward(const torch::Tensor& ids, torch::Tensor positions, const torch::Tensor& attention_mask) {
    const std::int64_t B = ids.size(0), T = ids.size(1);
    const auto longs = torch::TensorOptions().dtype(torch::kLong).device(ids.device());
    const bool given = positions.defined();
    if (!given) positions = torch::arange(T, longs).unsqueeze(0).expand({B, T});
    // Rotary embeddings of each token's position, in float32 (LlamaRotaryEmbedding).
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(ids.device());
    const torch::Tensor inv_freq = 1.0 / torch::pow(theta, torch::arange(0, head_dim, 2, longs).to(torch::kFloat) / head_dim);
    const torch::Tensor freqs = positions.to(torch::kFloat).unsqueeze(-1) * inv_freq.to(f32);
    const torch::Tensor emb = torch::cat({freqs, freqs}, -1);
    const torch::Tensor cos = emb.cos(), sin = emb.sin();
    // Causal; keys that are padding masked out (the attention mask); a packed row's sequences (each
    // starting at position 0, as Hugging Face's packing collator gives them) kept apart.
    torch::Tensor allowed = torch::ones({T, T}, torch::TensorOptions().dtype(torch::kBool).device(ids.device())).tril().expand({B, 1, T, T});
    if (attention_mask.defined()) allowed = allowed.logical_and(attention_mask.to(torch::kBool).view({B, 1, 1, T}));
    if (given) {
      const torch::Tensor sequence = positions.eq(0).cumsum(1);
      allowed = allowed.logical_and(sequence.view({B, 1, T, 1}).eq(sequence.view({B, 1, 1, T})));
    }
    torch::Tensor h = embed_tokens(ids);
    // The dtype's lowest finite value where attention is not allowed, as Hugging Face's mask: a
    // row with no key (a padding query) gets uniform weights instead of NaN.
    const torch::Tensor mask = torch::zeros(allowed.sizes(), h.options().requires_grad(false))
                                   .masked_fill(allowed.logical_not(), lowest(h.scalar_type()));
    for (const auto& layer : layers) h = layer->forward(h, cos, sin, mask);
    return norm(h);
  }
  std::int64_t head_dim;
  double theta;
  torch::nn::Embedding embed_tokens;
  std::vector<std::shared_ptr<ShardedLayer>> layers;
  RMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaModel);

}  // namespace

// LlamaForCausalLM: the model and lm_head (tied: the embedding's own Parameter).
struct LlamaForCausalLMImpl : torch::nn::Module {
  explicit LlamaForCausalLMImpl(const ModelShape& s) : model(register_module("model", LlamaModel(s))) {
    if (s.tie_weights) tied_head = register_module("lm_head", TiedLinear(model->embed_tokens->weight));
    else lm_head = register_module("lm_head", linear(s.n_embd, s.vocab_size, false, 0.02));
  }
  torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& positions = {}, const torch::Tensor& attention_mask = {}) {
    const torch::Tensor h = model(ids, positions, attention_mask);
    return lm_head ? lm_head(h) : tied_head(h);
  }
  LlamaModel model;
  torch::nn::Linear lm_head{nullptr};
  TiedLinear tied_head{nullptr};
};

std::int64_t llama_ffn_hidden(std::int64_t n_embd, std::int64_t ffn_hidden) {
  if (ffn_hidden > 0) return ffn_hidden;
  const std::int64_t two_thirds = 2 * (4 * n_embd) / 3, multiple = 256;
  return (two_thirds + multiple - 1) / multiple * multiple;
}

namespace {
std::shared_ptr<LlamaForCausalLMImpl> new_llama(const ModelShape& s) {
  if (s.n_embd % s.n_head != 0 || (s.n_embd / s.n_head) % 2 != 0) {
    throw std::invalid_argument("--n-embd " + std::to_string(s.n_embd) + " over --n-head " + std::to_string(s.n_head) +
                                " must give an even head size (rotary embeddings pair a head's halves)");
  }
  if (s.n_kv_head > 0 && s.n_head % s.n_kv_head != 0) {
    throw std::invalid_argument("--n-head " + std::to_string(s.n_head) + " is not a multiple of --n-kv-head " + std::to_string(s.n_kv_head));
  }
  return std::make_shared<LlamaForCausalLMImpl>(s);
}
}  // namespace

Model::Model(const std::string& kind, const ModelShape& s) {
  if (kind == "llama") {
    llama_ = new_llama(s);
    return;
  }
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
    if (s.tie_weights) throw std::invalid_argument("--tie-weights is for --model gpt and llama");
    seq->push_back("embed", Embed(s, false));
    seq->push_back("fc", linear(s.n_embd, 4 * s.n_embd, true, 0.02));
    seq->push_back("act", torch::nn::GELU());
    seq->push_back("out", linear(4 * s.n_embd, s.vocab_size, true, 0.02));
  } else if (kind == "script") {
    seq->push_back("script", fsdp::load_script_module(s.script));
  } else {
    throw std::invalid_argument("unknown model '" + kind + "' (gpt, llama or mlp)");
  }
  sequential_ = seq;
}

torch::nn::Module& Model::module() { return llama_ ? static_cast<torch::nn::Module&>(*llama_) : *sequential_; }

fsdp::ShardedModel& Model::setup(fsdp::Strategy& strategy) {
  if (llama_) {
    auto& m = strategy.setup_module(llama_);
    forward_ = [&m](const torch::Tensor& tokens) { return m.forward(tokens); };
    return m;
  }
  auto& m = strategy.setup_module(sequential_);
  forward_ = [&m](const torch::Tensor& tokens) { return m.forward(tokens); };
  return m;
}

torch::Tensor Model::forward(const torch::Tensor& tokens) { return forward_(tokens); }

std::shared_ptr<torch::nn::Module> make_llama(const ModelShape& s) { return new_llama(s); }

torch::Tensor llama_forward(torch::nn::Module& llama, const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& attention_mask) {
  return dynamic_cast<LlamaForCausalLMImpl&>(llama).forward(ids, positions, attention_mask);
}

}  // namespace fsdp_train
