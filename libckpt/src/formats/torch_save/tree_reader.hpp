// SPDX-License-Identifier: Apache-2.0
// The object tree of a torch.save file, whatever holds it: a zip archive's data.pkl, or the object
// pickle of the legacy format. The container says where each storage's bytes lie.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "ckpt/formats/torch_save.hpp"

namespace ckpt::detail {

/// A storage's bytes as its container holds them, and their CRC-32 (0: the container keeps none).
struct StorageBytes {
  SourcePtr data;
  std::uint32_t crc32 = 0;
};

/// Finds the bytes of storage `key`, of `numel` elements of `dtype`, that the persistent id `pid`
/// names. Throws kFormat (naming the container and the offset) where they are missing or of
/// another size; may return null bytes that the container fills in later.
using LocateStorage = std::function<StorageBytes(const std::string& key, DType dtype, std::uint64_t numel, const pickle::Value& pid)>;

/// Walks `file.root`, named `pkl` in errors: fills file.tensors, objects and key_paths, and
/// file.storages in order of first reference (those that only tensors of kinds we do not list
/// reference included), each located through `locate`. A storage is the persistent id
/// ('storage', class, key, location, numel). Throws kFormat at the node that is wrong.
void read_tree(TorchSaveFile& file, const std::string& pkl, const LocateStorage& locate);

}  // namespace ckpt::detail
