// SPDX-License-Identifier: Apache-2.0
// --include GLOB / --exclude GLOB, shared by merge and shard: filters apply in order to each
// entry's name; the last filter that matches decides; when none matches, the entry is selected
// unless the first filter is an include.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace ckpt {

struct EntryFilter {
  bool include = true;
  std::string glob;  ///< shell-style: '*', '?', '[...]'
};

/// Whether `filters` select `name`.
bool filters_select(const std::vector<EntryFilter>& filters, std::string_view name);

}  // namespace ckpt
