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
};

std::unique_ptr<CLI::App> make_inspect_app(InspectCliOptions& options);
ckpt::InspectOptions to_library(const InspectCliOptions& options);

}  // namespace fsdp_tools
