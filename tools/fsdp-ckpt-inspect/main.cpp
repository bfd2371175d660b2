// SPDX-License-Identifier: Apache-2.0
// fsdp-ckpt-inspect: options -> make_app() -> one library call -> exit code.
#include <iostream>

#include "common/cli_common.hpp"
#include "common/run_tool.hpp"
#include "fsdp-ckpt-inspect/cli.hpp"

int main(int argc, char** argv) {
  fsdp_tools::InspectCliOptions options;
  auto app = fsdp_tools::make_inspect_app(options);
  if (auto code = fsdp_tools::parse(*app, argc, argv)) return *code;
  return fsdp_tools::run_tool("fsdp-ckpt-inspect", [&] {
    ckpt::inspect(fsdp_tools::to_library(options), std::cout);
    return 0;
  });
}
