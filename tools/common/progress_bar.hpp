// SPDX-License-Identifier: Apache-2.0
// A ckpt::Progress that draws a one-line bar on stderr when stderr is a terminal, and is silent
// otherwise (or with -q); notes go to stderr as "<program>: note: ..." unless -q.
#pragma once

#include <chrono>
#include <string>

#include "ckpt/progress.hpp"

namespace fsdp_tools {

/// The bar reads `copying [#####.....]  52%  1.2 GiB / 2.3 GiB  310 MB/s  0:04, 0:03 left`: the
/// rate and the time left once half a second has passed (no `0 MB/s` frame), redrawn at most ten
/// times a second. An unfinished bar's line is cleared when it is destroyed, so that an error
/// printed after it starts on a clean line.
class ProgressBar final : public ckpt::Progress {
 public:
  /// `quiet_bar`: no bar (-q, --dry-run); `quiet_notes`: no notes either (-q).
  explicit ProgressBar(std::string program, bool quiet_bar = false, bool quiet_notes = false);
  ~ProgressBar() override;
  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;
  void start(std::string_view what, std::uint64_t total) override;
  void advance(std::uint64_t units) override;
  void finish() override;
  void note(std::string_view message) override;

 private:
  void draw(bool force);
  void clear_line();
  std::string program_;
  bool enabled_;
  bool notes_;
  bool drawn_ = false;  // the bar is on the terminal's current line
  std::string what_;
  std::uint64_t total_ = 0, done_ = 0;
  std::chrono::steady_clock::time_point last_{}, started_{};
};

}  // namespace fsdp_tools
