// SPDX-License-Identifier: Apache-2.0
// --verify for merge and shard: the CRC-32 of every storage record an archive records one for,
// checked from the bytes the copy reads anyway.
//
// NOTE [CRCs checked as the bytes pass]
// A DCP tensor item is a torch.save archive whose storage record carries a CRC-32. The copy reads
// each record's bytes once, in tasks of at most a few MiB that run in any order on any thread, and
// sometimes only part of a record (a view over a larger storage; a process of a cooperating shard
// that writes other ranks' files). Each task hands the CRC of what it read here, with where in the
// record it lies; once the pieces cover the record they are combined in order (crc32_combine) and
// compared, and the pieces go. What no task read is read at the end (finish), before anything is
// committed. A mismatch is kFormat naming the file, the record's offset and both CRCs, and the
// copy fails closed: its output is never committed.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "ckpt/io.hpp"

namespace ckpt::detail {

/// Checks the CRC-32 of every record of the torch.save archive `item` (a DCP bytes item, read whole
/// anyway). Throws kFormat.
void verify_item(const SourcePtr& item);

class PassingCrcs {
 public:
  /// A task read `bytes` at `offset` of `record`, whose recorded CRC-32 is `expected` (0: none,
  /// nothing is checked). Throws kFormat when this completes the record and its CRC differs.
  /// Thread-safe.
  void passed(const SourcePtr& record, std::uint32_t expected, std::uint64_t offset, std::span<const std::byte> bytes);
  /// `record` is read in a way that does not pass its bytes here (a gathered band): finish()
  /// reads it whole. Thread-safe.
  void read_later(const SourcePtr& record, std::uint32_t expected);
  /// Reads and checks what no task covered. Throws kFormat. Call once the copy is done.
  void finish();
  /// Records checked so far.
  std::uint64_t checked() const;

 private:
  struct Piece {
    std::uint64_t offset, length;
    std::uint32_t crc;
  };
  struct Record {
    SourcePtr source;
    std::uint32_t expected = 0;
    std::uint64_t covered = 0;
    std::vector<Piece> pieces;
  };
  using Key = std::pair<const ByteSource*, std::uint64_t>;  // resolve_window: the same bytes, however opened
  static Key key_of(const ByteSource& s);
  static void check(const SourcePtr& record, std::uint32_t expected, std::uint32_t crc);

  mutable std::mutex mutex_;
  std::map<Key, Record> open_;
  std::uint64_t checked_ = 0;
};

}  // namespace ckpt::detail
