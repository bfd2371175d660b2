// SPDX-License-Identifier: Apache-2.0
// Writer for the zip container of torch.save, laid out byte for byte as PyTorch's miniz-based
// PyTorchStreamWriter does (docs/formats/torch_save.md#member-layout): stored members, flags 0x0808 with a data
// descriptor, zero times, an `FB` extra field padding each payload to a multiple of the alignment
// (64), zip64 extras only where a size or offset reaches 0xFFFFFFFF, and always the zip64 end
// records.
//
// ZipLayout computes every header's bytes and every offset from member names and sizes alone; the
// CRCs are needed only for the data descriptors and the central directory, which come after the
// data. So the copy engine can lay a file out first and fill the data in parallel (pwrite), and
// ZipWriter, the sequential writer, is the same layout written in order.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "ckpt/io.hpp"

namespace ckpt::detail {

class ZipLayout {
 public:
  struct Member {
    std::string name;           ///< `<archive_name>/<record>`
    std::uint64_t header_offset;
    std::uint64_t data_offset;
    std::uint64_t size;
  };

  /// kLast: members() holds only the last member added, for a caller that needs the offsets and
  /// sizes but not the central directory (merge's output, a member per tensor).
  enum class Members { kAll, kLast };
  /// Members are named `<archive_name>/<record>`; the archive starts at offset `start`.
  explicit ZipLayout(std::string archive_name, std::uint64_t alignment = 64, std::uint64_t start = 0, Members keep = Members::kAll);

  /// Appends a member of `size` bytes and returns its local header, which goes at the member's
  /// header_offset; its data follows at data_offset. Throws kInvalidArgument for a name longer
  /// than 65535 bytes.
  std::vector<std::byte> add(std::string_view record, std::uint64_t size);
  /// The data descriptor of member `i` (empty for an empty member, as miniz writes none); it goes
  /// at data_offset + size.
  std::vector<std::byte> descriptor(std::size_t i, std::uint32_t crc) const;
  /// The central directory and end records, which go at end(), passed to `write` in order, a
  /// piece of at most about 64 KiB a call; `crcs[i]` is member i's CRC-32.
  void trailer(std::span<const std::uint32_t> crcs, const std::function<void(std::span<const std::byte>)>& write) const;
  /// The trailer's size, known from the members' names and offsets (with Members::kLast too).
  std::uint64_t trailer_size() const noexcept;
  /// The offset after the last member's data descriptor.
  std::uint64_t end() const noexcept { return end_; }
  const std::vector<Member>& members() const noexcept { return members_; }

 private:
  std::string prefix_;
  std::uint64_t alignment_;
  std::uint64_t end_;
  Members keep_;
  std::vector<Member> members_;
  std::uint64_t directory_size_ = 0;  ///< the central directory's entries so far
};

/// ZipLayout written in order through a ByteSink, CRC-32 computed while the bytes pass.
class ZipWriter {
 public:
  ZipWriter(ByteSink& sink, std::string archive_name, std::uint64_t alignment = 64);

  /// Writes a whole record.
  void add(std::string_view record, std::span<const std::byte> data);
  /// Starts a record of exactly `size` bytes, to be fed with write(); end_record() closes it.
  void begin_record(std::string_view record, std::uint64_t size);
  void write(std::span<const std::byte> data);
  /// Closes the record and writes its data descriptor.
  void end_record();
  /// Writes the central directory and end records. The sink is not committed.
  void finish();

 private:
  ByteSink& sink_;
  ZipLayout layout_;
  std::vector<std::uint32_t> crcs_;
  bool open_ = false;
  std::uint64_t remaining_ = 0;
  std::uint32_t crc_ = 0;
};

}  // namespace ckpt::detail
