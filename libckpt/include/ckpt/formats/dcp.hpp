// SPDX-License-Identifier: Apache-2.0
// PyTorch Distributed Checkpoint (DCP) directories (docs/formats/dcp.md):
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
// Accepted class paths: torch 1.13 (torch.distributed._shard.checkpoint), 2.0-2.2, 2.3+ (docs/formats/dcp.md#class-paths);
// a Metadata subclass from another module when its state has Metadata's fields; extra attributes
// (Megatron's mcore_data). The pickle is read by the restricted unpickler: persistent ids and any
// global outside the allow-list are refused and named, never executed.
// Checks on open: every file name stays inside the directory (no "..", no absolute path); every
// chunk lies inside its tensor; chunk rank equals tensor rank; known dtypes; storage ranges are
// non-negative and do not overflow. File existence, ranges inside files, decoding and coverage are
// checked by verify (ops/verify.hpp) so that a damaged checkpoint can still be inspected.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <vector>

#include "ckpt/checkpoint.hpp"

namespace ckpt {

/// Reads `.metadata` (and meta.pt, common.pt, metadata.json when present) into a Checkpoint
/// without reading any item. Throws ckpt::Error naming `.metadata` and the offset.
Checkpoint open_dcp(const std::filesystem::path& dir, MetaTrees trees = MetaTrees::kDrop);

/// One chunk to write: the box it covers, the rank whose file holds it, and its elements in C
/// order (exactly numel(sizes) × element size bytes).
struct DcpWriteChunk {
  int rank = 0;
  std::vector<std::int64_t> offsets;
  std::vector<std::int64_t> sizes;
  SourcePtr data;
};

struct DcpWriteTensor {
  std::string fqn;
  DType dtype = DType::kFloat32;
  std::vector<std::int64_t> shape;
  std::vector<DcpWriteChunk> chunks;
  bool requires_grad = false;
  /// Which of each rank's data files holds this tensor's chunks (__{rank}_{file}.distcp); -1: file
  /// 0, or DCP's split when no tensor names one. A save that writes a rank's files one at a time
  /// (write_dcp_rank_files with `file`) places its tensors so.
  int file = -1;
};

/// A non-tensor value, written as a bytes item (a torch.save archive of `value`) by `rank`.
struct DcpWriteObject {
  std::string fqn;
  pickle::ValuePtr value;
  int rank = 0;
};

/// Which torch release's layout to write.
enum class DcpLayout {
  kCurrent,   ///< torch 2.3+ class paths, storage_meta, version "1.0.0", planner_data (the default)
  kTorch113,  ///< torch.distributed._shard.checkpoint paths, three Metadata fields, planner_data None
};

enum class DcpCompression { kNone, kZstd };

struct DcpWriteOptions {
  int world_size = 1;                   ///< one __{rank}_0.distcp per rank, empty when it holds nothing
  DcpLayout layout = DcpLayout::kCurrent;
  DcpCompression compression = DcpCompression::kNone;  ///< kZstd: every item gets stream.zstd/1
  Overwrite overwrite = Overwrite::kNo;
  /// planner_data: FQN -> path of keys (a tuple of str and int). FQNs missing here get a
  /// one-element path.
  KeyPaths planner_data;
};

/// Writes a DCP directory as FSDP ranks would: every data file first (each complete and fsynced),
/// then `.metadata` through `.metadata.tmp` and a rename, so an interrupted write never looks
/// like a checkpoint (see NOTE [Atomic outputs]). Tensor items are whole torch.save archives with
/// offsets counted from the item's first byte; bytes items are torch.save archives of the value.
/// Throws kInvalidArgument for chunks that do not tile their tensor or data of the wrong size,
/// kIo for the file system. `dir` is created; with Overwrite::kNo it must not hold a checkpoint.
void write_dcp(const std::filesystem::path& dir, const std::vector<DcpWriteTensor>& tensors,
               const std::vector<DcpWriteObject>& objects, const DcpWriteOptions& options);

/// A save shared by `options.world_size` processes (libfsdp's): every process describes the whole
/// checkpoint alike, but only the chunks of its own `rank` need their data. Each writes its files
/// with write_dcp_rank_files; then, once every rank has (a barrier), one process writes `.metadata`
/// with write_dcp_metadata, which refuses while a data file is missing or short. Item offsets
/// follow from the plan, so no process sends another anything; uncompressed only. With `file`,
/// only that one of the rank's files is written, and only its chunks need their data: a caller
/// that makes its data piece by piece writes each file as soon as its chunks are made
/// (DcpWriteTensor::file places them).
void write_dcp_rank_files(const std::filesystem::path& dir, const std::vector<DcpWriteTensor>& tensors,
                          const std::vector<DcpWriteObject>& objects, const DcpWriteOptions& options, int rank,
                          std::optional<int> file = std::nullopt);
void write_dcp_metadata(const std::filesystem::path& dir, const std::vector<DcpWriteTensor>& tensors,
                        const std::vector<DcpWriteObject>& objects, const DcpWriteOptions& options);

}  // namespace ckpt
