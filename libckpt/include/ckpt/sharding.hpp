// SPDX-License-Identifier: Apache-2.0
// Box arithmetic over chunk grids (pure, no I/O): a chunk is the box [offsets, offsets + sizes)
// of its tensor. Shared by the DCP writer's checks, verify, and (later) merge and reshard plans.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace ckpt {

/// Elements in a box of `sizes` (1 for a 0-d box).
inline std::uint64_t box_volume(const std::vector<std::int64_t>& sizes) noexcept {
  std::uint64_t v = 1;
  for (auto s : sizes) v *= static_cast<std::uint64_t>(s);
  return v;
}

struct Box {
  std::vector<std::int64_t> offsets, sizes;
};

/// The intersection of two boxes of the same rank, or std::nullopt when it holds no element.
inline std::optional<Box> intersect(const std::vector<std::int64_t>& a_off, const std::vector<std::int64_t>& a_size,
                                    const std::vector<std::int64_t>& b_off, const std::vector<std::int64_t>& b_size) {
  Box out;
  for (std::size_t d = 0; d < a_off.size(); ++d) {
    const std::int64_t lo = std::max(a_off[d], b_off[d]);
    const std::int64_t hi = std::min(a_off[d] + a_size[d], b_off[d] + b_size[d]);
    if (hi <= lo) return std::nullopt;
    out.offsets.push_back(lo);
    out.sizes.push_back(hi - lo);
  }
  return out;
}

}  // namespace ckpt
