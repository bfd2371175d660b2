// SPDX-License-Identifier: Apache-2.0
// fsdp-ckpt-merge's command line: the options struct (the single source of defaults), make_app(),
// the translation into ckpt::MergeOptions, and the merge they describe (run_merge, which the tool
// and the Python module both call).
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>
#include <vector>

#include "ckpt/ops/merge.hpp"
#include "common/cli_common.hpp"

namespace fsdp_tools {

struct MergeCliOptions {
  std::string input;
  std::string output;
  std::string format;  ///< empty: from OUTPUT's extension
  std::string layout = "nested";
  std::string key;
  std::string dtype;
  std::vector<std::string> cast_include;
  bool strict_cast = false;
  bool model_only = false;
  std::string max_shard_size;
  bool hf_config = false;
  WriteFlags flags;
};

std::unique_ptr<CLI::App> make_merge_app(MergeCliOptions& options);

/// Throws CLI::ValidationError for values the parser could not check alone.
ckpt::MergeOptions to_merge(const MergeCliOptions& o, std::vector<ckpt::EntryFilter> filters);

/// The output `m` writes to: OUTPUT, or without one `<input>.consolidated` (a torch.save file,
/// Lightning's consolidate_checkpoint default). Throws CLI::ValidationError for a name that says
/// otherwise than what is written: a directory (a trailing '/') for a file, a file's extension
/// for a --max-shard-size directory, an extension of another format than --format's.
std::string merge_output(const MergeCliOptions& o, const ckpt::MergeOptions& m);

/// The merge of `o.input` into `o.output` (after merge_output) by `m`, with --hf-config's
/// config.json (MergeOptions::hf_config). Throws as ckpt::merge and llama_hf_config do.
ckpt::WriteResult run_merge(const MergeCliOptions& o, ckpt::MergeOptions m);

}  // namespace fsdp_tools
