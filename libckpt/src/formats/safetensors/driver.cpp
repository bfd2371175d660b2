// SPDX-License-Identifier: Apache-2.0
// The safetensors drivers: a single file (ckpt/formats/safetensors.hpp), and a Hugging Face
// shard set read through its `model.safetensors.index.json`.
#include <map>
#include <nlohmann/json.hpp>

#include "ckpt/error.hpp"
#include "ckpt/formats/safetensors.hpp"
#include "formats/driver.hpp"

namespace ckpt {
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
  Checkpoint c;
  c.format = Format::kSafetensors;
  c.root = path;
  c.writer = "safetensors";
  c.files.push_back({path.filename().string(), path, src->size()});
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

namespace formats {
namespace {

// A JSON object with a weight_map near its start: a sharded safetensors index.
Format detect_index(const Probe& p) {
  if (p.directory) return Format::kUnknown;
  const std::string_view text(reinterpret_cast<const char*>(p.head.data()), p.head.size());
  const auto first = text.find_first_not_of(" \t\r\n");
  const bool index = first != std::string_view::npos && text[first] == '{' && text.find("\"weight_map\"") != std::string_view::npos;
  return index ? Format::kSafetensorsIndex : Format::kUnknown;
}

}  // namespace

const Driver kSafetensorsDriver{
    "safetensors",
    [](const Probe& p) { return !p.directory && looks_like_safetensors(*p.file) ? Format::kSafetensors : Format::kUnknown; },
    [](const std::filesystem::path& path, MetaTrees) { return open_safetensors_checkpoint(path); },
};

const Driver kSafetensorsIndexDriver{
    "safetensors index",
    detect_index,
    [](const std::filesystem::path& path, MetaTrees) { return open_safetensors_index_checkpoint(path); },
};

}  // namespace formats
}  // namespace ckpt
