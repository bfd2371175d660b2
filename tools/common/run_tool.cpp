// SPDX-License-Identifier: Apache-2.0
#include "common/run_tool.hpp"

#include <iostream>

#include "ckpt/error.hpp"

namespace fsdp_tools {

int run_tool(std::string_view program, const std::function<int()>& body) {
  try {
    return body();
  } catch (const ckpt::Error& e) {
    std::cerr << program << ": error: " << e.what() << "\n";
  } catch (const std::exception& e) {
    std::cerr << program << ": error: " << e.what() << "\n";
  }
  return 1;
}

}  // namespace fsdp_tools
