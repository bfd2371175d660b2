// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "ckpt/sharding.hpp"

using D = ckpt::Dims;  // the box functions take spans, which braced lists do not make in C++20
using Pieces = std::vector<std::pair<std::int64_t, std::int64_t>>;

TEST_CASE("box arithmetic", "[ckpt][sharding]") {
  CHECK(ckpt::box_volume(D{}) == 1);
  CHECK(ckpt::box_volume(D{3, 0}) == 0);
  CHECK(ckpt::box_volume(D{2, 5}) == 10);
  auto i = ckpt::intersect(D{0, 0}, D{4, 6}, D{2, 3}, D{4, 4});
  REQUIRE(i);
  CHECK(i->offsets == std::vector<std::int64_t>{2, 3});
  CHECK(i->sizes == std::vector<std::int64_t>{2, 3});
  CHECK_FALSE(ckpt::intersect(D{0}, D{3}, D{3}, D{2}));  // touching, not overlapping
  CHECK_FALSE(ckpt::intersect(D{0, 0}, D{4, 2}, D{0, 2}, D{4, 2}));  // dim-1 neighbours
  CHECK_FALSE(ckpt::intersect(D{1}, D{0}, D{0}, D{5}));  // an empty box overlaps nothing
}

TEST_CASE("contiguous runs and tiling checks", "[ckpt][sharding]") {
  CHECK(ckpt::is_contiguous_run(D{2, 6}, D{10, 6}));      // dim-0 shard
  CHECK_FALSE(ckpt::is_contiguous_run(D{10, 3}, D{10, 6}));  // dim-1 shard
  CHECK(ckpt::is_contiguous_run(D{1, 3}, D{10, 6}));      // part of one row
  CHECK(ckpt::is_contiguous_run(D{1, 1, 4, 5}, D{2, 3, 7, 5}));
  CHECK_FALSE(ckpt::is_contiguous_run(D{1, 2, 4, 5}, D{2, 3, 7, 5}));
  CHECK(ckpt::is_contiguous_run(D{}, D{}));
  CHECK(ckpt::flat_index(D{3, 2}, D{1, 0}, D{4, 6}) == 2 * 6 + 2);

  struct B {
    std::vector<std::int64_t> offsets, sizes;
  };
  auto problems = [](const std::vector<std::int64_t>& shape, const std::vector<B>& chunks) {
    int overlaps = 0, coverage = 0;
    ckpt::tiling_problems(shape, chunks, [&](std::size_t, std::size_t) { ++overlaps; }, [&](std::optional<std::uint64_t>, std::uint64_t) { ++coverage; });
    return std::pair{overlaps, coverage};
  };
  CHECK(problems({10, 4}, {{{0, 0}, {5, 4}}, {{5, 0}, {5, 4}}}) == std::pair{0, 0});
  CHECK(problems({10, 4}, {{{0, 0}, {5, 4}}, {{6, 0}, {4, 4}}}) == std::pair{0, 1});  // a hole
  CHECK(problems({10, 4}, {{{0, 0}, {6, 4}}, {{5, 0}, {5, 4}}}) == std::pair{1, 1});  // an overlap
  CHECK(problems({}, {{{}, {}}}) == std::pair{0, 0});
  CHECK(problems({0, 4}, {}) == std::pair{0, 0});  // nothing to cover
  CHECK(problems({2}, {}) == std::pair{0, 1});
  // Tensor parallelism's dim-1 pieces and a 2-d grid: sound, whichever dimension is swept.
  CHECK(problems({10, 4}, {{{0, 0}, {10, 1}}, {{0, 1}, {10, 1}}, {{0, 2}, {10, 2}}}) == std::pair{0, 0});
  CHECK(problems({4, 6}, {{{0, 0}, {2, 3}}, {{0, 3}, {2, 3}}, {{2, 0}, {2, 3}}, {{2, 3}, {2, 3}}}) == std::pair{0, 0});
  CHECK(problems({10, 4}, {{{0, 0}, {10, 2}}, {{0, 1}, {10, 1}}, {{0, 2}, {10, 2}}}) == std::pair{1, 1});  // dim-1 overlap
  // Three copies of one box: each reported with the next, once.
  std::vector<std::pair<std::size_t, std::size_t>> pairs;
  ckpt::tiling_problems(
      D{4}, std::vector<B>{{{0}, {4}}, {{0}, {4}}, {{0}, {4}}}, [&](std::size_t i, std::size_t k) { pairs.emplace_back(i, k); },
      [](std::optional<std::uint64_t>, std::uint64_t) {});
  CHECK(pairs == std::vector<std::pair<std::size_t, std::size_t>>{{0, 1}, {1, 2}});
  // Volumes past 2^64 in all are reported as such, not wrapped round to a sum that fits.
  std::optional<std::uint64_t> reported = 0;
  const std::int64_t big = std::int64_t{1} << 62;
  ckpt::tiling_problems(
      D{big}, std::vector<B>(5, B{{0}, {big}}), [](std::size_t, std::size_t) {}, [&](std::optional<std::uint64_t> v, std::uint64_t) { reported = v; });
  CHECK_FALSE(reported.has_value());
}

