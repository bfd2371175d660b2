// SPDX-License-Identifier: Apache-2.0
#include "zip/crc32.hpp"

#include <libdeflate.h>
#include <zlib.h>

namespace ckpt::detail {

std::uint32_t crc32_update(std::uint32_t crc, std::span<const std::byte> bytes) noexcept {
  return libdeflate_crc32(crc, bytes.data(), bytes.size());
}

std::uint32_t crc32_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t length_b) noexcept {
  return static_cast<std::uint32_t>(::crc32_combine64(crc_a, crc_b, static_cast<z_off64_t>(length_b)));
}

}  // namespace ckpt::detail
