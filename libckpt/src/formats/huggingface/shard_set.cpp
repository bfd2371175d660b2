// SPDX-License-Identifier: Apache-2.0
// Hugging Face shard sets (docs/formats/safetensors.md#sharded-sets): `model-0000s-of-0000n.
// safetensors` (or `pytorch_model-0000s-of-0000n.bin`) files beside their index, read as one
// checkpoint; safetensors shard sets planned for writing.
#include "formats/huggingface/weight_map.hpp"
#include "formats/safetensors/tensor_entry.hpp"
#include "formats/torch_save/zip_checks.hpp"

#include <cstdio>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "ckpt/error.hpp"
#include "ckpt/formats/torch_save.hpp"

namespace ckpt {

SafetensorsShardSet plan_safetensors_shards(std::vector<SafetensorsEntry> entries, std::optional<std::uint64_t> max_shard_size,
                                            const std::vector<std::pair<std::string, std::string>>& metadata,
                                            const std::string& single_name) {
  // Hugging Face's greedy split, in entry order: file s holds entries [cuts[s], cuts[s + 1]); a
  // tensor larger than the bound gets a file of its own.
  std::vector<std::size_t> cuts{0};
  std::uint64_t in_file = 0, total = 0;
  for (std::size_t i = 0; i < entries.size(); ++i) {
    const std::uint64_t b = entries[i].nbytes();
    total += b;
    if (max_shard_size && i > cuts.back() && in_file + b > *max_shard_size) {
      cuts.push_back(i);
      in_file = 0;
    }
    in_file += b;
  }
  cuts.push_back(entries.size());
  const std::size_t n = cuts.size() - 1;
  SafetensorsShardSet set;
  for (std::size_t s = 0; s < n; ++s) {
    std::string name = single_name;
    if (max_shard_size) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", s + 1, n);
      name = n == 1 ? "model.safetensors" : buf;
    }
    // The entries move into the plan (all of them when there is one file), which gives each one's
    // place in this file back; a name given twice is refused there.
    std::vector<SafetensorsEntry> part;
    if (n == 1) {
      part = std::move(entries);
    } else {
      part.assign(std::make_move_iterator(entries.begin() + static_cast<std::ptrdiff_t>(cuts[s])),
                  std::make_move_iterator(entries.begin() + static_cast<std::ptrdiff_t>(cuts[s + 1])));
    }
    set.files.push_back({name, cuts[s], plan_safetensors(std::move(part), metadata, name)});
  }
  if (n > 1) {
    nlohmann::ordered_json j;
    j["metadata"]["total_size"] = total;
    std::map<std::string, std::string> weight_map;
    for (const auto& f : set.files) {
      for (const auto& e : f.layout.entries) weight_map[e.name] = f.name;
    }
    j["weight_map"] = weight_map;
    set.index = j.dump(2, ' ', true) + "\n";
  }
  return set;
}

namespace {

// Adds to `c` the tensors of the shard at `path`, file `file` of `c`, that `take(name)` accepts
// (the weight_map names them under this file).
using AddShard = std::function<void(Checkpoint& c, const std::filesystem::path& path, std::size_t file,
                                    const std::function<bool(const std::string& name)>& take)>;

void add_safetensors_shard(Checkpoint& c, const std::filesystem::path& shard, std::size_t file,
                           const std::function<bool(const std::string&)>& take) {
  const SafetensorsFile sf = read_safetensors(open_file(shard));
  for (const auto& t : sf.tensors) {
    if (take(t.name)) detail::add_safetensors_tensor(c, t, file);
  }
}

void add_torch_save_shard(Checkpoint& c, const std::filesystem::path& shard, std::size_t file,
                          const std::function<bool(const std::string&)>& take) {
  const TorchSaveFile f = read_torch_save(open_mmap(shard));
  for (const TorchTensor& t : f.tensors) {
    if (!take(t.name)) continue;
    c.tensors.push_back(torch_save_tensor_entry(f, t, file));
    c.tensors.back().position = c.tensors.size() - 1;
  }
  if (!f.objects.empty()) {
    c.notes.push_back(std::to_string(f.objects.size()) + " values of " + shard.filename().string() +
                      " that are not tensors are not read (a weight file holds tensors)");
  }
}

}  // namespace

Checkpoint detail::open_weight_map(const std::filesystem::path& path, std::optional<Format> format) {
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
    throw Error(ErrorKind::kFormat, path.string(), 0, "not a Hugging Face index: no \"weight_map\" object");
  }
  if (!format) {
    bool bins = !j["weight_map"].empty();
    for (const auto& [name, file] : j["weight_map"].items()) bins = bins && file.is_string() && file.get<std::string>().ends_with(".bin");
    format = bins ? Format::kTorchSaveIndex : Format::kSafetensorsIndex;
  }
  const bool torch_shards = *format == Format::kTorchSaveIndex;
  const std::string kind = torch_shards ? "torch.save" : "safetensors";
  const AddShard add_shard = torch_shards ? AddShard(add_torch_save_shard) : AddShard(add_safetensors_shard);
  Checkpoint c;
  c.format = *format;
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
  for (auto& [shard_name, index] : shard_of) {
    const std::string& f = shard_name;  // a reference the lambda below can capture
    const std::filesystem::path p = dir / f;
    if (!std::filesystem::is_regular_file(p, ec)) {
      throw Error(ErrorKind::kIo, p.string(), std::nullopt, "shard named by the index is missing");
    }
    if (!resolves_inside(dir.empty() ? std::filesystem::path(".") : dir, p)) {
      throw Error(ErrorKind::kFormat, p.string(), std::nullopt, "shard named by the index is a symbolic link that leads outside its directory");
    }
    index = c.files.size();
    c.files.push_back({f, p, std::filesystem::file_size(p, ec)});
    // A tensor of the shard is taken when the weight_map names it under this file.
    add_shard(c, p, index, [&](const std::string& name) {
      auto it = expected.find(name);
      if (it == expected.end() || it->second != f) {
        c.notes.push_back("tensor '" + name + "' in " + f + " is not in the weight_map" +
                          (it == expected.end() ? std::string() : " under this file (it names " + it->second + ")"));
        return false;
      }
      expected.erase(it);
      return true;
    });
  }
  if (!expected.empty()) {
    throw Error(ErrorKind::kFormat, path.string(), std::nullopt,
                "weight_map names '" + expected.begin()->first + "' in " + expected.begin()->second + ", which does not hold it" +
                    (expected.size() > 1 ? " (and " + std::to_string(expected.size() - 1) + " more)" : ""));
  }
  c.writer = "Hugging Face sharded " + kind + ", " + std::to_string(shard_of.size()) + " shards";
  if (torch_shards) c.file_checks = torch_save_file_checks();
  if (j.contains("metadata") && j["metadata"].is_object()) {
    for (const auto& [k, v] : j["metadata"].items()) c.metadata.emplace_back(k, v.is_string() ? v.get<std::string>() : v.dump());
  }
  return c;
}

Checkpoint open_safetensors_index_checkpoint(const std::filesystem::path& path) {
  return detail::open_weight_map(path, Format::kSafetensorsIndex);
}

Checkpoint open_torch_save_index_checkpoint(const std::filesystem::path& path) {
  return detail::open_weight_map(path, Format::kTorchSaveIndex);
}

}  // namespace ckpt
