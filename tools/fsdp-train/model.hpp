// SPDX-License-Identifier: Apache-2.0
// fsdp-train's models. gpt, mlp and script are torch::nn::Sequentials (each child one FSDP unit by
// default); llama is a module of its own, its decoder layers fsdp::Sharded:
//   gpt: embed (wte, wpe) | block0 … block{L-1} (ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
//        mlp.c_proj; pre-LayerNorm, causal self-attention, exact GELU) | head (ln_f, lm_head,
//        whose weight may be wte's: tied)
//   llama: model (embed_tokens, layers (0 … L-1, each input_layernorm, self_attn.{q,k,v,o}_proj,
//        post_attention_layernorm, mlp.{gate,up,down}_proj), norm), lm_head: Hugging Face's
//        LlamaForCausalLM with its names and layouts (RMSNorm, rotary embeddings of each token's
//        position in the rotate-half convention, grouped-query causal attention under a padding
//        mask, SwiGLU, no biases); its forward takes input ids, and positions and an attention
//        mask (padded and packed batches) where given
//   mlp: embed (wte) | fc | act (GELU) | out: a next-token model of the current token alone
// Parameter names are these FQNs; tests/train/gpt.py and tests/train/llama.py define the same
// modules in PyTorch.
// Initialization as nanoGPT's: N(0, 0.02) weights, zero biases, c_proj weights N(0, 0.02/√(2L)).
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "fsdp/strategy.hpp"

namespace fsdp_train {

struct ModelShape {
  int n_layer = 2, n_head = 4, n_embd = 64, block_size = 64, vocab_size = 256;
  /// gpt: head.lm_head.weight is embed.wte.weight (one Parameter under both names, as nanoGPT's);
  /// llama: lm_head.weight is model.embed_tokens.weight (tie_word_embeddings).
  bool tie_weights = false;
  // llama
  int n_kv_head = 0;        ///< key and value heads (grouped-query attention); 0: n_head
  std::int64_t ffn_hidden = 0;  ///< the MLP's hidden size; 0: Llama's rule (llama_ffn_hidden)
  double rope_theta = 10000, norm_eps = 1e-5;
  std::string script;  ///< kind "script": the torch.jit.save file
};

struct LlamaForCausalLMImpl;

/// A model as made, not yet sharded.
class Model {
 public:
  /// Initialized from the current torch seed; kind "script" is the TorchScript module of
  /// shape.script with its own values, the Sequential's only child. Throws std::invalid_argument
  /// for a shape that cannot be built (n_embd not a multiple of n_head), fsdp::Error for a file
  /// that is not a TorchScript module.
  Model(const std::string& kind, const ModelShape& shape);
  /// The module (its named_parameters() are the FQNs).
  torch::nn::Module& module();
  /// Sharded by `strategy` (setup_module): what the trainer steps and saves. Once.
  fsdp::ShardedModel& setup(fsdp::Strategy& strategy);
  /// Logits [B, T, vocab] of tokens [B, T], after setup.
  torch::Tensor forward(const torch::Tensor& tokens);

 private:
  torch::nn::Sequential sequential_{nullptr};
  std::shared_ptr<LlamaForCausalLMImpl> llama_;
  std::function<torch::Tensor(const torch::Tensor&)> forward_;
};

/// The Llama alone, not sharded (tests): make_llama's module gives llama_forward the logits
/// [B, T, vocab] of input ids [B, T], with positions [B, T] (none: 0 … T-1 in each row; a row's
/// sequences each start at position 0) and an attention mask [B, T] (1: a token, 0: padding; none:
/// all tokens).
std::shared_ptr<torch::nn::Module> make_llama(const ModelShape& shape);
torch::Tensor llama_forward(torch::nn::Module& llama, const torch::Tensor& ids, const torch::Tensor& positions, const torch::Tensor& attention_mask);

/// The llama MLP's hidden size: `ffn_hidden` when > 0, or Llama's rule, 2/3 of 4 × n_embd rounded
/// up to a multiple of 256 (11008 at 4096).
std::int64_t llama_ffn_hidden(std::int64_t n_embd, std::int64_t ffn_hidden);

}  // namespace fsdp_train
