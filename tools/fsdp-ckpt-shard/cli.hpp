// SPDX-License-Identifier: Apache-2.0
// fsdp-ckpt-shard's command line: the options struct (the single source of defaults), make_app(),
// and the translation into ckpt::ShardOptions (the process rank from the launcher's environment).
#pragma once

#include <CLI/CLI.hpp>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/ops/shard.hpp"
#include "common/cli_common.hpp"

namespace fsdp_tools {

struct ShardCliOptions {
  std::string input;
  std::string output;
  int world_size = 0;
  std::string layout = "fsdp";
  std::string format = "dcp";
  std::vector<std::string> replicate;
  int files_per_rank = 1;
  std::string compress;  ///< "", "zstd" or "zstd:LEVEL"
  std::string dtype;
  std::vector<std::string> cast_include;
  bool strict_cast = false;
  std::string key;
  std::string max_memory = "1GiB";
  double timeout = 1800;
  WriteFlags flags;
};

std::unique_ptr<CLI::App> make_shard_app(ShardCliOptions& options);

/// Throws CLI::ValidationError for values the parser could not check alone. `env` gives the
/// launcher's variables (RANK/WORLD_SIZE, or SLURM_PROCID/SLURM_NTASKS): this process's rank among
/// the cooperating processes.
ckpt::ShardOptions to_shard(const ShardCliOptions& o, std::vector<ckpt::EntryFilter> filters, const std::map<std::string, std::string>& env);

}  // namespace fsdp_tools
