// SPDX-License-Identifier: Apache-2.0
#include "ckpt/copy.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

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
  struct Done {
    std::uint64_t offset, length;
    std::uint32_t crc;
  };
  std::vector<Done> done(tasks.size());
  std::uint64_t total = 0;
  for (const CopyTask& t : tasks) {
    if (t.group >= groups) internal_error("run_copy: task group out of range");
    if (t.sink >= sinks.size()) internal_error("run_copy: task sink out of range");
    total += t.length;
  }
  Progress& progress = options.progress ? *options.progress : no_progress();
  progress.start("copying", total);

  std::mutex progress_mutex;
  struct Buffers {
    std::vector<std::byte> buffer, scratch;
  };
  detail::parallel_for<Buffers>(tasks.size(), options.threads, [&](std::size_t i, Buffers& b) {
    if (options.task_delay_ms) std::this_thread::sleep_for(std::chrono::milliseconds(options.task_delay_ms));
    CopyTask& t = tasks[i];
    PositionalSink& sink = *sinks[t.sink];
    if (cancel_requested()) throw Error(ErrorKind::kCancelled, sink.name(), std::nullopt, "interrupted; nothing was written");
    if (b.buffer.size() < t.length) b.buffer.resize(static_cast<std::size_t>(t.length));
    const std::span<std::byte> out(b.buffer.data(), static_cast<std::size_t>(t.length));
    t.fill(out, b.scratch);
    const std::uint32_t crc = detail::crc32_update(0, out);
    sink.write_at(t.offset, out);
    test_hooks::crash_point("task");
    done[i] = {t.offset, t.length, crc};
    t.fill = nullptr;  // release what the closure holds (sources, item parses)
    std::lock_guard lock(progress_mutex);
    progress.advance(t.length);
  });
  progress.finish();

  // Combine each group's pieces in offset order; they must tile the group without gaps.
  std::vector<std::size_t> order(tasks.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return tasks[a].group != tasks[b].group ? tasks[a].group < tasks[b].group : done[a].offset < done[b].offset;
  });
  std::vector<std::uint32_t> crcs(groups, 0);
  std::vector<std::uint64_t> end(groups, 0);
  std::vector<bool> started(groups, false);
  for (std::size_t i : order) {
    const std::size_t g = tasks[i].group;
    if (started[g] && done[i].offset != end[g]) internal_error("run_copy: the tasks of a CRC group leave a gap or overlap");
    crcs[g] = started[g] ? detail::crc32_combine(crcs[g], done[i].crc, done[i].length) : done[i].crc;
    started[g] = true;
    end[g] = done[i].offset + done[i].length;
  }
  return crcs;
}

}  // namespace ckpt
