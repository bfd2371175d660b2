// SPDX-License-Identifier: Apache-2.0
// The one worker pool: runs body(i, state) for every i in [0, count) on up to `threads` workers
// (0: the machine's cores), each with its own default-constructed State, in any order. The first
// exception stops the others (after the item in hand) and is rethrown to the caller.
#pragma once

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "ckpt/copy.hpp"

namespace ckpt::detail {

template <typename State, typename Body>
void parallel_for(std::size_t count, unsigned threads, Body&& body) {
  std::atomic<std::size_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mutex;
  auto worker = [&] {
    State state{};
    try {
      for (std::size_t i; !failed.load(std::memory_order_relaxed) && (i = next.fetch_add(1)) < count;) body(i, state);
    } catch (...) {
      failed = true;
      std::lock_guard lock(error_mutex);
      if (!error) error = std::current_exception();
    }
  };
  const unsigned n = std::min<unsigned>(copy_threads(threads), static_cast<unsigned>(std::max<std::size_t>(count, 1)));
  if (n <= 1) {
    worker();
  } else {
    std::vector<std::jthread> pool;
    for (unsigned i = 0; i < n; ++i) pool.emplace_back(worker);
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace ckpt::detail
