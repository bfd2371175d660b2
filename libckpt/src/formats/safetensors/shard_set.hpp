// SPDX-License-Identifier: Apache-2.0
#pragma once

#include "ckpt/checkpoint.hpp"
#include "ckpt/formats/safetensors.hpp"

namespace ckpt::detail {

/// Appends one whole-tensor raw chunk over tensor `t` of a safetensors header, in file `file` of
/// the checkpoint (the single-file driver and the shard-set reader share it).
void add_safetensors_tensor(Checkpoint& c, const SafetensorsTensor& t, std::size_t file);

}  // namespace ckpt::detail
