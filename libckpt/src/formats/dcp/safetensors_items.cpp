// SPDX-License-Identifier: Apache-2.0
// NOTE [DCP's safetensors serialization] (formats/dcp/metadata.hpp), following
// torch/distributed/checkpoint/filesystem.py: _write_item records a tensor item at the stream's
// position when it is written (nothing is, in this mode) and numel x element size;
// _write_files_from_queue then appends safetensors.torch.save of {fqn: tensor} with
// DCP_SHARDING_INFO.
#include <algorithm>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include "ckpt/error.hpp"
#include "ckpt/formats/safetensors.hpp"
#include "formats/dcp/metadata.hpp"
#include "formats/dcp/sharding_info.hpp"

namespace ckpt::detail {

void resolve_safetensors_items(Checkpoint& c) {
  // Where each file's first tensor item is recorded (the blob's start, in this mode); files whose
  // items are under a transform hold torch.save archives.
  constexpr std::uint64_t kNone = ~std::uint64_t{0};
  std::vector<std::uint64_t> first(c.files.size(), kNone);
  for (const TensorEntry& t : c.tensors) {
    for (const Chunk& ch : t.chunks) {
      if (!ch.location || ch.location->encoding != ChunkEncoding::kItem || ch.location->file >= first.size()) continue;
      const bool transformed = ch.location->layout && !ch.location->layout->transforms.empty();
      first[ch.location->file] = transformed ? kNone - 1 : std::min(first[ch.location->file], ch.location->offset);
    }
  }
  struct Blob {
    std::uint64_t at = 0;
    SafetensorsFile header;
    std::optional<std::vector<std::vector<std::int64_t>>> saved;
    std::map<std::string_view, std::size_t> by_name;
  };
  std::map<std::size_t, Blob> blobs;  // by file: those that hold a safetensors blob
  for (std::size_t f = 0; f < first.size(); ++f) {
    if (first[f] >= kNone - 1 || !c.files[f].size) continue;  // a missing file is verify's to report
    const SourcePtr file = open_mmap(c.files[f].path);
    const std::uint64_t at = first[f];
    if (at >= file->size() || file->size() - at < 9) continue;
    std::byte head[9];
    file->read_at(at, head);
    if (head[8] != std::byte{'{'}) continue;  // a torch.save archive ("PK\3\4"), or damage verify reports
    Blob& blob = blobs[f];
    blob.at = at;
    blob.header = read_safetensors(sub_source(file, at, file->size() - at, "safetensors blob"));
    blob.saved = dcp_saved_offsets(blob.header);
    for (std::size_t i = 0; i < blob.header.tensors.size(); ++i) blob.by_name.emplace(blob.header.tensors[i].name, i);
  }
  if (blobs.empty()) return;
  for (TensorEntry& t : c.tensors) {
    for (Chunk& ch : t.chunks) {
      if (!ch.location || ch.location->encoding != ChunkEncoding::kItem) continue;
      const auto b = blobs.find(ch.location->file);
      if (b == blobs.end()) continue;
      const Blob& blob = b->second;
      const std::string where = c.files[b->first].path.string();
      const auto it = blob.by_name.find(t.name);
      if (it == blob.by_name.end()) {
        throw Error(ErrorKind::kFormat, where, blob.at, "the safetensors blob holds no tensor '" + t.name + "', which .metadata places in this file");
      }
      const SafetensorsTensor& bt = blob.header.tensors[it->second];
      const bool same_box =
          std::equal(ch.sizes.begin(), ch.sizes.end(), bt.shape.begin(), bt.shape.end(),
                     [](std::int64_t x, std::uint64_t y) { return static_cast<std::uint64_t>(x) == y; }) &&
          (!blob.saved || std::equal(ch.offsets.begin(), ch.offsets.end(), (*blob.saved)[it->second].begin(), (*blob.saved)[it->second].end()));
      if (bt.dtype != t.dtype || !same_box) {
        throw Error(ErrorKind::kMismatch, where, blob.at,
                    "tensor '" + t.name + "' in the safetensors blob is not the chunk .metadata records (dtype, shape or saved offsets differ)");
      }
      ChunkLocation raw;
      raw.file = ch.location->file;
      raw.offset = blob.at + bt.begin;
      raw.length = bt.end - bt.begin;
      *ch.location = raw;
    }
  }
}

}  // namespace ckpt::detail
