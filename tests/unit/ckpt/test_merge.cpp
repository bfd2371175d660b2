// SPDX-License-Identifier: Apache-2.0
// merge (ops/merge.cpp), most of it into memory: what it writes is read back and compared with
// the input, tensor by tensor; the file output is held to the same bytes.
#include <catch2/catch.hpp>
#include <filesystem>

#include "ckpt/checkpoint.hpp"
#include "ckpt/formats/dcp.hpp"
#include "ckpt/formats/safetensors.hpp"
#include "ckpt/open.hpp"
#include "ckpt/ops/merge.hpp"
#include "ckpt/output.hpp"
#include "support/error_matchers.hpp"
#include "support/tensors.hpp"
#include "support/test_support.hpp"

using namespace fsdp_test;
using ckpt::DType;
using ckpt::ErrorKind;
namespace pk = ckpt::pickle;

TEST_CASE("merge into memory: safetensors of the model's tensors, each equal to the input's", "[ckpt][merge]") {
  const ckpt::Checkpoint in = ckpt::open_checkpoint(testdata("dcp/torch113_2rank"));
  const ckpt::ChunkReader reader(in);
  ckpt::MemoryOutput out("merged.safetensors");
  ckpt::MergeOptions o;
  o.format = ckpt::MergeFormat::kSafetensors;
  const ckpt::MergeResult r = ckpt::merge(in, out, o);
  REQUIRE(out.files().size() == 1);
  const ckpt::SafetensorsFile f = ckpt::read_safetensors(out.source());
  CHECK(r.files.size() == 1);
  CHECK(r.files[0].path == "merged.safetensors");
  CHECK(r.files[0].size == out.files().at("").size());
  std::size_t model = 0;
  for (const ckpt::TensorEntry& t : in.tensors) {
    if (!t.name.starts_with("model.")) continue;  // the top-level key "model" is what safetensors holds
    ++model;
    const auto st = std::find_if(f.tensors.begin(), f.tensors.end(), [&](const auto& x) { return x.name == t.name.substr(6); });
    INFO(t.name);
    REQUIRE(st != f.tensors.end());
    CHECK(st->dtype == t.dtype);
    CHECK(std::equal(st->shape.begin(), st->shape.end(), t.shape.data(), t.shape.data() + t.shape.size(),
                     [](std::uint64_t a, std::int64_t b) { return a == static_cast<std::uint64_t>(b); }));
    CHECK(f.data(*st)->read_vector(0, st->end - st->begin) == whole_tensor(reader, t));
  }
  CHECK(model > 0);
  CHECK(f.tensors.size() == model);
}

TEST_CASE("merge into memory: the bytes the file output holds, one file or a shard set", "[ckpt][merge]") {
  TestDir dir;
  const ckpt::Checkpoint in = ckpt::open_checkpoint(testdata("dcp/torch113_4rank"));
  SECTION("torch.save") {
    ckpt::MergeOptions o;
    ckpt::MemoryOutput out("full.pt");  // the archive's folder is named after the file, as torch.save names it
    ckpt::merge(in, out, o);
    ckpt::merge(in, dir.path() / "full.pt", o);
    CHECK(out.files().at("") == read_all(dir.path() / "full.pt"));
  }
  SECTION("safetensors shards") {
    ckpt::MergeOptions o;
    o.format = ckpt::MergeFormat::kSafetensors;
    o.max_shard_size = 100;
    ckpt::MemoryOutput out("shards");
    const ckpt::MergeResult r = ckpt::merge(in, out, o);
    ckpt::merge(in, dir.path() / "shards", o);
    std::size_t on_disk = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir.path() / "shards")) {
      ++on_disk;
      INFO(e.path());
      CHECK(out.files().at(e.path().filename().string()) == read_all(e.path()));
    }
    CHECK(out.files().size() == on_disk);
    CHECK(on_disk > 2);  // two shards or more, and the index
    CHECK(r.files.size() == on_disk);
    CHECK(out.files().count("model.safetensors.index.json") == 1);
  }
}

TEST_CASE("merge into memory: a failure leaves nothing committed", "[ckpt][merge]") {
  ckpt::Checkpoint in = ckpt::open_checkpoint(testdata("dcp/torch113_4rank"));
  // A tensor of the model whose items do not hold what the index says: found while copying.
  ckpt::TensorEntry* last = nullptr;
  for (ckpt::TensorEntry& t : in.tensors) {
    if (t.name.starts_with("model.") && (!last || t.position > last->position)) last = &t;
  }
  REQUIRE(last);
  last->dtype = DType::kFloat64;
  ckpt::MemoryOutput out;
  ckpt::MergeOptions o;
  o.format = ckpt::MergeFormat::kSafetensors;
  o.max_shard_size = 100;
  REQUIRE_THROWS_MATCHES(ckpt::merge(in, out, o), ckpt::Error, IsCkptError(ErrorKind::kMismatch, 0, "the metadata says float64"));
  CHECK(out.files().empty());
}

TEST_CASE("merge into memory: HDF5 is written to a file only", "[ckpt][merge]") {
  const ckpt::Checkpoint in = ckpt::open_checkpoint(testdata("dcp/torch113_2rank"));
  ckpt::MemoryOutput out;
  ckpt::MergeOptions o;
  o.format = ckpt::MergeFormat::kHdf5;
  REQUIRE_THROWS_MATCHES(ckpt::merge(in, out, o), ckpt::Error, IsCkptError(ErrorKind::kUnsupported, std::nullopt, ""));
  CHECK(out.files().empty());
}

TEST_CASE("merge refuses a planner_data path that indexes a list past every entry, in bounded memory", "[ckpt][merge]") {
  // torch grows a list with None up to the index; an index past the entries there are can only be
  // a hostile path (4,000,000,000 Nones would be 32 GB of nodes).
  TestDir dir;
  std::vector<ckpt::DcpWriteTensor> t{{"model.4000000000", DType::kFloat32, {1}, {{0, {0}, {1}, ckpt::memory_source(std::vector<std::byte>(4))}}, false}};
  ckpt::DcpWriteOptions opts;
  opts.planner_data.set("model.4000000000", pk::make_tuple({pk::make_str("model"), pk::make_int(4000000000)}));
  ckpt::write_dcp(dir.path() / "in", t, {}, opts);
  const ckpt::Checkpoint c = ckpt::open_checkpoint(dir.path() / "in");
  ckpt::MergeOptions mo;
  REQUIRE_THROWS_MATCHES(ckpt::merge(c, dir.path() / "out.pt", mo), ckpt::Error,
                         IsCkptError(ErrorKind::kFormat, std::nullopt, "indexes a list at 4000000000, past the 1 entries"));
  CHECK_FALSE(std::filesystem::exists(dir.path() / "out.pt"));
  // An index within the entries there are is torch's rule: the list grows to hold it.
  t[0].fqn = "model.0";
  ckpt::DcpWriteOptions ok;
  ok.planner_data.set("model.0", pk::make_tuple({pk::make_str("model"), pk::make_int(0)}));
  ckpt::write_dcp(dir.path() / "in0", t, {}, ok);
  const ckpt::MergeResult r = ckpt::merge(ckpt::open_checkpoint(dir.path() / "in0"), dir.path() / "out0.pt", mo);
  CHECK(r.files.size() == 1);
  CHECK(std::filesystem::exists(dir.path() / "out0.pt"));
}
