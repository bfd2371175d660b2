// SPDX-License-Identifier: Apache-2.0
#include "ckpt/test_hooks.hpp"

#include <csignal>
#include <cstdlib>
#include <mutex>
#include <string>

namespace ckpt::test_hooks {
namespace {

struct CrashPoint {
  bool armed = false;
  std::string name;
  long countdown = 1;
  std::mutex mutex;
};

CrashPoint& point() {
  static CrashPoint p;
  return p;
}

}  // namespace

void set_crash_point(std::string_view spec) {
  CrashPoint& p = point();
  p.armed = !spec.empty();
  if (!p.armed) return;
  const auto colon = spec.rfind(':');
  p.name = std::string(spec.substr(0, colon));
  p.countdown = colon == std::string_view::npos ? 1 : std::max(1L, std::atol(std::string(spec.substr(colon + 1)).c_str()));
}

void crash_point(std::string_view name) noexcept {
  CrashPoint& p = point();
  if (!p.armed || name != p.name) return;
  std::lock_guard lock(p.mutex);
  if (--p.countdown == 0) std::raise(SIGKILL);
}

}  // namespace ckpt::test_hooks
