// SPDX-License-Identifier: Apache-2.0
// Opening any checkpoint: the format is detected from content (ckpt/format.hpp) and the driver
// of that format (src/formats/registry.cpp) builds the index.
#pragma once

#include <filesystem>

#include "ckpt/checkpoint.hpp"

namespace ckpt {

/// Opens any supported checkpoint, detecting the format from content. With MetaTrees::kKeep the
/// parsed metadata tree (a DCP .metadata, a torch.save file's pickle) is kept in meta_trees (for
/// --meta); by default it is dropped after reading, since for large checkpoints it is far bigger
/// than the index. Throws ckpt::Error naming the file and offset; for a path no driver accepts,
/// kFormat with what it is closest to ("a .metadata.tmp but no .metadata: ...").
Checkpoint open_checkpoint(const std::filesystem::path& path, MetaTrees trees = MetaTrees::kDrop);

}  // namespace ckpt
