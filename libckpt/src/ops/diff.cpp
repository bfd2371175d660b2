// SPDX-License-Identifier: Apache-2.0
// diff: two checkpoints of any formats and layouts, compared entry by entry. Each tensor is
// assembled from its chunks into global order (one tensor at a time), so a merged file compares
// against its sharded source.
#include <cmath>
#include <nlohmann/json.hpp>
#include <ostream>
#include <set>

#include "ckpt/checkpoint.hpp"
#include "ckpt/error.hpp"
#include "ckpt/ops/inspect.hpp"
#include "ckpt/torch_save.hpp"
#include "ops/elements.hpp"
#include "ops/text.hpp"

namespace ckpt {
namespace {

// The tensor's elements as doubles, in global C order (elements no chunk covers stay 0; verify
// reports such holes).
std::vector<double> assemble(const ChunkReader& reader, const TensorEntry& t) {
  std::vector<double> full(static_cast<std::size_t>(t.numel()), 0.0);
  const auto gstride = contiguous_strides(t.shape);
  for (const Chunk& ch : t.chunks) {
    const ChunkData d = reader.read(t, ch);
    const auto lstride = contiguous_strides(ch.sizes);
    detail::for_each_element(d, [&](std::uint64_t i, const std::byte* p) {
      std::uint64_t g = 0, rest = i;
      for (std::size_t k = 0; k < ch.sizes.size(); ++k) {
        const auto idx = rest / static_cast<std::uint64_t>(lstride[k]);
        rest %= static_cast<std::uint64_t>(lstride[k]);
        g += (idx + static_cast<std::uint64_t>(ch.offsets[k])) * static_cast<std::uint64_t>(gstride[k]);
      }
      full[static_cast<std::size_t>(g)] = detail::to_double(d.dtype, p);
    });
  }
  return full;
}

// The non-tensor values by name, as leaves: a DCP bytes item is unpickled and flattened the way
// a torch.save file's tree is (keys joined with '.'), so that a merged file's leaves
// ("optim.param_groups.0.lr") meet the bytes item they came from ("optim.param_groups").
std::map<std::string, pickle::ValuePtr> object_leaves(const Checkpoint& c, const ChunkReader& reader) {
  std::map<std::string, pickle::ValuePtr> out;
  for (const ObjectEntry& o : c.objects) {
    if (!o.item) {
      out[o.name] = o.value;
      continue;
    }
    const TorchSaveFile f = read_torch_save(reader.item(*o.item));
    for (const auto& [leaf, v] : f.objects) out[leaf.empty() ? o.name : o.name + "." + leaf] = v;
  }
  return out;
}

struct Row {
  std::string name;
  std::string status;  // "equal", "differs", "only in A", "only in B", "dtype", "shape", "not compared"
  std::string detail;
  double max_abs = 0, max_rel = 0;
};

}  // namespace

bool diff(const DiffOptions& options, std::ostream& out, Progress& progress) {
  const Checkpoint a = open_checkpoint(options.a), b = open_checkpoint(options.b);
  const ChunkReader ra(a, FileAccess::kReadSmallItemsWhole), rb(b, FileAccess::kReadSmallItemsWhole);
  std::map<std::string, const TensorEntry*> ta, tb;
  for (const auto& t : a.tensors) ta[t.name] = &t;
  for (const auto& t : b.tensors) tb[t.name] = &t;
  const std::map<std::string, pickle::ValuePtr> oa = object_leaves(a, ra), ob = object_leaves(b, rb);
  std::set<std::string> names;
  for (auto& [n, t] : ta) names.insert(n);
  for (auto& [n, t] : tb) names.insert(n);
  for (auto& [n, o] : oa) names.insert(n);
  for (auto& [n, o] : ob) names.insert(n);
  std::uint64_t total = 0;
  for (auto& [n, t] : ta) total += t->nbytes();
  progress.start("comparing", total);
  std::vector<Row> rows;
  bool equal = true;
  for (const std::string& n : names) {
    Row r{n, "equal", "", 0, 0};
    const bool in_a = ta.count(n) || oa.count(n), in_b = tb.count(n) || ob.count(n);
    if (!in_a || !in_b) {
      r.status = in_a ? "only in A" : "only in B";
    } else if (ta.count(n) != tb.count(n)) {
      r.status = "kind";
      r.detail = ta.count(n) ? "tensor in A, object in B" : "object in A, tensor in B";
    } else if (ta.count(n)) {
      const TensorEntry &x = *ta[n], &y = *tb[n];
      if (x.dtype != y.dtype) {
        r.status = "dtype";
        r.detail = std::string(name(x.dtype)) + " vs " + std::string(name(y.dtype));
      } else if (x.shape != y.shape) {
        r.status = "shape";
        r.detail = detail::shape_text(x.shape) + " vs " + detail::shape_text(y.shape);
      } else if (!detail::is_numeric(x.dtype)) {
        r.status = "not compared";
        r.detail = "dtype " + std::string(name(x.dtype)) + " is not compared";
      } else {
        try {
          const auto va = assemble(ra, x), vb = assemble(rb, y);
          bool within = true;
          for (std::size_t i = 0; i < va.size(); ++i) {
            const double p = va[i], q = vb[i];
            if (std::isnan(p) && std::isnan(q)) continue;
            if (p == q) continue;  // equal infinities too
            const double d = std::fabs(p - q);
            if (std::isnan(d)) {
              within = false;
              r.max_abs = INFINITY;
              continue;
            }
            r.max_abs = std::max(r.max_abs, d);
            if (q != 0) r.max_rel = std::max(r.max_rel, d / std::fabs(q));
            else r.max_rel = INFINITY;
            if (!(d <= options.atol + options.rtol * std::fabs(q))) within = false;
          }
          if (!within) r.status = "differs";
        } catch (Error& e) {
          e.add_context("comparing '" + n + "'");
          throw;
        }
        progress.advance(x.nbytes());
      }
    } else {
      const pickle::ValuePtr& va = oa.at(n);
      const pickle::ValuePtr& vb = ob.at(n);
      const std::string sa = va ? pickle::repr(*va, 1u << 16) : "", sb = vb ? pickle::repr(*vb, 1u << 16) : "";
      if (sa != sb) {
        r.status = "differs";
        r.detail = escape_name(sa.substr(0, 60)) + " vs " + escape_name(sb.substr(0, 60));
      }
    }
    if (r.status != "equal") equal = false;
    rows.push_back(std::move(r));
  }
  progress.finish();
  if (options.format == OutputFormat::kJson) {
    nlohmann::ordered_json j{{"schema", 1}, {"a", options.a.string()}, {"b", options.b.string()}, {"atol", options.atol},
                             {"rtol", options.rtol}, {"equal", equal}, {"entries", nlohmann::ordered_json::array()}};
    for (const auto& r : rows) {
      nlohmann::ordered_json x{{"name", r.name}, {"status", r.status}};
      if (!r.detail.empty()) x["detail"] = r.detail;
      if (r.status == "equal" || r.status == "differs") {
        x["max_abs"] = std::isfinite(r.max_abs) ? nlohmann::ordered_json(r.max_abs) : nlohmann::ordered_json(nullptr);
        x["max_rel"] = std::isfinite(r.max_rel) ? nlohmann::ordered_json(r.max_rel) : nlohmann::ordered_json(nullptr);
      }
      j["entries"].push_back(std::move(x));
    }
    out << j.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) << "\n";
    return equal;
  }
  std::size_t differing = 0;
  for (const auto& r : rows) {
    if (r.status == "equal") continue;
    ++differing;
    out << r.status << ": " << escape_name(r.name);
    if (!r.detail.empty()) out << " (" << r.detail << ")";
    if (r.status == "differs" && !(r.max_abs == 0 && r.max_rel == 0) && r.detail.empty()) {
      char buf[96];
      std::snprintf(buf, sizeof buf, " max-abs %.6g max-rel %.6g", r.max_abs, r.max_rel);
      out << buf;
    }
    out << "\n";
  }
  out << (equal ? "equal" : "different") << ": " << rows.size() << " entries compared, " << differing << " differ"
      << " (atol " << options.atol << ", rtol " << options.rtol << ")\n";
  return equal;
}

}  // namespace ckpt
