// SPDX-License-Identifier: Apache-2.0
// Reader for the zip container of torch.save (docs/formats/torch_save.md#container, #member-layout; PKWARE APPNOTE
// 6.3.x section 4.3). Layout, little-endian:
//   [local header 30+n+e][data][descriptor]...  central directory  [zip64 EOCD 56][zip64 locator 20]
//   EOCD 22+comment
// We locate the EOCD by scanning back at most 65,557 bytes, follow the zip64 locator when one
// precedes it, and take every size and offset from the central directory (zip64 extra 0x0001
// where a 32-bit field is 0xFFFFFFFF). Data offsets come from each local header, whose extra field
// differs (PyTorch's `FB` padding). Members are handed out as windows of the source, no copy.
// Limits: single-disk archives; entry count and central directory size must fit the bytes that
// precede the EOCD; names unique; stored members only (deflated ones are listed but refused when
// opened, kUnsupported). CRCs are not checked on open (PyTorch never checks them); verify_crc()
// checks one member on demand.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "ckpt/io.hpp"

namespace ckpt::detail {

struct ZipEntry {
  std::string name;
  std::uint16_t method = 0;  ///< 0 stored, 8 deflated
  std::uint32_t crc32 = 0;
  std::uint64_t compressed_size = 0;
  std::uint64_t size = 0;    ///< uncompressed
  std::uint64_t local_header_offset = 0;
  std::uint64_t data_offset = 0;  ///< first byte of the member's data in the source
};

/// Whether `source` starts with a zip local file header ("PK\x03\x04").
bool starts_like_zip(const ByteSource& source);

class ZipReader {
 public:
  /// Reads the central directory and every local header. Throws ckpt::Error kFormat naming
  /// `source` and the offset of the faulty structure.
  explicit ZipReader(SourcePtr source);

  const std::vector<ZipEntry>& entries() const noexcept { return entries_; }
  const ZipEntry* find(std::string_view name) const noexcept;
  /// The member's bytes as a window named `<source>[<name>]`. kUnsupported unless stored.
  SourcePtr open(const ZipEntry& entry) const;
  /// Throws kFormat when the member's CRC-32 differs from the central directory's (0 = not
  /// recorded, accepted: PyTorch can write archives without CRCs).
  void verify_crc(const ZipEntry& entry) const;
  const SourcePtr& source() const noexcept { return source_; }
  /// The offset of the end-of-central-directory record.
  std::uint64_t eocd_offset() const noexcept { return eocd_offset_; }

 private:
  SourcePtr source_;
  std::vector<ZipEntry> entries_;
  std::unordered_map<std::string_view, std::size_t> by_name_;
  std::uint64_t eocd_offset_ = 0;
};

}  // namespace ckpt::detail
