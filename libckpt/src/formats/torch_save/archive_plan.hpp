// SPDX-License-Identifier: Apache-2.0
// A torch.save archive laid out for the copy engine: merge's torch output and every DCP tensor
// item. From the records' names and sizes alone, every local header, literal record (data.pkl,
// version, ...) and storage record's data offset is known, so the storages can be filled by copy
// tasks in any order; the data descriptors and the central directory follow once the CRCs are
// known. stream() writes the same bytes in order through a ByteSink (a zstd-compressed item).
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/formats/torch_save.hpp"
#include "ckpt/io.hpp"

namespace ckpt::detail {

class ArchivePlan {
 public:
  /// `records` as plan_torch_save gives them; the archive starts at offset 0 (offsets inside it
  /// count from its first byte, as in a DCP item).
  ArchivePlan(std::string archive_name, TorchSaveRecords records);

  /// Where an archive's first record's data starts when it is named `name` and smaller than
  /// 4 GiB (data_offset(0) of such a plan): known before its bytes are made.
  static std::uint64_t first_data_offset(const std::string& archive_name, const std::string& name);

  /// The whole archive's size, central directory included.
  std::uint64_t size() const noexcept { return size_; }
  const TorchSaveRecords& records() const noexcept { return records_; }
  /// How many of the records are storages.
  std::size_t storage_count() const noexcept { return storages_; }
  /// Where record `i`'s data starts, from the archive's first byte.
  std::uint64_t data_offset(std::size_t i) const { return data_offsets_.at(i); }

  /// Writes every local header and literal record (but those `written` already), the archive
  /// starting at `base` of `sink`.
  void place_heads(PositionalSink& sink, std::uint64_t base) const;
  /// Writes the data descriptors and the central directory once the storages are in place;
  /// `storage_crcs` holds each storage record's CRC-32, in record order (storage_count() of them).
  void place_tail(PositionalSink& sink, std::uint64_t base, std::span<const std::uint32_t> storage_crcs) const;

  /// Writes the archive in order through `sink`; `storage(i, write)` must pass record i's bytes,
  /// exactly its size in all, to `write`. No record may be `written`.
  using StorageWriter = std::function<void(std::size_t record, const std::function<void(std::span<const std::byte>)>& write)>;
  void stream(ByteSink& sink, const StorageWriter& storage) const;

 private:
  std::string archive_;
  TorchSaveRecords records_;
  std::vector<std::uint64_t> data_offsets_;
  std::size_t storages_ = 0;
  std::uint64_t size_ = 0;
};

}  // namespace ckpt::detail
