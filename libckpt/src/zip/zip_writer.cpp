// SPDX-License-Identifier: Apache-2.0
#include "zip/zip_writer.hpp"

#include "ckpt/error.hpp"
#include "zip/crc32.hpp"

namespace ckpt::detail {
namespace {

constexpr std::uint64_t kMax32 = 0xffffffffu;

// The zip64 extra field (header, sizes, offset) a member needs, in a local header and in the
// central directory alike: 0 when neither its size nor its offset reaches 0xFFFFFFFF.
std::uint64_t zip64_extra(bool big_size, bool big_offset) {
  return big_size || big_offset ? 4u + (big_size ? 16u : 0u) + (big_offset ? 8u : 0u) : 0u;
}

class Bytes {
 public:
  void u16(std::uint64_t v) { le(v, 2); }
  void u32(std::uint64_t v) { le(v, 4); }
  void u64(std::uint64_t v) { le(v, 8); }
  void str(std::string_view s) { for (char c : s) b_.push_back(static_cast<std::byte>(c)); }
  void fill(std::size_t n, std::uint8_t v) { b_.insert(b_.end(), n, std::byte{v}); }
  std::span<const std::byte> span() const { return b_; }
  std::size_t size() const { return b_.size(); }
  std::vector<std::byte> take() { return std::move(b_); }

