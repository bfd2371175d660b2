// SPDX-License-Identifier: Apache-2.0
// fsdp-ckpt-inspect: options -> make_app() -> one library call -> exit code.
#include <iostream>

#include "common/cli_common.hpp"
#include "common/progress_bar.hpp"
#include "common/run_tool.hpp"
#include "fsdp-ckpt-inspect/cli.hpp"

int main(int argc, char** argv) {
  fsdp_tools::InspectCliOptions options;
  auto app = fsdp_tools::make_inspect_app(options);
  if (auto code = fsdp_tools::parse(*app.app, argc, argv)) return *code;
  ckpt::DiffOptions diff;
  ckpt::InspectOptions inspect;
  if (auto code = fsdp_tools::usage_errors("fsdp-ckpt-inspect", [&] {
        if (app.command() == fsdp_tools::InspectCommand::kDiff) diff = fsdp_tools::to_diff(options, fsdp_tools::filters_in_order(argc, argv));
        if (app.command() == fsdp_tools::InspectCommand::kInspect) inspect = fsdp_tools::to_inspect(options);
      })) {
    return *code;
  }
  fsdp_tools::map_large_blocks();
  return fsdp_tools::run_tool("fsdp-ckpt-inspect", [&] {
    fsdp_tools::ProgressBar progress("fsdp-ckpt-inspect", options.quiet || options.json, options.quiet);
    switch (app.command()) {
      case fsdp_tools::InspectCommand::kVerify: return ckpt::verify(fsdp_tools::to_verify(options), std::cout, progress) ? 0 : 1;
      case fsdp_tools::InspectCommand::kStats: ckpt::stats(fsdp_tools::to_stats(options), std::cout, progress); return 0;
      case fsdp_tools::InspectCommand::kDiff: return ckpt::diff(diff, std::cout, progress) ? 0 : 1;
      case fsdp_tools::InspectCommand::kInspect: break;
    }
    ckpt::inspect(inspect, std::cout);
    return 0;
  });
}
