// SPDX-License-Identifier: Apache-2.0
#include "ckpt/ops/result.hpp"

#include <nlohmann/json.hpp>
#include <ostream>

#include "ckpt/text.hpp"
#include "text_helpers.hpp"

namespace ckpt {
namespace {

std::string box_text(const ResultChunk& c) {
  std::string out = std::to_string(c.rank) + ":[";
  for (std::size_t i = 0; i < c.offsets.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(c.offsets[i]) + ":" + std::to_string(c.offsets[i] + c.sizes[i]);
  }
  return out + "]";
}

}  // namespace

void print_text(const WriteResult& r, std::ostream& out) {
  const bool shard = r.operation == Operation::kShard;
  if (r.dry_run) {
    std::size_t tensors = 0;
    for (const auto& e : r.entries) tensors += e.kind == "tensor";
    out << "plan: " << r.entries.size() << " entries (" << tensors << " tensors, " << r.tensor_bytes << " bytes of tensor data)";
    if (shard) out << " for " << r.world_size << " ranks";
    if (r.dropped) out << ", " << r.dropped << " left out";
    out << "\n";
    for (const auto& e : r.entries) {
      out << "  " << escape_name(e.name) << "  " << e.kind;
      if (shard) {
        if (e.dtype) {
          out << "  " << name(*e.dtype) << "  " << detail::shape_text(e.shape) << "  " << e.chunks.size()
              << (e.chunks.size() == 1 ? " chunk:" : " chunks:");
          for (const auto& c : e.chunks) out << " " << box_text(c);
        } else if (e.kind == "object") {
          out << "  rank " << e.chunks.front().rank;
        } else {
          out << "  meta.pt";
        }
      } else {
        if (e.dtype) out << "  " << name(*e.dtype) << "  " << detail::shape_text(e.shape) << "  " << e.nbytes << " bytes";
        out << "  -> " << escape_name(e.file);
      }
      out << "\n";
    }
    out << "would write" << (r.compressed ? " (sizes before compression)" : "") << ":\n";
  } else if (r.process_count > 1) {
    out << "process " << r.process_index << " of " << r.process_count << (r.committed ? " (committed .metadata)" : "") << " wrote:\n";
  } else {
    out << "wrote:\n";
  }
  for (const auto& f : r.files) {
    if (!r.dry_run && !f.written_here && !r.committed) continue;
    out << "  " << escape_name(f.path.string()) << "  " << f.size << " bytes";
    if (f.count) out << ", " << f.count << (shard ? " items" : " tensors");
    out << "\n";
  }
}

std::string to_json(const WriteResult& r) {
  const bool shard = r.operation == Operation::kShard;
  nlohmann::ordered_json j;
  j["schema"] = 1;
  j["dry_run"] = r.dry_run;
  if (shard) {
    j["world_size"] = r.world_size;
    j["committed"] = r.committed;
  }
  j["files"] = nlohmann::json::array();
  for (const auto& f : r.files) {
    nlohmann::ordered_json x{{"path", f.path.string()}, {"size", f.size}};
    if (shard) {
      x["items"] = f.count;
      x["written_here"] = f.written_here;
    } else {
      x["tensors"] = f.count;
    }
    j["files"].push_back(std::move(x));
  }
  j["entries"] = nlohmann::json::array();
  for (const auto& e : r.entries) {
    nlohmann::ordered_json x{{"name", e.name}, {"kind", e.kind}};
    if (e.dtype) {
      x["dtype"] = std::string(name(*e.dtype));
      x["shape"] = e.shape;
      x["nbytes"] = e.nbytes;
    }
    if (shard && e.kind != "meta") {
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
    if (!shard) x["file"] = e.file;
    j["entries"].push_back(std::move(x));
  }
  j["tensor_bytes"] = r.tensor_bytes;
  j["dropped"] = r.dropped;
  return j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

}  // namespace ckpt
