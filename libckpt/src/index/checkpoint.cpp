// SPDX-License-Identifier: Apache-2.0
// The index and ChunkReader. The index knows no format: chunks stored as items are read through
// the ItemDecoder the opening driver left in Checkpoint::items.
#include "ckpt/checkpoint.hpp"

#include <cstring>

#include "ckpt/error.hpp"
#include "ckpt/sharding.hpp"
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

std::vector<std::byte> read_elements(const ChunkReader& reader, const TensorEntry& tensor, std::uint64_t begin, std::uint64_t end) {
  std::vector<std::byte> out(static_cast<std::size_t>(end > begin ? end - begin : 0) * element_size(tensor.dtype));
  read_elements(reader, tensor, begin, end, out);
  return out;
}

void read_elements(const ChunkReader& reader, const TensorEntry& tensor, std::uint64_t begin, std::uint64_t end, std::span<std::byte> out) {
  const std::uint64_t numel = box_volume(tensor.shape);
  if (begin > end || end > numel) {
    throw Error(ErrorKind::kInvalidArgument, "elements [" + std::to_string(begin) + ", " + std::to_string(end) + ") of '" + tensor.name +
                                                 "', which has " + std::to_string(numel));
  }
  const std::size_t es = element_size(tensor.dtype);
  if (out.size() != static_cast<std::size_t>(end - begin) * es) internal_error("read_elements: the output is not the range's size");
  const std::vector<Box> boxes = flat_range_boxes(tensor.shape, static_cast<std::int64_t>(begin), static_cast<std::int64_t>(end));
  const Dims origin(std::vector<std::int64_t>(tensor.shape.size(), 0));
  std::uint64_t covered = 0;
  for (const Chunk& chunk : tensor.chunks) {
    for (const Box& box : boxes) {
      if (const std::optional<Box> part = intersect(box.offsets, box.sizes, chunk.offsets, chunk.sizes)) covered += box_volume(part->sizes);
    }
  }
  if (covered != end - begin) std::memset(out.data(), 0, out.size());
  for (const Chunk& chunk : tensor.chunks) {
    if (box_volume(chunk.sizes) == 0) continue;
    std::optional<ChunkData> d;  // read once, when a box needs it
    for (const Box& box : boxes) {
      const std::optional<Box> part = intersect(box.offsets, box.sizes, chunk.offsets, chunk.sizes);
      if (!part) continue;
      if (!d) d = reader.read(tensor, chunk);
      // Each row of `part` along the last dimension (the whole of a 0-d tensor) in one read when
      // the chunk stores it contiguously, element by element otherwise.
      const std::size_t n = part->sizes.size();
      const std::int64_t row = n ? part->sizes[n - 1] : 1;
      const bool contiguous = n == 0 || d->strides[n - 1] == 1;
      std::vector<std::int64_t> at = part->offsets.vec();
      for (bool more = true; more;) {
        const std::uint64_t g = flat_index(at, origin, tensor.shape);
        std::int64_t element = d->storage_offset;
        for (std::size_t k = 0; k < n; ++k) element += (at[k] - chunk.offsets[k]) * d->strides[k];
        std::byte* to = out.data() + static_cast<std::size_t>(g - begin) * es;
        if (contiguous) {
          d->storage->read_at(static_cast<std::uint64_t>(element) * es, {to, static_cast<std::size_t>(row) * es});
        } else {
          for (std::int64_t i = 0; i < row; ++i) {
            d->storage->read_at(static_cast<std::uint64_t>(element + i * d->strides[n - 1]) * es, {to + static_cast<std::size_t>(i) * es, es});
          }
        }
        // The next row: an odometer over the dimensions before the last, innermost first.
        more = false;
        for (std::size_t k = n > 1 ? n - 1 : 0; k-- > 0;) {
          if (++at[k] < part->offsets[k] + part->sizes[k]) {
            more = true;
            break;
          }
          at[k] = part->offsets[k];
        }
      }
    }
  }
}

}  // namespace ckpt
