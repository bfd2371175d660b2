// SPDX-License-Identifier: Apache-2.0
// CRC-32 (the zip polynomial): computed while bytes are written, combined across pieces so that
// parallel copies never need a second pass (DESIGN.md, the copy engine).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace ckpt::detail {

/// The CRC-32 of `bytes` continuing from `crc` (0 to start). libdeflate's SIMD implementation.
std::uint32_t crc32_update(std::uint32_t crc, std::span<const std::byte> bytes) noexcept;
/// The CRC-32 of A followed by B, from crc(A), crc(B) and B's length (zlib's crc32_combine).
std::uint32_t crc32_combine(std::uint32_t crc_a, std::uint32_t crc_b, std::uint64_t length_b) noexcept;

}  // namespace ckpt::detail
