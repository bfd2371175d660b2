// SPDX-License-Identifier: Apache-2.0
// merge: a sharded checkpoint (DCP or Lightning directory) into one full file, through the copy
// engine (ckpt/copy.hpp): the output is laid out from metadata, then every chunk is copied into
// its final offset in parallel, in memory bounded by the tasks in flight.
//
// torch output holds what PyTorch's dcp_to_torch_save produces (docs/formats/dcp.md#dcp_to_torch_save): entries
// nested by planner_data with torch's set_element rules (a str key makes a dict, an int key a list
// padded with None), plain dicts and lists, full contiguous CPU tensors, bytes items unpickled into
// their values (tensors inside them included); for a Lightning folder the top-level keys of meta.pt
// are then merged in, replacing entries of the same key, as Lightning's consolidate_checkpoint does.
// safetensors and HDF5 output (ckpt/formats/hdf5.hpp) hold tensors only.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/cast.hpp"
#include "ckpt/checkpoint.hpp"
#include "ckpt/copy.hpp"
#include "ckpt/ops/filter.hpp"
#include "ckpt/ops/result.hpp"
#include "ckpt/output.hpp"
#include "ckpt/progress.hpp"

namespace ckpt {

enum class MergeFormat { kTorch, kSafetensors, kHdf5 };
enum class MergeLayout { kNested, kFlat };

struct MergeOptions {
  MergeFormat format = MergeFormat::kTorch;
  MergeLayout layout = MergeLayout::kNested;  ///< torch: nested by planner_data, or {fqn: value}
  std::optional<std::string> key;             ///< safetensors: the top-level key whose tensors to write
  std::optional<DType> dtype;                 ///< cast the model's floating tensors (NOTE [What --dtype casts])
  std::vector<std::string> cast_include;      ///< --cast-include: also cast the floating tensors these globs name
  CastCheck cast_check = CastCheck::kReport;  ///< a cast that overflows or flushes values: a note, or (--strict-cast) an error
  Verify verify = Verify::kNo;                ///< check the input's CRC-32s as they pass (--verify), failing closed
  std::vector<EntryFilter> filters;           ///< applied to each FQN and each key of meta.pt
  bool model_only = false;                    ///< only the top-level key "model"
  /// --strip-prefix and --rename: the output's names (safetensors and HDF5, torch with
  /// MergeLayout::kFlat or a flat torch.save input); two names made one are refused.
  EntryRenames renames;
  /// safetensors: the Hugging Face sharded layout in a directory, files of at most this size
  /// (a tensor larger than it gets a file of its own).
  std::optional<std::uint64_t> max_shard_size;
  /// safetensors: Hugging Face's config.json (its text), written into a max_shard_size directory
  /// with the shards (the output is then a Hugging Face model folder, OutputKind::kHuggingFaceFolder)
  /// or beside a file output in the file system once the file is in place; listed among the files.
  std::optional<std::string> hf_config;
  Overwrite overwrite = Overwrite::kNo;
  unsigned threads = 0;                       ///< 0: the machine's cores
  /// Fill MergeResult::entries (about 200 bytes an entry); false: only its files, counts and bytes.
  bool report_entries = true;
  Progress* progress = nullptr;
  unsigned task_delay_ms = 0;                 ///< tests only (CopyOptions::task_delay_ms)
};

/// What merge planned or wrote (ckpt/ops/result.hpp).
using MergeResult = WriteResult;

/// Plans the merge of `input` into `output` and, unless `dry_run`, writes it atomically (see
/// NOTE [Atomic outputs]; a directory output is built under a temporary name and renamed). Throws
/// ckpt::Error: kInvalidArgument for options that cannot apply (no tensor under --key, an existing
/// output without Overwrite::kYes), kFormat/kMismatch/kIo for bad input, found before any output
/// exists where the metadata shows it; a failure while copying removes the partial output.
MergeResult merge(const Checkpoint& input, const std::filesystem::path& output, const MergeOptions& options, bool dry_run = false);
/// The same into any output (ckpt/output.hpp; options.overwrite is the output's business). HDF5
/// is written only to an output in the file system.
MergeResult merge(const Checkpoint& input, Output& output, const MergeOptions& options, bool dry_run = false);

}  // namespace ckpt
