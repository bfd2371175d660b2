// SPDX-License-Identifier: Apache-2.0
// The .metadata interpreter behind open_dcp, callable on bytes (the fuzz target uses it).
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"

namespace ckpt::detail {

/// Parses `.metadata` bytes (named `source` in errors) into `checkpoint`, whose `root` must be the
/// directory the file names are relative to. Touches no data file. `release(n)`: bytes before n
/// are not needed for now; they are read again later (pickle::ParseOptions::on_scanned), so it
/// may only drop what comes back when read, as the pages of a file mapping do.
void read_dcp_metadata(std::span<const std::byte> bytes, const std::string& source, Checkpoint& checkpoint,
                       MetaTrees trees = MetaTrees::kDrop, const std::function<void(std::uint64_t)>& release = {});

/// The two readers read_dcp_metadata chooses from (NOTE [The direct .metadata reader]): the tree
/// reader, which reads any .metadata and reports every error; and the direct reader, which reads
/// a well-formed one faster (bench/metadata measures by how much) and returns false, touching
/// nothing, for anything else.
void read_dcp_metadata_tree(std::span<const std::byte> bytes, const std::string& source, Checkpoint& checkpoint,
                            MetaTrees trees = MetaTrees::kDrop, const std::function<void(std::uint64_t)>& release = {});
/// What the direct reader did (tests and ckpt_probe look): chunks read at a glance (NOTE [A chunk
/// at a glance]) or opcode by opcode, and storage_data's objects read at a glance (NOTE [An object
/// at a glance]).
struct DirectReadStats {
  std::uint64_t chunks_at_a_glance = 0;
  std::uint64_t chunks_by_opcode = 0;
  std::uint64_t objects_at_a_glance = 0;
  /// NOTE [The first pass beside the reader]: the memo indices below which the reader guessed
  /// (0: it had the first pass's answer from the start), the tokens it kept guessing, and whether
  /// a wrong guess made it read again.
  std::uint64_t guessed_below = 0;
  std::uint64_t guessed = 0;
  bool reguessed = false;
  /// NOTE [The builder beside the reader]: batches of pairs the index builder took on the other
  /// thread, and all it took.
  std::uint64_t batches_beside = 0;
  std::uint64_t batches = 0;
};
/// How the direct reader gets the first pass's answer.
struct DirectReadOptions {
  enum class FirstPass : std::uint8_t {
    kAuto,   ///< beside the reader, on another thread, for a .metadata up to 16 MiB; else first
    kFirst,  ///< first, then the reader
    kAt,     ///< tests: first, but the reader guesses until byte `settle_at` (0: not at all)
  };
  FirstPass first_pass = FirstPass::kAuto;
  std::uint64_t settle_at = 0;
};
bool read_dcp_metadata_direct(std::span<const std::byte> bytes, const std::string& source, Checkpoint& checkpoint,
                              const std::function<void(std::uint64_t)>& release = {}, DirectReadStats* stats = nullptr,
                              const DirectReadOptions& options = {});

/// The rank-local metadata files of `dir` (`__0.metadata`, `__1.metadata`, ...: NOTE [Rank-local
/// metadata] in metadata_tree.cpp), by rank; empty when there are none. Throws when a rank's file is missing.
std::vector<std::filesystem::path> rank_local_metadata(const std::filesystem::path& dir);

/// How a DCP checkpoint's items are read (formats/dcp/driver.cpp); open_dcp gives it to the index.
std::shared_ptr<const ItemDecoder> dcp_items();

/// NOTE [DCP's safetensors serialization]: a checkpoint that FileSystemWriter saved with
/// serialization_format=SAFETENSORS (torch 2.7 and later) keeps each data file's tensors in one
/// safetensors blob after its bytes items, and .metadata records every tensor item of a file at
/// the blob's start with length numel x element size, not where its bytes are. This finds each
/// such file (its tensor items do not start with a torch.save archive but with a safetensors
/// header) and points its chunks at their bytes in the blob, raw, after checking the blob's dtype,
/// shape and DCP_SHARDING_INFO offsets against the metadata. Throws kFormat/kMismatch naming the
/// file and offset; kUnsupported for such items under a transform.
void resolve_safetensors_items(Checkpoint& c);

/// How two indexes differ (the first difference found, in words), or empty when they are the same:
/// entries, chunks and their locations, files, notes, writer and planner_data. For tests and the
/// fuzz target, which hold the two readers to the same result.
std::string index_difference(const Checkpoint& a, const Checkpoint& b);

}  // namespace ckpt::detail
