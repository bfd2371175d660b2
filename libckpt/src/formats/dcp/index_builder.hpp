// SPDX-License-Identifier: Apache-2.0
// What both .metadata readers (the tree reader in metadata_tree.cpp and the direct reader in
// metadata_direct.cpp) do with what they read: entries, chunk locations, files, the writer it looks
// like. One piece, so that the two readers build the same index from the same file.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/checkpoint.hpp"

namespace ckpt::detail {

/// The problem with chunk `ch` of tensor `fqn` (of `shape`): its rank or its extent. Empty when
/// it fits.
std::string chunk_problem(const std::string& fqn, const Dims& shape, const Chunk& ch);

class DcpIndexBuilder {
 public:
  DcpIndexBuilder(std::string source, Checkpoint& c) : source_(std::move(source)), c_(c) {}

  [[noreturn]] void fail(std::uint64_t at, const std::string& message) const;
  const std::string& source() const noexcept { return source_; }

  // state_dict_metadata, in the order the file gives its items. `at`: the key's offset, for errors.
  void add_tensor(TensorEntry t, std::uint64_t at);  ///< t.name is the FQN
  void add_bytes(const std::string& fqn, std::uint64_t at);

  // storage_data, in any order against state_dict_metadata (finish() places what came first).
  /// The index in Checkpoint::files of `relative_path`, checked (inside the directory) and added
  /// when first met.
  std::uint32_t file_index(std::string_view relative_path, std::uint64_t at);
  /// One shared block per run of chunks with the same transforms (NOTE [Compact chunks]).
  ChunkLocation::LayoutPtr layout(std::vector<std::string> transforms);
  /// The location of the chunk of `fqn` at `offsets` (tensor), or of bytes entry `fqn`.
  void add_storage(std::string_view fqn, bool tensor, Dims offsets, ChunkLocation loc, std::uint64_t at);
  /// After both dicts: places storage met before its entry; notes what belongs to nothing.
  void finish();

  /// The writer the root class and Metadata's fields point to.
  void set_writer(std::string_view root_module, bool has_storage_meta, const std::string* version);

 private:
  struct Placed {
    bool tensor;
    std::size_t index;  ///< into c_.tensors or c_.objects
  };
  // The entries by FQN without a second copy of the names (NOTE [Compact chunks]): an
  // open-addressing table of entry numbers, each compared with its entry's own name.
  class EntryIndex {
   public:
    explicit EntryIndex(const Checkpoint& c) : c_(c) {}
    std::optional<Placed> find(std::string_view fqn) const;
    /// False when an entry of that name is there already.
    bool insert(std::string_view fqn, Placed p);

   private:
    static constexpr std::uint32_t kTensor = std::uint32_t{1} << 31;
    std::size_t mask() const { return slots_.size() - 1; }
    static std::uint32_t encode(Placed p) { return (p.tensor ? kTensor : 0) | static_cast<std::uint32_t>(p.index + 1); }
    static Placed decode(std::uint32_t v) { return {(v & kTensor) != 0, static_cast<std::size_t>((v & ~kTensor) - 1)}; }
    // insert() runs just before its entry is pushed, and compares only with entries pushed before.
    const std::string& name(Placed p) const { return p.tensor ? c_.tensors[p.index].name : c_.objects[p.index].name; }
    void put(std::string_view fqn, std::uint32_t v);
    void grow();
    const Checkpoint& c_;
    std::vector<std::uint32_t> slots_;  ///< 0: empty; else kTensor for a tensor | (index + 1)
    std::size_t count_ = 0;
  };
  struct Key {
    std::string fqn;
    bool tensor;
    Dims offsets;
    auto operator<=>(const Key&) const = default;
  };
  struct Pending {
    ChunkLocation location;
    std::uint64_t offset;  ///< of its MetadataIndex, for errors
  };

  void add_fqn(const std::string& fqn, bool tensor, std::size_t index, std::uint64_t at);
  bool place(std::string_view fqn, bool tensor, const Dims& offsets, const ChunkLocation& loc, std::uint64_t at);
  std::optional<Placed> find_entry(std::string_view fqn);

  std::string source_;
  Checkpoint& c_;
  EntryIndex entries_{c_};
  std::vector<std::uint32_t> next_chunk_;  ///< per tensor: the chunk place() looks at first
  std::map<Key, Pending> pending_;         ///< storage_data items read before their entry
  std::map<std::string, std::uint32_t, std::less<>> file_by_name_;
  std::uint32_t last_file_ = ~std::uint32_t{0};  ///< the file file_index() gave last
  std::size_t last_tensor_ = 0;                  ///< the tensor find_entry() gave last
  ChunkLocation::LayoutPtr last_layout_;  ///< the transforms the last chunk had
};

}  // namespace ckpt::detail
