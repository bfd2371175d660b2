// SPDX-License-Identifier: Apache-2.0
// The operations of fsdp-ckpt-inspect: inspect (summary and entries, from metadata alone), verify
// (is it complete and readable), stats (per-tensor statistics, streaming) and diff (two
// checkpoints of any formats and layouts). Each writes its report to the stream it is given, as
// text or as one JSON object (schema 1); the library never prints on its own.
#pragma once

#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/format.hpp"
#include "ckpt/ops/filter.hpp"
#include "ckpt/progress.hpp"

namespace ckpt {

enum class OutputFormat { kText, kJson };

struct InspectOptions {
  std::filesystem::path path;
  OutputFormat format = OutputFormat::kText;
  std::string tensor_glob;  ///< non-empty: only matching entries, each with its whole chunk grid
  bool meta = false;        ///< also print meta.pt, common.pt, .metadata and non-tensor items as trees
  bool summary = false;     ///< text: the summary alone, no table of entries (gguf_dump --no-tensors, h5dump -H)
  bool all_files = false;   ///< text: every file, where more than kFoldFiles data files are otherwise counted
  bool exact_bytes = false; ///< text: sizes in bytes, not in human units (KiB, MiB, ...)
  /// With tensor_glob: each matching tensor's first this many values, in C order, read from the
  /// bytes that hold them alone (read_elements); kAllValues: every one.
  std::optional<std::uint64_t> values = std::nullopt;
};
inline constexpr std::uint64_t kAllValues = ~std::uint64_t{0};

/// Past this many data files (DCP's __r_n.distcp, safetensors shards), the text summary counts
/// them in one line instead of listing each (InspectOptions::all_files lists them).
inline constexpr std::size_t kFoldFiles = 8;

struct Checkpoint;
/// Which entries a --tensor GLOB selects from.
enum class GlobOver { kTensors, kEntries };
/// Throws kInvalidArgument when `glob` (--tensor; empty: no selection) matches none of `c`'s
/// tensors (kTensors) or entries (kEntries): a listing of nothing is no answer to a typo.
void require_match(const Checkpoint& c, const std::string& glob, GlobOver over);

/// Throws ckpt::Error: kFormat for bad data (naming the file and offset), kUnsupported for a
/// format this build cannot read yet, kIo when the path cannot be read.
void inspect(const InspectOptions& options, std::ostream& out);
/// The same of a checkpoint open already (options.path unused; options.meta needs it opened with
/// MetaTrees::kKeep for its metadata trees).
void inspect(const Checkpoint& checkpoint, const InspectOptions& options, std::ostream& out);

enum class VerifyDepth { kStructure, kDeep };

struct VerifyOptions {
  std::filesystem::path path;
  VerifyDepth depth = VerifyDepth::kStructure;
  OutputFormat format = OutputFormat::kText;
};

/// One problem verify found: where (a file, an item inside it), the byte offset when known, what.
struct VerifyProblem {
  std::string source;
  std::optional<std::uint64_t> offset;
  std::string message;
};

/// "<source>: offset <N>: <message>", escaped for a terminal (the offset when known).
std::string to_string(const VerifyProblem& problem);

/// What verify found: every problem (none: sound), and what it checked.
struct VerifyReport {
  std::vector<VerifyProblem> problems;
  std::optional<Format> format;  ///< unset when the path could not be opened as a checkpoint
  std::size_t tensors = 0, objects = 0, files = 0, items = 0;
  bool ok() const noexcept { return problems.empty(); }
};

/// Checks everything it can and collects every problem it finds, not only the first. kDeep also
/// reads every byte (checking CRC-32s where the format records them), reporting bytes to
/// `progress`. A checkpoint that cannot be opened is one problem; nothing is thrown for it.
VerifyReport check_checkpoint(const VerifyOptions& options, Progress& progress = no_progress());

/// check_checkpoint, written to `out` as text (a "problem:" line each, then a summary) or JSON.
/// Returns true when the checkpoint is sound. Throws only for failures outside the checkpoint
/// (an unwritable stream).
bool verify(const VerifyOptions& options, std::ostream& out, Progress& progress = no_progress());

struct StatsOptions {
  std::filesystem::path path;
  std::string tensor_glob;  ///< empty: every tensor
  OutputFormat format = OutputFormat::kText;
  unsigned threads = 0;     ///< 0: the machine's cores
};

/// min, max, mean, std, max-abs, NaN and Inf counts per tensor, reading each chunk once.
void stats(const StatsOptions& options, std::ostream& out, Progress& progress = no_progress());

struct DiffOptions {
  std::filesystem::path a, b;
  double atol = 0.0;
  double rtol = 0.0;
  OutputFormat format = OutputFormat::kText;
  /// merge's selections, read on A's names (and on B's, in A's terms): --include/--exclude in order,
  /// --model-only, --key (A's tensors under that top-level key, named without it).
  std::vector<EntryFilter> filters;
  bool model_only = false;
  std::optional<std::string> key;
  /// --map-prefix FROM=TO: an A name that starts with FROM is compared as TO and the rest (the
  /// first that applies).
  std::vector<std::pair<std::string, std::string>> map_prefix;
};

/// Compares two checkpoints as fsdp-ckpt-merge reads them (meta.pt's top-level keys in place of the
/// DCP entries under the same keys; a torch 1.13 checkpoint's flat FQNs split at their first
/// component): entries only in A or only in B, shape differences, and per tensor the max-abs and
/// max-rel difference, taken in float64 across dtypes (a dtype change is noted, not a difference).
/// When B is a safetensors or HDF5 file, A's entries that such a file cannot hold (non-tensors) are
/// counted apart, and A's tensors under "model" are compared by their names below it, as merge
/// writes safetensors, unless --key says otherwise. Returns true when A and B are equal within
/// tolerance. Throws kInvalidArgument when the selection selects nothing.
bool diff(const DiffOptions& options, std::ostream& out, Progress& progress = no_progress());


}  // namespace ckpt
