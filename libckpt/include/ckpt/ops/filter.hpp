// SPDX-License-Identifier: Apache-2.0
// --include GLOB / --exclude GLOB, shared by merge and shard: filters apply in order to each
// entry's name; the last filter that matches decides; when none matches, the entry is selected
// unless the first filter is an include.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/dtype.hpp"
#include "ckpt/progress.hpp"

namespace ckpt {

struct EntryFilter {
  bool include = true;
  std::string glob;  ///< shell-style: '*', '?', '[...]'
};

/// Whether `filters` select `name`.
bool filters_select(const std::vector<EntryFilter>& filters, std::string_view name);

/// `filters` applied to every name of a checkpoint, remembering which of them matched a name: a
/// pattern that matches nothing is most likely a mistake, and a selection that selects nothing
/// must not write an empty checkpoint.
class EntrySelection {
 public:
  explicit EntrySelection(const std::vector<EntryFilter>& filters);
  /// Whether the filters select `name` (filters_select), counting what it selects.
  bool select(std::string_view name);
  /// How many names select() was given, and how many it selected.
  std::size_t offered() const noexcept { return offered_; }
  std::size_t selected() const noexcept { return selected_; }
  /// The filters that matched no name, as the command line gives them: "--include 'dec*'".
  std::vector<std::string> unmatched() const;
  /// Once every name of `where` was offered and `kept` entries are to be written: when a selection
  /// was made (`chose`: filters, or the caller's own such as --model-only) and nothing is kept,
  /// throws kInvalidArgument naming each filter that matched nothing and each of `why`; otherwise
  /// notes those on `progress` (may be null).
  void conclude(const std::string& where, std::size_t kept, bool chose, std::vector<std::string> why, Progress* progress) const;

 private:
  const std::vector<EntryFilter>& filters_;
  std::vector<bool> matched_;
  std::size_t offered_ = 0, selected_ = 0;
};

/// --strip-prefix P and --rename 's/REGEX/REPLACEMENT/[g]' (several, applied in order), shared by
/// merge and shard: the names an output gives its entries. The prefix goes first, from the names
/// that start with it; then each rename as sed's s command does it: any delimiter after the s,
/// an ECMAScript regex, \1 to \9 and & in the replacement, the first match or (g) every one.
/// Filters and --dtype's choice still see the input's names.
class EntryRenames {
 public:
  EntryRenames() = default;
  /// Throws kInvalidArgument for a rename that is not s<d>REGEX<d>REPLACEMENT<d>[g], or whose
  /// regex does not compile, naming it.
  EntryRenames(std::optional<std::string> strip_prefix, const std::vector<std::string>& renames);
  EntryRenames(const EntryRenames&);
  EntryRenames& operator=(const EntryRenames&);
  ~EntryRenames();

  bool empty() const noexcept { return !prefix_ && rules_.empty(); }
  /// `name` renamed.
  std::string apply(std::string_view name) const;
  /// `name` renamed, for an output that holds each name once: throws kInvalidArgument, naming
  /// both and `where`, when another name was renamed to the same one before.
  std::string claim(std::string_view name, const std::string& where);

 private:
  struct Rule;
  std::optional<std::string> prefix_;
  std::vector<std::shared_ptr<const Rule>> rules_;
  std::map<std::string, std::string, std::less<>> made_;  ///< new name -> the name it came from
};

struct Checkpoint;

/// The top-level key the entry `fqn` of `c` sits under: the first key of its planner_data path;
/// where a DCP checkpoint stores none (torch 1.13 keeps flat FQNs), the FQN's first component, as
/// torch 2.x would have stored it; empty for an entry of a flat state dict (safetensors, HDF5).
std::string_view top_level_key(const Checkpoint& c, std::string_view fqn);

/// Which tensors --dtype casts (NOTE [What --dtype casts]): the model's floating tensors, and any
/// other floating tensor a --cast-include GLOB names.
class CastScope {
 public:
  /// `c`: the checkpoint whose entries will be asked about; `to`: --dtype (none: cast nothing).
  CastScope(const Checkpoint& c, std::optional<DType> to, std::vector<std::string> include);
  /// The dtype the tensor `fqn` of `dtype` is written in.
  DType out(std::string_view fqn, DType dtype) const;

 private:
  const Checkpoint& c_;
  std::optional<DType> to_;
  std::vector<std::string> include_;
  bool has_model_ = false;  ///< some entry sits under the top-level key "model"
};

}  // namespace ckpt
