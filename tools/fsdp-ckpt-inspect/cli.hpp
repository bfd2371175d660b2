// SPDX-License-Identifier: Apache-2.0
// fsdp-ckpt-inspect's command line: the options struct (the single source of defaults) and make_app().
#pragma once

#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "ckpt/ops/inspect.hpp"

namespace fsdp_tools {

struct InspectCliOptions {
  std::string path;
  bool json = false;
  std::string tensor_glob;
  bool meta = false;
  bool summary = false, all_files = false, exact_bytes = false;
  std::string values;  ///< --values: "all" (given without N) or N; empty: not given
  bool quiet = false;
  // verify
  std::string verify_path;
  bool deep = false;
  // stats
  std::string stats_path;
  unsigned threads = 0;
  // diff
  std::string diff_a, diff_b;
  double atol = 0.0, rtol = 0.0;
  std::vector<std::string> include, exclude;  ///< their order comes from filters_in_order()
  bool model_only = false;
  std::string key;
  std::vector<std::string> map_prefix;
};

enum class InspectCommand { kInspect, kVerify, kStats, kDiff };

struct InspectApp {
  std::unique_ptr<CLI::App> app;
  CLI::App* verify = nullptr;
  CLI::App* stats = nullptr;
  CLI::App* diff = nullptr;
  /// Which command the parsed argv asked for.
  InspectCommand command() const;
};

InspectApp make_inspect_app(InspectCliOptions& options);

ckpt::InspectOptions to_inspect(const InspectCliOptions& o);
ckpt::VerifyOptions to_verify(const InspectCliOptions& o);
ckpt::StatsOptions to_stats(const InspectCliOptions& o);
/// Throws CLI::ValidationError for a --map-prefix that is not FROM=TO.
ckpt::DiffOptions to_diff(const InspectCliOptions& o, std::vector<ckpt::EntryFilter> filters = {});

}  // namespace fsdp_tools
