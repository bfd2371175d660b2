// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "ckpt/formats/safetensors.hpp"
#include "support/error_matchers.hpp"
#include "support/test_support.hpp"

using namespace fsdp_test;
using ckpt::DType;
using ckpt::ErrorKind;

namespace {

std::vector<std::byte> file_with_header(const std::string& header, std::size_t buffer) {
  std::vector<std::byte> b(8);
  put_u64(b, 0, header.size());
  auto h = bytes_of(header);
  b.insert(b.end(), h.begin(), h.end());
  b.resize(b.size() + buffer, std::byte{1});
  return b;
}

}  // namespace

TEST_CASE("safetensors round trip in memory", "[ckpt][safetensors]") {
  std::vector<ckpt::SafetensorsEntry> e;
  e.push_back({"b", DType::kUInt8, {3}, ckpt::memory_source(bytes_of("abc"))});
  e.push_back({"a", DType::kFloat32, {2}, ckpt::memory_source(bytes_of("12345678"))});
  e.push_back({"s", DType::kFloat64, {}, ckpt::memory_source(bytes_of("ABCDEFGH"))});
  e.push_back({"z", DType::kInt16, {0, 5}, ckpt::memory_source({})});
  ckpt::MemorySink sink;
  ckpt::write_safetensors(sink, e, {{"format", "pt"}});
  auto f = ckpt::read_safetensors(ckpt::memory_source(sink.take(), "m.safetensors"));
  CHECK((8 + f.header_size) % 8 == 0);
  CHECK(f.metadata == std::vector<std::pair<std::string, std::string>>{{"format", "pt"}});
  REQUIRE(f.tensors.size() == 4);
  CHECK(f.tensors[0].name == "s");  // F64 first: alignment descending, then name
  CHECK(f.tensors[1].name == "a");
  CHECK(f.tensors[2].name == "z");
  CHECK(f.tensors[3].name == "b");
  CHECK(f.data(f.tensors[1])->read_vector(0, 8) == bytes_of("12345678"));
  CHECK(f.tensors[0].shape.empty());
  CHECK(f.tensors[1].begin % 8 == 0);
  CHECK(f.data(f.tensors[3])->name() == "m.safetensors[b]");
  REQUIRE_THROWS_MATCHES(ckpt::write_safetensors(sink, {{"c", DType::kComplex128, {1}, ckpt::memory_source(std::vector<std::byte>(16))}}),
                         ckpt::Error, IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "safetensors cannot store"));
}

TEST_CASE("plan_safetensors gives each entry's place among those given", "[ckpt][safetensors]") {
  std::vector<ckpt::SafetensorsEntry> e{{"b", DType::kUInt8, {3}, nullptr}, {"a", DType::kFloat32, {2}, nullptr},
                                        {"s", DType::kFloat64, {}, nullptr}, {"z", DType::kInt16, {0, 5}, nullptr}};
  const ckpt::SafetensorsLayout l = ckpt::plan_safetensors(e, {}, "p.safetensors");
  REQUIRE(l.order == std::vector<std::size_t>{2, 1, 3, 0});  // s (F64), a (F32), z (I16), b (U8)
  for (std::size_t i = 0; i < l.order.size(); ++i) CHECK(l.entries[i].name == e[l.order[i]].name);
  e.push_back({"a", DType::kFloat16, {1}, nullptr});
  REQUIRE_THROWS_MATCHES(ckpt::plan_safetensors(e, {}, "p.safetensors"), ckpt::Error,
                         IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "tensor name 'a' given twice"));
}

