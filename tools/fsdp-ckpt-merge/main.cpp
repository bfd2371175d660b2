// SPDX-License-Identifier: Apache-2.0
// fsdp-ckpt-merge: options -> one library call (ckpt::merge) -> what was written, on stdout.
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>

#include "ckpt/checkpoint.hpp"
#include "ckpt/open.hpp"
#include "ckpt/ops/inspect.hpp"
#include "ckpt/text.hpp"
#include "common/cli_common.hpp"
#include "common/progress_bar.hpp"
#include "common/run_tool.hpp"
#include "fsdp-ckpt-merge/cli.hpp"

namespace {

void print_json(const ckpt::MergeResult& r, bool dry_run) {
  nlohmann::ordered_json j;
  j["schema"] = 1;
  j["dry_run"] = dry_run;
  j["files"] = nlohmann::json::array();
  for (const auto& f : r.files) j["files"].push_back({{"path", f.path.string()}, {"size", f.size}, {"tensors", f.tensors}});
  j["entries"] = nlohmann::json::array();
  for (const auto& e : r.entries) {
    nlohmann::ordered_json x{{"name", e.name}, {"kind", e.kind}};
    if (e.dtype) {
      x["dtype"] = std::string(ckpt::name(*e.dtype));
      x["shape"] = e.shape;
      x["nbytes"] = e.nbytes;
    }
    x["file"] = e.file;
    j["entries"].push_back(std::move(x));
  }
  j["tensor_bytes"] = r.tensor_bytes;
  j["dropped"] = r.dropped;
  std::cout << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
}

void print_text(const ckpt::MergeResult& r, bool dry_run) {
  std::size_t tensors = 0;
  for (const auto& e : r.entries) tensors += e.kind == "tensor";
  if (dry_run) {
    std::cout << "plan: " << r.entries.size() << " entries (" << tensors << " tensors, " << r.tensor_bytes << " bytes of tensor data)";
    if (r.dropped) std::cout << ", " << r.dropped << " left out";
    std::cout << "\n";
    for (const auto& e : r.entries) {
      std::cout << "  " << ckpt::escape_name(e.name) << "  " << e.kind;
      if (e.dtype) std::cout << "  " << ckpt::name(*e.dtype) << "  " << fsdp_tools::shape_text(e.shape) << "  " << e.nbytes << " bytes";
      std::cout << "  -> " << ckpt::escape_name(e.file) << "\n";
    }
    std::cout << "would write:\n";
  } else {
    std::cout << "wrote:\n";
  }
  for (const auto& f : r.files) {
    std::cout << "  " << ckpt::escape_name(f.path.string()) << "  " << f.size << " bytes";
    if (f.tensors) std::cout << ", " << f.tensors << " tensors";
    std::cout << "\n";
  }
}

}  // namespace

int main(int argc, char** argv) {
  fsdp_tools::MergeCliOptions options;
  auto app = fsdp_tools::make_merge_app(options);
  if (auto code = fsdp_tools::parse(*app, argc, argv)) return *code;
  ckpt::MergeOptions merge;
  if (auto code = fsdp_tools::usage_errors("fsdp-ckpt-merge", [&] { merge = fsdp_tools::to_merge(options, fsdp_tools::filters_in_order(argc, argv)); })) {
    return *code;
  }
  merge.task_delay_ms = fsdp_tools::test_hooks_from_environment();
  const fsdp_tools::WriteFlags& flags = options.flags;
  fsdp_tools::cancel_on_signals();
  fsdp_tools::map_large_blocks();
  return fsdp_tools::run_tool("fsdp-ckpt-merge", [&] {
    fsdp_tools::ProgressBar progress("fsdp-ckpt-merge", flags.quiet || flags.dry_run, flags.quiet);
    merge.progress = &progress;
    const ckpt::Checkpoint input = ckpt::open_checkpoint(options.input);
    const ckpt::MergeResult result = ckpt::merge(input, options.output, merge, flags.dry_run);
    if (flags.json) print_json(result, flags.dry_run);
    else print_text(result, flags.dry_run);
    return 0;
  });
}
