// SPDX-License-Identifier: Apache-2.0
// DCP's Hugging Face storage (docs/formats/dcp.md#hugging-face-storage): what torch's
// HuggingFaceStorageWriter leaves, safetensors files without a .metadata, named
// `shard-0000r-model-0000k-of-0000n.safetensors` (save_sharded: each rank its own) or
// `model-0000k-of-0000n.safetensors`. A file's __metadata__ may carry DCP_SHARDING_INFO, the JSON
// {fqn: {"saved_offsets": [...]}}: its tensors are then chunks at those offsets, else whole
// tensors at offset 0. Read as HuggingFaceStorageReader.read_metadata reads them: every such file
// of the directory, each tensor's shape the furthest extent of its chunks. A box that several files
// saved (a replicated tensor written by every rank) is read once.
#include <algorithm>
#include <map>
#include <regex>
#include <vector>

#include "ckpt/error.hpp"
#include "ckpt/formats/safetensors.hpp"
#include "formats/dcp/sharding_info.hpp"
#include "formats/driver.hpp"

namespace ckpt::formats {
namespace {

// The directory's files as the writer names them, sorted; a symbolic link that leads outside is
// left out (it is not read).
std::vector<std::filesystem::path> storage_files(const std::filesystem::path& dir) {
  static const std::regex kName(R"((shard-\d{5}-)?model-\d{5}-of-\d{5}\.safetensors)");
  std::vector<std::filesystem::path> out;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (std::regex_match(e.path().filename().string(), kName) && e.is_regular_file(ec) && resolves_inside(dir, e.path())) {
      out.push_back(e.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

Format detect(const Probe& p) {
  std::error_code ec;
  if (!p.directory || std::filesystem::exists(p.path / ".metadata", ec)) return Format::kUnknown;
  return storage_files(p.path).empty() ? Format::kUnknown : Format::kDcpSafetensors;
}

Checkpoint open(const std::filesystem::path& dir, MetaTrees) {
  Checkpoint c;
  c.format = Format::kDcpSafetensors;
  c.root = dir;
  std::map<std::string, std::size_t> by_name;  // tensor name -> its entry
  bool sharded = false;
  std::size_t replicas = 0;
  for (const std::filesystem::path& p : storage_files(dir)) {
    const SafetensorsFile f = read_safetensors(open_file(p));
    std::vector<std::vector<std::int64_t>> offsets;
    if (auto saved = detail::dcp_saved_offsets(f)) {
      offsets = std::move(*saved);
    } else {
      for (const SafetensorsTensor& t : f.tensors) offsets.emplace_back(t.shape.size(), 0);
    }
    const std::size_t file = c.files.size();
    c.files.push_back({p.filename().string(), p, f.source->size()});
    for (std::size_t i = 0; i < f.tensors.size(); ++i) {
      const SafetensorsTensor& t = f.tensors[i];
      const std::vector<std::int64_t> sizes(t.shape.begin(), t.shape.end());
      auto [it, added] = by_name.emplace(t.name, c.tensors.size());
      if (added) {
        TensorEntry e;
        e.name = t.name;
        e.dtype = t.dtype;
        e.shape = std::vector<std::int64_t>(sizes.size(), 0);
        e.position = c.tensors.size();
        c.tensors.push_back(std::move(e));
      }
      TensorEntry& e = c.tensors[it->second];
      if (e.dtype != t.dtype || e.shape.size() != sizes.size()) {
        throw Error(ErrorKind::kMismatch, p.string(), 8,
                    "tensor '" + t.name + "' is " + std::string(name(t.dtype)) + " of " + std::to_string(sizes.size()) +
                        " dimensions here, " + std::string(name(e.dtype)) + " of " + std::to_string(e.shape.size()) + " in " +
                        c.files[e.chunks.front().location->file].relative);
      }
      for (std::size_t d = 0; d < sizes.size(); ++d) {
        e.shape[d] = std::max(e.shape[d], offsets[i][d] + sizes[d]);
        sharded = sharded || offsets[i][d] != 0;
      }
      // A replica (the same box saved by another file): read once, from the first file, never
      // concatenated.
      const bool replica = std::any_of(e.chunks.begin(), e.chunks.end(), [&](const Chunk& ch) {
        return std::equal(ch.offsets.begin(), ch.offsets.end(), offsets[i].begin(), offsets[i].end()) &&
               std::equal(ch.sizes.begin(), ch.sizes.end(), sizes.begin(), sizes.end());
      });
      if (replica) {
        ++replicas;
        continue;
      }
      ChunkLocation loc;
      loc.file = static_cast<std::uint32_t>(file);
      loc.offset = t.begin;
      loc.length = t.end - t.begin;
      e.chunks.push_back({offsets[i], sizes, loc});
    }
  }
  if (replicas) {
    c.notes.push_back(std::to_string(replicas) + " chunks were saved by more than one file (replicas); the first file's copy is used");
  }
  c.writer = std::string("torch.distributed.checkpoint HuggingFaceStorageWriter") + (sharded ? " (sharded)" : "") + ", " +
             std::to_string(c.files.size()) + " files";
  return c;
}

}  // namespace

const Driver kDcpSafetensorsDriver{"DCP Hugging Face storage", detect, open};

}  // namespace ckpt::formats
