// SPDX-License-Identifier: Apache-2.0
// inspect: one summary model for every format, printed as a table or as JSON schema 1.
#include "ckpt/ops/inspect.hpp"

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>

#include "ckpt/error.hpp"
#include "ckpt/format.hpp"
#include "ckpt/io.hpp"
#include "ckpt/safetensors.hpp"
#include "ckpt/torch_save.hpp"

namespace ckpt {
namespace {

using nlohmann::ordered_json;

struct Chunk {
  std::vector<std::int64_t> offsets, sizes;
  std::string file;
  std::uint64_t offset = 0, length = 0;
};

struct Entry {
  std::string name;
  std::string kind;  // tensor | bytes | object
  std::optional<DType> dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t nbytes = 0;
  std::vector<Chunk> chunks;
  std::string value;  // objects: a repr
};

struct Summary {
  Format format = Format::kUnknown;
  std::string writer;
  std::optional<int> world_size;
  std::vector<std::pair<std::string, std::uint64_t>> files;
  std::vector<Entry> entries;
  std::vector<std::pair<std::string, std::string>> metadata;
};

std::vector<std::int64_t> contiguous_shape(const std::vector<std::uint64_t>& s) {
  return {s.begin(), s.end()};
}

Summary from_torch_save(const std::filesystem::path& path) {
  SourcePtr src = open_mmap(path);
  TorchSaveFile f = read_torch_save(src);
  Summary s;
  s.format = Format::kTorchSave;
  auto has = [&](std::string_view r) { return std::find(f.records.begin(), f.records.end(), r) != f.records.end(); };
  // spec/FORMATS.md §2.5: which releases write which records.
  if (has(".storage_alignment")) s.writer = "torch >= 2.6";
  else if (has(".format_version")) s.writer = "torch >= 2.2";
  else if (has(".data/serialization_id")) s.writer = "torch >= 2.2";
  else if (has("byteorder")) s.writer = "torch >= 2.1";
  else s.writer = "torch 1.6 - 2.0";
  s.files.emplace_back(path.string(), src->size());
  for (const TorchTensor& t : f.tensors) {
    const TorchStorage& st = f.storages[t.storage];
    const std::size_t es = element_size(t.dtype);
    Entry e{t.name, "tensor", t.dtype, t.shape, t.numel() * es, {}, {}};
    Chunk c;
    c.offsets.assign(t.shape.size(), 0);
    c.sizes = t.shape;
    c.file = path.string();
    const Window w = resolve_window(*st.data);
    c.offset = w.offset + static_cast<std::uint64_t>(t.storage_offset) * es;
    std::uint64_t span = t.numel() ? 1 : 0;
    for (std::size_t d = 0; d < t.shape.size() && t.numel(); ++d) span += static_cast<std::uint64_t>((t.shape[d] - 1) * t.stride[d]);
    c.length = span * es;
    e.chunks.push_back(std::move(c));
    s.entries.push_back(std::move(e));
  }
  for (const auto& [name, v] : f.objects) {
    s.entries.push_back({name, "object", std::nullopt, {}, 0, {}, pickle::repr(*v, 200)});
  }
  return s;
}

Summary from_safetensors(const std::filesystem::path& path) {
  SourcePtr src = open_mmap(path);
  SafetensorsFile f = read_safetensors(src);
  Summary s;
  s.format = Format::kSafetensors;
  s.writer = "safetensors";
  s.files.emplace_back(path.string(), src->size());
  s.metadata = f.metadata;
  for (const auto& t : f.tensors) {
    Entry e{t.name, "tensor", t.dtype, contiguous_shape(t.shape), t.end - t.begin, {}, {}};
    e.chunks.push_back({std::vector<std::int64_t>(t.shape.size(), 0), e.shape, path.string(), t.begin, t.end - t.begin});
    s.entries.push_back(std::move(e));
  }
  return s;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

std::string group_of(const Entry& e) {
  if (e.kind != "tensor") return "other";
  const std::string first = e.name.substr(0, e.name.find('.'));
  if (first.starts_with("optim")) return "optimizer";
  return "model";
}

void print_text(const Summary& s, std::ostream& out) {
  out << "format:    " << to_string(s.format) << " (looks like " << s.writer << ")\n";
  out << "world:     " << (s.world_size ? std::to_string(*s.world_size) : std::string("-")) << "\n";
  for (const auto& [p, size] : s.files) out << "file:      " << escape_name(p) << " (" << size << " bytes)\n";
  std::size_t tensors = 0;
  std::map<std::string, std::pair<std::size_t, std::uint64_t>> by_dtype, by_group;
  for (const auto& e : s.entries) {
    auto& g = by_group[group_of(e)];
    ++g.first;
    g.second += e.nbytes;
    if (e.kind != "tensor") continue;
    ++tensors;
    auto& d = by_dtype[std::string(name(*e.dtype))];
    ++d.first;
    d.second += e.nbytes;
  }
  out << "entries:   " << s.entries.size() << " (" << tensors << " tensors, " << s.entries.size() - tensors << " other)\n";
  for (const auto& [d, c] : by_dtype) out << "bytes:     " << d << " " << c.second << " in " << c.first << " tensors\n";
  out << "split:    ";
  for (const char* g : {"model", "optimizer", "other"}) {
    auto it = by_group.find(g);
    out << " " << g << " " << (it == by_group.end() ? 0 : it->second.first);
  }
  out << "\n";
  out << "metadata:  ";
  if (s.metadata.empty()) out << "-";
  for (std::size_t i = 0; i < s.metadata.size(); ++i) out << (i ? ", " : "") << escape_name(s.metadata[i].first);
  out << "\n\n";
  std::vector<const Entry*> order;
  for (const auto& e : s.entries) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->name < b->name; });
  // Columns are counted in code points, so that non-ASCII names line up.
  auto width = [](const std::string& t) {
    return static_cast<std::size_t>(std::count_if(t.begin(), t.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xc0) != 0x80; }));
  };
  std::size_t w = 4;
  for (auto* e : order) w = std::max(w, width(escape_name(e->name)));
  auto pad = [&](std::string t, std::size_t n) {
    const std::size_t tw = width(t);
    return tw >= n ? t + " " : t + std::string(n - tw + 1, ' ');
  };
  out << pad("NAME", w) << pad("KIND", 6) << pad("DTYPE", 10) << pad("SHAPE", 16) << pad("NUMEL", 12) << pad("BYTES", 12) << "CHUNKS\n";
  for (auto* e : order) {
    if (e->kind == "tensor") {
      std::uint64_t numel = 1;
      for (auto d : e->shape) numel *= static_cast<std::uint64_t>(d);
      out << pad(escape_name(e->name), w) << pad(e->kind, 6) << pad(std::string(name(*e->dtype)), 10) << pad(shape_text(e->shape), 16)
          << pad(std::to_string(numel), 12) << pad(std::to_string(e->nbytes), 12) << e->chunks.size() << "\n";
    } else {
      out << pad(escape_name(e->name), w) << pad(e->kind, 6) << escape_name(e->value) << "\n";
    }
  }
}

