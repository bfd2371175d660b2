// SPDX-License-Identifier: Apache-2.0
// inspect, verify, stats and diff (ops/inspect.cpp, verify.cpp, stats.cpp, diff.cpp) into a
// string stream: what they report, checked against the fixtures' own contents.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>

#include "ckpt/checkpoint.hpp"
#include "ckpt/formats/safetensors.hpp"
#include "ckpt/open.hpp"
#include "ckpt/ops/inspect.hpp"
#include "ckpt/ops/merge.hpp"
#include "support/error_matchers.hpp"
#include "support/tensors.hpp"
#include "support/test_support.hpp"

using namespace fsdp_test;
using ckpt::ErrorKind;
using nlohmann::json;

namespace {

json json_of(const std::ostringstream& out) { return json::parse(out.str()); }

}  // namespace

TEST_CASE("inspect: the index as text and as JSON, every entry with its chunks", "[ckpt][inspect]") {
  const auto path = testdata("dcp/torch113_4rank");
  const ckpt::Checkpoint c = ckpt::open_checkpoint(path);
  std::ostringstream text;
  ckpt::inspect({path, ckpt::OutputFormat::kText, {}, false}, text);
  CHECK(text.str().find("world:     4") != std::string::npos);
  std::ostringstream js;
  ckpt::inspect({path, ckpt::OutputFormat::kJson, {}, false}, js);
  const json j = json_of(js);
  CHECK(j["format"] == "dcp");
  CHECK(j["world_size"] == 4);
  REQUIRE(j["entries"].size() == c.tensors.size() + c.objects.size());
  for (const ckpt::TensorEntry& t : c.tensors) {
    INFO(t.name);
    CHECK(text.str().find(t.name) != std::string::npos);
    const auto e = std::find_if(j["entries"].begin(), j["entries"].end(), [&](const json& x) { return x["name"] == t.name; });
    REQUIRE(e != j["entries"].end());
    CHECK((*e)["nbytes"] == t.nbytes());
    CHECK((*e)["chunks"].size() == t.chunks.size());
  }
  std::ostringstream none;
  REQUIRE_THROWS_MATCHES(ckpt::inspect({path, ckpt::OutputFormat::kText, "nothing.*", false}, none), ckpt::Error,
                         IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "nothing.*"));
}

TEST_CASE("verify: a sound checkpoint passes; a truncated one names every item past the end, at its offset", "[ckpt][verify]") {
  std::ostringstream ok;
  CHECK(ckpt::verify({testdata("dcp/torch113_2rank"), ckpt::VerifyDepth::kDeep, ckpt::OutputFormat::kJson}, ok));
  CHECK(json_of(ok)["ok"] == true);
  const ckpt::VerifyReport bad = ckpt::check_checkpoint({testdata("bad/dcp_truncated_distcp"), ckpt::VerifyDepth::kStructure, ckpt::OutputFormat::kText});
  REQUIRE(bad.problems.size() == 5);
  CHECK(bad.problems.front().offset == 6171u);
  CHECK(bad.problems.front().message.find("'model.head.weight' [6171, 7570) passes the end of the file (6487 bytes)") != std::string::npos);
  std::ostringstream text;
  CHECK_FALSE(ckpt::verify({testdata("bad/dcp_truncated_distcp"), ckpt::VerifyDepth::kStructure, ckpt::OutputFormat::kText}, text));
  CHECK(text.str().find("5 problems found") != std::string::npos);
}

TEST_CASE("stats: each tensor's min, max and mean are its elements'", "[ckpt][stats]") {
  const auto path = testdata("dcp/torch113_2rank");
  const ckpt::Checkpoint c = ckpt::open_checkpoint(path);
  const ckpt::ChunkReader reader(c);
  std::ostringstream out;
  ckpt::stats({path, "model.buffer.count", ckpt::OutputFormat::kJson, 1}, out);
  const json j = json_of(out);
  REQUIRE(j["tensors"].size() == 1);
  const ckpt::TensorEntry* t = c.find_tensor("model.buffer.count");
  REQUIRE(t);
  REQUIRE(t->dtype == ckpt::DType::kInt64);
  const std::vector<std::byte> bytes = whole_tensor(reader, *t);
  std::vector<std::int64_t> v(bytes.size() / 8);
  std::memcpy(v.data(), bytes.data(), bytes.size());
  double sum = 0;
  for (const std::int64_t x : v) sum += static_cast<double>(x);
  CHECK(j["tensors"][0]["min"] == static_cast<double>(*std::min_element(v.begin(), v.end())));
  CHECK(j["tensors"][0]["max"] == static_cast<double>(*std::max_element(v.begin(), v.end())));
  CHECK(std::abs(j["tensors"][0]["mean"].get<double>() - sum / static_cast<double>(v.size())) < 1e-12);
}

TEST_CASE("diff: a checkpoint equals its merge; a changed element is found, by how much", "[ckpt][diff]") {
  TestDir dir;
  const auto in = testdata("dcp/torch113_2rank");
  ckpt::MergeOptions mo;
  mo.format = ckpt::MergeFormat::kSafetensors;
  ckpt::merge(ckpt::open_checkpoint(in), dir / "m.safetensors", mo);
  std::ostringstream same;
  CHECK(ckpt::diff({in, dir / "m.safetensors", 0, 0, ckpt::OutputFormat::kJson, {}, false, {}, {}}, same));
  CHECK(json_of(same)["equal"] == true);
  // A float32 tensor's last element + 1.0.
  std::vector<std::byte> bytes = read_all(dir / "m.safetensors");
  const ckpt::SafetensorsFile f = ckpt::read_safetensors(ckpt::memory_source(bytes));
  const auto last = std::find_if(f.tensors.begin(), f.tensors.end(), [](const auto& t) { return t.dtype == ckpt::DType::kFloat32; });
  REQUIRE(last != f.tensors.end());
  float x = 0;
  std::memcpy(&x, bytes.data() + last->end - 4, 4);
  x += 1.0f;
  std::memcpy(bytes.data() + last->end - 4, &x, 4);
  {
    auto sink = ckpt::open_file_sink(dir / "m.safetensors", ckpt::Overwrite::kYes);
    sink->write(bytes);
    sink->commit();
  }
  std::ostringstream changed;
  CHECK_FALSE(ckpt::diff({in, dir / "m.safetensors", 0, 0, ckpt::OutputFormat::kJson, {}, false, {}, {}}, changed));
  const json j = json_of(changed);
  std::size_t differ = 0;
  for (const json& e : j["entries"]) {
    if (e["status"] == "equal") continue;
    ++differ;
    CHECK(e["name"] == last->name);  // A's "model." tensors by their names below it, as merge writes them
    CHECK(e["max_abs"] == Approx(1.0));
  }
  CHECK(differ == 1);
}
