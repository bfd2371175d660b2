// SPDX-License-Identifier: Apache-2.0
#include "common/run_tool.hpp"

#include <csignal>
#include <iostream>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include "ckpt/copy.hpp"
#include "ckpt/text.hpp"

#include "ckpt/error.hpp"

namespace fsdp_tools {

int run_tool(std::string_view program, const std::function<int()>& body) {
  try {
    return body();
  } catch (const ckpt::Error& e) {
    // Messages quote what files hold: printed escaped (ckpt::escape_name), one line each.
    std::cerr << program << ": error: " << ckpt::escape_name(e.what()) << "\n";
    if (e.kind() == ckpt::ErrorKind::kCancelled) return 130;
  } catch (const std::exception& e) {
    std::cerr << program << ": error: " << ckpt::escape_name(e.what()) << "\n";
  }
  return 1;
}

void map_large_blocks() {
#if defined(__GLIBC__)
  ::mallopt(M_MMAP_THRESHOLD, 128 * 1024);  // a fixed threshold: glibc no longer raises it
#endif
}

void cancel_on_signals() {
  struct sigaction sa {};
  sa.sa_handler = [](int) { ckpt::request_cancel(); };
  sa.sa_flags = static_cast<int>(SA_RESETHAND);  // the second signal takes the default action
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

}  // namespace fsdp_tools
