// SPDX-License-Identifier: Apache-2.0
// inspect: the Checkpoint index printed as a summary and a table, or as JSON schema 1.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <ostream>

#include "ckpt/checkpoint.hpp"
#include "ckpt/error.hpp"
#include "ckpt/open.hpp"
#include "ckpt/ops/inspect.hpp"
#include "ckpt/text.hpp"
#include "ops/elements.hpp"
#include "text_helpers.hpp"

namespace ckpt {
namespace {

using detail::pad;
using detail::shape_text;
using nlohmann::ordered_json;

// The most nodes --json --meta shows of one pickled tree (a .metadata kept whole has a node per
// chunk; the text form stops at 1 MiB likewise).
constexpr std::size_t kMetaJsonNodes = 200000;

// Which part of a training state an entry belongs to, from its first key.
std::string group_of(const std::string& name, bool tensor) {
  const std::string first = name.substr(0, name.find('.'));
  if (first.starts_with("optim")) return "optimizer";
  if (!tensor) return "other";
  return "model";
}

// Entries whose name matches `glob`, sorted by name (tensors and objects alike).
template <typename Entry>
std::vector<const Entry*> sorted_matching(const std::vector<Entry>& entries, const std::string& glob) {
  std::vector<const Entry*> out;
  for (const auto& e : entries) {
    if (detail::glob_match(glob, e.name)) out.push_back(&e);
  }
  std::stable_sort(out.begin(), out.end(), [](auto* a, auto* b) { return a->name < b->name; });
  return out;
}
std::vector<const TensorEntry*> sorted_tensors(const Checkpoint& c, const std::string& glob) { return sorted_matching(c.tensors, glob); }
std::vector<const ObjectEntry*> sorted_objects(const Checkpoint& c, const std::string& glob) { return sorted_matching(c.objects, glob); }

std::string object_text(const ObjectEntry& o) {
  if (o.value) return pickle::repr(*o.value, 200);
  if (o.item) return "(bytes item, " + std::to_string(o.item->length) + " bytes)";
  return "(no storage)";
}

// A tree rendering for --meta: mappings and sequences one entry per line, the rest as repr.
void pretty(const pickle::Value& v, std::ostream& out, int indent) {
  const std::string pad_s(static_cast<std::size_t>(indent) * 2, ' ');
  if (const auto* items = v.dict_items()) {
    if (items->empty()) {
      out << "{}";
      return;
    }
    out << (v.object() ? "OrderedDict {\n" : "{\n");
    for (const auto& [k, x] : *items) {
      out << pad_s << "  " << escape_name(pickle::repr(*k, 200)) << ": ";
      pretty(*x, out, indent + 1);
      out << "\n";
    }
    out << pad_s << "}";
    return;
  }
  if (const pickle::Object* o = v.object(); o && o->state && o->state->dict_items() && indent < 64) {
    // An object of a class we may not know: its class and state, never executed.
    out << escape_name(v.type_name().substr(7)) << " ";
    pretty(*o->state, out, indent);
    return;
  }
  out << escape_name(pickle::repr(v, 400));
}

// `name` as escape_name() shows it: `name` itself when nothing in it needs escaping (the rule for
// nearly every name), else escape_name(name) in `scratch`.
std::string_view escaped(std::string_view name, std::string& scratch) {
  const bool plain = std::all_of(name.begin(), name.end(), [](char ch) {
    const auto c = static_cast<unsigned char>(ch);
    return c >= 0x20 && c < 0x7f && c != '\\';
  });
  if (plain) return name;
  scratch = escape_name(name);
  return scratch;
}

// Python's repr of complex(re, im): its parts without float repr's ".0" ("(1+2.5j)"), and the
// imaginary part alone when the real one is +0 ("2j").
template <typename F>
std::string complex_repr(F re, F im) {
  auto part = [](F x) {
    std::string t = float_repr(x);
    if (t.ends_with(".0")) t.resize(t.size() - 2);
    return t;
  };
  if (re == 0 && !std::signbit(re)) return part(im).append("j");
  std::string out = "(";
  out.append(part(re)).append(std::signbit(im) && !std::isnan(im) ? "" : "+").append(part(im)).append("j)");
  return out;
}

// One element for people: exact integers, floats as Python's repr in their own precision
// (float16, bfloat16 and float8 as the float32 they widen to exactly), complex as Python's, and
// the bytes in hex for dtypes without a number (quantized, bits).
std::string element_text(DType dtype, const std::byte* p) {
  auto load = [p](auto v, std::size_t at = 0) {
    std::memcpy(&v, p + at, sizeof v);
    return v;
  };
  switch (dtype) {
    case DType::kBool: return load(std::uint8_t{}) ? "True" : "False";
    case DType::kFloat32: return float_repr(load(float{}));
    case DType::kFloat64: return float_repr(load(double{}));
    case DType::kFloat16: case DType::kBFloat16: case DType::kFloat8E5M2: case DType::kFloat8E4M3FN:
      return float_repr(static_cast<float>(detail::to_double(dtype, p)));
    case DType::kComplex64: return complex_repr(load(float{}), load(float{}, 4));
    case DType::kComplex128: return complex_repr(load(double{}), load(double{}, 8));
    default:
      break;
  }
  if (detail::is_integral(dtype)) return detail::integer_text(detail::integer_value(dtype, p));
  std::string hex = "0x";
  for (std::size_t i = element_size(dtype); i-- > 0;) {  // little-endian: the high byte first
    char b[4];
    std::snprintf(b, sizeof b, "%02x", static_cast<unsigned>(p[i]));
    hex += b;
  }
  return hex;
}

// The same as JSON: numbers where JSON has them (nan and inf as strings), true/false, text else.
ordered_json element_json(DType dtype, const std::byte* p) {
  if (dtype == DType::kBool) return static_cast<bool>(p[0]);
  if (detail::is_integral(dtype)) return detail::integer_json<ordered_json>(detail::integer_value(dtype, p));
  if (detail::is_numeric(dtype)) {
    const double v = detail::to_double(dtype, p);
    if (std::isfinite(v)) return v;
  }
  return element_text(dtype, p);
}

// The first `count` elements of `t` (all: kAllValues), read from the bytes that hold them.
std::vector<std::byte> first_elements(const ChunkReader& reader, const TensorEntry& t, std::uint64_t count) {
  return read_elements(reader, t, 0, std::min<std::uint64_t>(count, t.numel()));
}

// `t`'s first values as text: lines of up to 8 consecutive values of one row, each after the
// index of its first value ("    [1, 0]  0.5 -2.25 ...").
void print_values(const ChunkReader& reader, const TensorEntry& t, std::uint64_t count, std::ostream& out) {
  const std::vector<std::byte> bytes = first_elements(reader, t, count);
  const std::size_t es = element_size(t.dtype);
  const std::uint64_t n = bytes.size() / es, numel = t.numel();
  out << "    values: " << (n == numel ? "all " + std::to_string(n) : "the first " + std::to_string(n) + " of " + std::to_string(numel))
      << ", in C order\n";
  const std::int64_t row = t.shape.empty() ? 1 : std::max<std::int64_t>(t.shape.back(), 1);
  for (std::uint64_t i = 0; i < n;) {
    // The multi-index of element i.
    std::vector<std::int64_t> index(t.shape.size());
    std::uint64_t rest = i;
    for (std::size_t k = t.shape.size(); k-- > 0;) {
      const auto dim = static_cast<std::uint64_t>(std::max<std::int64_t>(t.shape[k], 1));
      index[k] = static_cast<std::int64_t>(rest % dim);
      rest /= dim;
    }
    const std::uint64_t line_end = std::min({n, i + 8, i + static_cast<std::uint64_t>(row - (index.empty() ? 0 : index.back()))});
    out << "    " << detail::shape_text(index) << " ";
    for (; i < line_end; ++i) out << " " << element_text(t.dtype, bytes.data() + i * es);
    out << "\n";
  }
}

void print_text(const Checkpoint& c, const InspectOptions& opt, std::ostream& out, const ChunkReader& reader) {
  const auto tensors = sorted_tensors(c, opt.tensor_glob);
  const auto objects = sorted_objects(c, opt.tensor_glob);
  if (opt.tensor_glob.empty()) {
    out << "format:    " << to_string(c.format) << " (looks like " << c.writer << ")\n";
    out << "world:     " << (c.world_size ? std::to_string(*c.world_size) : std::string("-")) << "\n";
    auto size_text = [&](std::uint64_t bytes) { return opt.exact_bytes ? std::to_string(bytes) + " bytes" : human_bytes(bytes); };
    // Data files (DCP's, safetensors shards) past kFoldFiles are counted in one line; the others
    // (.metadata, meta.pt, an index) are always listed.
    auto is_data = [](const CheckpointFile& f) {
      return f.relative.ends_with(".distcp") || f.relative.ends_with(".safetensors");
    };
    const auto data_files = static_cast<std::size_t>(std::count_if(c.files.begin(), c.files.end(), is_data));
    const bool fold = !opt.all_files && data_files > kFoldFiles;
    std::uint64_t folded_bytes = 0;
    std::size_t missing = 0;
    // A DCP directory's .metadata, which the index reads but does not list among its files.
    std::error_code ec;
    const bool listed = std::any_of(c.files.begin(), c.files.end(), [](const CheckpointFile& f) { return f.relative == ".metadata"; });
    if (const auto size = std::filesystem::file_size(c.root / ".metadata", ec); !ec && !listed && std::filesystem::is_directory(c.root, ec)) {
      out << "file:      .metadata (" << size_text(size) << ")\n";
    }
    for (const auto& f : c.files) {
      if (fold && is_data(f)) {
        folded_bytes += f.size.value_or(0);
        if (!f.size) ++missing;
        continue;
      }
      out << "file:      " << escape_name(f.relative) << " (" << (f.size ? size_text(*f.size) : std::string("MISSING")) << ")\n";
    }
    if (fold) {
      out << "files:     " << data_files << " data files, " << size_text(folded_bytes)
          << (missing ? ", " + std::to_string(missing) + " MISSING" : std::string()) << " (--files lists them)\n";
    }
    std::map<std::string, std::pair<std::size_t, std::uint64_t>> by_dtype;
    std::map<std::string, std::size_t> by_group;
    for (const auto& t : c.tensors) {
      auto& d = by_dtype[std::string(name(t.dtype))];
      ++d.first;
      d.second += t.nbytes();
      ++by_group[group_of(t.name, true)];
    }
    for (const auto& o : c.objects) ++by_group[group_of(o.name, false)];
    out << "entries:   " << c.tensors.size() + c.objects.size() << " (" << c.tensors.size() << " tensors, "
        << c.objects.size() << " other)\n";
    for (const auto& [d, n] : by_dtype) out << "bytes:     " << d << " " << size_text(n.second) << " in " << n.first << " tensors\n";
    out << "split:    ";
    for (const char* g : {"model", "optimizer", "other"}) out << " " << g << " " << by_group[g];
    out << "\nmetadata:  ";
    if (c.metadata.empty()) out << "-";
    for (std::size_t i = 0; i < c.metadata.size(); ++i) out << (i ? ", " : "") << escape_name(c.metadata[i].first);
    out << "\n";
    for (const auto& n : c.notes) out << "note:      " << escape_name(n) << "\n";
    if (opt.summary) return;
    out << "\n";
  }
  std::string scratch;
  std::size_t w = 4;
  for (auto* t : tensors) w = std::max(w, detail::text_width(escaped(t->name, scratch)));
  for (auto* o : objects) w = std::max(w, detail::text_width(escaped(o->name, scratch)));
  out << pad("NAME", w) << pad("KIND", 6) << pad("DTYPE", 10) << pad("SHAPE", 16) << pad("NUMEL", 12) << pad("BYTES", 12)
      << "CHUNKS\n";
  // Tensors and objects in one name order. A tensor's row is made in `row`, reused.
  std::string row;
  std::size_t i = 0, j = 0;
  while (i < tensors.size() || j < objects.size()) {
    if (j == objects.size() || (i < tensors.size() && tensors[i]->name <= objects[j]->name)) {
      const TensorEntry& t = *tensors[i++];
      row.clear();
      detail::append_padded(row, escaped(t.name, scratch), w);
      detail::append_padded(row, "tensor", 6);
      detail::append_padded(row, name(t.dtype), 10);
      detail::append_padded(row, shape_text(t.shape), 16);
      detail::append_padded(row, std::to_string(t.numel()), 12);
      detail::append_padded(row, opt.exact_bytes ? std::to_string(t.nbytes()) : human_bytes(t.nbytes()), 12);
      row += std::to_string(t.chunks.size());
      row += '\n';
      out << row;
      if (!opt.tensor_glob.empty()) {
        for (const Chunk& ch : t.chunks) {
          out << "    offsets " << shape_text(ch.offsets) << " sizes " << shape_text(ch.sizes);
          if (ch.location) {
            out << " in " << escape_name(c.files[ch.location->file].relative) << " [" << ch.location->offset << ", "
                << ch.location->offset + ch.location->length << ")";
            for (const auto& tr : ch.location->transforms()) out << " " << escape_name(tr);
          } else {
            out << " (no storage)";
          }
          out << "\n";
        }
        if (opt.values) print_values(reader, t, *opt.values, out);
      }
    } else {
      const ObjectEntry& o = *objects[j++];
      out << pad(escape_name(o.name), w) << pad(o.item ? "bytes" : "object", 6) << escape_name(object_text(o)) << "\n";
    }
  }
}

// A pickled value as JSON data, for --json --meta: plain values as themselves, the rest as objects
// that say what they are ({"class": "torch._utils._rebuild_tensor_v2", "args": [...]}, {"tuple":
// [...]}, {"global": "torch.float32"}, ...), never built. At most `budget` nodes; past that
// {"truncated": true}.
class PickleJson {
 public:
  explicit PickleJson(std::size_t budget) : left_(budget) {}

