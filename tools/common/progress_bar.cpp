// SPDX-License-Identifier: Apache-2.0
#include "common/progress_bar.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <utility>

#include "ckpt/text.hpp"

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
  clear_line();  // the note takes the bar's line; the next draw redraws it
  std::fprintf(stderr, "%s: note: %.*s\n", program_.c_str(), static_cast<int>(message.size()), message.data());
  std::fflush(stderr);
}

ProgressBar::~ProgressBar() { clear_line(); }

void ProgressBar::clear_line() {
  if (!drawn_) return;
  std::fputs("\r\033[K", stderr);
  std::fflush(stderr);
  drawn_ = false;
}

namespace {

std::string clock_text(double seconds) {
  const auto s = static_cast<long long>(seconds + 0.5);
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  } else {
    std::snprintf(buf, sizeof buf, "%lld:%02lld", s / 60, s % 60);
  }
  return buf;
}

}  // namespace

void ProgressBar::draw(bool force) {
  if (!enabled_) return;
  const auto now = std::chrono::steady_clock::now();
  if (!force && now - last_ < std::chrono::milliseconds(100)) return;
  last_ = now;
  const std::uint64_t done = std::min(done_, total_);
  const double frac = total_ ? static_cast<double>(done) / static_cast<double>(total_) : 1.0;
  const int width = 30, filled = static_cast<int>(frac * width);
  const double secs = std::chrono::duration<double>(now - started_).count();
  std::string line = "\r" + what_ + " [" + std::string(static_cast<std::size_t>(filled), '#') + std::string(static_cast<std::size_t>(width - filled), '.') + "] ";
  char pct[16];
  std::snprintf(pct, sizeof pct, "%3.0f%%", frac * 100);
  line += pct;
  line += "  " + ckpt::human_bytes(done) + " / " + ckpt::human_bytes(total_);
  if (secs >= 0.5) {
    const double rate = static_cast<double>(done) / secs;
    char r[32];
    std::snprintf(r, sizeof r, "  %.0f MB/s", rate / 1e6);
    line += r;
    line += "  " + clock_text(secs);
    if (done < total_ && rate > 0) line += ", " + clock_text(static_cast<double>(total_ - done) / rate) + " left";
  }
  line += "\033[K";
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
  drawn_ = true;
}

}  // namespace fsdp_tools
