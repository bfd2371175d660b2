// SPDX-License-Identifier: Apache-2.0
#include "ckpt/copy.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <unordered_map>
#include <thread>
#include <utility>

#include "ckpt/error.hpp"
#include "ckpt/test_hooks.hpp"
#include "parallel.hpp"
#include "zip/crc32.hpp"

namespace ckpt {
namespace {

std::atomic<bool> g_cancel{false};
static_assert(std::atomic<bool>::is_always_lock_free, "request_cancel must be async-signal-safe");

}  // namespace

void request_cancel() noexcept { g_cancel.store(true, std::memory_order_relaxed); }
bool cancel_requested() noexcept { return g_cancel.load(std::memory_order_relaxed); }

std::uint64_t task_bytes(unsigned threads) noexcept {
  const std::uint64_t per = kInFlightBytes / (2 * std::uint64_t{copy_threads(threads)});
  return std::clamp<std::uint64_t>(per & ~std::uint64_t{4095}, std::uint64_t{1} << 20, kTaskBytes);
}

unsigned copy_threads(unsigned threads) noexcept {
  if (threads) return threads;
  const unsigned n = std::thread::hardware_concurrency();
  return n ? n : 1;
}

void add_range_tasks(std::vector<CopyTask>& tasks, SourcePtr source, std::uint64_t from, std::uint64_t length,
                     std::uint64_t offset, std::size_t group, std::uint64_t max_task) {
  for (std::uint64_t at = 0; at < length; at += max_task) {
    const std::uint64_t n = std::min(max_task, length - at);
    tasks.push_back({offset + at, n, group,
                     [source, pos = from + at](std::span<std::byte> out, std::vector<std::byte>&) { source->read_at(pos, out); }});
  }
}

std::vector<std::uint32_t> run_copy(PositionalSink& sink, std::vector<CopyTask> tasks, std::size_t groups,
                                    const CopyOptions& options) {
  PositionalSink* const one[] = {&sink};
  return run_copy(one, std::move(tasks), groups, options);
}

std::vector<std::uint32_t> run_copy(std::span<PositionalSink* const> sinks, std::vector<CopyTask> tasks, std::size_t groups,
                                    const CopyOptions& options) {
  std::uint64_t total = 0;
  for (const CopyTask& t : tasks) total += t.length;
  bool given = false;
  return run_copy(
      sinks,
      [&](std::vector<CopyTask>& out) {
        if (!std::exchange(given, true)) out = std::move(tasks);
        return false;
      },
      total, groups, options);
}

std::vector<std::uint32_t> run_copy(PositionalSink& sink, const TaskSource& next, std::uint64_t total, std::size_t groups,
                                    const CopyOptions& options) {
  PositionalSink* const one[] = {&sink};
  return run_copy(one, next, total, groups, options);
}

// NOTE [Tasks made as they are needed]: a checkpoint of 100,000 tensors makes hundreds of
// thousands of tasks, and each holds what it reads from (an item's parse, its source). Made all at
// once they would cost more than the copy's buffers by far. The engine keeps a queue instead: a
// worker that finds it empty asks the source for the next tasks (under the lock, so the source
// needs none of its own), and a task's closure is freed when it is done.
//
// NOTE [CRC groups in flight]: a call of the source makes every task of the groups it touches, so
// a group is complete once its tasks are done. Its finished pieces, (offset, length, crc), are
// kept only until then, and then combined in offset order into its CRC: what the engine holds is
// one CRC per group and the pieces of the groups in flight, never a list of every piece, which
// would grow with the output.
std::vector<std::uint32_t> run_copy(std::span<PositionalSink* const> sinks, const TaskSource& next, std::uint64_t total,
                                    std::size_t groups, const CopyOptions& options) {
  struct Piece {
    std::uint64_t offset, length;
    std::uint32_t crc;
  };
  struct Open {  // a group whose tasks are not all done
    std::size_t left = 0;  // tasks
    std::vector<Piece> pieces;
  };
  Progress& progress = options.progress ? *options.progress : no_progress();
  progress.start("copying", total);

  std::mutex mutex;  // guards everything below it, and calls of `next`
  std::deque<CopyTask> queue;
  std::vector<CopyTask> made;
  bool exhausted = false;
  std::uint64_t made_bytes = 0;
  std::vector<std::uint32_t> crcs(groups, 0);
  std::vector<bool> seen(groups);  // groups an earlier call of the source made tasks of
  std::unordered_map<std::size_t, Open> open;
  std::atomic<bool> failed{false};

  auto take = [&](CopyTask& t) {
    while (queue.empty() && !exhausted) {
      exhausted = !next(made);
      for (const CopyTask& m : made) {
        if (m.sink >= sinks.size()) internal_error("run_copy: task sink out of range");
        if (!groups) continue;
        if (m.group >= groups) internal_error("run_copy: task group out of range");
        if (seen[m.group]) internal_error("run_copy: a CRC group's tasks came from two calls of the task source");
        ++open[m.group].left;
      }
      for (CopyTask& m : made) {
        if (groups) seen[m.group] = true;
        made_bytes += m.length;
        queue.push_back(std::move(m));
      }
      made.clear();
    }
    if (queue.empty()) return false;
    t = std::move(queue.front());
    queue.pop_front();
    return true;
  };
  // A task's piece of its group; the group's CRC once it is the last.
  auto record = [&](std::size_t group, const Piece& p) {
    Open& g = open.at(group);
    g.pieces.push_back(p);
    if (--g.left) return;
    std::sort(g.pieces.begin(), g.pieces.end(), [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
    std::uint32_t crc = g.pieces[0].crc;
    for (std::size_t i = 1; i < g.pieces.size(); ++i) {
      if (g.pieces[i].offset != g.pieces[i - 1].offset + g.pieces[i - 1].length) internal_error("run_copy: the tasks of a CRC group leave a gap or overlap");
      crc = detail::crc32_combine(crc, g.pieces[i].crc, g.pieces[i].length);
    }
    crcs[group] = crc;
    open.erase(group);
  };

  struct Buffers {
    std::vector<std::byte> buffer, scratch;
  };
  const unsigned workers = copy_threads(options.threads);
  detail::parallel_for<Buffers>(workers, workers, [&](std::size_t, Buffers& b) {
    try {
      while (!failed.load(std::memory_order_relaxed)) {
        CopyTask t;
        {
          std::lock_guard lock(mutex);
          if (!take(t)) return;
        }
        if (options.task_delay_ms) std::this_thread::sleep_for(std::chrono::milliseconds(options.task_delay_ms));
        PositionalSink& sink = *sinks[t.sink];
        if (cancel_requested()) throw Error(ErrorKind::kCancelled, sink.name(), std::nullopt, "interrupted; nothing was written");
        if (b.buffer.size() < t.length) b.buffer.resize(static_cast<std::size_t>(t.length));
        const std::span<std::byte> out(b.buffer.data(), static_cast<std::size_t>(t.length));
        t.fill(out, b.scratch);
        const std::uint32_t crc = groups ? detail::crc32_update(0, out) : 0;
        sink.write_at(t.offset, out);
        test_hooks::crash_point("task");
        t.fill = nullptr;  // release what the closure holds (sources, item parses)
        std::lock_guard lock(mutex);
        if (groups) record(t.group, {t.offset, t.length, crc});
        progress.advance(t.length);
      }
    } catch (...) {
      failed = true;
      throw;
    }
  });
  progress.finish();
  if (made_bytes != total) internal_error("run_copy: the tasks make " + std::to_string(made_bytes) + " bytes, not " + std::to_string(total));
  if (!open.empty()) internal_error("run_copy: a CRC group's tasks did not all finish");
  return crcs;
}

}  // namespace ckpt
