// SPDX-License-Identifier: Apache-2.0
// fsdp-ckpt-shard: options -> one library call (ckpt::shard) -> what was written, on stdout.
#include <cstdlib>
#include <iostream>

#include "ckpt/checkpoint.hpp"
#include "ckpt/open.hpp"
#include "common/cli_common.hpp"
#include "common/progress_bar.hpp"
#include "common/run_tool.hpp"
#include "fsdp-ckpt-shard/cli.hpp"

int main(int argc, char** argv) {
  fsdp_tools::ShardCliOptions options;
  auto app = fsdp_tools::make_shard_app(options);
  if (auto code = fsdp_tools::parse(*app, argc, argv)) return *code;
  ckpt::ShardOptions shard;
  std::map<std::string, std::string> env;
  for (const char* name : {"RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"}) {
    if (const char* v = std::getenv(name)) env[name] = v;
  }
  if (auto code = fsdp_tools::usage_errors("fsdp-ckpt-shard", [&] { shard = fsdp_tools::to_shard(options, fsdp_tools::filters_in_order(argc, argv), env); })) {
    return *code;
  }
  shard.task_delay_ms = fsdp_tools::test_hooks_from_environment();
  const fsdp_tools::WriteFlags& flags = options.flags;
  fsdp_tools::cancel_on_signals();
  fsdp_tools::map_large_blocks();
  return fsdp_tools::run_tool("fsdp-ckpt-shard", [&] {
    fsdp_tools::ProgressBar progress("fsdp-ckpt-shard", flags.quiet || flags.dry_run, flags.quiet);
    shard.progress = &progress;
    const ckpt::ShardResult result = ckpt::shard(ckpt::open_checkpoint(options.input), options.output, shard, flags.dry_run);
    if (flags.json) std::cout << ckpt::to_json(result);
    else if (!flags.quiet || flags.dry_run) ckpt::print_text(result, std::cout);  // -q: errors only
    return 0;
  });
}
