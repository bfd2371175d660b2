// SPDX-License-Identifier: Apache-2.0
// fsdp-ckpt-shard: options -> one library call (ckpt::shard) -> what was written, on stdout.
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
#include "fsdp-ckpt-shard/cli.hpp"

namespace {

std::string box_text(const ckpt::ShardChunk& c) {
  std::string out = std::to_string(c.rank) + ":[";
  for (std::size_t i = 0; i < c.offsets.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(c.offsets[i]) + ":" + std::to_string(c.offsets[i] + c.sizes[i]);
  }
  return out + "]";
}

void print_json(const ckpt::ShardResult& r, bool dry_run) {
  nlohmann::ordered_json j;
  j["schema"] = 1;
  j["dry_run"] = dry_run;
  j["world_size"] = r.world_size;
  j["committed"] = r.committed;
  j["files"] = nlohmann::json::array();
  for (const auto& f : r.files) {
    j["files"].push_back({{"path", f.path.string()}, {"size", f.size}, {"items", f.items}, {"written_here", f.written_here}});
  }
  j["entries"] = nlohmann::json::array();
  for (const auto& e : r.entries) {
    nlohmann::ordered_json x{{"name", e.name}, {"kind", e.kind}};
    if (e.dtype) {
      x["dtype"] = std::string(ckpt::name(*e.dtype));
      x["shape"] = e.shape;
      x["nbytes"] = e.nbytes;
    }
    if (e.kind != "meta") {
      x["chunks"] = nlohmann::json::array();
      for (const auto& c : e.chunks) {
        nlohmann::ordered_json cj{{"rank", c.rank}};
        if (e.dtype) {
          cj["offsets"] = c.offsets;
          cj["sizes"] = c.sizes;
        }
        x["chunks"].push_back(std::move(cj));
      }
    }
    j["entries"].push_back(std::move(x));
  }
  j["tensor_bytes"] = r.tensor_bytes;
  j["dropped"] = r.dropped;
  std::cout << j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
}

void print_text(const ckpt::ShardResult& r, bool dry_run, const ckpt::ShardOptions& o) {
  if (dry_run) {
    std::size_t tensors = 0;
    for (const auto& e : r.entries) tensors += e.kind == "tensor";
    std::cout << "plan: " << r.entries.size() << " entries (" << tensors << " tensors, " << r.tensor_bytes << " bytes of tensor data) for "
              << r.world_size << " ranks";
    if (r.dropped) std::cout << ", " << r.dropped << " left out";
    std::cout << "\n";
    for (const auto& e : r.entries) {
      std::cout << "  " << ckpt::escape_name(e.name) << "  " << e.kind;
      if (e.dtype) {
        std::cout << "  " << ckpt::name(*e.dtype) << "  " << fsdp_tools::shape_text(e.shape) << "  " << e.chunks.size()
                  << (e.chunks.size() == 1 ? " chunk:" : " chunks:");
        for (const auto& c : e.chunks) std::cout << " " << box_text(c);
      } else if (e.kind == "object") {
        std::cout << "  rank " << e.chunks.front().rank;
      } else {
        std::cout << "  meta.pt";
      }
      std::cout << "\n";
    }
    std::cout << "would write" << (o.compression == ckpt::DcpCompression::kZstd ? " (sizes before compression)" : "") << ":\n";
  } else if (o.process_count > 1) {
    std::cout << "process " << o.process_index << " of " << o.process_count << (r.committed ? " (committed .metadata)" : "") << " wrote:\n";
  } else {
    std::cout << "wrote:\n";
  }
  for (const auto& f : r.files) {
    if (!dry_run && !f.written_here && !r.committed) continue;
    std::cout << "  " << ckpt::escape_name(f.path.string()) << "  " << f.size << " bytes";
    if (f.items) std::cout << ", " << f.items << " items";
    std::cout << "\n";
  }
}

}  // namespace

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
    if (flags.json) print_json(result, flags.dry_run);
    else print_text(result, flags.dry_run, shard);
    return 0;
  });
}