  ordered_json operator()(const pickle::Value& v) {
    if (left_ == 0) return ordered_json{{"truncated", true}};
    --left_;
    return std::visit([&](const auto& p) { return emit(p); }, v.payload);
  }

 private:
  ordered_json list(const std::vector<pickle::ValuePtr>& items) {
    ordered_json out = ordered_json::array();
    for (const auto& x : items) out.push_back(x ? (*this)(*x) : ordered_json());
    return out;
  }
  ordered_json pairs(const std::vector<std::pair<pickle::ValuePtr, pickle::ValuePtr>>& items) {
    const bool str_keys = std::all_of(items.begin(), items.end(), [](const auto& kv) { return kv.first && kv.first->str(); });
    if (str_keys) {
      ordered_json out = ordered_json::object();
      for (const auto& [k, v] : items) out[*k->str()] = v ? (*this)(*v) : ordered_json();
      return out;
    }
    ordered_json out = ordered_json::array();
    for (const auto& [k, v] : items) out.push_back(ordered_json::array({k ? (*this)(*k) : ordered_json(), v ? (*this)(*v) : ordered_json()}));
    return ordered_json{{"dict", std::move(out)}};
  }
  ordered_json emit(const pickle::None&) { return nullptr; }
  ordered_json emit(bool b) { return b; }
  ordered_json emit(const pickle::Int& i) {
    if (i.fits_int64()) return i.value;
    std::string hex;
    for (auto it = i.big.rbegin(); it != i.big.rend(); ++it) hex += detail::hex_byte(*it);
    return ordered_json{{"int", "0x" + hex}};
  }
  ordered_json emit(double d) {
    if (std::isfinite(d)) return d;
    return ordered_json{{"float", std::isnan(d) ? "nan" : d > 0 ? "inf" : "-inf"}};
  }
  ordered_json emit(const pickle::Str& t) { return t.text; }
  ordered_json emit(const pickle::Bytes& b) {
    std::string hex;
    for (std::size_t i = 0; i < std::min<std::size_t>(b.data.size(), 256); ++i) hex += detail::hex_byte(static_cast<unsigned char>(b.data[i]));
    return ordered_json{{"bytes", hex}, {"length", b.data.size()}};
  }
  ordered_json emit(const pickle::List& l) { return list(l.items); }
  ordered_json emit(const pickle::Tuple& t) { return ordered_json{{"tuple", list(t.items)}}; }
  ordered_json emit(const pickle::Set& t) { return ordered_json{{"set", list(t.items)}}; }
  ordered_json emit(const pickle::FrozenSet& t) { return ordered_json{{"frozenset", list(t.items)}}; }
  ordered_json emit(const pickle::Dict& d) { return pairs(d.items); }
  ordered_json emit(const std::unique_ptr<pickle::Global>& g) { return ordered_json{{"global", g->module + "." + g->name}}; }
  ordered_json emit(const std::unique_ptr<pickle::Object>& o) {
    ordered_json out = ordered_json::object();
    const pickle::Global* g = o->callable ? o->callable->global() : nullptr;
    out["class"] = g ? ordered_json(g->module + "." + g->name) : o->callable ? (*this)(*o->callable) : ordered_json();
    if (o->op != pickle::BuildOp::kReduce) out["new"] = true;
    const auto* args = o->args ? o->args->sequence() : nullptr;
    out["args"] = args ? list(*args) : o->args ? (*this)(*o->args) : ordered_json::array();
    if (o->kwargs) out["kwargs"] = (*this)(*o->kwargs);
    if (!o->list_items.empty()) out["items"] = list(o->list_items);
    if (!o->dict_items.empty()) out["dict_items"] = pairs(o->dict_items);
    if (o->state) out["state"] = (*this)(*o->state);
    return out;
  }
  ordered_json emit(const pickle::PersistentId& p) { return ordered_json{{"persistent_id", p.pid ? (*this)(*p.pid) : ordered_json()}}; }

