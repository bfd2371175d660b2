// SPDX-License-Identifier: Apache-2.0
// The copy engine: tasks in any order and on any number of threads give the bytes and the CRC-32
// of one sequential pass; the first error stops the run and leaves no output.
#include <catch2/catch.hpp>
#include <cstring>
#include <fstream>
#include <limits>

#include "ckpt/cast.hpp"
#include "ckpt/copy.hpp"
#include "ckpt/error.hpp"
#include "support/test_support.hpp"
#include "zip/crc32.hpp"

namespace {

std::vector<std::byte> pattern(std::size_t n) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>((i * 2654435761u) >> 13);
  return v;
}

std::vector<std::byte> slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> out(c.size());
  std::memcpy(out.data(), c.data(), c.size());
  return out;
}

}  // namespace

TEST_CASE("run_copy writes every task at its offset and combines CRCs per group", "[ckpt][copy]") {
  fsdp_test::TestDir dir;
  const auto data = pattern(3'000'001);
  const auto src = ckpt::memory_source(data);
  // Two groups: [0, 1'000'000) and [1'000'000, end), cut into uneven pieces, listed backwards.
  std::vector<ckpt::CopyTask> tasks;
  const std::vector<std::uint64_t> cuts{0, 7, 65536, 999'999, 1'000'000, 1'000'001, 2'500'000, 3'000'001};
  for (std::size_t i = cuts.size() - 1; i-- > 0;) {
    const std::uint64_t at = cuts[i], n = cuts[i + 1] - cuts[i];
    tasks.push_back({at, n, at < 1'000'000 ? 0u : 1u,
                     [src, at](std::span<std::byte> out, std::vector<std::byte>&) { src->read_at(at, out); }});
  }
  const unsigned threads = GENERATE(1u, 2u, 5u);
  auto sink = ckpt::open_positional_sink(dir.path() / "out", ckpt::Overwrite::kYes);
  sink->resize(data.size());
  const auto crcs = ckpt::run_copy(*sink, tasks, 2, {threads, nullptr});
  sink->commit();
  CHECK(slurp(dir.path() / "out") == data);
  REQUIRE(crcs.size() == 2);
  CHECK(crcs[0] == ckpt::detail::crc32_update(0, std::span(data).subspan(0, 1'000'000)));
  CHECK(crcs[1] == ckpt::detail::crc32_update(0, std::span(data).subspan(1'000'000)));
}

TEST_CASE("run_copy from a task source: a group per call, CRCs combined as each completes; none without groups", "[ckpt][copy]") {
  fsdp_test::TestDir dir;
  const auto data = pattern(1'000'003);
  const auto src = ckpt::memory_source(data);
  // Group g is [g * 100'000, (g + 1) * 100'000) (the last is shorter), made by call g in pieces of
  // 30,000 bytes, listed backwards.
  const std::size_t ngroups = 11;
  auto source = [&](bool split_a_group) {
    return [&, split_a_group, g = std::size_t{0}](std::vector<ckpt::CopyTask>& out) mutable {
      if (g == ngroups) return false;
      const std::uint64_t begin = g * 100'000, end = std::min<std::uint64_t>(begin + 100'000, data.size());
      std::vector<ckpt::CopyTask> made;
      ckpt::add_range_tasks(made, src, begin, end - begin, begin, g, 30'000);
      if (split_a_group && g == 5) made.pop_back();  // given again by the next call
      if (split_a_group && g == 6) made.push_back(ckpt::CopyTask{begin - 10'000, 10'000, 5, nullptr});
      out.insert(out.end(), std::make_move_iterator(made.rbegin()), std::make_move_iterator(made.rend()));
      return ++g < ngroups;
    };
  };
  const unsigned threads = GENERATE(1u, 3u);
  {
    auto sink = ckpt::open_positional_sink(dir.path() / "out", ckpt::Overwrite::kYes);
    sink->resize(data.size());
    const auto crcs = ckpt::run_copy(*sink, source(false), data.size(), ngroups, {threads, nullptr});
    sink->commit();
    CHECK(slurp(dir.path() / "out") == data);
    REQUIRE(crcs.size() == ngroups);
    for (std::size_t g = 0; g < ngroups; ++g) {
      const std::size_t begin = g * 100'000, n = std::min<std::size_t>(100'000, data.size() - begin);
      CHECK(crcs[g] == ckpt::detail::crc32_update(0, std::span(data).subspan(begin, n)));
    }
  }
  {
    auto sink = ckpt::open_positional_sink(dir.path() / "out0", ckpt::Overwrite::kYes);
    sink->resize(data.size());
    CHECK(ckpt::run_copy(*sink, source(false), data.size(), 0, {threads, nullptr}).empty());
    sink->commit();
    CHECK(slurp(dir.path() / "out0") == data);
  }
  auto sink = ckpt::open_positional_sink(dir.path() / "out1", ckpt::Overwrite::kYes);
  sink->resize(data.size());
  CHECK_THROWS_WITH(ckpt::run_copy(*sink, source(true), data.size(), ngroups, {threads, nullptr}),
                    Catch::Contains("a CRC group's tasks came from two calls"));
}

