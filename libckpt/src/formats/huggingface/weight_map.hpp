// SPDX-License-Identifier: Apache-2.0
// The weight_map of a Hugging Face index, shared by its safetensors and torch.save shard sets.
#pragma once

#include <filesystem>
#include <functional>
#include <string>

#include "ckpt/checkpoint.hpp"

namespace ckpt::detail {

/// Adds to `c` the tensors of the shard at `path`, file `file` of `c`, that `take(name)` accepts
/// (the weight_map names them under this file).
using AddShard = std::function<void(Checkpoint& c, const std::filesystem::path& path, std::size_t file,
                                    const std::function<bool(const std::string& name)>& take)>;

/// A Hugging Face index (`model.safetensors.index.json`, `pytorch_model.bin.index.json`): its
/// weight_map's shards, file names inside the index's directory, read as one checkpoint of
/// `format` by `add_shard`; every tensor the weight_map names must be in the shard it names
/// (docs/formats/safetensors.md#sharded-sets). `kind` names the shards in messages.
Checkpoint open_weight_map(const std::filesystem::path& index, Format format, const std::string& kind, const AddShard& add_shard);

}  // namespace ckpt::detail