  std::size_t left_;
};

ordered_json chunk_json(const Checkpoint& c, const Chunk& ch) {
  ordered_json x{{"offsets", ch.offsets}, {"sizes", ch.sizes}};
  if (ch.location) {
    x["file"] = c.files[ch.location->file].relative;
    x["offset"] = ch.location->offset;
    x["length"] = ch.location->length;
    if (!ch.location->transforms().empty()) x["transforms"] = ch.location->transforms();
  } else {
    x["file"] = nullptr;
    x["offset"] = nullptr;
    x["length"] = nullptr;
  }
  return x;
}

// One JSON object, written as it goes: the entries are made and written one at a time, so a
// million chunks never stand in memory as a JSON tree (the bytes are what one dump of the whole
// object would give).
void print_json(const Checkpoint& c, const InspectOptions& opt, std::ostream& out, const ChunkReader& reader) {
  auto dump = [&](const ordered_json& v) { out << v.dump(-1, ' ', false, ordered_json::error_handler_t::replace); };
  bool first = true;
  auto key = [&](const char* k) {
    out << (first ? "{" : ",");
    first = false;
    dump(ordered_json(k));
    out << ":";
  };
  key("schema");
  dump(1);
  key("format");
  dump(std::string(to_string(c.format)));
  key("writer");
  dump(c.writer);
  key("world_size");
  dump(c.world_size ? ordered_json(*c.world_size) : ordered_json(nullptr));
  ordered_json files = ordered_json::array();
  for (const auto& f : c.files) files.push_back({{"path", f.relative}, {"size", f.size ? ordered_json(*f.size) : ordered_json(nullptr)}});
  key("files");
  dump(files);
  // Tensors and objects by name (stable: tensors first among equal names), as one list.
  std::vector<std::pair<const TensorEntry*, const ObjectEntry*>> entries;
  for (auto* t : sorted_tensors(c, opt.tensor_glob)) entries.emplace_back(t, nullptr);
  for (auto* o : sorted_objects(c, opt.tensor_glob)) entries.emplace_back(nullptr, o);
  auto name_of = [](const auto& e) -> const std::string& { return e.first ? e.first->name : e.second->name; };
  std::stable_sort(entries.begin(), entries.end(), [&](const auto& a, const auto& b) { return name_of(a) < name_of(b); });
  key("entries");
  out << "[";
  for (std::size_t i = 0; i < entries.size(); ++i) {
    ordered_json x;
    if (const TensorEntry* t = entries[i].first) {
      x = ordered_json{{"name", t->name}, {"kind", "tensor"}, {"dtype", std::string(name(t->dtype))}, {"shape", t->shape},
                       {"nbytes", t->nbytes()}};
      x["chunks"] = ordered_json::array();
      for (const auto& ch : t->chunks) x["chunks"].push_back(chunk_json(c, ch));
      if (opt.values) {
        const std::vector<std::byte> bytes = first_elements(reader, *t, *opt.values);
        const std::size_t es = element_size(t->dtype);
        x["values"] = ordered_json::array();
        for (std::size_t k = 0; k < bytes.size(); k += es) x["values"].push_back(element_json(t->dtype, bytes.data() + k));
      }
    } else {
      const ObjectEntry* o = entries[i].second;
      x = ordered_json{{"name", o->name}, {"kind", o->item ? "bytes" : "object"}};
      if (o->item) {
        x["chunks"] = ordered_json::array({{{"offsets", ordered_json::array()}, {"sizes", ordered_json::array()},
                                            {"file", c.files[o->item->file].relative}, {"offset", o->item->offset},
                                            {"length", o->item->length}}});
      }
      if (opt.meta || o->value) {
        auto v = opt.meta ? reader.object_value(*o) : o->value;
        x["value"] = v ? pickle::repr(*v, 4096) : std::string();
        if (opt.meta && v) x["value_json"] = PickleJson(kMetaJsonNodes)(*v);
      }
    }
    if (i) out << ",";
    dump(x);
  }
  out << "]";
  ordered_json metadata = ordered_json::object();
  for (const auto& [k, v] : c.metadata) metadata[k] = v;
  key("metadata");
  dump(metadata);
  key("notes");
  dump(ordered_json(c.notes));
  if (opt.meta) {
    ordered_json meta = ordered_json::object();
    ordered_json meta_json = ordered_json::object();
    for (const auto& [n, tree] : c.meta_trees) {
      meta[n] = pickle::repr(*tree, 1u << 20);
      meta_json[n] = PickleJson(kMetaJsonNodes)(*tree);
    }
    key("meta");
    dump(meta);
    key("meta_json");
    dump(meta_json);
  }
  out << "}\n";
}

}  // namespace


void require_match(const Checkpoint& c, const std::string& glob, GlobOver over) {
  const bool tensors_only = over == GlobOver::kTensors;
  if (glob.empty()) return;
  for (const auto& t : c.tensors) {
    if (detail::glob_match(glob, t.name)) return;
  }
  if (!tensors_only) {
    for (const auto& o : c.objects) {
      if (detail::glob_match(glob, o.name)) return;
    }
  }
  const std::size_t n = c.tensors.size() + (tensors_only ? 0 : c.objects.size());
  throw Error(ErrorKind::kInvalidArgument, c.root.string(), std::nullopt,
              "--tensor '" + glob + "' matches none of the " + std::to_string(n) + (tensors_only ? " tensors" : " entries"));
}

void inspect(const InspectOptions& options, std::ostream& out) {
  inspect(open_checkpoint(options.path, options.meta ? MetaTrees::kKeep : MetaTrees::kDrop), options, out);
}

void inspect(const Checkpoint& c, const InspectOptions& options, std::ostream& out) {
  require_match(c, options.tensor_glob, GlobOver::kEntries);
  const ChunkReader reader(c);
  if (options.format == OutputFormat::kJson) return print_json(c, options, out, reader);
  print_text(c, options, out, reader);
  if (options.meta) {
    for (const auto& [n, tree] : c.meta_trees) {
      out << "\n== " << escape_name(n) << "\n";
      pretty(*tree, out, 0);
      out << "\n";
    }
    bool header = false;
    for (auto* o : sorted_objects(c, options.tensor_glob)) {
      if (!o->item) continue;
      if (!header) out << "\n== non-tensor items\n";
      header = true;
      out << escape_name(o->name) << " = ";
      pretty(*reader.object_value(*o), out, 0);
      out << "\n";
    }
  }
}

}  // namespace ckpt
