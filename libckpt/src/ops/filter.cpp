// SPDX-License-Identifier: Apache-2.0
#include "ckpt/ops/filter.hpp"

#include "ops/text.hpp"

namespace ckpt {

bool filters_select(const std::vector<EntryFilter>& filters, std::string_view name) {
  bool selected = filters.empty() || !filters.front().include;
  const std::string n(name);
  for (const EntryFilter& f : filters) {
    if (detail::glob_match(f.glob, n)) selected = f.include;
  }
  return selected;
}

}  // namespace ckpt
