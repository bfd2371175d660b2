// SPDX-License-Identifier: Apache-2.0
// safetensors files (docs/formats/safetensors.md; huggingface/safetensors README and safetensors/src/tensor.rs).
//
//   offset 0      u64 little-endian N: header length in bytes
//   offset 8      N bytes of UTF-8 JSON, an object:
//                   {"__metadata__": {"<key>": "<str>", ...},            (optional, strings only)
//                    "<tensor>": {"dtype": "F32", "shape": [d0, ...], "data_offsets": [begin, end]}, ...}
//                 padded with spaces to a multiple of 8 by the reference writer
//   offset 8+N    the byte buffer; data_offsets count from here, end exclusive; C order, little-endian
//
// Limits we enforce, as the reference reader does (docs/formats/safetensors.md#reader-checks): file ≥ 8 bytes; N ≤ 100,000,000 and
// 8 + N ≤ file size; the header is valid UTF-8, starts with '{' and is one JSON object nested at
// most 64 deep; names are unique; dtype strings are known (others are refused, never guessed);
// shape entries and offsets are non-negative integers; sorted by offset the tensors tile the
// buffer from 0 with no hole or overlap, end − begin = numel × element size (overflow-checked),
// and the last end is the buffer's size (no trailing bytes).
// Errors name the file and the absolute byte offset of the faulty header byte or range.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "ckpt/dims.hpp"
#include "ckpt/dtype.hpp"
#include "ckpt/io.hpp"

namespace ckpt {

struct SafetensorsTensor {
  std::string name;
  DType dtype;
  std::vector<std::uint64_t> shape;
  std::uint64_t begin = 0;  ///< absolute offset of the first byte in the file
  std::uint64_t end = 0;    ///< absolute offset one past the last byte
};

struct SafetensorsFile {
  std::uint64_t header_size = 0;  ///< N
  std::vector<std::pair<std::string, std::string>> metadata;  ///< `__metadata__`, in file order
  std::vector<SafetensorsTensor> tensors;                      ///< in header order
  SourcePtr source;                                            ///< the file read
  /// The bytes [t.begin, t.end) of one of `tensors` as a window, no copy, made when asked for
  /// rather than kept for every tensor.
  SourcePtr data(const SafetensorsTensor& t) const;
};

/// Reads and validates the header; reads no tensor bytes. Throws ckpt::Error kFormat (malformed),
/// kUnsupported (a dtype string we know of but cannot represent).
SafetensorsFile read_safetensors(SourcePtr source);

/// Whether `source` looks like safetensors: 8 bytes of header length, then '{'.
bool looks_like_safetensors(const ByteSource& source);

struct SafetensorsEntry {
  std::string name;
  DType dtype;
  Dims shape;  ///< 1-d and 2-d inline (NOTE [Compact chunks]): a merge plans one per tensor
  SourcePtr data;  ///< exactly numel × element size bytes, C order (unused by plan_safetensors)
  std::uint64_t nbytes() const noexcept;
};

/// Where everything of a safetensors file goes, as the reference writer lays it out. The head is
/// not kept but made again when it is written: it grows with the tensors.
struct SafetensorsLayout {
  std::vector<SafetensorsEntry> entries;  ///< in the order their bytes follow the header
  std::vector<std::size_t> order;         ///< each of `entries`' index in the entries planned
  std::vector<std::uint64_t> begins;      ///< absolute offset of each entry's first byte
  std::vector<std::pair<std::string, std::string>> metadata;  ///< `__metadata__`
  std::uint64_t head_size = 0;            ///< the 8-byte length and the padded JSON header
  std::uint64_t size = 0;                 ///< of the whole file
  /// Passes the head (the 8-byte length and the padded JSON header, head_size bytes) to `write`,
  /// in order, in pieces of about 64 KiB.
  void write_head(const std::function<void(std::span<const std::byte>)>& write) const;
};

/// Lays out a safetensors file of `entries` (their data is not looked at). `target` names the
/// output in errors. Throws what write_safetensors throws, except for data sizes.
SafetensorsLayout plan_safetensors(std::vector<SafetensorsEntry> entries,
                                   const std::vector<std::pair<std::string, std::string>>& metadata, const std::string& target);

/// Writes a safetensors file as the reference writer does: tensors sorted by dtype alignment
/// (descending) then name, compact JSON with `__metadata__` first, the header padded with spaces
/// to a multiple of 8. Throws kInvalidArgument for a dtype safetensors has no string for, a data
/// size that does not match the shape, or a duplicate name. The sink is not committed.
void write_safetensors(ByteSink& sink, std::vector<SafetensorsEntry> entries,
                       const std::vector<std::pair<std::string, std::string>>& metadata = {});

/// A Hugging Face shard set planned: files of at most `max_shard_size` bytes of tensor data,
/// split greedily in entry order (a tensor larger than the bound alone in its file), named
/// `model-0000s-of-0000n.safetensors` (`model.safetensors` when one file is enough), and the
/// `model.safetensors.index.json` that names each tensor's file. Without `max_shard_size`: one
/// file named `single_name`.
struct SafetensorsShardSet {
  struct File {
    std::string name;
    std::size_t first = 0;     ///< its entries are the planned entries [first, first + layout.order.size())
    SafetensorsLayout layout;  ///< layout.order indexes those entries
  };
  std::vector<File> files;
  std::string index;           ///< the index's text; empty for one file
};
inline constexpr const char* kSafetensorsIndexName = "model.safetensors.index.json";
SafetensorsShardSet plan_safetensors_shards(std::vector<SafetensorsEntry> entries, std::optional<std::uint64_t> max_shard_size,
                                            const std::vector<std::pair<std::string, std::string>>& metadata,
                                            const std::string& single_name);

/// Opens a safetensors file into the index: one raw chunk per tensor, `__metadata__` as metadata.
Checkpoint open_safetensors_checkpoint(const std::filesystem::path& path);
/// A Hugging Face `model.safetensors.index.json`: its shards (file names inside the index's
/// directory) read as one checkpoint; a tensor the weight_map names must be in the shard it names.
Checkpoint open_safetensors_index_checkpoint(const std::filesystem::path& path);

}  // namespace ckpt
