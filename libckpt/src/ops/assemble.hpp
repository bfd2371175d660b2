// SPDX-License-Identifier: Apache-2.0
// Copy tasks that assemble a box of a tensor (the whole tensor for a merge, one rank's slice for a
// reshard) from the chunks that hold it, C-contiguous, optionally cast.
//
// A chunk whose overlap with the box is one contiguous run both in the box and in the chunk's
// stored elements (every dim-0 shard, the FSDP case) becomes plain range copies of at most
// `max_task` bytes: no buffer beyond the copy's own. Anything else (dim-1 chunks, strided items) is
// gathered band by band: rows of the box's dim 0 filled from every chunk that crosses them, at
// most `max_task` bytes a band (or one row, when a row is larger).
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "ckpt/cast.hpp"
#include "ckpt/checkpoint.hpp"
#include "ckpt/copy.hpp"
#include "ckpt/sharding.hpp"
#include "ops/passing_crcs.hpp"

namespace ckpt::detail {

/// What copy tasks report as they run, each when given (they must outlive the tasks).
struct TaskChecks {
  CastLedger* casts = nullptr;  ///< a cast's damage, under the tensor's name
  PassingCrcs* crcs = nullptr;  ///< the CRC of every recorded storage read (--verify)
};

/// Adds to `tasks` (CRC group `group`) the tasks that write box `dest` of `tensor`, as `out`
/// elements, C-contiguous from offset `base` of the output. `reader` and `tensor` must outlive
/// the tasks. Reads every chunk's item header now (callers make a tensor's tasks when the engine
/// needs them, into an uncommitted output, so a missing file or a bad item leaves nothing);
/// compressed items are decoded when their task runs. Throws
/// kFormat/kMismatch for chunks that do not tile `dest` or items that disagree with the metadata,
/// and kInvalidArgument when one task would need more than `max_memory` bytes: a row of a gathered
/// band, or a compressed item, which its task decodes whole. `checks` says what the tasks report
/// as they run.
void add_box_tasks(std::vector<CopyTask>& tasks, const ChunkReader& reader, const TensorEntry& tensor, const Box& dest, DType out,
                   std::uint64_t base, std::size_t group, std::uint64_t max_task = kTaskBytes,
                   std::uint64_t max_memory = std::numeric_limits<std::uint64_t>::max(), const TaskChecks& checks = {});

/// The whole box of `tensor`.
Box whole(const TensorEntry& tensor);

}  // namespace ckpt::detail
