// SPDX-License-Identifier: Apache-2.0
// What a writing operation (merge, shard) planned or wrote: one result type for both, and its one
// printer, as text and as the --json object, which every tool and binding prints alike.
#pragma once

#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/dtype.hpp"

namespace ckpt {

enum class Operation { kMerge, kShard };

/// One chunk of an output entry: the rank whose file holds it, and its box (tensors).
struct ResultChunk {
  int rank = 0;
  std::vector<std::int64_t> offsets, sizes;
};

/// One entry of the output.
struct ResultEntry {
  std::string name;                  ///< FQN, or the meta.pt key
  std::string kind;                  ///< "tensor", "object" (a bytes item), "meta" (a meta.pt key)
  std::optional<DType> dtype;        ///< tensors: the output dtype
  std::vector<std::int64_t> shape;
  std::uint64_t nbytes = 0;          ///< tensors: in the output dtype
  std::vector<ResultChunk> chunks;   ///< shard: a tensor's chunks in .metadata order; an object's one
  std::string file;                  ///< merge: the output file it goes to (its name)
};

struct ResultFile {
  std::filesystem::path path;
  std::uint64_t size = 0;            ///< shard's plan: before compression
  std::size_t count = 0;             ///< what it holds: tensors (merge), items (shard)
  bool written_here = true;          ///< shard across processes: whether this process wrote it
};

struct WriteResult {
  Operation operation = Operation::kMerge;
  bool dry_run = false;
  std::vector<ResultEntry> entries;  ///< in output order (empty unless the options ask for them)
  std::vector<ResultFile> files;
  std::size_t dropped = 0;           ///< entries the selection left out
  std::uint64_t tensor_bytes = 0;
  // shard
  int world_size = 0;
  bool committed = false;            ///< this process wrote .metadata (process 0, not a dry run)
  int process_index = 0, process_count = 1;
  bool compressed = false;           ///< sizes in a plan are before compression
};

/// The result as the tools print it: a dry run's plan (every entry, then the files it would
/// write), or the files written. Names are escaped (escape_name).
void print_text(const WriteResult& result, std::ostream& out);
/// The result as one JSON object (schema 1), indented by two, with a newline.
std::string to_json(const WriteResult& result);

}  // namespace ckpt
