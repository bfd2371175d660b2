// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "ckpt/sharding.hpp"

TEST_CASE("box arithmetic", "[ckpt][sharding]") {
  CHECK(ckpt::box_volume({}) == 1);
  CHECK(ckpt::box_volume({3, 0}) == 0);
  CHECK(ckpt::box_volume({2, 5}) == 10);
  auto i = ckpt::intersect({0, 0}, {4, 6}, {2, 3}, {4, 4});
  REQUIRE(i);
  CHECK(i->offsets == std::vector<std::int64_t>{2, 3});
  CHECK(i->sizes == std::vector<std::int64_t>{2, 3});
  CHECK_FALSE(ckpt::intersect({0}, {3}, {3}, {2}));  // touching, not overlapping
  CHECK_FALSE(ckpt::intersect({0, 0}, {4, 2}, {0, 2}, {4, 2}));  // dim-1 neighbours
  CHECK_FALSE(ckpt::intersect({1}, {0}, {0}, {5}));  // an empty box overlaps nothing
}

TEST_CASE("contiguous runs and tiling checks", "[ckpt][sharding]") {
  CHECK(ckpt::is_contiguous_run({2, 6}, {10, 6}));      // dim-0 shard
  CHECK_FALSE(ckpt::is_contiguous_run({10, 3}, {10, 6}));  // dim-1 shard
  CHECK(ckpt::is_contiguous_run({1, 3}, {10, 6}));      // part of one row
  CHECK(ckpt::is_contiguous_run({1, 1, 4, 5}, {2, 3, 7, 5}));
  CHECK_FALSE(ckpt::is_contiguous_run({1, 2, 4, 5}, {2, 3, 7, 5}));
  CHECK(ckpt::is_contiguous_run({}, {}));
  CHECK(ckpt::flat_index({3, 2}, {1, 0}, {4, 6}) == 2 * 6 + 2);

  struct B {
    std::vector<std::int64_t> offsets, sizes;
  };
  auto problems = [](const std::vector<std::int64_t>& shape, const std::vector<B>& chunks) {
    int overlaps = 0, coverage = 0;
    ckpt::tiling_problems(shape, chunks, [&](std::size_t, std::size_t) { ++overlaps; }, [&](std::uint64_t, std::uint64_t) { ++coverage; });
    return std::pair{overlaps, coverage};
  };
  CHECK(problems({10, 4}, {{{0, 0}, {5, 4}}, {{5, 0}, {5, 4}}}) == std::pair{0, 0});
  CHECK(problems({10, 4}, {{{0, 0}, {5, 4}}, {{6, 0}, {4, 4}}}) == std::pair{0, 1});  // a hole
  CHECK(problems({10, 4}, {{{0, 0}, {6, 4}}, {{5, 0}, {5, 4}}}) == std::pair{1, 1});  // an overlap
  CHECK(problems({}, {{{}, {}}}) == std::pair{0, 0});
  CHECK(problems({0, 4}, {}) == std::pair{0, 0});  // nothing to cover
  CHECK(problems({2}, {}) == std::pair{0, 1});
}
