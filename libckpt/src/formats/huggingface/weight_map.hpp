// SPDX-License-Identifier: Apache-2.0
// The weight_map of a Hugging Face index, shared by its safetensors and torch.save shard sets.
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <string>

#include "ckpt/checkpoint.hpp"

namespace ckpt::detail {

/// A Hugging Face index (`model.safetensors.index.json`, `pytorch_model.bin.index.json`): its
/// weight_map's shards, file names inside the index's directory, read as one checkpoint; every
/// tensor the weight_map names must be in the shard it names
/// (docs/formats/safetensors.md#sharded-sets). `format` says which shards they are
/// (Format::kSafetensorsIndex or kTorchSaveIndex); without it, the shards' names say (all `.bin`:
/// torch.save), from the one parse of the index.
Checkpoint open_weight_map(const std::filesystem::path& index, std::optional<Format> format = std::nullopt);

}  // namespace ckpt::detail
