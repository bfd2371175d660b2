// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <cstddef>

#include "ckpt/checkpoint.hpp"
#include "ckpt/formats/safetensors.hpp"

namespace ckpt::detail {

/// Appends one whole-tensor raw chunk over tensor `t` of a safetensors header, in file `file` of
/// the checkpoint (a single file's driver and a Hugging Face shard set share it).
void add_safetensors_tensor(Checkpoint& c, const SafetensorsTensor& t, std::size_t file);

}  // namespace ckpt::detail
