// SPDX-License-Identifier: Apache-2.0
// fsdp-train's models, as torch::nn::Sequential so that each child is one FSDP unit:
//   gpt: embed (wte, wpe) | block0 … block{L-1} (ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
//        mlp.c_proj; pre-LayerNorm, causal self-attention, exact GELU) | head (ln_f, lm_head,
//        whose weight may be wte's: tied)
//   mlp: embed (wte) | fc | act (GELU) | out: a next-token model of the current token alone
// Parameter names are these FQNs; tests/train/gpt.py defines the same modules in PyTorch.
// Initialization as nanoGPT's: N(0, 0.02) weights, zero biases, c_proj weights N(0, 0.02/√(2L)).
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <cstdint>
#include <string>

namespace fsdp_train {

struct ModelShape {
  int n_layer = 2, n_head = 4, n_embd = 64, block_size = 64, vocab_size = 256;
  /// gpt: head.lm_head.weight is embed.wte.weight (one Parameter under both names, as nanoGPT's).
  bool tie_weights = false;
  std::string script;  ///< kind "script": the torch.jit.save file
};

/// The model, initialized from the current torch seed; kind "script" is the TorchScript module
/// of shape.script with its own values, the Sequential's only child. Throws std::invalid_argument
/// for a shape that cannot be built (n_embd not a multiple of n_head), fsdp::Error for a file that
/// is not a TorchScript module.
torch::nn::Sequential make_model(const std::string& kind, const ModelShape& shape);

}  // namespace fsdp_train
