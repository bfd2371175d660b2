// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <filesystem>

#include "ckpt/checkpoint.hpp"
#include "ckpt/formats/dcp.hpp"
#include "ckpt/open.hpp"
#include "ckpt/ops/merge.hpp"
#include "ckpt/ops/shard.hpp"
#include "ckpt/output.hpp"
#include "formats/dcp/metadata.hpp"
#include "formats/dcp/write_plan.hpp"
#include "support/error_matchers.hpp"
#include "support/tensors.hpp"
#include "support/test_support.hpp"

using namespace fsdp_test;
using ckpt::DType;
using ckpt::ErrorKind;
namespace pk = ckpt::pickle;

TEST_CASE("DCP file plan: K files per rank split as DCP's thread_count does", "[ckpt][shard]") {
  ckpt::detail::DcpPlan plan;
  plan.world_size = 2;
  plan.files_per_rank = 2;
  plan.tensors.reserve(3);  // the chunks are added through references to them
  auto tensor = [&](const char* fqn, std::int64_t n) -> ckpt::detail::DcpPlanTensor& {
    return plan.tensors.emplace_back(ckpt::detail::DcpPlanTensor{.fqn = fqn, .position = plan.tensors.size(), .shape = {n}});
  };
  auto chunk = [&](ckpt::detail::DcpPlanTensor& t, int rank, std::int64_t at, std::int64_t n) {
    const std::int64_t offsets[] = {at}, sizes[] = {n};
    plan.chunks.add(t, rank, offsets, sizes);
  };
  auto& a = tensor("a", 10);
  chunk(a, 0, 0, 2);
  chunk(a, 1, 2, 8);
  chunk(tensor("b", 6), 0, 0, 6);
  chunk(tensor("c", 3), 0, 0, 3);
  const std::string objects[] = {"o0", "o1", "o2"};  // the plan views its FQNs
  for (int i = 0; i < 3; ++i) plan.objects.push_back({objects[i], 3u + static_cast<std::size_t>(i), 0, ckpt::memory_source({})});
  const auto files = ckpt::detail::plan_dcp_files(plan);
  REQUIRE(files.size() == 4);
  CHECK(files[0].name == "__0_0.distcp");
  CHECK(files[3].name == "__1_1.distcp");
  auto names = [&](const ckpt::detail::DcpFilePlan& f) {
    std::vector<std::string> out;
    for (const auto& r : f.items) out.emplace_back(r.tensor ? plan.tensors[r.index].fqn : plan.objects[r.index].fqn);
    return out;
  };
  // bytes items round-robin; tensors largest first into the lighter file: b (24 B) to file 0,
  // c (12 B) to file 1, a's 8 bytes to file 1 (12 < 24)
  CHECK(names(files[0]) == std::vector<std::string>{"o0", "o2", "b"});
  CHECK(names(files[1]) == std::vector<std::string>{"o1", "c", "a"});
  CHECK(names(files[2]) == std::vector<std::string>{"a"});
  CHECK(files[3].items.empty());  // empty files are still written, as DCP does
  CHECK(files[3].size == 0);
}

TEST_CASE("DCP plan chunks: one table, a tensor's chunks together, boxes of the tensor's rank", "[ckpt][shard]") {
  ckpt::detail::DcpPlan plan;
  plan.tensors.reserve(2);
  auto& a = plan.tensors.emplace_back(ckpt::detail::DcpPlanTensor{.fqn = "a", .position = 0, .shape = {4, 3}});
  auto& b = plan.tensors.emplace_back(ckpt::detail::DcpPlanTensor{.fqn = "b", .position = 1, .shape = {5}});
  const std::int64_t a0_off[] = {0, 0}, a0_size[] = {2, 3}, a1_off[] = {2, 0}, a1_size[] = {2, 3}, b_off[] = {0}, b_size[] = {5};
  plan.chunks.add(a, 1, a0_off, a0_size);
  plan.chunks.add(a, 0, a1_off, a1_size);
  CHECK_THROWS_WITH(plan.chunks.add(b, 0, a0_off, a0_size), Catch::Contains("tensor 'b': chunk rank differs from the tensor's"));
  plan.chunks.add(b, 2, b_off, b_size);
  CHECK_THROWS(plan.chunks.add(a, 0, a1_off, a1_size));  // a's chunks are no longer the last
  REQUIRE(a.chunk_count == 2);
  REQUIRE(b.chunk_count == 1);
  const auto c = plan.chunks.get(a, 1);
  CHECK(c.rank == 0);
  CHECK(std::vector<std::int64_t>(c.offsets.begin(), c.offsets.end()) == std::vector<std::int64_t>{2, 0});
  CHECK(std::vector<std::int64_t>(c.sizes.begin(), c.sizes.end()) == std::vector<std::int64_t>{2, 3});
  plan.chunks.set_rank(b, 0, 1);
  CHECK(plan.chunks.get(b, 0).rank == 1);
  CHECK(plan.chunks.get(b, 0).sizes[0] == 5);
  CHECK(plan.chunks.get(a, 0).rank == 1);
}

