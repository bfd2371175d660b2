// SPDX-License-Identifier: Apache-2.0
// Box arithmetic over chunk grids (pure, no I/O): a chunk is the box [offsets, offsets + sizes)
// of its tensor. Shared by the DCP writer's checks, verify, and assembling tensors for merge and reshard.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <span>
#include <utility>
#include <vector>

#include "ckpt/dims.hpp"

namespace ckpt {

/// Elements in a box of `sizes` (1 for a 0-d box).
inline std::uint64_t box_volume(std::span<const std::int64_t> sizes) noexcept {
  std::uint64_t v = 1;
  for (auto s : sizes) v *= static_cast<std::uint64_t>(s);
  return v;
}

struct Box {
  Dims offsets, sizes;
};

/// The intersection of two boxes of the same rank, or std::nullopt when it holds no element.
inline std::optional<Box> intersect(std::span<const std::int64_t> a_off, std::span<const std::int64_t> a_size,
                                    std::span<const std::int64_t> b_off, std::span<const std::int64_t> b_size) {
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

/// Whether `inner` (a box inside `outer`, both absolute) is one contiguous run of `outer` in C
/// order: size 1 in every dimension before some k, whole in every dimension after it.
inline bool is_contiguous_run(std::span<const std::int64_t> inner_sizes, std::span<const std::int64_t> outer_sizes) noexcept {
  std::size_t k = 0;
  while (k < inner_sizes.size() && inner_sizes[k] == 1) ++k;
  for (std::size_t i = k + 1; i < inner_sizes.size(); ++i) {
    if (inner_sizes[i] != outer_sizes[i]) return false;
  }
  return true;
}

/// Flat C-order index of `point - origin` inside a box of `sizes`.
inline std::uint64_t flat_index(std::span<const std::int64_t> point, std::span<const std::int64_t> origin,
                                std::span<const std::int64_t> sizes) noexcept {
  std::uint64_t idx = 0;
  for (std::size_t i = 0; i < sizes.size(); ++i) idx = idx * static_cast<std::uint64_t>(sizes[i]) + static_cast<std::uint64_t>(point[i] - origin[i]);
  return idx;
}

/// Whether two boxes of the same rank share an element (intersect() without making the box).
inline bool overlaps(std::span<const std::int64_t> a_off, std::span<const std::int64_t> a_size, std::span<const std::int64_t> b_off,
                     std::span<const std::int64_t> b_size) noexcept {
  for (std::size_t d = 0; d < a_off.size(); ++d) {
    if (std::min(a_off[d] + a_size[d], b_off[d] + b_size[d]) <= std::max(a_off[d], b_off[d])) return false;
  }
  return true;
}

/// Checks that `chunks` tile a tensor of `shape`, every element covered exactly once. `chunks` is
/// anything with size() and operator[] whose elements have .offsets and .sizes, each box inside
/// the tensor. Calls `overlap(i, k)` (i < k) for chunks that overlap, at most once for each i, and
/// `coverage(volume, numel)` once when the chunks' volumes do not add up to the tensor's (a hole,
/// or an overlap already reported; `volume` std::nullopt: past 2^64). Calls neither for a sound
/// tiling.
///
/// Overlaps are found by a sweep along one dimension: the chunks in order of their start there,
/// each against those that start before it ends. The dimension is the one where that makes the
/// fewest pairs (none for FSDP's dim-0 pieces or for tensor parallelism's dim-1 ones), so a real
/// layout costs a sort per dimension, not every pair; and a chunk stops at its first overlap, so
/// many copies of one box cost no more than as many distinct ones.
template <typename Chunks, typename Overlap, typename Coverage>
void tiling_problems(std::span<const std::int64_t> shape, const Chunks& chunks, Overlap&& overlap, Coverage&& coverage) {
  const std::size_t n = chunks.size();
  std::uint64_t volume = 0;
  bool past = false;
  for (std::size_t i = 0; i < n; ++i) past = __builtin_add_overflow(volume, box_volume(chunks[i].sizes), &volume) || past;
  if (!shape.empty() && n > 1) {
    std::vector<std::int64_t> starts(n);
    std::size_t sweep = 0;
    std::uint64_t fewest = std::numeric_limits<std::uint64_t>::max();
    for (std::size_t d = 0; d < shape.size(); ++d) {
      for (std::size_t i = 0; i < n; ++i) starts[i] = chunks[i].offsets[d];
      std::sort(starts.begin(), starts.end());
      std::uint64_t pairs = 0;  // the chunks that start in each one's extent along d, itself included
      for (std::size_t i = 0; i < n; ++i) {
        const std::int64_t b = chunks[i].offsets[d], e = b + chunks[i].sizes[d];
        pairs += static_cast<std::uint64_t>(std::lower_bound(starts.begin(), starts.end(), e) - std::lower_bound(starts.begin(), starts.end(), b));
      }
      if (pairs < fewest) {
        fewest = pairs;
        sweep = d;
      }
    }
    std::vector<std::size_t> order(n);
    for (std::size_t i = 0; i < n; ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) {
      const std::int64_t a = chunks[x].offsets[sweep], b = chunks[y].offsets[sweep];
      return a != b ? a < b : x < y;
    });
    for (std::size_t a = 0; a < n; ++a) {
      const auto& ci = chunks[order[a]];
      const std::int64_t end = ci.offsets[sweep] + ci.sizes[sweep];
      for (std::size_t b = a + 1; b < n && chunks[order[b]].offsets[sweep] < end; ++b) {
        const auto& ck = chunks[order[b]];
        if (!overlaps(ci.offsets, ci.sizes, ck.offsets, ck.sizes)) continue;
        const auto [first, second] = std::minmax(order[a], order[b]);
        overlap(first, second);
        break;
      }
    }
  }
  const std::uint64_t numel = box_volume(shape);
  const bool ok = shape.empty() ? n == 1 : (!past && volume == numel && (numel == 0 || n > 0));
  if (!ok) coverage(past ? std::nullopt : std::optional<std::uint64_t>(volume), numel);
}

/// The boxes that elements [begin, end) of a tensor of `shape`, flattened in C order, make up, in
/// that order, each one contiguous run (is_contiguous_run): at most 2 * rank - 1 of them (the part
/// of a row before the first whole row, the whole rows, the part after them, recursively), and
/// one empty box for a 0-d tensor's element. None for an empty range. What a rank's slice of
/// FSDP's flat buffer holds of a parameter is such a range (docs/formats/sharding.md).
inline std::vector<Box> flat_range_boxes(std::span<const std::int64_t> shape, std::int64_t begin, std::int64_t end) {
  std::vector<Box> out;
  if (begin >= end) return out;
  if (shape.empty()) {
    out.emplace_back();
    return out;
  }
  std::vector<std::int64_t> at;  // the fixed indices of the dimensions before the current one
  auto rows = [&](std::size_t d, std::int64_t first, std::int64_t count) {  // whole rows of dimension d at `at`
    std::vector<std::int64_t> offsets = at, sizes(at.size(), 1);
    offsets.push_back(first);
    sizes.push_back(count);
    for (std::size_t i = d + 1; i < shape.size(); ++i) {
      offsets.push_back(0);
      sizes.push_back(shape[i]);
    }
    out.push_back({Dims(offsets), Dims(sizes)});
  };
  // [b, e) of the sub-tensor at `at`, which spans dimensions d and after.
  auto split = [&](auto& self, std::size_t d, std::int64_t b, std::int64_t e) -> void {
    std::int64_t row = 1;
    for (std::size_t i = d + 1; i < shape.size(); ++i) row *= shape[i];
    if (b % row != 0) {  // the end of row b / row
      const std::int64_t r = b / row, stop = std::min(e, (r + 1) * row);
      at.push_back(r);
      self(self, d + 1, b - r * row, stop - r * row);
      at.pop_back();
      b = stop;
    }
    if (b >= e) return;
    if (e / row > b / row) rows(d, b / row, e / row - b / row);
    if (e % row != 0) {  // the start of row e / row
      at.push_back(e / row);
      self(self, d + 1, 0, e % row);
      at.pop_back();
    }
  };
  split(split, 0, begin, end);
  return out;
}

/// The torch.chunk rule (docs/formats/sharding.md, "FSDP's flat split"): the [begin, begin + size)
/// pieces of a dimension of `length` split `world` ways; fewer than `world` when they run out.
inline std::vector<std::pair<std::int64_t, std::int64_t>> chunk_pieces(std::int64_t length, int world) {
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  if (length == 0) {
    for (int r = 0; r < world; ++r) out.emplace_back(0, 0);
    return out;
  }
  const std::int64_t c = (length + world - 1) / world;
  for (std::int64_t begin = 0; begin < length; begin += c) out.emplace_back(begin, std::min(c, length - begin));
  return out;
}

/// DTensor Shard(0) (docs/formats/sharding.md, "DTensor's Shard(0)"): rank `rank`'s
/// [begin, begin + size), empty at `length` past the end.
inline std::pair<std::int64_t, std::int64_t> dtensor_piece(std::int64_t length, int world, int rank) {
  if (length % world == 0) return {rank * (length / world), length / world};
  const std::int64_t c = (length + world - 1) / world;
  const std::int64_t start = rank * c;
  if (start >= length) return {length, 0};
  return {start, std::min(length, start + c) - start};
}

}  // namespace ckpt
