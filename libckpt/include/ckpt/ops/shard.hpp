// SPDX-License-Identifier: Apache-2.0
// shard: any checkpoint (a torch.save full file, safetensors or an index, a DCP or Lightning
// directory of any world size) into a DCP directory for `world_size` ranks, laid out as FSDP
// writes it (docs/formats/sharding.md), through the copy engine: each output chunk is copied from the
// input chunks that overlap it, range by range, never assembling a whole tensor.
//
// What goes where:
// - DCP input: every entry keeps its FQN and planner_data; bytes items are copied as they are;
//   meta.pt, common.pt and metadata.json are carried over byte for byte (meta.pt is rewritten
//   only when filters drop some of its keys).
// - torch.save input: flattened by DCP's rules (torch >= 2.4, docs/formats/dcp.md#flattening-and-planner-data): mappings are descended
//   into, lists only when they hold a tensor or a mapping, everything else is a leaf; planner_data
//   records each path. A Lightning full checkpoint (a top-level dict whose "model" is a mapping)
//   is split as Lightning's sharded save splits it: "model" and every optimizer state dict (a
//   mapping with "state" and "param_groups") go into the DCP part, the other top-level keys into
//   meta.pt. Anything else is a bare state dict: all of it in the DCP part.
// - safetensors input: every tensor by its name.
// - `key`: for input that is not DCP, every entry goes under this top-level key ("model").
//
// Geometry: kFsdp chunks dim 0 by torch.chunk's rule (FSDP1's sharded state dict: ranks past the
// last piece write nothing for that tensor); kDtensor as DTensor Shard(0) (every rank, empty
// shards at offset dim-0 size). 0-d tensors, tensors matched by `replicate` and non-tensor
// entries are written once, by the rank DCP's deduplication picks (docs/formats/dcp.md#deduplication). Optimizer moments
// have their parameter's shape, so they are chunked exactly like it.
//
// Several processes (RANK/WORLD_SIZE from a launcher, over a shared file system) can run the same
// shard together: output ranks are divided among them (rank r to process r mod P), each writes
// its files into `<outdir>.partial` and then a completion marker listing its items; process 0
// waits for every marker, writes `.metadata` last and moves the directory into place. A process
// that fails writes a failure marker instead; process 0 then writes no `.metadata` and names it.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/cast.hpp"
#include "ckpt/checkpoint.hpp"
#include "ckpt/copy.hpp"
#include "ckpt/formats/dcp.hpp"
#include "ckpt/ops/filter.hpp"
#include "ckpt/ops/result.hpp"
#include "ckpt/output.hpp"
#include "ckpt/progress.hpp"

namespace ckpt {

enum class ShardLayout { kFsdp, kDtensor };
/// kDcp: a DCP directory. kHfSafetensors: DCP's Hugging Face storage, what
/// HuggingFaceStorageWriter(save_sharded=True) writes (docs/formats/dcp.md#hugging-face-storage):
/// a safetensors file per rank, tensors only (other entries, meta.pt and the like are left out
/// with a note); one process.
enum class ShardFormat { kDcp, kHfSafetensors };

struct ShardOptions {
  int world_size = 1;
  ShardLayout layout = ShardLayout::kFsdp;
  ShardFormat format = ShardFormat::kDcp;
  std::vector<std::string> replicate;         ///< globs: tensors kept whole, written once
  int files_per_rank = 1;
  DcpCompression compression = DcpCompression::kNone;
  int zstd_level = 3;
  std::optional<DType> dtype;                 ///< cast the model's floating tensors (NOTE [What --dtype casts]; not those inside bytes items or meta.pt)
  std::vector<std::string> cast_include;      ///< --cast-include: also cast the floating tensors these globs name
  CastCheck cast_check = CastCheck::kReport;  ///< a cast that overflows or flushes values: a note, or (--strict-cast) an error
  Verify verify = Verify::kNo;                ///< check the input's CRC-32s as they pass (--verify), failing closed
  std::vector<EntryFilter> filters;           ///< applied to each FQN and each key of meta.pt
  /// --strip-prefix and --rename: each entry's FQN in the output (its planner_data path follows
  /// when it is the FQN split at '.'); two FQNs made one are refused.
  EntryRenames renames;
  std::optional<std::string> key;             ///< input that is not DCP: put every entry under this key
  /// The most memory one task may need: a band of a gathered tensor (dim-1 or strided input, a
  /// cast) and a compressed input item are decoded whole. Exceeding it is an error, not a swap.
  std::uint64_t max_memory = std::uint64_t{1} << 30;
  Overwrite overwrite = Overwrite::kNo;
  unsigned threads = 0;                       ///< 0: the machine's cores
  /// Fill ShardResult::entries (each with its chunks); false: only its files, counts and bytes.
  bool report_entries = true;
  Progress* progress = nullptr;
  unsigned task_delay_ms = 0;                 ///< tests only (CopyOptions::task_delay_ms)
  int process_index = 0;                      ///< distributed: this process among process_count
  int process_count = 1;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};  ///< process 0's wait for the others
};

/// What shard planned or wrote (ckpt/ops/result.hpp).
using ShardResult = WriteResult;

/// Plans the shard of `input` into the DCP directory `output` and, unless `dry_run`, writes it:
/// data files, then `.metadata` last, in a directory beside it (NOTE [Atomic outputs]; several
/// processes: `<output>.partial`), renamed into place. Throws
/// ckpt::Error: kInvalidArgument for options that cannot apply (an existing output without
/// Overwrite::kYes, the output over the input, a task larger than max_memory), kFormat/kMismatch/
/// kIo for bad input, found before any output exists where the metadata shows it; a failure while
/// copying leaves no output.
ShardResult shard(const Checkpoint& input, const std::filesystem::path& output, const ShardOptions& options, bool dry_run = false);
/// The same for an input not needed afterwards: its chunk lists go once the data files are
/// written, before `.metadata` is made, so the two never stand at once.
ShardResult shard(Checkpoint&& input, const std::filesystem::path& output, const ShardOptions& options, bool dry_run = false);
/// The same into any output (ckpt/output.hpp; options.overwrite is the output's business).
/// Several processes share an output in the file system only.
ShardResult shard(const Checkpoint& input, Output& output, const ShardOptions& options, bool dry_run = false);
ShardResult shard(Checkpoint&& input, Output& output, const ShardOptions& options, bool dry_run = false);


}  // namespace ckpt
