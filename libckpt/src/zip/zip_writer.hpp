// SPDX-License-Identifier: Apache-2.0
// Writer for the zip container of torch.save, laid out byte for byte as PyTorch's miniz-based
// PyTorchStreamWriter does (spec/FORMATS.md §2.3): stored members, flags 0x0808 with a data
// descriptor, zero times, an `FB` extra field padding each payload to a multiple of the alignment
// (64), zip64 extras only where a size or offset reaches 0xFFFFFFFF, and always the zip64 end
// records. CRC-32 is computed while the bytes pass.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ckpt/io.hpp"

namespace ckpt::detail {

class ZipWriter {
 public:
  /// Members are named `<archive_name>/<record>`.
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
  struct Member {
    std::string name;
    std::uint64_t header_offset;
    std::uint64_t size;
    std::uint32_t crc;
  };
  ByteSink& sink_;
  std::string prefix_;
  std::uint64_t alignment_;
  std::vector<Member> members_;
  bool open_ = false;
  std::uint64_t remaining_ = 0;
  std::uint32_t crc_ = 0;
};

}  // namespace ckpt::detail
