// SPDX-License-Identifier: Apache-2.0
// FQN -> path of keys: a DCP's planner_data (the keys through which torch's flatten_state_dict
// reached each leaf, so that dcp_to_torch_save nests it again), or a torch.save file's nesting.
//
// NOTE [Compact key paths]: a checkpoint of 100,000 tensors has 100,000 of them, and as a map of
// pickle trees they cost about 280 bytes each (a map node and its key, a tuple node, a str node
// and a string per key). A path of str and int keys whose texts joined by '.' spell the FQN,
// which is every path flatten_state_dict makes, is kept here as the positions of its cuts in one
// copy of the FQN, and made into a tuple again when it is asked for; about 80 bytes. Any other
// value is kept as the tree it was read as, so that whoever uses it reports it as before.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "ckpt/pickle.hpp"

namespace ckpt {

class KeyPaths {
 public:
  KeyPaths() = default;
  KeyPaths(const KeyPaths& other);
  KeyPaths& operator=(const KeyPaths& other);
  KeyPaths(KeyPaths&&) noexcept = default;  // the names' blocks move whole: the views stay valid
  KeyPaths& operator=(KeyPaths&&) noexcept = default;
  ~KeyPaths() = default;

  /// Sets `fqn`'s path to `value` (replacing one set before).
  void set(std::string_view fqn, const pickle::ValuePtr& value);
  /// Sets it unless `fqn` has one already.
  void add(std::string_view fqn, const pickle::ValuePtr& value);
  /// One key of a path as text: a str's, or an int's in decimal (as std::to_string writes it).
  struct Key {
    std::string_view text;
    bool is_int = false;
  };
  /// Sets `fqn`'s path to the tuple of `keys` and returns true when they spell it (a compact
  /// path); otherwise sets nothing and returns false. A reader's way to keep a path without
  /// making its tree first.
  bool set_spelled(std::string_view fqn, std::span<const Key> keys);
  bool contains(std::string_view fqn) const { return at(fqn) != nullptr; }
  /// `fqn`'s path: a tuple of str and int nodes, made anew for a compact one (offset 0), or the
  /// value as it was set; nullptr when `fqn` has none.
  pickle::ValuePtr find(std::string_view fqn) const;
  /// One key of a path, seen in place: a str's text, or an int's value (and, in a compact path,
  /// its text).
  struct KeyView {
    std::string_view text;
    bool is_int = false;
    std::int64_t index = 0;
  };
  /// `fqn`'s path as views that stay valid as long as this object does (a compact path's keys are
  /// cuts of the FQN kept here, a tree's are its own str and int nodes), without making a tuple:
  /// false when `fqn` has none or its value is not a non-empty tuple or list of str and int keys
  /// (find() gives the value itself).
  bool keys(std::string_view fqn, std::vector<KeyView>& out) const;
  std::size_t size() const noexcept { return entries_.size(); }
  bool empty() const noexcept { return entries_.empty(); }
  /// Every FQN that has a path, sorted (views into this object).
  std::vector<std::string_view> fqns() const;
  /// How many are kept as trees (not compact).
  std::size_t trees() const noexcept { return trees_.size(); }

 private:
  struct Rec {
    std::uint32_t cuts_at = 0;  ///< into cuts_: the end of each key but the last
    std::uint16_t keys = 0;
    std::uint16_t ints = 0;     ///< bit k: key k is an int
    std::int32_t tree = -1;     ///< >= 0: the value is trees_[tree]
  };
  std::string_view keep(std::string_view fqn);  ///< a copy that never moves
  Rec compact(std::string_view fqn, const pickle::ValuePtr& value);
  /// Whether `keys` (1 to 16) spell `fqn`; if so `r` gets their cuts.
  bool spell(std::string_view fqn, std::span<const Key> keys, Rec& r);
  /// `fqn`'s record becomes `r`.
  void put(std::string_view fqn, const Rec& r);
  struct Entry {
    std::string_view fqn;  ///< the kept copy
    Rec rec;
  };
  const Entry* at(std::string_view fqn) const;
  /// A compact path's keys: cuts of its kept FQN.
  void spelled(const Entry& e, std::vector<KeyView>& out) const;

  std::vector<std::unique_ptr<char[]>> blocks_;
  std::size_t block_used_ = 0, block_size_ = 0;
  /// The FQNs in the order first set, and a hash table of their indices (NOTE [Open index] in
  /// libckpt/src/open_index.hpp): 36 bytes a path where a hash map's node and bucket took 72.
  std::vector<Entry> entries_;
  std::vector<std::uint32_t> slots_;
  std::vector<std::uint32_t> cuts_;
  std::vector<pickle::ValuePtr> trees_;
};

}  // namespace ckpt