 private:
  void le(std::uint64_t v, int n) {
    for (int i = 0; i < n; ++i) b_.push_back(static_cast<std::byte>(v >> (8 * i)));
  }
  std::vector<std::byte> b_;
};

}  // namespace

ZipLayout::ZipLayout(std::string archive_name, std::uint64_t alignment, std::uint64_t start, Members keep)
    : prefix_(std::move(archive_name) + "/"), alignment_(alignment), end_(start), keep_(keep) {
  if (alignment_ == 0 || alignment_ > 0x10000) internal_error("zip alignment out of range");
}

std::vector<std::byte> ZipLayout::add(std::string_view record, std::uint64_t size) {
  std::string name = prefix_ + std::string(record);
  if (name.size() > 0xffff) throw Error(ErrorKind::kInvalidArgument, name.substr(0, 64) + "...", std::nullopt, "record name longer than 65535 bytes");
  const std::uint64_t cursor = end_;
  const bool big_size = size >= kMax32, big_offset = cursor >= kMax32;
  // See docs/formats/torch_save.md#member-layout for the padding rule (miniz's mz_zip_writer_add_mem_ex_v2 + PyTorch's
  // getPadding): the zip64 part is counted before the FB field.
  std::uint64_t start = cursor + 30 + name.size() + 4;
  const std::uint64_t zip64_len = zip64_extra(big_size, big_offset);
  start += zip64_len;
  const std::uint64_t pad = (alignment_ - start % alignment_) % alignment_;
  Bytes h;
  h.u32(0x04034b50);
  h.u16(0);       // version needed: miniz writes 0
  h.u16(size == 0 ? 0x0800 : 0x0808);  // UTF-8, + data descriptor unless empty (miniz, verified on 1.13)
  h.u16(0);       // stored
  h.u16(0);
  h.u16(0);       // time, date
  h.u32(0);       // crc, sizes: in the descriptor
  h.u32(0);
  h.u32(0);
  h.u16(name.size());
  h.u16(zip64_len + 4 + pad);
  h.str(name);
  if (zip64_len) {
    h.u16(0x0001);
    h.u16(zip64_len - 4);
    if (big_size) {
      h.u64(size);
      h.u64(size);
    }
    if (big_offset) h.u64(cursor);
  }
  h.u16(0x4246);  // "FB"
  h.u16(pad);
  h.fill(static_cast<std::size_t>(pad), 'Z');
  const std::uint64_t data_offset = cursor + h.size();
  const std::uint64_t descriptor_size = size == 0 ? 0 : (size >= kMax32 || cursor >= kMax32) ? 24 : 16;
  directory_size_ += 46 + name.size() + zip64_extra(big_size, big_offset);
  if (keep_ == Members::kLast) members_.clear();
  members_.push_back({std::move(name), cursor, data_offset, size});
  end_ = data_offset + size + descriptor_size;
  return h.take();
}

std::vector<std::byte> ZipLayout::descriptor(std::size_t i, std::uint32_t crc) const {
  const Member& m = members_.at(i);
  Bytes d;
  if (m.size == 0) return d.take();  // miniz writes no descriptor for an empty member
  d.u32(0x08074b50);
  d.u32(crc);
  if (m.size >= kMax32 || m.header_offset >= kMax32) {
    d.u64(m.size);
    d.u64(m.size);
  } else {
    d.u32(m.size);
    d.u32(m.size);
  }
  return d.take();
}

std::uint64_t ZipLayout::trailer_size() const noexcept { return directory_size_ + 56 + 20 + 22; }

void ZipLayout::trailer(std::span<const std::uint32_t> crcs, const std::function<void(std::span<const std::byte>)>& write) const {
  if (keep_ != Members::kAll) internal_error("ZipLayout::trailer: the layout kept only its last member");
  if (crcs.size() != members_.size()) internal_error("ZipLayout::trailer: one CRC per member expected");
  constexpr std::size_t kPiece = std::size_t{64} << 10;
  const std::uint64_t cd_offset = end_;
  std::uint64_t cd_size = 0;
  Bytes cd;
  for (std::size_t i = 0; i < members_.size(); ++i) {
    if (cd.size() >= kPiece) {
      cd_size += cd.size();
      write(cd.span());
      cd = Bytes();
    }
    const Member& m = members_[i];
    const bool big_size = m.size >= kMax32, big_offset = m.header_offset >= kMax32;
    cd.u32(0x02014b50);
    cd.u16(0);  // made by
    cd.u16(0);  // needed
    cd.u16(m.size == 0 ? 0x0800 : 0x0808);
    cd.u16(0);
    cd.u16(0);
    cd.u16(0);
    cd.u32(crcs[i]);
    cd.u32(big_size ? kMax32 : m.size);
    cd.u32(big_size ? kMax32 : m.size);
    cd.u16(m.name.size());
    const std::uint64_t extra = zip64_extra(big_size, big_offset);
    cd.u16(extra);
    cd.u16(0);  // comment
    cd.u16(0);  // disk
    cd.u16(0);  // internal attributes
    cd.u32(0);  // external attributes
    cd.u32(big_offset ? kMax32 : m.header_offset);
    cd.str(m.name);
    if (extra) {
      cd.u16(0x0001);
      cd.u16(extra - 4);
      if (big_size) {
        cd.u64(m.size);
        cd.u64(m.size);
      }
      if (big_offset) cd.u64(m.header_offset);
    }
  }
  cd_size += cd.size();
  if (cd_size != directory_size_) internal_error("ZipLayout::trailer: the central directory's size differs from its count");
  const std::uint64_t n = members_.size();
  const std::uint64_t z64_at = cd_offset + cd_size;
  cd.u32(0x06064b50);
  cd.u64(44);
  cd.u16(0x031e);
  cd.u16(0x002d);
  cd.u32(0);
  cd.u32(0);
  cd.u64(n);
  cd.u64(n);
  cd.u64(cd_size);
  cd.u64(cd_offset);
  cd.u32(0x07064b50);
  cd.u32(0);
  cd.u64(z64_at);
  cd.u32(1);
  cd.u32(0x06054b50);
  cd.u16(0);
  cd.u16(0);
  cd.u16(std::min<std::uint64_t>(n, 0xffff));
  cd.u16(std::min<std::uint64_t>(n, 0xffff));
  cd.u32(std::min<std::uint64_t>(cd_size, kMax32));
  cd.u32(std::min<std::uint64_t>(cd_offset, kMax32));
  cd.u16(0);
  write(cd.span());
}

ZipWriter::ZipWriter(ByteSink& sink, std::string archive_name, std::uint64_t alignment)
    : sink_(sink), layout_(std::move(archive_name), alignment, sink.offset()) {}

void ZipWriter::add(std::string_view record, std::span<const std::byte> data) {
  begin_record(record, data.size());
  write(data);
  end_record();
}

void ZipWriter::begin_record(std::string_view record, std::uint64_t size) {
  if (open_) internal_error("ZipWriter::begin_record while a record is open");
  if (sink_.offset() != layout_.end()) internal_error("ZipWriter: the sink was written behind the writer's back");
  sink_.write(layout_.add(record, size));
  open_ = true;
  remaining_ = size;
  crc_ = 0;
}

void ZipWriter::write(std::span<const std::byte> data) {
  if (!open_ || data.size() > remaining_) internal_error("ZipWriter::write beyond the declared record size");
  crc_ = crc32_update(crc_, data);
  sink_.write(data);
  remaining_ -= data.size();
}

void ZipWriter::end_record() {
  if (!open_ || remaining_ != 0) internal_error("ZipWriter::end_record before the declared size was written");
  open_ = false;
  crcs_.push_back(crc_);
  sink_.write(layout_.descriptor(crcs_.size() - 1, crc_));
}

void ZipWriter::finish() {
  if (open_) internal_error("ZipWriter::finish while a record is open");
  layout_.trailer(crcs_, [&](std::span<const std::byte> b) { sink_.write(b); });
}

}  // namespace ckpt::detail
