// SPDX-License-Identifier: Apache-2.0
#include "ops/passing_crcs.hpp"

#include <algorithm>
#include <cstdio>
#include <string>

#include "ckpt/error.hpp"
#include "zip/crc32.hpp"
#include "zip/zip_reader.hpp"

namespace ckpt::detail {
namespace {

std::string hex32(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

// The CRC-32 of all of `s`, streamed.
std::uint32_t crc_of(const ByteSource& s) {
  std::uint32_t crc = 0;
  stream_range(s, 0, s.size(), [&](std::span<const std::byte> b) { crc = crc32_update(crc, b); });
  return crc;
}

}  // namespace

void verify_item(const SourcePtr& item) {
  const ZipReader zip(item);
  for (const ZipEntry& e : zip.entries()) zip.verify_crc(e);
}

PassingCrcs::Key PassingCrcs::key_of(const ByteSource& s) {
  const Window w = resolve_window(s);
  return {w.root, w.offset};
}

void PassingCrcs::check(const SourcePtr& record, std::uint32_t expected, std::uint32_t crc) {
  if (crc == expected) return;
  const Window w = resolve_window(*record);
  throw Error(ErrorKind::kFormat, w.root->name(), w.offset,
              "CRC-32 of " + record->name() + " (" + std::to_string(record->size()) + " bytes) is " + hex32(crc) +
                  ", the archive records " + hex32(expected) + " (--verify: nothing was written)");
}

void PassingCrcs::passed(const SourcePtr& record, std::uint32_t expected, std::uint64_t offset, std::span<const std::byte> bytes) {
  if (expected == 0) return;
  const std::uint32_t crc = crc32_update(0, bytes);
  std::vector<Piece> pieces;
  {
    std::lock_guard lock(mutex_);
    Record& r = open_[key_of(*record)];
    if (!r.source) r = Record{record, expected, 0, {}};
    r.pieces.push_back({offset, bytes.size(), crc});
    r.covered += bytes.size();
    if (r.covered < record->size()) return;
    pieces = std::move(r.pieces);
    open_.erase(key_of(*record));
    ++checked_;
  }
  // Complete: combined in offset order, outside the lock. Pieces that overlap or leave a gap (a
  // record read twice) are not combined: the record is read whole instead.
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
  std::uint32_t whole = 0;
  std::uint64_t at = 0;
  for (const Piece& p : pieces) {
    if (p.offset != at) return check(record, expected, crc_of(*record));
    whole = crc32_combine(whole, p.crc, p.length);
    at += p.length;
  }
  check(record, expected, at == record->size() ? whole : crc_of(*record));
}

void PassingCrcs::read_later(const SourcePtr& record, std::uint32_t expected) {
  if (expected == 0) return;
  std::lock_guard lock(mutex_);
  Record& r = open_[key_of(*record)];
  if (!r.source) r = Record{record, expected, 0, {}};
}

void PassingCrcs::finish() {
  std::map<Key, Record> left;
  {
    std::lock_guard lock(mutex_);
    left.swap(open_);
  }
  for (auto& [key, r] : left) {
    check(r.source, r.expected, crc_of(*r.source));
    std::lock_guard lock(mutex_);
    ++checked_;
  }
}

std::uint64_t PassingCrcs::checked() const {
  std::lock_guard lock(mutex_);
  return checked_;
}

}  // namespace ckpt::detail
