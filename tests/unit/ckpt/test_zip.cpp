// SPDX-License-Identifier: Apache-2.0
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>

#include "support/error_matchers.hpp"
#include "support/test_support.hpp"
#include "zip/crc32.hpp"
#include "zip/zip_reader.hpp"
#include "zip/zip_writer.hpp"

using namespace fsdp_test;
using ckpt::ErrorKind;
using ckpt::detail::ZipReader;
using ckpt::detail::ZipWriter;

namespace {

std::vector<std::byte> sample_zip() {
  ckpt::MemorySink sink("z");
  ZipWriter w(sink, "arch");
  w.add("data.pkl", bytes_of("pickle-bytes"));
  std::vector<std::byte> big(1000, std::byte{3});
  w.begin_record("data/0", big.size());
  w.write(std::span(big).first(10));
  w.write(std::span(big).subspan(10));
  w.end_record();
  w.add("version", bytes_of("3\n"));
  w.finish();
  return sink.take();
}

}  // namespace

TEST_CASE("zip round trip in memory, payloads 64-byte aligned, CRCs right", "[ckpt][zip]") {
  auto bytes = sample_zip();
  ZipReader r(ckpt::memory_source(bytes, "z"));
  REQUIRE(r.entries().size() == 3);
  CHECK(r.entries()[0].name == "arch/data.pkl");
  for (const auto& e : r.entries()) {
    CHECK(e.data_offset % 64 == 0);
    CHECK_NOTHROW(r.verify_crc(e));
  }
  auto m = r.open(*r.find("arch/version"));
  CHECK(m->name() == "z[arch/version]");
  CHECK(m->read_vector(0, 2) == bytes_of("3\n"));
  CHECK(r.find("arch/data/0")->size == 1000);
  CHECK(ckpt::detail::crc32_update(0, bytes_of("123456789")) == 0xcbf43926u);
  const std::uint32_t a = ckpt::detail::crc32_update(0, bytes_of("1234")), b = ckpt::detail::crc32_update(0, bytes_of("56789"));
  CHECK(ckpt::detail::crc32_combine(a, b, 5) == 0xcbf43926u);
}

TEST_CASE("zip corruption table", "[ckpt][zip]") {
  const auto good = sample_zip();
  const std::size_t eocd = good.size() - 22;
  const std::size_t cd = static_cast<std::size_t>(std::to_integer<std::uint32_t>(good[eocd + 16]) |
                                                  (std::to_integer<std::uint32_t>(good[eocd + 17]) << 8));
  const std::vector<PatchRow> rows = {
      {"too small", [](auto& b) { b.resize(10); }, ErrorKind::kFormat, 0, "too small to be a zip archive"},
      {"no end record", [](auto& b) { b.resize(b.size() - 5); }, ErrorKind::kFormat, good.size() - 5, "no end-of-central-directory record"},  // the end searched back from
      {"bad central signature", [&](auto& b) { put_u32(b, cd, 0x12345678); }, ErrorKind::kFormat, cd, "expected 0x02014b50"},
      {"end records disagree", [&](auto& b) { put_u16(b, eocd + 10, 2); }, ErrorKind::kFormat, eocd, "disagrees with the zip64 end record"},
      {"bad local signature", [](auto& b) { put_u32(b, 0, 0x12345678); }, ErrorKind::kFormat, 0, "expected 0x04034b50"},
      // (the 32-bit end record saturated, as a writer leaves it when the zip64 values are needed)
      {"too many entries", [&](auto& b) { put_u64(b, eocd - 20 - 56 + 24, 1000); put_u64(b, eocd - 20 - 56 + 32, 1000);
                                          put_u16(b, eocd + 8, 0xffff); put_u16(b, eocd + 10, 0xffff); },
       ErrorKind::kFormat, eocd, "1000 entries cannot fit"},
      {"central directory past the end records", [&](auto& b) { put_u64(b, eocd - 20 - 56 + 40, 100000); put_u32(b, eocd + 12, 0xffffffffu); },
       ErrorKind::kFormat, eocd, "does not end before the end records"},
      {"zip64 locator points nowhere", [&](auto& b) { put_u64(b, eocd - 20 + 8, eocd); }, ErrorKind::kFormat, eocd - 12,
       "leaves no room"},
      {"zip64 record signature", [&](auto& b) { put_u32(b, eocd - 20 - 56, 0); }, ErrorKind::kFormat, eocd - 76, "expected 0x06064b50"},
      {"local header offset past the directory", [&](auto& b) { put_u32(b, cd + 42, 0x7fffff); }, ErrorKind::kFormat, 0x7fffff,
       "does not lie before the central directory"},
      {"member data runs into the directory", [&](auto& b) { put_u32(b, cd + 20, 5000); put_u32(b, cd + 24, 5000); },
       ErrorKind::kFormat, 64, "runs into the central directory"},
      {"stored sizes disagree", [&](auto& b) { put_u32(b, cd + 20, 5); }, ErrorKind::kFormat, cd, "has compressed size 5 but size 12"},
      {"multi-disk", [&](auto& b) { b[eocd + 4] = std::byte{1}; }, ErrorKind::kUnsupported, eocd, "multi-disk"},
  };
  run_patch_table(good, rows, [](const std::vector<std::byte>& bad) { return ZipReader(ckpt::memory_source(bad, "z")); });

  SECTION("deflated member is listed but refused when opened") {
    auto bad = good;
    bad[cd + 10] = std::byte{8};
    ZipReader r(ckpt::memory_source(bad, "z"));
    REQUIRE_THROWS_MATCHES(r.open(r.entries()[0]), ckpt::Error, IsCkptError(ErrorKind::kUnsupported, 0, "only stored members"));
  }
  SECTION("a wrong CRC is found on demand") {
    auto bad = good;
    bad[64] = std::byte{'X'};
    ZipReader r(ckpt::memory_source(bad, "z"));
    REQUIRE_THROWS_MATCHES(r.verify_crc(r.entries()[0]), ckpt::Error, IsCkptError(ErrorKind::kFormat, 64, "CRC-32 of 'arch/data.pkl'"));
  }
}