TEST_CASE("run_copy stops on the first error and the uncommitted output disappears", "[ckpt][copy]") {
  fsdp_test::TestDir dir;
  std::vector<ckpt::CopyTask> tasks;
  for (std::uint64_t i = 0; i < 64; ++i) {
    tasks.push_back({i * 16, 16, 0, [i](std::span<std::byte> out, std::vector<std::byte>&) {
                       if (i == 40) throw ckpt::Error(ckpt::ErrorKind::kFormat, "input", 123, "bad bytes");
                       std::fill(out.begin(), out.end(), std::byte{1});
                     }});
  }
  {
    auto sink = ckpt::open_positional_sink(dir.path() / "out", ckpt::Overwrite::kNo);
    CHECK_THROWS_WITH(ckpt::run_copy(*sink, tasks, 1, {2, nullptr}), Catch::Contains("bad bytes"));
  }
  CHECK(std::filesystem::is_empty(dir.path()));
}

TEST_CASE("casts round to nearest even like c10", "[ckpt][cast]") {
  auto bf16 = [](float f) {
    std::uint16_t out;
    ckpt::cast(std::as_bytes(std::span(&f, 1)), ckpt::DType::kFloat32, std::as_writable_bytes(std::span(&out, 1)), ckpt::DType::kBFloat16);
    return out;
  };
  auto f16 = [](float f) {
    std::uint16_t out;
    ckpt::cast(std::as_bytes(std::span(&f, 1)), ckpt::DType::kFloat32, std::as_writable_bytes(std::span(&out, 1)), ckpt::DType::kFloat16);
    return out;
  };
  CHECK(bf16(1.0f) == 0x3F80);
  CHECK(bf16(1.0f + 0x1.0p-8f) == 0x3F80);        // a tie rounds to even (down)
  CHECK(bf16(1.0f + 3 * 0x1.0p-8f) == 0x3F82);    // a tie rounds to even (up)
  CHECK(bf16(std::numeric_limits<float>::quiet_NaN()) == 0x7FC0);
  CHECK(f16(65504.0f) == 0x7BFF);
  CHECK(f16(65520.0f) == 0x7C00);                  // rounds up to inf
  CHECK(f16(0x1.0p-24f) == 0x0001);                // smallest subnormal
  CHECK(f16(0x1.0p-25f) == 0x0000);                // tie to even: zero
  CHECK(f16(-0.0f) == 0x8000);
  CHECK(ckpt::is_castable_float(ckpt::DType::kFloat64));
  CHECK_FALSE(ckpt::is_castable_float(ckpt::DType::kInt64));
}

TEST_CASE("a narrowing cast counts the finite values it turns into inf and the non-zeros it flushes", "[ckpt][cast]") {
  const std::vector<float> in{1.0f, 65504.0f, 65520.0f, 1e6f, -1e6f, 1e-12f, -1e-12f, 0x1.0p-24f, 0.0f,
                              std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  std::vector<std::uint16_t> out(in.size());
  const ckpt::CastDamage f16 = ckpt::cast(std::as_bytes(std::span(in)), ckpt::DType::kFloat32, std::as_writable_bytes(std::span(out)),
                                          ckpt::DType::kFloat16);
  CHECK(f16.overflowed == 3);  // 65520 rounds up to inf, and +-1e6; inf itself was not finite
  CHECK(f16.flushed == 2);     // +-1e-12; 2^-24 is float16's smallest subnormal and stays
  const ckpt::CastDamage bf16 = ckpt::cast(std::as_bytes(std::span(in)), ckpt::DType::kFloat32, std::as_writable_bytes(std::span(out)),
                                           ckpt::DType::kBFloat16);
  CHECK_FALSE(bf16.any());  // bfloat16 has float32's exponent range
  std::vector<double> wide(in.size());
  CHECK_FALSE(ckpt::cast(std::as_bytes(std::span(in)), ckpt::DType::kFloat32, std::as_writable_bytes(std::span(wide)), ckpt::DType::kFloat64).any());

  ckpt::CastLedger ledger;
  ledger.record("a", f16);
  ledger.record("a", f16);
  ledger.record("b", bf16);  // no damage: not listed
  const auto damaged = ledger.damaged();
  REQUIRE(damaged.size() == 1);
  CHECK(damaged.at("a").overflowed == 6);
  CHECK_THROWS_WITH(ledger.conclude(ckpt::DType::kFloat16, ckpt::CastCheck::kStrict, nullptr, "out.pt"),
                    Catch::Contains("'a' cast to float16: 6 finite values became inf, 4 non-zero values became 0"));
}
