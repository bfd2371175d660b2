// SPDX-License-Identifier: Apache-2.0
// The Checkpoint index for torch.save and safetensors files and safetensors indexes, open_checkpoint(),
// and ChunkReader.
#include "ckpt/checkpoint.hpp"

#include <zstd.h>

#include <map>
#include <nlohmann/json.hpp>

#include "ckpt/dcp.hpp"
#include "ckpt/hdf5.hpp"
#include "ckpt/error.hpp"
#include "ckpt/safetensors.hpp"
#include "ckpt/torch_save.hpp"

namespace ckpt {

std::uint64_t TensorEntry::numel() const noexcept {
  std::uint64_t n = 1;
  for (auto d : shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

const TensorEntry* Checkpoint::find_tensor(std::string_view name) const noexcept {
  for (const auto& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

std::vector<std::int64_t> contiguous_strides(std::span<const std::int64_t> shape) {
  std::vector<std::int64_t> s(shape.size());
  std::int64_t k = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    s[i] = k;
    k *= std::max<std::int64_t>(shape[i], 1);
  }
  return s;
}

namespace {

std::string torch_writer_guess(const std::vector<std::string>& records) {
  auto has = [&](std::string_view r) { return std::find(records.begin(), records.end(), r) != records.end(); };
  // spec/FORMATS.md §2.5: which releases write which records.
  if (has(".storage_alignment")) return "torch >= 2.6";
  if (has(".format_version") || has(".data/serialization_id")) return "torch >= 2.2";
  if (has("byteorder")) return "torch >= 2.1";
  return "torch 1.6 - 2.0";
}

// The index of a single-file checkpoint, before its entries are added.
Checkpoint single_file(Format format, const std::filesystem::path& path, std::string writer, std::uint64_t size) {
  Checkpoint c;
  c.format = format;
  c.root = path;
  c.writer = std::move(writer);
  c.files.push_back({path.filename().string(), path, size});
  return c;
}

}  // namespace

TensorEntry torch_save_tensor_entry(const TorchSaveFile& f, const TorchTensor& t, std::size_t file) {
  const TorchStorage& st = f.storages[t.storage];
  TensorEntry e;
  e.name = t.name;
  e.dtype = t.dtype;
  e.shape = t.shape;
  e.requires_grad = t.requires_grad;
  ChunkLocation loc;
  loc.file = static_cast<std::uint32_t>(file);
  loc.offset = resolve_window(*st.data).offset;
  loc.length = st.data->size();
  const bool strided = t.stride != contiguous_strides(t.shape);
  if (strided || t.storage_offset != 0 || st.crc32 != 0) {
    loc.layout = ChunkLocation::LayoutPtr(ChunkLocation::Layout{{}, strided ? t.stride : std::vector<std::int64_t>{}, t.storage_offset, st.crc32});
  }
  e.chunks.push_back({std::vector<std::int64_t>(t.shape.size(), 0), t.shape, loc});
  return e;
}

Checkpoint open_torch_save_checkpoint(const std::filesystem::path& path, MetaTrees trees) {
  SourcePtr src = open_mmap(path);
  TorchSaveFile f = read_torch_save(src);
  Checkpoint c = single_file(Format::kTorchSave, path, torch_writer_guess(f.records), src->size());
  for (const TorchTensor& t : f.tensors) {
    c.tensors.push_back(torch_save_tensor_entry(f, t, 0));
    c.tensors.back().position = c.tensors.size() - 1;
  }
  for (auto& [name, v] : f.objects) c.objects.push_back({name, c.tensors.size() + c.objects.size(), v, std::nullopt});
  for (auto& [name, keys] : f.key_paths) c.planner_data.add(name, pickle::make_tuple(keys));
  // The whole tree (for --meta) only when asked: the leaves already hold the objects they need,
  // and the rest is a node per tensor's rebuild call.
  if (trees == MetaTrees::kKeep) c.meta_trees.emplace_back(path.filename().string(), f.root);
  return c;
}

namespace {

// One whole-tensor raw chunk in file `file` for a tensor of a safetensors header.
void add_safetensors_tensor(Checkpoint& c, const SafetensorsTensor& t, std::size_t file) {
  TensorEntry e;
  e.name = t.name;
  e.dtype = t.dtype;
  for (const auto d : t.shape) e.shape.push_back(static_cast<std::int64_t>(d));
  ChunkLocation loc;
  loc.file = static_cast<std::uint32_t>(file);
  loc.offset = t.begin;
  loc.length = t.end - t.begin;
  e.chunks.push_back({std::vector<std::int64_t>(e.shape.size(), 0), e.shape, loc});
  e.position = c.tensors.size();
  c.tensors.push_back(std::move(e));
}

}  // namespace

Checkpoint open_safetensors_checkpoint(const std::filesystem::path& path) {
  SourcePtr src = open_mmap(path);
  SafetensorsFile f = read_safetensors(src);
  Checkpoint c = single_file(Format::kSafetensors, path, "safetensors", src->size());
  c.metadata = f.metadata;
  c.tensors.reserve(f.tensors.size());  // grown by doubling, both copies would stand for a moment
  for (const auto& t : f.tensors) add_safetensors_tensor(c, t, 0);
  return c;
}

Checkpoint open_safetensors_index_checkpoint(const std::filesystem::path& path) {
  constexpr std::uint64_t kMaxIndex = std::uint64_t{256} << 20;
  SourcePtr src = open_file(path);
  if (src->size() > kMaxIndex) throw Error(ErrorKind::kFormat, path.string(), std::nullopt, "index larger than 256 MiB");
  const std::vector<std::byte> bytes = src->read_vector(0, src->size());
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(reinterpret_cast<const char*>(bytes.data()), reinterpret_cast<const char*>(bytes.data()) + bytes.size());
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(ErrorKind::kFormat, path.string(), e.byte > 0 ? e.byte - 1 : 0, std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    throw Error(ErrorKind::kFormat, path.string(), 0, "not a safetensors index: no \"weight_map\" object");
  }
  Checkpoint c;
  c.format = Format::kSafetensorsIndex;
  c.root = path;
  const std::filesystem::path dir = path.parent_path();
  std::error_code ec;
  c.files.push_back({path.filename().string(), path, std::filesystem::file_size(path, ec)});
  // Shards in name order; each name must stay in the index's directory.
  std::map<std::string, std::size_t> shard_of;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string()) throw Error(ErrorKind::kFormat, path.string(), std::nullopt, "weight_map of '" + name + "' is not a file name");
    const std::string f = file.get<std::string>();
    if (f.empty() || f.find('/') != std::string::npos || f.find('\\') != std::string::npos || f == "." || f == "..") {
      throw Error(ErrorKind::kFormat, path.string(), std::nullopt, "weight_map names '" + f + "', which is not a file in the index's directory");
    }
    shard_of.emplace(f, 0);
  }
  std::map<std::string, std::string> expected;  // tensor -> shard
  for (const auto& [name, file] : j["weight_map"].items()) expected[name] = file.get<std::string>();
  for (auto& [f, index] : shard_of) {
    const std::filesystem::path p = dir / f;
    if (!std::filesystem::is_regular_file(p, ec)) {
      throw Error(ErrorKind::kIo, p.string(), std::nullopt, "shard named by the index is missing");
    }
    if (!resolves_inside(dir.empty() ? std::filesystem::path(".") : dir, p)) {
      throw Error(ErrorKind::kFormat, p.string(), std::nullopt, "shard named by the index is a symbolic link that leads outside its directory");
    }
    SourcePtr shard = open_file(p);
    SafetensorsFile sf = read_safetensors(shard);
    index = c.files.size();
    c.files.push_back({f, p, shard->size()});
    for (const auto& t : sf.tensors) {
      auto it = expected.find(t.name);
      if (it == expected.end() || it->second != f) {
        c.notes.push_back("tensor '" + t.name + "' in " + f + " is not in the weight_map" +
                          (it == expected.end() ? std::string() : " under this file (it names " + it->second + ")"));
        continue;
      }
      expected.erase(it);
      add_safetensors_tensor(c, t, index);
    }
  }
  if (!expected.empty()) {
    throw Error(ErrorKind::kFormat, path.string(), std::nullopt,
                "weight_map names '" + expected.begin()->first + "' in " + expected.begin()->second + ", which does not hold it" +
                    (expected.size() > 1 ? " (and " + std::to_string(expected.size() - 1) + " more)" : ""));
  }
  c.writer = "Hugging Face sharded safetensors, " + std::to_string(shard_of.size()) + " shards";
  if (j.contains("metadata") && j["metadata"].is_object()) {
    for (const auto& [k, v] : j["metadata"].items()) c.metadata.emplace_back(k, v.is_string() ? v.get<std::string>() : v.dump());
  }
  return c;
}

Checkpoint open_checkpoint(const std::filesystem::path& path, MetaTrees trees) {
  const Format f = detect_format(path);
  switch (f) {
    case Format::kTorchSave: return open_torch_save_checkpoint(path, trees);
    case Format::kSafetensors: return open_safetensors_checkpoint(path);
    case Format::kDcp:
    case Format::kLightningSharded: return open_dcp(path, trees);
    case Format::kHdf5: return open_hdf5_checkpoint(path);
    case Format::kSafetensorsIndex: return open_safetensors_index_checkpoint(path);
    case Format::kUnknown: {
      std::error_code ec;
      if (std::filesystem::is_directory(path, ec)) {
        const bool tmp = std::filesystem::exists(path / ".metadata.tmp", ec);
        throw Error(ErrorKind::kFormat, path.string(), std::nullopt,
                    tmp ? "directory has .metadata.tmp but no .metadata: the save died before it committed (incomplete checkpoint)"
                        : "directory has no .metadata: not a DCP checkpoint, or an incomplete one");
      }
      throw Error(ErrorKind::kFormat, path.string(), 0,
                  "not a checkpoint this tool recognises (torch.save zip, safetensors, DCP directory)");
    }
    default:
      internal_error("open_checkpoint: a format without a reader");
  }
}

// ---- ChunkReader -----------------------------------------------------------------------------

ChunkReader::ChunkReader(const Checkpoint& checkpoint, FileAccess access) : checkpoint_(checkpoint), access_(access) {}

namespace {
constexpr std::uint64_t kSmallItem = 64 * 1024;
}  // namespace

SourcePtr ChunkReader::file(std::size_t index) const {
  std::lock_guard lock(mutex_);
  if (auto it = open_.find(index); it != open_.end()) return it->second;
  if (index >= checkpoint_.files.size()) internal_error("ChunkReader: file index out of range");
  const CheckpointFile& f = checkpoint_.files[index];
  if (!f.size) throw Error(ErrorKind::kIo, f.path.string(), std::nullopt, "file is missing (the metadata names it)");
  SourcePtr s = access_ == FileAccess::kMap ? open_mmap(f.path) : open_file(f.path);
  open_.emplace(index, s);
  return s;
}

namespace {

SourcePtr zstd_decode(const SourcePtr& in, std::uint64_t max_decoded) {
  // NOTE [zstd in a stream]: the frame's content size, when present, is not trusted; the output
  // grows as decoded and stops at `max_decoded`. Exactly one frame must fill the item.
  std::unique_ptr<ZSTD_DCtx, decltype(&ZSTD_freeDCtx)> ctx(ZSTD_createDCtx(), ZSTD_freeDCtx);
  if (!ctx) internal_error("ZSTD_createDCtx failed");
  std::vector<std::byte> out;
  std::vector<std::byte> chunk(ZSTD_DStreamOutSize());
  std::uint64_t consumed = 0;
  size_t ret = 1;
  stream_range(*in, 0, in->size(), [&](std::span<const std::byte> piece) {
    ZSTD_inBuffer ib{piece.data(), piece.size(), 0};
    while (ib.pos < ib.size) {
      if (ret == 0) {
        throw Error(ErrorKind::kFormat, in->name(), consumed + ib.pos, "bytes follow the end of the zstd frame (one frame per item)");
      }
      ZSTD_outBuffer ob{chunk.data(), chunk.size(), 0};
      ret = ZSTD_decompressStream(ctx.get(), &ob, &ib);
      if (ZSTD_isError(ret)) {
        throw Error(ErrorKind::kFormat, in->name(), consumed + ib.pos, std::string("zstd: ") + ZSTD_getErrorName(ret));
      }
      if (out.size() + ob.pos > max_decoded) {
        throw Error(ErrorKind::kFormat, in->name(), consumed + ib.pos,
                    "zstd item decodes to more than " + std::to_string(max_decoded) + " bytes");
      }
      out.insert(out.end(), chunk.begin(), chunk.begin() + static_cast<std::ptrdiff_t>(ob.pos));
    }
    consumed += piece.size();
  });
  if (ret != 0) throw Error(ErrorKind::kFormat, in->name(), in->size(), "zstd frame is truncated");
  return memory_source(std::move(out), in->name() + "[zstd]");
}

}  // namespace

SourcePtr ChunkReader::item(const ChunkLocation& loc, std::uint64_t max_decoded) const {
  SourcePtr f = file(loc.file);
  SourcePtr s = sub_source(f, loc.offset, loc.length, "item at " + std::to_string(loc.offset));
  if (access_ == FileAccess::kReadSmallItemsWhole && loc.transforms().empty() && loc.length <= kSmallItem) {
    s = memory_source(s->read_vector(0, s->size()), s->name());  // same name and offsets as the window
  }
  if (loc.transforms().size() > 1) {
    throw Error(ErrorKind::kUnsupported, s->name(), 0,
                std::to_string(loc.transforms().size()) + " stacked transforms; at most one is supported (spec/FORMATS.md §3.5)");
  }
  for (const std::string& t : loc.transforms()) {
    const std::string name = t.substr(0, t.find('/'));
    const std::string version = t.find('/') == std::string::npos ? "" : t.substr(t.find('/') + 1);
    if (name != "stream.zstd") {
      throw Error(ErrorKind::kUnsupported, s->name(), 0, "unknown transform '" + t + "' (only stream.zstd/1 is known)");
    }
    if (!version.empty() && version.substr(0, version.find('.')) != "1") {
      throw Error(ErrorKind::kUnsupported, s->name(), 0, "transform '" + t + "' has major version other than 1");
    }
    s = zstd_decode(s, max_decoded);
  }
  return s;
}

ChunkData ChunkReader::read(const TensorEntry& tensor, const Chunk& chunk) const {
  if (!chunk.location) {
    throw Error(ErrorKind::kFormat, checkpoint_.root.string(), std::nullopt,
                "chunk at offsets of '" + tensor.name + "' has no storage entry");
  }
  const ChunkLocation& loc = *chunk.location;
  ChunkData d;
  d.dtype = tensor.dtype;
  d.shape = chunk.sizes;
  if (loc.encoding == ChunkEncoding::kRaw) {
    d.storage = sub_source(file(loc.file), loc.offset, loc.length, tensor.name);
    d.strides = loc.strides().empty() ? contiguous_strides(chunk.sizes) : loc.strides();
    d.storage_offset = loc.storage_offset();
    d.crc32 = loc.crc32();
    return d;
  }
  std::uint64_t bytes = element_size(tensor.dtype);
  for (auto s : chunk.sizes) bytes *= static_cast<std::uint64_t>(s);
  SourcePtr it = item(loc, bytes + (std::uint64_t{1} << 20));
  TorchSaveFile f = read_torch_save(it);
  if (f.tensors.size() != 1 || !f.tensors[0].name.empty()) {
    throw Error(ErrorKind::kFormat, it->name(), 0,
                "tensor item of '" + tensor.name + "' holds " + std::to_string(f.tensors.size()) +
                    " tensors at its top level, expected one");
  }
  const TorchTensor& t = f.tensors[0];
  if (t.dtype != tensor.dtype) {
    throw Error(ErrorKind::kMismatch, it->name(), 0,
                "item of '" + tensor.name + "' is " + std::string(name(t.dtype)) + ", the metadata says " +
                    std::string(name(tensor.dtype)));
  }
  if (t.shape != chunk.sizes) {
    auto text = [](const std::vector<std::int64_t>& v) {
      std::string s = "[";
      for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
      return s + "]";
    };
    throw Error(ErrorKind::kMismatch, it->name(), 0,
                "item of '" + tensor.name + "' has shape " + text(t.shape) + ", the chunk " + text(chunk.sizes));
  }
  d.storage = f.storages[t.storage].data;
  d.crc32 = f.storages[t.storage].crc32;
  d.strides = t.stride;
  d.storage_offset = t.storage_offset;
  return d;
}

pickle::ValuePtr ChunkReader::object_value(const ObjectEntry& entry) const {
  if (entry.value || !entry.item) return entry.value;
  SourcePtr it = item(*entry.item);
  return read_torch_save(it).root;
}

}  // namespace ckpt
