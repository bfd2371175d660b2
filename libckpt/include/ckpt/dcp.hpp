// SPDX-License-Identifier: Apache-2.0
// PyTorch Distributed Checkpoint (DCP) directories (spec/FORMATS.md §3):
//   <dir>/.metadata            a pickle (protocol 4 or 5) of one Metadata object:
//       Metadata{state_dict_metadata: {fqn: TensorStorageMetadata{properties: TensorProperties
//                  (state: (dtype, layout, requires_grad, memory_format, pin_memory)), size: Size,
//                  chunks: [ChunkStorageMetadata{offsets: Size, sizes: Size}]} | BytesStorageMetadata},
//                planner_data: {fqn: (key, ...)} | None,
//                storage_data: {MetadataIndex{fqn, offset: Size | absent, index}: _StorageInfo{
//                  relative_path, offset, length[, transform_descriptors]}},
//                storage_meta, version, ...}
//   <dir>/__{rank}_{n}.distcp  concatenated items; each tensor item and each bytes item is a whole
//                              torch.save archive at [offset, offset + length), offsets inside it
//                              counted from the item's first byte
//   <dir>/meta.pt              Lightning: the rest of the state, a torch.save file
// Accepted class paths: torch 1.13 (torch.distributed._shard.checkpoint), 2.0-2.2, 2.3+ (§3.3.4);
// a Metadata subclass from another module when its state has Metadata's fields; extra attributes
// (Megatron's mcore_data). The pickle is read by the restricted unpickler: persistent ids and any
// global outside the allow-list are refused and named, never executed.
// Checks on open: every file name stays inside the directory (no "..", no absolute path); every
// chunk lies inside its tensor; chunk rank equals tensor rank; known dtypes; storage ranges are
// non-negative and do not overflow. File existence, ranges inside files, decoding and coverage are
// checked by verify (ops/verify.hpp) so that a damaged checkpoint can still be inspected.
#pragma once

#include <filesystem>

#include "ckpt/checkpoint.hpp"

namespace ckpt {

/// Reads `.metadata` (and meta.pt, common.pt, metadata.json when present) into a Checkpoint
/// without reading any item. Throws ckpt::Error naming `.metadata` and the offset.
Checkpoint open_dcp(const std::filesystem::path& dir);

}  // namespace ckpt
