// SPDX-License-Identifier: Apache-2.0
#include "formats/torch_save/archive_plan.hpp"

#include "ckpt/error.hpp"
#include "zip/crc32.hpp"
#include "zip/zip_writer.hpp"

namespace ckpt::detail {

ArchivePlan::ArchivePlan(std::string archive_name, TorchSaveRecords records)
    : archive_(std::move(archive_name)), records_(std::move(records)) {
  // The layout is cheap to rebuild, so only the offsets are kept (a DCP directory may hold
  // hundreds of thousands of items).
  ZipLayout layout(archive_, 64, 0, ZipLayout::Members::kLast);
  data_offsets_.reserve(records_.size());
  for (const TorchSaveRecord r : records_) {
    layout.add(r.name, r.size);
    data_offsets_.push_back(layout.members().back().data_offset);
    storages_ += r.storage ? 1 : 0;
  }
  size_ = layout.end() + layout.trailer_size();
}

std::uint64_t ArchivePlan::first_data_offset(const std::string& archive_name, const std::string& name) {
  ZipLayout layout(archive_name, 64, 0, ZipLayout::Members::kLast);
  layout.add(name, 0);
  return layout.members().back().data_offset;
}

void ArchivePlan::place_heads(PositionalSink& sink, std::uint64_t base) const {
  ZipLayout layout(archive_, 64, 0, ZipLayout::Members::kLast);
  for (const TorchSaveRecord r : records_) {
    const std::vector<std::byte> header = layout.add(r.name, r.size);
    const ZipLayout::Member& m = layout.members().back();
    sink.write_at(base + m.header_offset, header);
    if (!r.storage && !r.written) sink.write_at(base + m.data_offset, r.bytes);
  }
}

void ArchivePlan::place_tail(PositionalSink& sink, std::uint64_t base, std::span<const std::uint32_t> storage_crcs) const {
  ZipLayout layout(archive_);
  if (storage_crcs.size() != storages_) internal_error("ArchivePlan::place_tail: a CRC for each storage record");
  std::vector<std::uint32_t> crcs(records_.size());
  std::size_t storage = 0;
  for (std::size_t i = 0; i < records_.size(); ++i) {
    layout.add(records_[i].name, records_[i].size);
    const TorchSaveRecord& r = records_[i];
    crcs[i] = r.storage ? storage_crcs[storage++] : r.written ? *r.written : crc32_update(0, r.bytes);
    const ZipLayout::Member& m = layout.members().back();
    sink.write_at(base + m.data_offset + m.size, layout.descriptor(i, crcs[i]));
  }
  std::uint64_t at = base + layout.end();
  layout.trailer(crcs, [&](std::span<const std::byte> b) {
    sink.write_at(at, b);
    at += b.size();
  });
}

void ArchivePlan::stream(ByteSink& sink, const StorageWriter& storage) const {
  ZipLayout layout(archive_);
  const std::uint64_t base = sink.offset();
  std::vector<std::uint32_t> crcs(records_.size());
  for (std::size_t i = 0; i < records_.size(); ++i) {
    const TorchSaveRecord& r = records_[i];
    if (r.written) internal_error("ArchivePlan::stream: data.pkl went out as it was made; there is nothing to stream");
    sink.write(layout.add(r.name, r.size));
    std::uint32_t crc = 0;
    std::uint64_t written = 0;
    if (r.storage) {
      storage(i, [&](std::span<const std::byte> b) {
        crc = crc32_update(crc, b);
        written += b.size();
        sink.write(b);
      });
    } else {
      crc = crc32_update(0, r.bytes);
      written = r.bytes.size();
      sink.write(r.bytes);
    }
    if (written != r.size) internal_error("ArchivePlan::stream: a storage record got the wrong number of bytes");
    crcs[i] = crc;
    sink.write(layout.descriptor(i, crc));
  }
  layout.trailer(crcs, [&](std::span<const std::byte> b) { sink.write(b); });
  if (sink.offset() - base != size_) internal_error("ArchivePlan::stream: the archive's size differs from its plan");
}

}  // namespace ckpt::detail
