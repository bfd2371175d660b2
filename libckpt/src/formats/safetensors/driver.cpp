// SPDX-License-Identifier: Apache-2.0
// The safetensors driver: a single file (ckpt/formats/safetensors.hpp). Shard sets with an index
// are Hugging Face's (formats/huggingface/).
#include "ckpt/error.hpp"
#include "ckpt/formats/safetensors.hpp"
#include "formats/driver.hpp"
#include "formats/safetensors/tensor_entry.hpp"

namespace ckpt {

// One whole-tensor raw chunk in file `file` for a tensor of a safetensors header.
void detail::add_safetensors_tensor(Checkpoint& c, const SafetensorsTensor& t, std::size_t file) {
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
  for (const auto& t : f.tensors) detail::add_safetensors_tensor(c, t, 0);
  return c;
}

namespace formats {

const Driver kSafetensorsDriver{
    "safetensors",
    [](const Probe& p) { return !p.directory && looks_like_safetensors(*p.file) ? Format::kSafetensors : Format::kUnknown; },
    [](const std::filesystem::path& path, MetaTrees) { return open_safetensors_checkpoint(path); },
};

}  // namespace formats
}  // namespace ckpt
