// SPDX-License-Identifier: Apache-2.0
// fsdp-ckpt-merge: options -> one library call (ckpt::merge) -> what was written, on stdout.
#include <cstdlib>
#include <iostream>

#include "ckpt/checkpoint.hpp"
#include "common/cli_common.hpp"
#include "common/progress_bar.hpp"
#include "common/run_tool.hpp"
#include "fsdp-ckpt-merge/cli.hpp"

int main(int argc, char** argv) {
  fsdp_tools::MergeCliOptions options;
  auto app = fsdp_tools::make_merge_app(options);
  if (auto code = fsdp_tools::parse(*app, argc, argv)) return *code;
  ckpt::MergeOptions merge;
  if (auto code = fsdp_tools::usage_errors("fsdp-ckpt-merge", [&] {
        merge = fsdp_tools::to_merge(options, fsdp_tools::filters_in_order(argc, argv));
        options.output = fsdp_tools::merge_output(options, merge);
      })) {
    return *code;
  }
  merge.task_delay_ms = fsdp_tools::test_hooks_from_environment();
  const fsdp_tools::WriteFlags& flags = options.flags;
  fsdp_tools::cancel_on_signals();
  fsdp_tools::map_large_blocks();
  return fsdp_tools::run_tool("fsdp-ckpt-merge", [&] {
    fsdp_tools::ProgressBar progress("fsdp-ckpt-merge", flags.quiet || flags.dry_run, flags.quiet);
    merge.progress = &progress;
    const ckpt::WriteResult result = fsdp_tools::run_merge(options, merge);
    if (flags.json) std::cout << ckpt::to_json(result);
    else if (!flags.quiet || flags.dry_run) ckpt::print_text(result, std::cout);  // -q: errors only
    return 0;
  });
}