TEST_CASE("shard refuses bad options before writing anything", "[ckpt][shard]") {
  TestDir dir;
  const ckpt::Checkpoint in = ckpt::open_checkpoint(testdata("dcp/torch113_2rank"));
  ckpt::ShardOptions o;
  o.world_size = 0;
  REQUIRE_THROWS_MATCHES(ckpt::shard(in, dir.path() / "out", o), ckpt::Error,
                         IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "--world-size must be at least 1"));
  o.world_size = 2;
  o.process_count = 2;
  o.process_index = 2;
  REQUIRE_THROWS_MATCHES(ckpt::shard(in, dir.path() / "out", o), ckpt::Error,
                         IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "is not a valid process rank"));
  o.process_count = 1;
  o.process_index = 0;
  o.key = "model";
  REQUIRE_THROWS_MATCHES(ckpt::shard(in, dir.path() / "out", o), ckpt::Error,
                         IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "--key applies to input that is not a DCP"));
  o.key.reset();
  o.max_memory = 4;  // head.weight is chunked on dim 1: gathered, one row is 12 bytes
  REQUIRE_THROWS_MATCHES(ckpt::shard(in, dir.path() / "out", o), ckpt::Error,
                         IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "more than the memory bound of 4"));
  CHECK(std::filesystem::is_empty(dir.path()));
}

TEST_CASE("shard: a hole in the input is refused and leaves nothing", "[ckpt][shard]") {
  TestDir dir;
  ckpt::Checkpoint in = ckpt::open_checkpoint(testdata("dcp/torch113_2rank"));
  for (auto& t : in.tensors) {
    if (t.name == "model.embed.weight") t.chunks.pop_back();
  }
  ckpt::ShardOptions o;
  o.world_size = 3;
  REQUIRE_THROWS_MATCHES(ckpt::shard(in, dir.path() / "out", o), ckpt::Error,
                         IsCkptError(ErrorKind::kFormat, std::nullopt, "(a hole)"));
  CHECK(std::filesystem::is_empty(dir.path()));
}

TEST_CASE("shard: the dry run plans, -j does not change the bytes", "[ckpt][shard]") {
  TestDir dir;
  const ckpt::Checkpoint in = ckpt::open_checkpoint(testdata("dcp/torch113_4rank"));
  ckpt::ShardOptions o;
  o.world_size = 3;
  const ckpt::ShardResult plan = ckpt::shard(in, dir.path() / "dry", o, true);
  CHECK_FALSE(std::filesystem::exists(dir.path() / "dry"));
  CHECK(plan.files.size() == 3);
  o.threads = 1;
  const ckpt::ShardResult one = ckpt::shard(in, dir.path() / "j1", o);
  o.threads = 8;
  ckpt::shard(in, dir.path() / "j8", o);
  CHECK(one.committed);
  for (int r = 0; r < 3; ++r) {
    const std::string f = "__" + std::to_string(r) + "_0.distcp";
    CHECK(read_all(dir.path() / "j1" / f) == read_all(dir.path() / "j8" / f));
    CHECK(std::filesystem::file_size(dir.path() / "j1" / f) == plan.files[static_cast<std::size_t>(r)].size);
  }
}