TEST_CASE("Dims keeps two values inline and more on the heap", "[ckpt][sharding]") {
  D a{5, 7};
  CHECK(a.size() == 2);
  CHECK(a == std::vector<std::int64_t>{5, 7});
  const std::int64_t* inline_data = a.data();
  CHECK(inline_data == reinterpret_cast<const std::int64_t*>(&a));  // in the object itself
  a.push_back(9);  // spills to the heap, values kept
  CHECK(a == D{5, 7, 9});
  CHECK(a.data() != reinterpret_cast<const std::int64_t*>(&a));
  for (std::int64_t v = 10; v < 40; ++v) a.push_back(v);
  CHECK(a.size() == 33);
  CHECK(a.back() == 39);
  D b = a;  // deep copy
  b[0] = -1;
  CHECK(a[0] == 5);
  D c = std::move(b);  // takes the heap block
  CHECK(c.size() == 33);
  CHECK(c[0] == -1);
  CHECK(b.empty());  // NOLINT(bugprone-use-after-move): a moved-from Dims is empty
  c = D{1};  // back to inline
  CHECK(c == D{1});
  CHECK(c.vec() == std::vector<std::int64_t>{1});
  D e(std::vector<std::int64_t>{1, 2, 3, 4});
  e = a;
  CHECK(e == a);
  CHECK_FALSE(e == D{5, 7});
  CHECK(D{} == std::vector<std::int64_t>{});
  CHECK(D{1, 2} < D{1, 3});  // lexicographic, as std::vector's (the DCP reader's pending map)
  CHECK(D{1} < D{1, 0});
  CHECK_FALSE(D{2} < D{1, 9});
  std::vector<std::int64_t> as_vector = D{3, 4};
  CHECK(as_vector == std::vector<std::int64_t>{3, 4});
}

TEST_CASE("torch.chunk's rule (docs/formats/sharding.md#torchchunk-rule table, verified on torch 1.13)", "[ckpt][shard]") {
  CHECK(ckpt::chunk_pieces(10, 4) == Pieces{{0, 3}, {3, 3}, {6, 3}, {9, 1}});
  CHECK(ckpt::chunk_pieces(6, 4) == Pieces{{0, 2}, {2, 2}, {4, 2}});  // only 3 pieces
  CHECK(ckpt::chunk_pieces(5, 8) == Pieces{{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}});
  CHECK(ckpt::chunk_pieces(8, 4) == Pieces{{0, 2}, {2, 2}, {4, 2}, {6, 2}});
  CHECK(ckpt::chunk_pieces(7, 3) == Pieces{{0, 3}, {3, 3}, {6, 1}});
  CHECK(ckpt::chunk_pieces(1, 4) == Pieces{{0, 1}});
  CHECK(ckpt::chunk_pieces(0, 4) == Pieces{{0, 0}, {0, 0}, {0, 0}, {0, 0}});
}

TEST_CASE("DTensor Shard(0) pieces (docs/formats/sharding.md#dtensor-shard0): every rank, empty at the end", "[ckpt][shard]") {
  Pieces six_on_four, two_on_four, eight_on_four;
  for (int r = 0; r < 4; ++r) {
    six_on_four.push_back(ckpt::dtensor_piece(6, 4, r));
    two_on_four.push_back(ckpt::dtensor_piece(2, 4, r));
    eight_on_four.push_back(ckpt::dtensor_piece(8, 4, r));
  }
  CHECK(six_on_four == Pieces{{0, 2}, {2, 2}, {4, 2}, {6, 0}});
  CHECK(two_on_four == Pieces{{0, 1}, {1, 1}, {2, 0}, {2, 0}});
  CHECK(eight_on_four == Pieces{{0, 2}, {2, 2}, {4, 2}, {6, 2}});
}

TEST_CASE("a flat range as boxes", "[ckpt][sharding]") {
  // Every range of every shape here: the boxes are contiguous runs that hold exactly the range's
  // elements, in order, and there are at most 2 * rank - 1 of them.
  const std::vector<std::vector<std::int64_t>> shapes = {{7}, {3, 4}, {2, 3, 4}, {2, 1, 3, 2}, {1, 5}};
  for (const auto& shape : shapes) {
    const auto numel = static_cast<std::int64_t>(ckpt::box_volume(shape));
    for (std::int64_t b = 0; b <= numel; ++b) {
      for (std::int64_t e = b; e <= numel; ++e) {
        const std::vector<ckpt::Box> boxes = ckpt::flat_range_boxes(shape, b, e);
        CAPTURE(shape, b, e);
        CHECK(boxes.size() <= (b == e ? 0 : 2 * shape.size() - 1));
        std::int64_t next = b;
        for (const ckpt::Box& box : boxes) {
          CHECK(ckpt::is_contiguous_run(box.sizes, shape));
          CHECK(static_cast<std::int64_t>(ckpt::flat_index(box.offsets, D(std::vector<std::int64_t>(shape.size(), 0)), shape)) == next);
          next += static_cast<std::int64_t>(ckpt::box_volume(box.sizes));
        }
        CHECK(next == e);
      }
    }
  }
  CHECK(ckpt::flat_range_boxes(D{}, 0, 1).size() == 1);  // a 0-d tensor's element
  CHECK(ckpt::flat_range_boxes(D{}, 0, 1)[0].sizes.size() == 0);
  const auto whole = ckpt::flat_range_boxes(D{3, 4}, 0, 12);
  REQUIRE(whole.size() == 1);
  CHECK(whole[0].sizes == std::vector<std::int64_t>{3, 4});
  const auto mid = ckpt::flat_range_boxes(D{3, 4}, 2, 10);  // the end of row 0, row 1, the start of row 2
  REQUIRE(mid.size() == 3);
  CHECK(mid[0].offsets == std::vector<std::int64_t>{0, 2});
  CHECK(mid[1].sizes == std::vector<std::int64_t>{1, 4});
  CHECK(mid[2].sizes == std::vector<std::int64_t>{1, 2});
}
