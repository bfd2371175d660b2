// SPDX-License-Identifier: Apache-2.0
#include "zip/zip_reader.hpp"

#include <cstring>

#include "ckpt/error.hpp"
#include "io/cursor.hpp"
#include "zip/crc32.hpp"

namespace ckpt::detail {
namespace {

constexpr std::uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50,
                        kZip64EocdSig = 0x06064b50, kZip64LocatorSig = 0x07064b50;
constexpr std::uint64_t kEocdSize = 22, kZip64EocdSize = 56, kZip64LocatorSize = 20, kCentralSize = 46,
                        kLocalSize = 30, kMaxComment = 65535;

std::string hex32(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

}  // namespace

bool starts_like_zip(const ByteSource& source) {
  if (source.size() < 4) return false;
  std::byte head[4];
  source.read_at(0, head);
  return std::memcmp(head, "PK\x03\x04", 4) == 0;
}

ZipReader::ZipReader(SourcePtr source) : source_(std::move(source)) {
  const ByteSource& src = *source_;
  const std::string& name = src.name();
  const std::uint64_t size = src.size();
  if (size < kEocdSize) {
    throw Error(ErrorKind::kFormat, name, 0,
                "file of " + std::to_string(size) + " bytes is too small to be a zip archive (at least 22 bytes)");
  }

  // 1. The end-of-central-directory record, scanning back over the longest possible comment.
  const std::uint64_t tail_len = std::min<std::uint64_t>(size, kEocdSize + kMaxComment);
  const std::uint64_t tail_at = size - tail_len;
  const std::vector<std::byte> tail = src.read_vector(tail_at, tail_len);
  std::optional<std::uint64_t> eocd;
  for (std::uint64_t i = tail_len - kEocdSize + 1; i-- > 0;) {
    const auto at = static_cast<std::size_t>(i);
    std::uint32_t sig = 0;
    std::memcpy(&sig, tail.data() + at, 4);
    if (sig != 0x06054b50u) continue;  // end-of-central-directory signature
    Cursor c(std::span<const std::byte>(tail).subspan(at), name, tail_at + i);
    c.skip(4);
    c.skip(16);
    const std::uint16_t comment = c.u16le();
    if (i + kEocdSize + comment == tail_len) {
      eocd = tail_at + i;
      break;
    }
  }
  if (!eocd) {
    throw Error(ErrorKind::kFormat, name, size,
                "no end-of-central-directory record in the last " + std::to_string(tail_len) +
                    " bytes: not a zip archive, or truncated");
  }
  eocd_offset_ = *eocd;
  Cursor e(std::span<const std::byte>(tail).subspan(static_cast<std::size_t>(*eocd - tail_at)), name, *eocd);
  e.skip(4);
  const std::uint16_t disk = e.u16le(), cd_disk = e.u16le();
  std::uint64_t entries_on_disk = e.u16le(), entries_total = e.u16le();
  std::uint64_t cd_size = e.u32le(), cd_offset = e.u32le();
  if (disk != 0 || cd_disk != 0) {
    throw Error(ErrorKind::kUnsupported, name, *eocd, "multi-disk zip archives are not supported");
  }
  std::uint64_t cd_limit = *eocd;  // the central directory ends before this

  // 2. Zip64: a locator right before the EOCD points at the zip64 EOCD record.
  if (*eocd >= kZip64LocatorSize) {
    const std::uint64_t loc_at = *eocd - kZip64LocatorSize;
    std::byte lbuf[kZip64LocatorSize];
    src.read_at(loc_at, lbuf);
    Cursor l(lbuf, name, loc_at);
    if (l.u32le() == kZip64LocatorSig) {
      l.skip(4);
      const std::uint64_t rec_at = l.u64le();
      if (rec_at > loc_at || loc_at - rec_at < kZip64EocdSize) {
        throw Error(ErrorKind::kFormat, name, loc_at + 8,
                    "zip64 locator points at " + std::to_string(rec_at) + ", which leaves no room for the 56-byte zip64 "
                    "end record before the locator at " + std::to_string(loc_at));
      }
      std::byte rbuf[kZip64EocdSize];
      src.read_at(rec_at, rbuf);
      Cursor r(rbuf, name, rec_at);
      const std::uint32_t sig = r.u32le();
      if (sig != kZip64EocdSig) {
        r.fail_at(rec_at, "zip64 end-of-central-directory signature is " + hex32(sig) + ", expected 0x06064b50");
      }
      r.skip(8 + 2 + 2 + 4 + 4);
      const std::uint64_t z_on_disk = r.u64le(), z_total = r.u64le(), z_size = r.u64le(), z_offset = r.u64le();
      // A 32-bit field is saturated (0xFFFF...) when its value needs the zip64 record, and equal
      // to it otherwise (miniz and CPython write both): anything else is a damaged end record.
      auto agrees = [](std::uint64_t narrow, std::uint64_t wide, std::uint64_t saturated) { return narrow == saturated || narrow == wide; };
      if (!agrees(entries_on_disk, z_on_disk, 0xffff) || !agrees(entries_total, z_total, 0xffff) ||
          !agrees(cd_size, z_size, 0xffffffffu) || !agrees(cd_offset, z_offset, 0xffffffffu)) {
        throw Error(ErrorKind::kFormat, name, *eocd,
                    "end-of-central-directory record (" + std::to_string(entries_total) + " entries, directory at " +
                        std::to_string(cd_offset) + ", " + std::to_string(cd_size) + " bytes) disagrees with the zip64 end record (" +
                        std::to_string(z_total) + " entries, at " + std::to_string(z_offset) + ", " + std::to_string(z_size) +
                        " bytes)");
      }
      entries_on_disk = z_on_disk;
      entries_total = z_total;
      cd_size = z_size;
      cd_offset = z_offset;
      cd_limit = rec_at;
    }
  }
  if (entries_on_disk != entries_total) {
    throw Error(ErrorKind::kUnsupported, name, *eocd, "multi-disk zip archives are not supported");
  }
  if (cd_offset > cd_limit || cd_size > cd_limit - cd_offset) {
    throw Error(ErrorKind::kFormat, name, *eocd,
                "central directory [" + std::to_string(cd_offset) + ", " + std::to_string(cd_offset + cd_size) +
                    ") does not end before the end records at " + std::to_string(cd_limit));
  }
  if (entries_total > cd_size / kCentralSize) {
    throw Error(ErrorKind::kFormat, name, *eocd,
                std::to_string(entries_total) + " entries cannot fit a central directory of " + std::to_string(cd_size) +
                    " bytes (46 bytes each at least)");
  }

  // 3. The central directory.
  const std::vector<std::byte> cd = src.read_vector(cd_offset, cd_size);
  Cursor c(cd, name, cd_offset);
  entries_.reserve(static_cast<std::size_t>(entries_total));
  for (std::uint64_t i = 0; i < entries_total; ++i) {
    const std::uint64_t at = c.offset();
    const std::uint32_t sig = c.u32le("central directory entry");
    if (sig != kCentralSig) c.fail_at(at, "central directory entry " + std::to_string(i) + " has signature " + hex32(sig) + ", expected 0x02014b50");
    ZipEntry z;
    c.skip(4);  // versions
    const std::uint16_t flags = c.u16le();
    z.method = c.u16le();
    c.skip(4);  // time, date
    z.crc32 = c.u32le();
    z.compressed_size = c.u32le();
    z.size = c.u32le();
    const std::uint16_t n = c.u16le(), extra = c.u16le(), comment = c.u16le();
    const std::uint16_t disk_start = c.u16le();
    c.skip(6);  // internal, external attributes
    z.local_header_offset = c.u32le();
    if (flags & 0x0001) c.fail_at(at, "member is encrypted", ErrorKind::kUnsupported);
    (void)disk_start;
    z.name = std::string(c.string(n, "member name"));
    Cursor x(c.bytes(extra, "extra field"), name, c.offset() - extra);
    while (x.remaining() >= 4) {
      const std::uint16_t id = x.u16le(), len = x.u16le();
      auto body = x.bytes(len, "extra field record");
      if (id != 0x0001) continue;
      Cursor z64(body, name, x.offset() - len);
      if (z.size == 0xffffffffu) z.size = z64.u64le("zip64 uncompressed size");
      if (z.compressed_size == 0xffffffffu) z.compressed_size = z64.u64le("zip64 compressed size");
      if (z.local_header_offset == 0xffffffffu) z.local_header_offset = z64.u64le("zip64 local header offset");
    }
    c.skip(comment, "entry comment");
    if (z.method == 0 && z.compressed_size != z.size) {
      c.fail_at(at, "stored member '" + z.name + "' has compressed size " + std::to_string(z.compressed_size) +
                        " but size " + std::to_string(z.size));
    }
    if (by_name_.count(z.name)) c.fail_at(at, "member name '" + z.name + "' appears twice");
    entries_.push_back(std::move(z));
  }
  for (std::size_t i = 0; i < entries_.size(); ++i) by_name_.emplace(entries_[i].name, i);

  // 4. Each local header gives where the data starts.
  for (ZipEntry& z : entries_) {
    std::byte lh[kLocalSize];
    if (z.local_header_offset > cd_offset || kLocalSize > cd_offset - z.local_header_offset) {
      throw Error(ErrorKind::kFormat, name, z.local_header_offset,
                  "local header of '" + z.name + "' at " + std::to_string(z.local_header_offset) +
                      " does not lie before the central directory at " + std::to_string(cd_offset));
    }
    src.read_at(z.local_header_offset, lh);
    Cursor l(lh, name, z.local_header_offset);
    const std::uint32_t sig = l.u32le();
    if (sig != kLocalSig) {
      l.fail_at(z.local_header_offset, "local header of '" + z.name + "' has signature " + hex32(sig) + ", expected 0x04034b50");
    }
    l.skip(22);
    const std::uint16_t n = l.u16le(), extra = l.u16le();
    if (n != z.name.size()) {
      l.fail_at(z.local_header_offset + 26, "local header of '" + z.name + "' has a name of " + std::to_string(n) +
                                                " bytes, the central directory " + std::to_string(z.name.size()));
    }
    z.data_offset = z.local_header_offset + kLocalSize + n + extra;
    if (z.data_offset > cd_offset || z.compressed_size > cd_offset - z.data_offset) {
      throw Error(ErrorKind::kFormat, name, z.data_offset,
                  "data of '" + z.name + "' [" + std::to_string(z.data_offset) + ", " +
                      std::to_string(z.data_offset + z.compressed_size) + ") runs into the central directory at " +
                      std::to_string(cd_offset));
    }
  }
}

const ZipEntry* ZipReader::find(std::string_view name) const noexcept {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

SourcePtr ZipReader::open(const ZipEntry& entry) const {
  if (entry.method != 0) {
    throw Error(ErrorKind::kUnsupported, source_->name(), entry.local_header_offset,
                "member '" + entry.name + "' is compressed (method " + std::to_string(entry.method) +
                    "); only stored members are supported (torch.save always stores)");
  }
  return sub_source(source_, entry.data_offset, entry.size, entry.name);
}

void ZipReader::verify_crc(const ZipEntry& entry) const {
  if (entry.crc32 == 0) return;
  SourcePtr m = open(entry);
  std::uint32_t crc = 0;
  std::vector<std::byte> buf(std::min<std::uint64_t>(m->size(), 1u << 20));
  for (std::uint64_t at = 0; at < m->size();) {
    const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(buf.size(), m->size() - at));
    auto v = m->view(at, n);
    if (v) {
      crc = crc32_update(crc, *v);
    } else {
      m->read_at(at, std::span(buf).first(n));
      crc = crc32_update(crc, std::span(buf).first(n));
    }
    at += n;
  }
  if (crc != entry.crc32) {
    throw Error(ErrorKind::kFormat, source_->name(), entry.data_offset,
                "CRC-32 of '" + entry.name + "' is " + hex32(crc) + ", the central directory says " + hex32(entry.crc32));
  }
}

}  // namespace ckpt::detail
