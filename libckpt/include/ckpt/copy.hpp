// SPDX-License-Identifier: Apache-2.0
// The copy engine (DESIGN.md): every writer that produces a big file (merge, shard) lays the file
// out first from metadata, so every byte's final offset is known, then hands the engine a list of
// tasks. Each task makes `length` bytes (a range copied from an input, cast or gathered on the
// way) that go at `offset`; tasks run on `threads` workers and are written with pwrite, so they
// finish in any order. Memory is bounded by the tasks in flight: one buffer of the largest task
// per worker (writers cut tasks to task_bytes(threads)). The CRC-32 of each group of tasks (a zip member)
// is computed while the bytes pass and combined in offset order, never in a second pass.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string_view>
#include <vector>

#include "ckpt/io.hpp"
#include "ckpt/progress.hpp"

namespace ckpt {

/// Whether a conversion checks every CRC-32 its input records as the bytes pass through the copy
/// (--verify; NOTE [CRCs checked as the bytes pass]).
enum class Verify { kNo, kChecksums };

/// The most bytes a task makes: large enough for disk speed, small enough to bound memory.
constexpr std::uint64_t kTaskBytes = std::uint64_t{8} << 20;
/// The bytes all workers' buffers may hold together (a task's buffer, and its scratch for a cast).
constexpr std::uint64_t kInFlightBytes = std::uint64_t{32} << 20;

/// The size to cut tasks to for `threads` workers (0: the machine's cores), so that
/// threads × 2 buffers stay within kInFlightBytes: kTaskBytes on a few cores, down to 1 MiB.
std::uint64_t task_bytes(unsigned threads) noexcept;

struct CopyTask {
  std::uint64_t offset = 0;  ///< where the bytes go in the output
  std::uint64_t length = 0;  ///< how many the task makes
  std::size_t group = 0;     ///< CRC group: the tasks of one group must tile it, in any order
  /// Fills `out` (exactly `length` bytes). `scratch` is the worker's to use (a cast reads into
  /// it). Throws ckpt::Error for bad input.
  std::function<void(std::span<std::byte> out, std::vector<std::byte>& scratch)> fill;
  std::size_t sink = 0;      ///< which output (run_copy over several files: an index into `sinks`)
};

struct CopyOptions {
  unsigned threads = 0;           ///< 0: the machine's cores
  Progress* progress = nullptr;   ///< advanced by bytes written
  unsigned task_delay_ms = 0;     ///< tests only: sleep before each task, to interrupt a copy on cue
};

/// Asks every running and later run_copy to stop after the tasks in hand; it then throws
/// kCancelled. Async-signal-safe (one atomic store): tools call it from SIGINT/SIGTERM handlers.
void request_cancel() noexcept;
bool cancel_requested() noexcept;

/// Makes tasks on demand (NOTE [Tasks made as they are needed] in copy.cpp): appends the next few
/// to `out` and returns false once there are none left (it may append none and return true). The
/// engine calls it, one call at a time, whenever the tasks in hand run out, so that what a task
/// holds (an item's parse, its source) exists only for the tasks in flight, whatever the number
/// of tensors. A call makes all the tasks of each CRC group it makes any of (NOTE [CRC groups in
/// flight]); a group's tasks from two calls are an internal error. Throws ckpt::Error for bad
/// input, which stops the copy as a task's error does.
using TaskSource = std::function<bool(std::vector<CopyTask>& out)>;

/// Runs every task `next` makes into `sinks[task.sink]`: `total` bytes in all (what progress
/// counts; a different sum is an internal error). Otherwise as the run_copy below.
std::vector<std::uint32_t> run_copy(std::span<PositionalSink* const> sinks, const TaskSource& next, std::uint64_t total,
                                    std::size_t groups, const CopyOptions& options = {});
/// One sink.
std::vector<std::uint32_t> run_copy(PositionalSink& sink, const TaskSource& next, std::uint64_t total, std::size_t groups,
                                    const CopyOptions& options = {});

/// Runs every task into `sink` and returns the CRC-32 of each of `groups` groups (0 for a group
/// with no task). With `groups` 0 no CRC is computed, tasks' groups are ignored, and the result
/// is empty. On the first error the other workers stop and the error is rethrown here; the
/// sink is left uncommitted (the caller's destructor then removes the temporary file). Throws
/// kCancelled after request_cancel().
std::vector<std::uint32_t> run_copy(PositionalSink& sink, std::vector<CopyTask> tasks, std::size_t groups,
                                    const CopyOptions& options = {});
/// The same over several outputs at once (a DCP directory's files): each task writes into
/// `sinks[task.sink]`; one progress phase covers them all. A CRC group lies within one sink.
std::vector<std::uint32_t> run_copy(std::span<PositionalSink* const> sinks, std::vector<CopyTask> tasks, std::size_t groups,
                                    const CopyOptions& options = {});

/// Adds tasks that copy [`from`, `from + length`) of `source` as it is to `offset` of the output,
/// cut to `max_task` bytes each, in CRC group `group`. `source` is kept alive by the tasks.
void add_range_tasks(std::vector<CopyTask>& tasks, SourcePtr source, std::uint64_t from, std::uint64_t length,
                     std::uint64_t offset, std::size_t group, std::uint64_t max_task = kTaskBytes);

/// The number of workers run_copy uses for `threads` (0 means the machine's cores).
unsigned copy_threads(unsigned threads) noexcept;

}  // namespace ckpt
