// SPDX-License-Identifier: Apache-2.0
// The one thing the index asks of a format: how to read what it stores as items. A chunk with
// ChunkEncoding::kItem and an object entry with an `item` are bytes in the format's own encoding
// (a DCP item is a torch.save archive, maybe zstd-compressed); the driver that opened the
// checkpoint puts its decoder in Checkpoint::items, and ChunkReader calls it. The index itself
// knows no format.
#pragma once

#include <cstdint>

#include "ckpt/checkpoint.hpp"

namespace ckpt {

class ItemDecoder {
 public:
  virtual ~ItemDecoder() = default;
  /// `stored` (the bytes at `location`) with the transforms `location` names undone, decoding at
  /// most `max_decoded` bytes. Throws kUnsupported for a transform it does not know, kFormat for
  /// bytes that do not decode, each with the offset in `stored`.
  virtual SourcePtr undo_transforms(SourcePtr stored, const ChunkLocation& location, std::uint64_t max_decoded) const = 0;
  /// The elements of `chunk` of `tensor` that the item `item` (transforms undone) holds. Throws
  /// kFormat or kMismatch, naming the item, when it does not agree with the index.
  virtual ChunkData tensor(const SourcePtr& item, const TensorEntry& tensor, const Chunk& chunk) const = 0;
  /// The value the object item `item` holds.
  virtual pickle::ValuePtr object(const SourcePtr& item) const = 0;
  /// Checks every checksum `item` records over its bytes (verify --deep); throws kFormat at the
  /// first that does not match.
  virtual void check_checksums(const SourcePtr& item) const = 0;
};

}  // namespace ckpt
