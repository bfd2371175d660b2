// SPDX-License-Identifier: Apache-2.0
// diff: two checkpoints of any formats and layouts, compared entry by entry. Each tensor is
// assembled from its chunks into global order (one tensor at a time), so a merged file compares
// against its sharded source.
#include <cmath>
#include <nlohmann/json.hpp>
#include <ostream>
#include <memory>
#include <set>

#include "ckpt/checkpoint.hpp"
#include "ckpt/error.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "ckpt/open.hpp"
#include "ckpt/ops/inspect.hpp"
#include "ckpt/sharding.hpp"
#include "ckpt/text.hpp"
#include "ops/elements.hpp"
#include "text_helpers.hpp"

namespace ckpt {
namespace {

// The tensor's elements as doubles, in global C order (elements no chunk covers stay 0; verify
// reports such holes). With `progress`, advances by the bytes converted as it goes (every 4 Mi
// elements), so that a large tensor moves the bar.
std::vector<double> assemble(const ChunkReader& reader, const TensorEntry& t, Progress* progress = nullptr) {
  std::vector<double> full(static_cast<std::size_t>(t.numel()), 0.0);
  const auto gstride = contiguous_strides(t.shape);
  constexpr std::uint64_t kStep = std::uint64_t{1} << 22;
  for (const Chunk& ch : t.chunks) {
    const ChunkData d = reader.read(t, ch);
    const auto lstride = contiguous_strides(ch.sizes);
    std::uint64_t reported = 0;  // elements of this chunk the bar has been told of
    detail::for_each_element(d, [&](std::uint64_t i, const std::byte* p) {
      if (progress && i - reported >= kStep) {
        progress->advance((i - reported) * element_size(t.dtype));
        reported = i;
      }
      std::uint64_t g = 0, rest = i;
      for (std::size_t k = 0; k < ch.sizes.size(); ++k) {
        const auto idx = rest / static_cast<std::uint64_t>(lstride[k]);
        rest %= static_cast<std::uint64_t>(lstride[k]);
        g += (idx + static_cast<std::uint64_t>(ch.offsets[k])) * static_cast<std::uint64_t>(gstride[k]);
      }
      full[static_cast<std::size_t>(g)] = detail::to_double(d.dtype, p);
    });
    if (progress) progress->advance((box_volume(ch.sizes) - reported) * element_size(t.dtype));
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
  std::string status;  // "equal", "differs", "only in A", "only in B", "kind", "shape", "not compared"
  std::string detail;
  double max_abs = 0, max_rel = 0;
};

// A tensor to compare and the reader of the checkpoint (or meta.pt) that holds it.
struct Held {
  const TensorEntry* tensor;
  const ChunkReader* reader;
};

// One side of the diff as merge reads it: its entries under the names they are compared by.
struct Side {
  Checkpoint c;
  ChunkReader reader;
  std::unique_ptr<Checkpoint> meta;  // a DCP directory's meta.pt, whose top-level keys replace the DCP's
  std::unique_ptr<ChunkReader> meta_reader;
  std::map<std::string, Held> tensors;
  std::map<std::string, pickle::ValuePtr> objects;

  explicit Side(const std::filesystem::path& path) : c(open_checkpoint(path)), reader(c, FileAccess::kReadSmallItemsWhole) {
    for (const CheckpointFile& f : c.files) {
      if (f.relative != "meta.pt" || !f.size) continue;
      meta = std::make_unique<Checkpoint>(open_checkpoint(f.path));
      meta_reader = std::make_unique<ChunkReader>(*meta, FileAccess::kReadSmallItemsWhole);
    }
  }
};

bool holds_tensors_only(Format f) {
  return f == Format::kSafetensors || f == Format::kSafetensorsIndex || f == Format::kTorchSaveIndex || f == Format::kDcpSafetensors ||
         f == Format::kHdf5;
}

// The names entries are compared by, and which are selected: merge's selections on A's FQNs (B's
// are put in A's terms first), then A's key and prefix mapping.
class Naming {
 public:
  Naming(const DiffOptions& o, std::optional<std::string> key) : o_(o), key_(std::move(key)), selection_(o.filters) {}

  // A's entry `fqn` (of `c`, where its top-level key is looked up): its name in the comparison, or
  // nothing when deselected.
  std::optional<std::string> a(const Checkpoint& c, const std::string& fqn) {
    const std::string_view top = top_level_key(c, fqn);
    if (!selection_.select(fqn) || (o_.model_only && top != "model")) return std::nullopt;
    std::string name = fqn;
    if (key_) {
      if (top != *key_ || fqn.size() <= key_->size() + 1) {
        ++outside_key_;
        return std::nullopt;
      }
      name = fqn.substr(key_->size() + 1);
    }
    for (const auto& [from, to] : o_.map_prefix) {
      if (name.starts_with(from)) {
        name = to + name.substr(from.size());
        break;
      }
    }
    return name;
  }

  // B's entry `name` (of `c`): whether the selections keep it, read in A's terms.
  bool b(const Checkpoint& c, const std::string& name) const {
    const std::string in_a = key_ ? *key_ + "." + name : name;
    if (!filters_select(o_.filters, in_a)) return false;
    // under "model": by its stored path, or as a flat FQN (merge writes torch 1.13's that way)
    return !o_.model_only || key_ == "model" || top_level_key(c, name) == "model" || in_a.starts_with("model.");
  }

  const EntrySelection& selection() const { return selection_; }
  std::size_t outside_key() const { return outside_key_; }

 private:
  const DiffOptions& o_;
  std::optional<std::string> key_;
  EntrySelection selection_;
  std::size_t outside_key_ = 0;  ///< A's selected entries not under the key
};

// Fills `s`'s tensors and objects: its own, then meta.pt's in place of those under the same
// top-level keys (Lightning's consolidate_checkpoint, as merge does). `name` gives each FQN its
// compared name, or none.
// The key `fqn` sits under in merge's output tree: its stored path's first key, else the FQN itself
// (an entry without a path is written under its FQN).
std::string stored_top(const Checkpoint& c, const std::string& fqn) {
  thread_local std::vector<KeyPaths::KeyView> keys;
  if (c.planner_data.keys(fqn, keys) && !keys.empty()) return keys.front().is_int ? std::to_string(keys.front().index) : std::string(keys.front().text);
  return fqn;
}

template <typename Name>
void collect(Side& s, Name&& name) {
  std::set<std::string, std::less<>> meta_keys;
  if (s.meta) {
    for (const auto& t : s.meta->tensors) meta_keys.insert(stored_top(*s.meta, t.name));
    for (const auto& o : s.meta->objects) meta_keys.insert(stored_top(*s.meta, o.name));
  }
  auto add = [&](const Checkpoint& c, const ChunkReader& reader, bool from_meta) {
    for (const auto& t : c.tensors) {
      if (!from_meta && meta_keys.count(stored_top(c, t.name))) continue;
      if (auto n = name(c, t.name)) s.tensors[*n] = Held{&t, &reader};
    }
    for (const auto& [leaf, v] : object_leaves(c, reader)) {
      if (!from_meta && meta_keys.count(stored_top(c, leaf))) continue;
      if (auto n = name(c, leaf)) s.objects[*n] = v;
    }
  };
  add(s.c, s.reader, false);
  if (s.meta) add(*s.meta, *s.meta_reader, true);
}

}  // namespace

bool diff(const DiffOptions& options, std::ostream& out, Progress& progress) {
  Side a(options.a), b(options.b);
  // safetensors output holds the tensors under "model" by their names below it, unless --key says
  // which key (merge's default); a tensors-only output holds none of A's other entries.
  std::optional<std::string> key = options.key;
  const bool tensors_only = holds_tensors_only(b.c.format) && !holds_tensors_only(a.c.format);
  if (!key && (b.c.format == Format::kSafetensors || b.c.format == Format::kSafetensorsIndex || b.c.format == Format::kTorchSaveIndex) && tensors_only) {
    for (const auto& t : a.c.tensors) {
      if (top_level_key(a.c, t.name) == "model" && t.name.size() > 6) {
        key = "model";
        break;
      }
    }
  }
  Naming naming(options, key);
  collect(a, [&](const Checkpoint& c, const std::string& fqn) { return naming.a(c, fqn); });
  collect(b, [&](const Checkpoint& c, const std::string& fqn) { return naming.b(c, fqn) ? std::optional<std::string>(fqn) : std::nullopt; });
  naming.selection().conclude(a.c.root.string(), a.tensors.size() + a.objects.size(), options.model_only || options.key.has_value(),
                              {}, &progress);
  std::size_t not_held = 0;  // A's non-tensors a tensors-only B cannot hold
  if (tensors_only) {
    not_held = a.objects.size();
    a.objects.clear();
  }
  const auto& ta = a.tensors;
  const auto& tb = b.tensors;
  const auto& oa = a.objects;
  const auto& ob = b.objects;
  std::set<std::string> names;
  for (auto& [n, t] : ta) names.insert(n);
  for (auto& [n, t] : tb) names.insert(n);
  for (auto& [n, o] : oa) names.insert(n);
  for (auto& [n, o] : ob) names.insert(n);
  std::uint64_t total = 0;
  for (auto& [n, t] : ta) total += t.tensor->nbytes();
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
      const Held &hx = ta.at(n), &hy = tb.at(n);
      const TensorEntry &x = *hx.tensor, &y = *hy.tensor;
      const bool numeric = detail::is_numeric(x.dtype) && detail::is_numeric(y.dtype);
      if (x.dtype != y.dtype) r.detail = "dtype " + std::string(name(x.dtype)) + " vs " + std::string(name(y.dtype));
      if (x.shape != y.shape) {
        r.status = "shape";
        r.detail = detail::shape_text(x.shape) + " vs " + detail::shape_text(y.shape);
      } else if (!numeric) {
        r.status = x.dtype == y.dtype ? "not compared" : "dtype";
        if (x.dtype == y.dtype) r.detail = "dtype " + std::string(name(x.dtype)) + " is not compared";
      } else {
        try {
          // Across dtypes the values meet in float64, within the tolerances.
          const auto va = assemble(*hx.reader, x, &progress), vb = assemble(*hy.reader, y);
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
      }
      if (r.status == "shape" || !numeric) progress.advance(x.nbytes());  // not read: counted as done
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
                             {"rtol", options.rtol}, {"equal", equal}, {"not_held", not_held}, {"outside_key", naming.outside_key()}, {"entries", nlohmann::ordered_json::array()}};
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
  std::size_t differing = 0, recast = 0;
  for (const auto& r : rows) {
    if (r.status == "equal") {
      recast += !r.detail.empty();  // equal across a dtype change
      continue;
    }
    ++differing;
    out << r.status << ": " << escape_name(r.name);
    if (!r.detail.empty()) out << " (" << r.detail << ")";
    if (r.status == "differs" && !(r.max_abs == 0 && r.max_rel == 0) && (r.detail.empty() || r.detail.starts_with("dtype"))) {
      char buf[96];
      std::snprintf(buf, sizeof buf, " max-abs %.6g max-rel %.6g", r.max_abs, r.max_rel);
      out << buf;
    }
    out << "\n";
  }
  out << (equal ? "equal" : "different") << ": " << rows.size() << " entries compared, " << differing << " differ";
  if (recast) out << ", " << recast << " equal across a dtype change";
  out << " (atol " << options.atol << ", rtol " << options.rtol << ")";
  if (naming.outside_key()) out << "; " << naming.outside_key() << " entries of A outside the key '" << *key << "' not compared";
  if (not_held) {
    out << "; " << not_held << " non-tensor entr" << (not_held == 1 ? "y" : "ies") << " of A not compared (" << to_string(b.c.format)
        << " holds tensors only)";
  }
  out << "\n";
  return equal;
}

}  // namespace ckpt
