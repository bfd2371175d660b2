// SPDX-License-Identifier: Apache-2.0
// The one result type of merge and shard, and its printer: the text and JSON every tool prints.
#include <catch2/catch.hpp>

#include <nlohmann/json.hpp>
#include <sstream>

#include "ckpt/ops/result.hpp"

namespace {

ckpt::WriteResult shard_plan() {
  ckpt::WriteResult r;
  r.operation = ckpt::Operation::kShard;
  r.dry_run = true;
  r.world_size = 2;
  r.tensor_bytes = 24;
  r.compressed = true;
  r.entries.push_back({"model.w\n", "tensor", ckpt::DType::kFloat32, {2, 3}, 24, {{0, {0, 0}, {1, 3}}, {1, {1, 0}, {1, 3}}}, {}});
  r.entries.push_back({"epoch", "object", std::nullopt, {}, 0, {{1, {}, {}}}, {}});
  r.entries.push_back({"hparams", "meta", std::nullopt, {}, 0, {}, {}});
  r.files.push_back({"out/__0_0.distcp", 100, 1, true});
  return r;
}

}  // namespace

TEST_CASE("result: a shard plan as text names every chunk's box and escapes names", "[ckpt][result]") {
  std::ostringstream out;
  ckpt::print_text(shard_plan(), out);
  CHECK(out.str() ==
        "plan: 3 entries (1 tensors, 24 bytes of tensor data) for 2 ranks\n"
        "  model.w\\n  tensor  float32  [2, 3]  2 chunks: 0:[0:1, 0:3] 1:[1:2, 0:3]\n"
        "  epoch  object  rank 1\n"
        "  hparams  meta  meta.pt\n"
        "would write (sizes before compression):\n"
        "  out/__0_0.distcp  100 bytes, 1 items\n");
}

TEST_CASE("result: JSON holds what the operation has, in one layout", "[ckpt][result]") {
  const auto shard = nlohmann::json::parse(ckpt::to_json(shard_plan()));
  CHECK(shard["world_size"] == 2);
  CHECK(shard["files"][0]["items"] == 1);
  CHECK(shard["entries"][0]["chunks"][1]["offsets"] == std::vector<int>{1, 0});
  CHECK_FALSE(shard["entries"][2].contains("chunks"));  // a meta.pt key has none

  ckpt::WriteResult merge;
  merge.files.push_back({"m.pt", 10, 2, true});
  merge.entries.push_back({"w", "tensor", ckpt::DType::kBFloat16, {4}, 8, {}, "m.pt"});
  const auto j = nlohmann::json::parse(ckpt::to_json(merge));
  CHECK_FALSE(j.contains("world_size"));
  CHECK(j["files"][0]["tensors"] == 2);
  CHECK(j["entries"][0]["file"] == "m.pt");
  CHECK(j["entries"][0]["dtype"] == "bfloat16");
  std::ostringstream out;
  ckpt::print_text(merge, out);
  CHECK(out.str() == "wrote:\n  m.pt  10 bytes, 2 tensors\n");
}
