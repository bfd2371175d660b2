// SPDX-License-Identifier: Apache-2.0
// A ckpt::Progress that draws a one-line bar on stderr when stderr is a terminal, and is silent
// otherwise (or with -q).
#pragma once

#include <chrono>
#include <string>

#include "ckpt/progress.hpp"

namespace fsdp_tools {

class ProgressBar final : public ckpt::Progress {
 public:
  explicit ProgressBar(bool quiet = false);
  void start(std::string_view what, std::uint64_t total) override;
  void advance(std::uint64_t units) override;
  void finish() override;

 private:
  void draw(bool force);
  bool enabled_;
  std::string what_;
  std::uint64_t total_ = 0, done_ = 0;
  std::chrono::steady_clock::time_point last_{}, started_{};
};

}  // namespace fsdp_tools