void print_json(const Summary& s, std::ostream& out) {
  ordered_json j;
  j["schema"] = 1;
  j["format"] = std::string(to_string(s.format));
  j["writer"] = s.writer;
  j["world_size"] = s.world_size ? ordered_json(*s.world_size) : ordered_json(nullptr);
  j["files"] = ordered_json::array();
  for (const auto& [p, size] : s.files) j["files"].push_back({{"path", p}, {"size", size}});
  std::vector<const Entry*> order;
  for (const auto& e : s.entries) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->name < b->name; });
  j["entries"] = ordered_json::array();
  for (auto* e : order) {
    ordered_json x;
    x["name"] = e->name;
    x["kind"] = e->kind;
    if (e->kind == "tensor") {
      x["dtype"] = std::string(name(*e->dtype));
      x["shape"] = e->shape;
      x["nbytes"] = e->nbytes;
      x["chunks"] = ordered_json::array();
      for (const auto& c : e->chunks) {
        x["chunks"].push_back({{"offsets", c.offsets}, {"sizes", c.sizes}, {"file", c.file}, {"offset", c.offset}, {"length", c.length}});
      }
    } else {
      x["value"] = e->value;
    }
    j["entries"].push_back(std::move(x));
  }
  j["metadata"] = ordered_json::object();
  for (const auto& [k, v] : s.metadata) j["metadata"][k] = v;
  // Invalid UTF-8 in a name is replaced rather than aborting the listing.
  out << j.dump(-1, ' ', false, ordered_json::error_handler_t::replace) << "\n";
}

}  // namespace

std::string escape_name(std::string_view name) {
  std::string out;
  out.reserve(name.size());
  for (char ch : name) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out;
}

void inspect(const InspectOptions& options, std::ostream& out) {
  const Format f = detect_format(options.path);
  Summary s;
  switch (f) {
    case Format::kTorchSave: s = from_torch_save(options.path); break;
    case Format::kSafetensors: s = from_safetensors(options.path); break;
    case Format::kUnknown:
      throw Error(ErrorKind::kFormat, options.path.string(), 0,
                  "not a checkpoint this tool recognises (torch.save zip, safetensors, DCP directory, HDF5)");
    default:
      // TODO(fsdp-tools): DCP, Lightning sharded, safetensors index and HDF5 readers (#3).
      throw Error(ErrorKind::kUnsupported, options.path.string(), std::nullopt,
                  std::string(to_string(f)) + " checkpoints are recognised but not readable by this version yet");
  }
  if (options.format == OutputFormat::kJson) print_json(s, out);
  else print_text(s, out);
}

}  // namespace ckpt
