// SPDX-License-Identifier: Apache-2.0
#include "common/progress_bar.hpp"

#include <unistd.h>

#include <cstdio>
#include <utility>

namespace fsdp_tools {

ProgressBar::ProgressBar(std::string program, bool quiet_bar, bool quiet_notes)
    : program_(std::move(program)), enabled_(!quiet_bar && ::isatty(STDERR_FILENO)), notes_(!quiet_notes) {}

void ProgressBar::start(std::string_view what, std::uint64_t total) {
  what_ = std::string(what);
  total_ = total;
  done_ = 0;
  started_ = std::chrono::steady_clock::now();
  draw(true);
}

void ProgressBar::advance(std::uint64_t units) {
  done_ += units;
  draw(false);
}

void ProgressBar::finish() {
  if (!enabled_) return;
  draw(true);
  std::fputc('\n', stderr);
  drawn_ = false;
}

void ProgressBar::note(std::string_view message) {
  if (!notes_) return;
  if (drawn_) std::fputs("\r\033[K", stderr);  // the note takes the bar's line; the next draw redraws it
  drawn_ = false;
  std::fprintf(stderr, "%s: note: %.*s\n", program_.c_str(), static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
}

void ProgressBar::draw(bool force) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (!force && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  const double frac = total_ ? static_cast<double>(std::min(done_, total_)) / static_cast<double>(total_) : 1.0;
  const int width = 30, filled = static_cast<int>(frac * width);
  const double secs = std::chrono::duration<double>(now - started_).count();
  const double mbs = secs > 0 ? static_cast<double>(done_) / 1e6 / secs : 0;
  std::fprintf(stderr, "\r%s [%.*s%*s] %3.0f%% %.0f MB/s", what_.c_str(), filled, "##############################",
               width - filled, "", frac * 100, mbs);
  std::fflush(stderr);
  drawn_ = true;
}

}  // namespace fsdp_tools
