// SPDX-License-Identifier: Apache-2.0
// The one validation of a checkpoint's index: what verify reports of the index, and what merge and
// shard refuse before they write anything. No tensor data is read.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>

#include "ckpt/checkpoint.hpp"
#include "ckpt/ops/inspect.hpp"

namespace ckpt {

/// Elements in a box of `sizes`, or std::nullopt when a size is negative or the product passes 2^63
/// (a hostile shape whose element count would wrap).
std::optional<std::uint64_t> checked_numel(std::span<const std::int64_t> sizes) noexcept;

/// Calls `problem` for every problem of `c`'s index, in entry order: a shape with a negative size,
/// or whose element or byte count does not fit 63 bits; chunks that overlap, leave a hole, or whose
/// element counts overflow; a chunk or bytes entry without storage; storage that passes the end of
/// its file (a missing file is reported once). Checked arithmetic throughout.
void index_problems(const Checkpoint& c, const std::function<void(VerifyProblem)>& problem);

/// Whether `loc` lies inside its file, whose size is known.
bool location_in_file(const Checkpoint& c, const ChunkLocation& loc) noexcept;

/// Throws kFormat naming the first problem index_problems finds (and how many there are): every
/// tool that writes from an index calls it before writing.
void require_valid_index(const Checkpoint& c);

}  // namespace ckpt
