// SPDX-License-Identifier: Apache-2.0
// --hf-config: Hugging Face's config.json for the Llama an fsdp-train run saved, from the training
// configuration its checkpoint keeps (meta.pt's `config`, or a full file's top-level `config`).
#pragma once

#include <optional>
#include <string>

#include "ckpt/checkpoint.hpp"
#include "ckpt/dtype.hpp"

namespace fsdp_tools {

/// LlamaConfig's keys as config.json holds them (hidden_size = n_embd, intermediate_size =
/// ffn_hidden, num_key_value_heads = n_kv_head, tie_word_embeddings = tie_weights, ...);
/// torch_dtype is `dtype`'s name (the merge's --dtype), float32 without one. Throws ckpt::Error
/// kInvalidArgument, naming the input, when it holds no fsdp-train llama configuration.
std::string llama_hf_config(const ckpt::Checkpoint& input, std::optional<ckpt::DType> dtype);

}  // namespace fsdp_tools