namespace {

// A source of `size` zero bytes, and a file sink that turns runs of zeros into holes, so that
// archives past the 4 GiB mark cost neither memory nor disk.
class ZeroSource final : public ckpt::ByteSource {
 public:
  explicit ZeroSource(std::uint64_t size) : size_(size) {}
  const std::string& name() const noexcept override { return name_; }
  std::uint64_t size() const noexcept override { return size_; }
  void read_at(std::uint64_t offset, std::span<std::byte> out) const override {
    check_range(offset, out.size(), "read");
    std::memset(out.data(), 0, out.size());
  }

 private:
  std::uint64_t size_;
  std::string name_ = "zeros";
};

class SparseSink final : public ckpt::ByteSink {
 public:
  explicit SparseSink(const std::filesystem::path& p) : name_(p.string()) {
    fd_ = ::open(p.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw std::runtime_error("open");
  }
  ~SparseSink() override { ::close(fd_); }
  const std::string& name() const noexcept override { return name_; }
  std::uint64_t offset() const noexcept override { return at_; }
  void write(std::span<const std::byte> b) override {
    const bool zero = b.size() >= 4096 && std::all_of(b.begin(), b.end(), [](std::byte x) { return x == std::byte{0}; });
    if (!zero && ::pwrite(fd_, b.data(), b.size(), static_cast<off_t>(at_)) != static_cast<ssize_t>(b.size())) {
      throw std::runtime_error("pwrite");
    }
    at_ += b.size();
  }
  using ckpt::ByteSink::write;
  void commit() override {
    if (::ftruncate(fd_, static_cast<off_t>(at_)) != 0) throw std::runtime_error("ftruncate");
  }

 private:
  std::string name_;
  int fd_ = -1;
  std::uint64_t at_ = 0;
};

}  // namespace

TEST_CASE("zip64: a member of 4 GiB + 5 at offset 540 gets miniz's extra field, and one past 4 GiB its offset", "[ckpt][zip][slow]") {
  TestDir dir;
  const auto path = dir / "big.zip";
  const std::uint64_t big = 4294967301ull;
  {
    SparseSink sink(path);
    ZipWriter w(sink, "archive");
    // data.pkl of 460 bytes puts the next local header at 64 + 460 + 16 = 540, as in the spec's
    // [verified-1.13] experiment (docs/formats/torch_save.md#member-layout).
    w.add("data.pkl", std::vector<std::byte>(460, std::byte{'p'}));
    REQUIRE(sink.offset() == 540);
    ZeroSource zeros(big);
    w.begin_record("data/0", big);
    ckpt::stream_range(zeros, 0, big, [&](std::span<const std::byte> piece) { w.write(piece); });
    w.end_record();
    w.add("version", bytes_of("3\n"));
    w.finish();
    sink.commit();
  }
  auto src = ckpt::open_file(path);
  // The local header of data/0: 30 bytes, the name, then the zip64 extra as miniz writes it.
  std::vector<std::byte> lh = src->read_vector(540, 30 + 14 + 20);
  const std::vector<std::byte> want_extra = {std::byte{0x01}, std::byte{0x00}, std::byte{0x10}, std::byte{0x00},
                                             std::byte{0x05}, std::byte{0},    std::byte{0},    std::byte{0},
                                             std::byte{0x01}, std::byte{0},    std::byte{0},    std::byte{0},
                                             std::byte{0x05}, std::byte{0},    std::byte{0},    std::byte{0},
                                             std::byte{0x01}, std::byte{0},    std::byte{0},    std::byte{0}};
  CHECK(std::vector<std::byte>(lh.begin() + 44, lh.end()) == want_extra);
  ZipReader r(src);
  REQUIRE(r.entries().size() == 3);
  const auto* e = r.find("archive/data/0");
  REQUIRE(e);
  CHECK(e->size == big);
  CHECK(e->data_offset % 64 == 0);
  const auto* v = r.find("archive/version");
  REQUIRE(v);
  CHECK(v->local_header_offset > 0xffffffffull);
  CHECK(v->data_offset % 64 == 0);
  CHECK(r.open(*v)->read_vector(0, 2) == bytes_of("3\n"));
  // Its local header carries only the offset: 01 00 08 00 + u8.
  auto vh = src->read_vector(v->local_header_offset + 30 + 15, 4);
  CHECK(vh == std::vector<std::byte>{std::byte{0x01}, std::byte{0x00}, std::byte{0x08}, std::byte{0x00}});
  CHECK_NOTHROW(r.verify_crc(*v));
}
