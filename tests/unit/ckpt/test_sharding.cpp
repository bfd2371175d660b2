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
