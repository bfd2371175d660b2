// SPDX-License-Identifier: Apache-2.0
// NOTE [Open index]: a hash table of 4-byte indices into a vector its owner keeps (KeyPaths'
// paths, a merge output dict's keys), where a hash map would add a node, a bucket and often a key
// copy per entry. Open addressing with linear probing; a slot holds an index + 1 (0: empty); the
// table is kept at most half full, so a probe always ends at an empty slot.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ckpt/error.hpp"

namespace ckpt::detail {

inline constexpr std::size_t kNotIndexed = static_cast<std::size_t>(-1);

/// The index whose entry `matches`, probing from `hash`; kNotIndexed when none does.
template <class Matches>
std::size_t open_index_find(const std::vector<std::uint32_t>& slots, std::size_t hash, Matches&& matches) {
  if (slots.empty()) return kNotIndexed;
  const std::size_t mask = slots.size() - 1;
  for (std::size_t i = hash & mask;; i = (i + 1) & mask) {
    if (slots[i] == 0) return kNotIndexed;
    if (matches(std::size_t{slots[i]} - 1)) return std::size_t{slots[i]} - 1;
  }
}

/// Indexes entry `count - 1`, just appended by the owner; when that would leave the table more
/// than half full it doubles and every entry is placed again (`hash_of(i)`: entry i's hash).
template <class HashOf>
void open_index_add(std::vector<std::uint32_t>& slots, std::size_t count, HashOf&& hash_of) {
  if (count == 0 || count > 0xfffffffeu) internal_error("open index: no entry, or more than 2^32 entries");
  auto place = [&](std::size_t entry) {
    const std::size_t mask = slots.size() - 1;
    std::size_t i = hash_of(entry) & mask;
    while (slots[i] != 0) i = (i + 1) & mask;
    slots[i] = static_cast<std::uint32_t>(entry + 1);
  };
  if (2 * count > slots.size()) {
    slots.assign(std::max<std::size_t>(16, 2 * slots.size()), 0);
    for (std::size_t j = 0; j < count; ++j) place(j);
  } else {
    place(count - 1);
  }
}

}  // namespace ckpt::detail
