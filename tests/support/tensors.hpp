// SPDX-License-Identifier: Apache-2.0
// A tensor of any checkpoint as its whole bytes, element by element from its chunks: a reference
// for tests, independent of the copy engine that the operations use.
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "ckpt/checkpoint.hpp"

namespace fsdp_test {

/// `tensor`'s elements in C order, each chunk's read through `reader` and placed by its box.
inline std::vector<std::byte> whole_tensor(const ckpt::ChunkReader& reader, const ckpt::TensorEntry& tensor) {
  const std::size_t es = ckpt::element_size(tensor.dtype);
  const std::vector<std::int64_t> strides = ckpt::contiguous_strides(std::span<const std::int64_t>(tensor.shape.data(), tensor.shape.size()));
  std::vector<std::byte> out(tensor.nbytes());
  for (const ckpt::Chunk& c : tensor.chunks) {
    const ckpt::ChunkData d = reader.read(tensor, c);
    std::vector<std::byte> element(es);
    std::vector<std::int64_t> idx(d.shape.size(), 0);
    std::uint64_t n = 1;
    for (const std::int64_t s : d.shape) n *= static_cast<std::uint64_t>(s);
    for (std::uint64_t k = 0; k < n; ++k) {
      std::int64_t from = d.storage_offset, to = 0;
      for (std::size_t i = 0; i < idx.size(); ++i) {
        from += idx[i] * d.strides[i];
        to += (c.offsets[i] + idx[i]) * strides[i];
      }
      d.storage->read_at(static_cast<std::uint64_t>(from) * es, element);
      std::copy(element.begin(), element.end(), out.begin() + static_cast<std::ptrdiff_t>(static_cast<std::uint64_t>(to) * es));
      for (std::size_t i = idx.size(); i-- > 0;) {
        if (++idx[i] < d.shape[i]) break;
        idx[i] = 0;
      }
    }
  }
  return out;
}

}  // namespace fsdp_test
