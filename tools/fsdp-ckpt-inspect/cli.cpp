// SPDX-License-Identifier: Apache-2.0
#include "fsdp-ckpt-inspect/cli.hpp"

#include "common/cli_common.hpp"

namespace fsdp_tools {

std::unique_ptr<CLI::App> make_inspect_app(InspectCliOptions& o) {
  auto app = std::make_unique<CLI::App>();
  app->name("fsdp-ckpt-inspect");
  setup_app(*app, "fsdp-ckpt-inspect",
            "Show what a checkpoint holds (torch.save zip or safetensors file), without loading tensor data.");
  app->add_option("path", o.path, "checkpoint file to inspect; the format is detected from its content")
      ->required()
      ->check(CLI::ExistingPath);
  app->add_flag("--json", o.json, "print one JSON object (schema 1) instead of the table");
  return app;
}

ckpt::InspectOptions to_library(const InspectCliOptions& o) {
  return {o.path, o.json ? ckpt::OutputFormat::kJson : ckpt::OutputFormat::kText};
}

}  // namespace fsdp_tools