TEST_CASE("real safetensors files written by the reference implementation", "[ckpt][safetensors]") {
  const auto dir = shared_testdata_or_skip("huggingface__safetensors__samples");
  auto f = ckpt::read_safetensors(ckpt::open_file(dir / "overall.safetensors"));
  // What the header says (checked by hand against the file, and in tests/interop against Python).
  REQUIRE(f.tensors.size() == 9);
  CHECK(f.metadata == std::vector<std::pair<std::string, std::string>>{{"test", "a"}});
  CHECK(f.tensors[1].name == "H");
  CHECK(f.tensors[1].dtype == DType::kUInt16);
  CHECK(f.tensors[1].shape == std::vector<std::uint64_t>{6});
  CHECK(f.tensors[1].begin == 8 + 526 + 6);
  for (const char* n : {"B", "b", "H", "h", "I", "i", "e", "f", "d"}) {
    CHECK_NOTHROW(ckpt::read_safetensors(ckpt::open_file(dir / (std::string(n) + ".safetensors"))));
  }
}

TEST_CASE("safetensors corruption table", "[ckpt][safetensors]") {
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  struct Row {
    const char* defect;
    std::vector<std::byte> bytes;
    ErrorKind kind;
    std::uint64_t offset;
    const char* message;
  };
  auto huge = file_with_header(ok, 8);
  put_u64(huge, 0, 100'000'001);
  auto past = file_with_header(ok, 8);
  put_u64(past, 0, 4096);
  const std::vector<Row> rows = {
      {"too small", bytes_of("abc"), ErrorKind::kFormat, 0, "too small for a safetensors header length"},
      {"header too large", huge, ErrorKind::kFormat, 0, "exceeds the limit of 100000000"},
      {"header past the end", past, ErrorKind::kFormat, 0, "passes the end of the file"},
      {"not an object", file_with_header("[1]", 0), ErrorKind::kFormat, 8, "does not start with '{'"},
      {"bad JSON", file_with_header(R"({"a":{"dtype":"F32",})", 0), ErrorKind::kFormat, 28, "expected a string key"},
      {"invalid UTF-8", file_with_header("{\"\xc3\x28\":1}", 0), ErrorKind::kFormat, 8, "not valid UTF-8"},
      {"unknown dtype", file_with_header(R"({"a":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}})", 8), ErrorKind::kFormat, 22,
       "dtype 'F99' of 'a' is not a known safetensors dtype"},
      {"size mismatch", file_with_header(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), ErrorKind::kFormat, 55,
       "spans 8 bytes, but F32 3 elements need 12"},
      {"hole", file_with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12), ErrorKind::kFormat, 9,
       "starts at buffer offset 4, expected 0 (a hole)"},
      {"overlap",
       file_with_header(R"({"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}})", 6),
       ErrorKind::kFormat, 61, "(an overlap)"},
      {"trailing bytes", file_with_header(ok, 9), ErrorKind::kFormat, 8 + ok.size() + 8, "(trailing bytes)"},
      {"past the buffer", file_with_header(ok, 4), ErrorKind::kFormat, 55, "past the buffer's 4 bytes"},
      {"duplicate name",
       file_with_header(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})", 2),
       ErrorKind::kFormat, 61, "appears twice"},
      {"negative shape", file_with_header(R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", 1), ErrorKind::kFormat, 36,
       "expected a non-negative integer"},
      {"metadata not strings", file_with_header(R"({"__metadata__":{"k":1}})", 0), ErrorKind::kFormat, 29, "is not a string"},
      {"shape overflow",
       file_with_header(R"({"a":{"dtype":"U8","shape":[4294967296,4294967296],"data_offsets":[0,1]}})", 1), ErrorKind::kFormat, 47,
       "overflows 64 bits"},
      {"sub-byte dtype", file_with_header(R"({"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}})", 1), ErrorKind::kUnsupported,
       22, "sub-byte"},
  };
  for (const auto& row : rows) {
    SECTION(row.defect) {
      REQUIRE_THROWS_MATCHES(ckpt::read_safetensors(ckpt::memory_source(row.bytes, "t.safetensors")), ckpt::Error,
                             IsCkptError(row.kind, row.offset, row.message));
    }
  }
}