namespace {

// A DCP directory kept in memory, read back through the index as open_dcp reads one from disk.
ckpt::Checkpoint read_back_dcp(const ckpt::MemoryOutput& out) {
  ckpt::Checkpoint c;
  c.root = out.path();
  c.format = ckpt::Format::kDcp;
  ckpt::detail::read_dcp_metadata(out.files().at(".metadata"), (out.path() / ".metadata").string(), c);
  for (ckpt::CheckpointFile& f : c.files) {
    f.source = out.source(f.relative);
    f.size = f.source->size();
  }
  c.items = ckpt::detail::dcp_items();
  return c;
}

}  // namespace

TEST_CASE("shard into memory: read back, every tensor equals the input's, chunked as FSDP chunks it", "[ckpt][shard]") {
  const ckpt::Checkpoint in = ckpt::open_checkpoint(testdata("dcp/torch113_4rank"));
  ckpt::MemoryOutput out("resharded");
  ckpt::ShardOptions o;
  o.world_size = 3;
  const ckpt::ShardResult r = ckpt::shard(in, out, o);
  CHECK(r.committed);
  CHECK(out.files().size() == 4);  // .metadata and a file a rank
  for (const ckpt::ResultFile& f : r.files) CHECK(f.size == out.files().at(f.path.filename().string()).size());
  const ckpt::Checkpoint back = read_back_dcp(out);
  const ckpt::ChunkReader from(in), to(back);
  REQUIRE(back.tensors.size() == in.tensors.size());
  for (const ckpt::TensorEntry& t : in.tensors) {
    INFO(t.name);
    const auto b = std::find_if(back.tensors.begin(), back.tensors.end(), [&](const auto& x) { return x.name == t.name; });
    REQUIRE(b != back.tensors.end());
    CHECK(b->dtype == t.dtype);
    CHECK(b->shape == t.shape);
    CHECK(whole_tensor(to, *b) == whole_tensor(from, t));
    if (t.shape.size() == 0) continue;
    // torch.chunk's rule: pieces of ceil(n / 3) rows along dim 0, in rank order.
    const std::int64_t piece = (t.shape[0] + 2) / 3;
    std::int64_t at = 0;
    for (const ckpt::Chunk& c : b->chunks) {
      CHECK(c.offsets[0] == at);
      CHECK(c.sizes[0] == std::min(piece, t.shape[0] - at));
      at += c.sizes[0];
    }
    CHECK(at == t.shape[0]);
  }
}

TEST_CASE("shard into memory: the bytes the file output holds, DCP with zstd and DCP's Hugging Face storage", "[ckpt][shard]") {
  TestDir dir;
  const ckpt::Checkpoint in = ckpt::open_checkpoint(testdata("dcp/torch113_2rank"));
  ckpt::ShardOptions o;
  o.world_size = 3;
  SECTION("DCP, zstd") { o.compression = ckpt::DcpCompression::kZstd; }
  SECTION("hf-safetensors") { o.format = ckpt::ShardFormat::kHfSafetensors; }
  ckpt::MemoryOutput out;
  ckpt::shard(in, out, o);
  ckpt::shard(in, dir.path() / "out", o);
  std::size_t on_disk = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path() / "out")) {
    ++on_disk;
    const std::string name = e.path().filename().string();
    INFO(name);
    if (name == ".metadata") continue;  // its save id is random: compared as an index below
    CHECK(out.files().at(name) == read_all(e.path()));
  }
  CHECK(out.files().size() == on_disk);
  if (out.files().count(".metadata")) {
    ckpt::Checkpoint a, b;
    a.root = b.root = "out";
    ckpt::detail::read_dcp_metadata(out.files().at(".metadata"), "memory", a);
    ckpt::detail::read_dcp_metadata(read_all(dir.path() / "out" / ".metadata"), "file", b);
    CHECK(ckpt::detail::index_difference(a, b).empty());
  }
}

TEST_CASE("shard into memory: several processes share an output in the file system only", "[ckpt][shard]") {
  const ckpt::Checkpoint in = ckpt::open_checkpoint(testdata("dcp/torch113_2rank"));
  ckpt::MemoryOutput out;
  ckpt::ShardOptions o;
  o.world_size = 2;
  o.process_count = 2;
  REQUIRE_THROWS_MATCHES(ckpt::shard(in, out, o), ckpt::Error, IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "file system only"));
  CHECK(out.files().empty());
}
