// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

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
  struct Row {
    const char* defect;
    std::function<void(std::vector<std::byte>&)> patch;
    ErrorKind kind;
    std::optional<std::uint64_t> offset;
    const char* message;
  };
  const std::vector<Row> rows = {
      {"too small", [](auto& b) { b.resize(10); }, ErrorKind::kFormat, 0, "too small to be a zip archive"},
      {"no end record", [](auto& b) { b.resize(b.size() - 5); }, ErrorKind::kFormat, std::nullopt, "no end-of-central-directory record"},
      {"bad central signature", [&](auto& b) { put_u32(b, cd, 0x12345678); }, ErrorKind::kFormat, cd, "expected 0x02014b50"},
      {"bad local signature", [](auto& b) { put_u32(b, 0, 0x12345678); }, ErrorKind::kFormat, 0, "expected 0x04034b50"},
      {"too many entries", [&](auto& b) { put_u64(b, eocd - 20 - 56 + 24, 1000); put_u64(b, eocd - 20 - 56 + 32, 1000); },
       ErrorKind::kFormat, eocd, "1000 entries cannot fit"},
      {"central directory past the end records", [&](auto& b) { put_u64(b, eocd - 20 - 56 + 40, 100000); },
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
  for (const auto& row : rows) {
    SECTION(row.defect) {
      auto bad = good;
      row.patch(bad);
      REQUIRE_THROWS_MATCHES(ZipReader(ckpt::memory_source(bad, "z")), ckpt::Error, IsCkptError(row.kind, row.offset, row.message));
    }
  }
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
