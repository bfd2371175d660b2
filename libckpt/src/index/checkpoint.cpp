// SPDX-License-Identifier: Apache-2.0
// The index and ChunkReader. The index knows no format: chunks stored as items are read through
// the ItemDecoder the opening driver left in Checkpoint::items.
#include "ckpt/checkpoint.hpp"

#include "ckpt/error.hpp"
#include "index/item_decoder.hpp"

namespace ckpt {

// NOTE [Compact chunks]: a large .metadata is millions of chunks; their size is part of the design.
static_assert(sizeof(ChunkLocation) == 32 && sizeof(Chunk) == 80);

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
  if (f.source) return open_.emplace(index, f.source).first->second;
  if (!f.size) throw Error(ErrorKind::kIo, f.path.string(), std::nullopt, "file is missing (the metadata names it)");
  SourcePtr s = access_ == FileAccess::kMap ? open_mmap(f.path) : open_file(f.path);
  open_.emplace(index, s);
  return s;
}

const ItemDecoder& ChunkReader::decoder() const {
  if (!checkpoint_.items) {
    throw Error(ErrorKind::kFormat, checkpoint_.root.string(), std::nullopt,
                "the index names an encoded item, but its format gives no decoder for items");
  }
  return *checkpoint_.items;
}

SourcePtr ChunkReader::item(const ChunkLocation& loc, std::uint64_t max_decoded) const {
  SourcePtr f = file(loc.file);
  SourcePtr s = sub_source(f, loc.offset, loc.length, "item at " + std::to_string(loc.offset));
  if (access_ == FileAccess::kReadSmallItemsWhole && loc.transforms().empty() && loc.length <= kSmallItem) {
    s = memory_source(s->read_vector(0, s->size()), s->name());  // same name and offsets as the window
  }
  if (!loc.transforms().empty()) s = decoder().undo_transforms(std::move(s), loc, max_decoded);
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
  return decoder().tensor(it, tensor, chunk);
}

void ChunkReader::check_checksums(const ChunkLocation& location) const {
  if (location.encoding == ChunkEncoding::kItem) decoder().check_checksums(item(location));
}

pickle::ValuePtr ChunkReader::object_value(const ObjectEntry& entry) const {
  if (entry.value || !entry.item) return entry.value;
  return decoder().object(item(*entry.item));
}

}  // namespace ckpt
