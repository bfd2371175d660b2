// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <fstream>
#include <set>
#include <thread>

#include "ckpt/checkpoint.hpp"
#include "ckpt/format.hpp"
#include "ckpt/formats/dcp.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "ckpt/open.hpp"
#include "ckpt/ops/inspect.hpp"
#include "ckpt/text.hpp"
#include "formats/dcp/metadata.hpp"
#include "support/error_matchers.hpp"
#include "support/test_support.hpp"

using namespace fsdp_test;
using ckpt::DType;
using ckpt::ErrorKind;
namespace pk = ckpt::pickle;

namespace {

// A 2-rank checkpoint: w [5, 3] float32 chunked on dim 0 (rows 0-2, 3-4), b [3] bf16 on rank 0,
// a 0-d step and a bytes item. Element i of w is i.
void write_sample(const std::filesystem::path& dir, ckpt::DcpLayout layout = ckpt::DcpLayout::kCurrent,
                  ckpt::DcpCompression compression = ckpt::DcpCompression::kNone) {
  std::vector<float> w(15);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i);
  auto bytes = [](const float* p, std::size_t n) {
    std::vector<std::byte> b(n * 4);
    std::memcpy(b.data(), p, b.size());
    return ckpt::memory_source(std::move(b));
  };
  std::vector<ckpt::DcpWriteTensor> t{
      {"model.w", DType::kFloat32, {5, 3}, {{0, {0, 0}, {3, 3}, bytes(w.data(), 9)}, {1, {3, 0}, {2, 3}, bytes(w.data() + 9, 6)}}, false},
      {"model.b", DType::kBFloat16, {3}, {{0, {0}, {3}, ckpt::memory_source(std::vector<std::byte>(6, std::byte{0x3f}))}}, false},
      {"optim.step", DType::kInt64, {}, {{1, {}, {}, ckpt::memory_source(std::vector<std::byte>(8, std::byte{0}))}}, false},
  };
  std::vector<ckpt::DcpWriteObject> o{{"epoch", pk::make_int(5), 1}};
  ckpt::DcpWriteOptions opts;
  opts.world_size = 2;
  opts.layout = layout;
  opts.compression = compression;
  ckpt::write_dcp(dir, t, o, opts);
}

// Rewrites .metadata after `edit` changed its tree.
void edit_metadata(const std::filesystem::path& dir, const std::function<void(pk::ValuePtr&)>& edit) {
  auto bytes = read_all(dir / ".metadata");
  auto root = pk::parse(bytes, ".metadata");
  edit(root);
  auto out = pk::write(*root, 4);
  std::ofstream(dir / ".metadata", std::ios::binary).write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(out.size()));
}

// The attribute `key` of the object `v` (its BUILD state dict).
pk::ValuePtr& field(const pk::ValuePtr& v, const std::string& key) {
  auto* o = std::get<std::unique_ptr<pk::Object>>(v->payload).get();
  for (auto& [k, x] : std::get<pk::Dict>(o->state->payload).items) {
    if (*k->str() == key) return x;
  }
  throw std::runtime_error("no field " + key);
}
pk::ValuePtr& first_value(const pk::ValuePtr& dict) { return std::get<pk::Dict>(dict->payload).items.front().second; }
pk::ValuePtr& first_key(const pk::ValuePtr& dict) { return std::get<pk::Dict>(dict->payload).items.front().first; }

// NOTE [The direct .metadata reader]: reads `dir`'s .metadata with the direct reader and, when it
// accepts, with the tree reader too, which must then succeed and give the same index. Returns
// whether the direct reader accepted; `stats`, what it did with the chunks.
// NOTE [The first pass beside the reader]: each reading is made with the first pass first, with
// guessing settled at the start, at a third, at two thirds and never, and on its own thread: all
// must accept or decline alike and give the same index. `stats`: the first-pass-first reading's.
bool direct_reader_agrees(const std::filesystem::path& dir, ckpt::detail::DirectReadStats* stats = nullptr) {
  using Options = ckpt::detail::DirectReadOptions;
  const auto bytes = read_all(dir / ".metadata");
  ckpt::Checkpoint direct;
  direct.root = dir;
  direct.format = ckpt::Format::kDcp;
  ckpt::Checkpoint tree = direct;
  const ckpt::Checkpoint blank = direct;
  INFO(dir.string());
  const bool accepted = ckpt::detail::read_dcp_metadata_direct(bytes, ".metadata", direct, {}, stats, Options{Options::FirstPass::kFirst});
  for (const Options o : {Options{Options::FirstPass::kAt, 0}, Options{Options::FirstPass::kAt, bytes.size() / 3},
                          Options{Options::FirstPass::kAt, 2 * bytes.size() / 3}, Options{Options::FirstPass::kAt, bytes.size() + 1},
                          Options{Options::FirstPass::kAuto}}) {
    INFO("settled at " << o.settle_at << (o.first_pass == Options::FirstPass::kAuto ? " (beside)" : ""));
    ckpt::Checkpoint again = blank;
    ckpt::detail::DirectReadStats s;
    CHECK(ckpt::detail::read_dcp_metadata_direct(bytes, ".metadata", again, {}, &s, o) == accepted);
    if (!accepted) continue;
    CHECK(ckpt::detail::index_difference(direct, again) == "");
    // NOTE [The builder beside the reader]: on its own thread, the first pass's thread took every
    // batch (unless a wrong guess made the reader read again, by itself); else the reader did.
    const bool beside = o.first_pass == Options::FirstPass::kAuto && std::thread::hardware_concurrency() > 1 && !s.reguessed;
    CHECK((s.batches > 0) == (!direct.tensors.empty() || !direct.objects.empty()));
    CHECK(s.batches_beside == (beside ? s.batches : 0));
  }
  if (!accepted) {
    CHECK(direct.tensors.empty());  // declining touches nothing
    return false;
  }
  REQUIRE_NOTHROW(ckpt::detail::read_dcp_metadata_tree(bytes, ".metadata", tree));
  CHECK(ckpt::detail::index_difference(direct, tree) == "");
  return true;
}

// Makes the MetadataIndex of entry `entry`'s (named `fqn`) second chunk share that chunk's offsets
// Size, as one process's save does: the pickler then writes a GET of it.
void share_offsets(const std::filesystem::path& dir, std::size_t entry, const std::string& fqn) {
  edit_metadata(dir, [&](pk::ValuePtr& root) {
    const auto& entries = std::get<pk::Dict>(field(root, "state_dict_metadata")->payload).items;
    pk::ValuePtr chunk = std::get<pk::List>(field(entries.at(entry).second, "chunks")->payload).items.at(1);
    for (auto& [index, info] : std::get<pk::Dict>(field(root, "storage_data")->payload).items) {
      if (*field(index, "fqn")->str() == fqn && pk::repr(*field(index, "offset")) == pk::repr(*field(chunk, "offsets"))) {
        field(index, "offset") = field(chunk, "offsets");
      }
    }
  });
}

// The guessing reading of `dir`'s .metadata, never settled: what it kept, and whether it read again.
ckpt::detail::DirectReadStats guessing(const std::filesystem::path& dir) {
  using Options = ckpt::detail::DirectReadOptions;
  const auto bytes = read_all(dir / ".metadata");
  ckpt::Checkpoint c;
  c.root = dir;
  c.format = ckpt::Format::kDcp;
  ckpt::detail::DirectReadStats stats;
  CHECK(ckpt::detail::read_dcp_metadata_direct(bytes, ".metadata", c, {}, &stats, Options{Options::FirstPass::kAt, bytes.size() + 1}));
  return stats;
}

// NOTE [Rank-local metadata]: `got` (merged from rank-local files) has `want`'s tensors, each with
// its dtype, shape and chunks (found by offsets, in any order) and, with `locations`, each chunk
// in the same file at the same offset and length; only the entries' order may differ.
void same_tensors(const ckpt::Checkpoint& got, const ckpt::Checkpoint& want, bool locations) {
  REQUIRE(got.tensors.size() == want.tensors.size());
  for (const auto& t : want.tensors) {
    INFO(t.name);
    const auto* m = got.find_tensor(t.name);
    REQUIRE(m);
    CHECK(m->dtype == t.dtype);
    CHECK(m->shape == t.shape);
    REQUIRE(m->chunks.size() == t.chunks.size());
    for (const auto& ch : t.chunks) {
      const auto it = std::find_if(m->chunks.begin(), m->chunks.end(), [&](const auto& x) { return x.offsets == ch.offsets; });
      REQUIRE(it != m->chunks.end());
      CHECK(it->sizes == ch.sizes);
      if (!locations) continue;
      REQUIRE(it->location);
      CHECK(got.files[it->location->file].relative == want.files[ch.location->file].relative);
      CHECK(it->location->offset == ch.location->offset);
      CHECK(it->location->length == ch.location->length);
    }
  }
}

// NOTE [Rank-local metadata]: `dir`'s .metadata split as use_collectives=False writes it: for each
// rank r, __{r}.metadata holds only the entries, chunks, storage_data items and planner_data whose
// storage is in r's __{r}_N.distcp files, each in a Metadata of its own; .metadata is removed.
// `also_in_1`: rank 1's file also gives rank 0's items (both ranks saved them whole).
void split_rank_local(const std::filesystem::path& dir, int ranks, bool also_in_1 = false) {
  const auto bytes = read_all(dir / ".metadata");
  for (int r = 0; r < ranks; ++r) {
    auto root = pk::parse(bytes, ".metadata");
    auto mine = [&](const pk::ValuePtr& info) {
      const std::string& path = *field(info, "relative_path")->str();
      return path.starts_with("__" + std::to_string(r) + "_") || (also_in_1 && r == 1 && path.starts_with("__0_"));
    };
    std::set<std::string> kept;  // fqn + offsets, of the items r keeps
    auto& storage = std::get<pk::Dict>(field(root, "storage_data")->payload).items;
    std::erase_if(storage, [&](const auto& kv) { return !mine(kv.second); });
    auto offset_of = [](const pk::ValuePtr& index) {  // a bytes item's MetadataIndex may give no offset
      const auto& fields = std::get<pk::Dict>(std::get<std::unique_ptr<pk::Object>>(index->payload)->state->payload).items;
      const auto it = std::find_if(fields.begin(), fields.end(), [](const auto& f) { return *f.first->str() == "offset"; });
      return it == fields.end() ? std::string("None") : pk::repr(*it->second);
    };
    for (const auto& [index, info] : storage) kept.insert(*field(index, "fqn")->str() + offset_of(index));
    auto& entries = std::get<pk::Dict>(field(root, "state_dict_metadata")->payload).items;
    std::erase_if(entries, [&](auto& kv) {
      const std::string& fqn = *kv.first->str();
      const auto* o = std::get<std::unique_ptr<pk::Object>>(kv.second->payload).get();
      const auto* state = o->state ? std::get_if<pk::Dict>(&o->state->payload) : nullptr;
      const bool tensor = state && std::any_of(state->items.begin(), state->items.end(), [](const auto& f) { return *f.first->str() == "chunks"; });
      if (!tensor) return !kept.count(fqn + "None");
      auto& chunks = std::get<pk::List>(field(kv.second, "chunks")->payload).items;
      std::erase_if(chunks, [&](const auto& ch) { return !kept.count(fqn + pk::repr(*field(ch, "offsets"))); });
      return chunks.empty();
    });
    auto& planner = std::get<pk::Dict>(field(root, "planner_data")->payload).items;
    std::erase_if(planner, [&](const auto& kv) {
      return std::none_of(entries.begin(), entries.end(), [&](const auto& e) { return *e.first->str() == *kv.first->str(); });
    });
    auto out = pk::write(*root, 4);
    std::ofstream(dir / ("__" + std::to_string(r) + ".metadata"), std::ios::binary)
        .write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(out.size()));
  }
  std::filesystem::remove(dir / ".metadata");
}

}  // namespace

TEST_CASE("DCP round trip: write_dcp then open_dcp, every chunk readable", "[ckpt][dcp]") {
  for (auto compression : {ckpt::DcpCompression::kNone, ckpt::DcpCompression::kZstd}) {
    TestDir dir;
    write_sample(dir.path(), ckpt::DcpLayout::kCurrent, compression);
    CHECK_FALSE(std::filesystem::exists(dir / ".metadata.tmp"));
    auto c = ckpt::open_dcp(dir.path());
    CHECK(c.format == ckpt::Format::kDcp);
    CHECK(c.world_size == 2);
    CHECK(c.writer == "torch >= 2.4, DCP version 1.0.0");
    REQUIRE(c.tensors.size() == 3);
    const auto* w = c.find_tensor("model.w");
    REQUIRE(w);
    REQUIRE(w->chunks.size() == 2);
    CHECK(w->chunks[1].offsets == std::vector<std::int64_t>{3, 0});
    CHECK(c.files[w->chunks[1].location->file].relative == "__1_0.distcp");
    ckpt::ChunkReader r(c);
    auto d = r.read(*w, w->chunks[1]);
    float v[6];
    d.storage->read_at(0, std::as_writable_bytes(std::span(v)));
    CHECK(v[0] == 9.0f);
    CHECK(v[5] == 14.0f);
    CHECK(c.planner_data.contains("model.w"));
    REQUIRE(c.objects.size() == 1);
    CHECK(pk::repr(*r.object_value(c.objects[0])) == "5");
    std::ostringstream report;
    CHECK(ckpt::verify({dir.path(), ckpt::VerifyDepth::kDeep, ckpt::OutputFormat::kText}, report));
  }
}

TEST_CASE("rank-local metadata: __N.metadata files read as one checkpoint", "[ckpt][dcp]") {
  TestDir whole_dir;
  write_sample(whole_dir.path());
  const ckpt::Checkpoint whole = ckpt::open_dcp(whole_dir.path());
  SECTION("each rank's own metadata") {
    TestDir dir;
    write_sample(dir.path());
    split_rank_local(dir.path(), 2);
    REQUIRE(std::filesystem::exists(dir / "__1.metadata"));
    CHECK(ckpt::detect_format(dir.path()) == ckpt::Format::kDcp);
    ckpt::Checkpoint c = ckpt::open_dcp(dir.path());
    CHECK(c.world_size == 2);
    CHECK(c.writer == whole.writer + ", rank-local metadata (2 files)");
    same_tensors(c, whole, /*locations=*/true);
    REQUIRE(c.objects.size() == 1);
    CHECK(c.objects[0].name == "epoch");
    CHECK(c.planner_data.size() == whole.planner_data.size());
    const ckpt::VerifyReport report = ckpt::check_checkpoint({dir.path(), ckpt::VerifyDepth::kDeep, ckpt::OutputFormat::kText});
    CHECK(report.ok());
    CHECK(report.items == 5);
  }
  SECTION("a chunk that two ranks saved is one chunk, the lowest rank's") {
    TestDir dir;
    write_sample(dir.path());
    split_rank_local(dir.path(), 2, /*also_in_1=*/true);
    const ckpt::Checkpoint c = ckpt::open_dcp(dir.path());
    REQUIRE(c.find_tensor("model.w"));
    CHECK(c.find_tensor("model.w")->chunks.size() == 2);
    CHECK(std::find(c.notes.begin(), c.notes.end(),
                    "2 chunks or items were saved by more than one rank (rank-local metadata); the lowest rank's copy is used") != c.notes.end());
    CHECK(ckpt::check_checkpoint({dir.path(), ckpt::VerifyDepth::kDeep, ckpt::OutputFormat::kText}).ok());
  }
  SECTION("a rank whose file is missing: an incomplete checkpoint") {
    TestDir dir;
    write_sample(dir.path());
    split_rank_local(dir.path(), 2);
    std::filesystem::rename(dir / "__1.metadata", dir / "__2.metadata");
    REQUIRE_THROWS_MATCHES(ckpt::open_dcp(dir.path()), ckpt::Error,
                           IsCkptError(ErrorKind::kFormat, std::nullopt, "did not finish its save (incomplete checkpoint)"));
    REQUIRE_THROWS_MATCHES(ckpt::open_checkpoint(dir.path()), ckpt::Error,
                           IsCkptError(ErrorKind::kFormat, std::nullopt, "__1.metadata"));
  }
  SECTION("ranks that disagree about a tensor") {
    TestDir dir;
    write_sample(dir.path());
    split_rank_local(dir.path(), 2);
    auto bytes = read_all(dir / "__1.metadata");
    auto root = pk::parse(bytes, "__1.metadata");
    for (auto& [k, v] : std::get<pk::Dict>(field(root, "state_dict_metadata")->payload).items) {
      if (*k->str() != "model.w") continue;
      // torch.Size((5, 3)): REDUCE of torch.Size with one tuple of ints.
      auto& args = std::get<pk::Tuple>(std::get<std::unique_ptr<pk::Object>>(field(v, "size")->payload)->args->payload).items;
      auto& dims = args.at(0)->payload;
      auto& items = std::holds_alternative<pk::Tuple>(dims) ? std::get<pk::Tuple>(dims).items : std::get<pk::List>(dims).items;
      items.at(0) = pk::make_int(6);
    }
    auto out = pk::write(*root, 4);
    std::ofstream(dir / "__1.metadata", std::ios::binary).write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(out.size()));
    REQUIRE_THROWS_MATCHES(ckpt::open_dcp(dir.path()), ckpt::Error,
                           IsCkptError(ErrorKind::kFormat, std::nullopt, "'model.w' is float32 [6, 3] here and float32 [5, 3] in a lower rank's metadata"));
  }
  SECTION(".metadata, when there is one, is the checkpoint") {
    TestDir dir;
    write_sample(dir.path());
    std::filesystem::copy_file(dir / ".metadata", dir / "__0.metadata");
    CHECK(ckpt::open_dcp(dir.path()).writer == whole.writer);
  }
}

TEST_CASE("write_dcp refuses chunks that do not tile the tensor, and an existing checkpoint", "[ckpt][dcp]") {
  TestDir dir;
  auto four = ckpt::memory_source(std::vector<std::byte>(4));
  ckpt::DcpWriteOptions o;
  o.world_size = 2;
  REQUIRE_THROWS_MATCHES(ckpt::write_dcp(dir.path(), {{"x", DType::kFloat32, {2}, {{0, {0}, {1}, four}}, false}}, {}, o), ckpt::Error,
                         IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "chunks cover 1 of 2 elements"));
  REQUIRE_THROWS_MATCHES(ckpt::write_dcp(dir.path(), {{"x", DType::kFloat32, {1}, {{0, {0}, {1}, four}, {1, {0}, {1}, four}}, false}}, {}, o),
                         ckpt::Error, IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "chunks overlap"));
  REQUIRE_THROWS_MATCHES(ckpt::write_dcp(dir.path(), {{"x", DType::kFloat32, {2}, {{0, {0}, {2}, four}}, false}}, {}, o), ckpt::Error,
                         IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "holds 4 bytes, its box needs 8"));
  REQUIRE_THROWS_MATCHES(ckpt::write_dcp(dir.path(), {{"x", DType::kFloat32, {1}, {{2, {0}, {1}, four}}, false}}, {}, o), ckpt::Error,
                         IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "chunk rank 2 is not in [0, 2)"));
  // One FQN twice, with other names between the two (the check sorts them).
  const ckpt::DcpWriteTensor x{"x", DType::kFloat32, {1}, {{0, {0}, {1}, four}}, false};
  REQUIRE_THROWS_MATCHES(ckpt::write_dcp(dir.path(), {x, {"y", DType::kFloat32, {1}, {{0, {0}, {1}, four}}, false}, x}, {}, o), ckpt::Error,
                         IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "FQN 'x' given twice"));
  write_sample(dir.path());
  REQUIRE_THROWS_MATCHES(write_sample(dir.path()), ckpt::Error, IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "holds a checkpoint already"));
}

TEST_CASE("committed fixtures: torch 1.13 from 2 and 4 Gloo ranks", "[ckpt][dcp]") {
  // testdata/README.md: written by testdata/gen/make_dcp_fixtures.py.
  REQUIRE(std::filesystem::file_size(testdata("dcp/torch113_2rank/.metadata")) == 2535);
  REQUIRE(std::filesystem::file_size(testdata("dcp/torch113_4rank/.metadata")) == 3606);
  auto c = ckpt::open_dcp(testdata("dcp/torch113_4rank"));
  CHECK(c.writer == "torch 1.13 (torch.distributed._shard.checkpoint)");
  CHECK(c.world_size == 4);
  CHECK(c.planner_data.empty());  // 1.13 has none
  const auto* proj = c.find_tensor("model.proj.weight");
  REQUIRE(proj);
  CHECK(proj->dtype == DType::kBFloat16);
  CHECK(proj->chunks.size() == 3);  // 3 rows over 4 ranks: rank 3 owns none
  const auto* head = c.find_tensor("model.head.weight");
  REQUIRE(head);
  CHECK(head->chunks[1].offsets == std::vector<std::int64_t>{0, 2});  // dim-1 chunks
  const auto* step = c.find_tensor("optim.state.embed.step");
  REQUIRE(step);
  CHECK(step->shape.empty());
  CHECK(step->chunks.size() == 1);
  std::ostringstream report;
  CHECK(ckpt::verify({testdata("dcp/torch113_4rank"), ckpt::VerifyDepth::kDeep, ckpt::OutputFormat::kText}, report));
}

TEST_CASE("real torch 2.4 Megatron torch_dist checkpoint", "[ckpt][dcp]") {
  const auto dir = shared_testdata_or_skip("LionRock-Research__Megatron-LM__simple-mcore-tp1-ckpt");
  auto c = ckpt::open_dcp(dir);
  CHECK(c.tensors.size() == 17);
  CHECK(c.objects.size() == 8);
  const auto* fc1 = c.find_tensor("decoder.layers.mlp.linear_fc1.weight");
  REQUIRE(fc1);
  CHECK(fc1->shape == std::vector<std::int64_t>{2, 48, 12});
  CHECK(fc1->chunks.size() == 2);
  CHECK(std::find(c.notes.begin(), c.notes.end(), "Metadata has extra attribute 'mcore_data'") != c.notes.end());
  ckpt::ChunkReader r(c);
  for (const auto& t : c.tensors)
    for (const auto& ch : t.chunks) CHECK_NOTHROW(r.read(t, ch));
}

namespace {

// A dataclass instance as CPython pickles it: NEWOBJ of the class, then BUILD with its fields.
pk::ValuePtr dataclass(const std::string& module, const std::string& name, std::vector<std::pair<std::string, pk::ValuePtr>> fields) {
  std::vector<std::pair<pk::ValuePtr, pk::ValuePtr>> state;
  for (auto& [k, v] : fields) state.emplace_back(pk::make_str(k), std::move(v));
  return pk::make_object(pk::make_global(module, name), pk::BuildOp::kNewObj, pk::make_tuple({}), pk::make_dict(std::move(state)));
}

// Adds attribute `key` to the object `v`'s BUILD state.
void add_field(const pk::ValuePtr& v, const std::string& key, pk::ValuePtr value) {
  auto* o = std::get<std::unique_ptr<pk::Object>>(v->payload).get();
  std::get<pk::Dict>(o->state->payload).items.emplace_back(pk::make_str(key), std::move(value));
}

// The save plans PyTorch 2.6+ may keep in .metadata (all_local_plans: SavePlan and WriteItem,
// field layout of torch/distributed/checkpoint/planner.py) and a Megatron-Core plan
// (megatron/core/dist_checkpointing/strategies/torch.py's MCoreSavePlan), at their real
// module paths, around a copy of a storage_data key.
void add_save_plans(pk::ValuePtr& root, const pk::ValuePtr& hostile = nullptr) {
  const std::string planner = "torch.distributed.checkpoint.planner";
  auto item = dataclass(planner, "WriteItem",
                        {{"index", first_key(field(root, "storage_data"))},
                         {"type", pk::make_object(pk::make_global(planner, "WriteItemType"), pk::BuildOp::kReduce, pk::make_tuple({pk::make_int(2)}))},
                         {"tensor_data", pk::make_none()}});
  auto plan = dataclass(planner, "SavePlan",
                        {{"items", pk::make_list({item})}, {"storage_data", pk::make_none()},
                         {"planner_data", hostile ? hostile : pk::make_none()}, {"usable", pk::make_bool(true)}});
  add_field(root, "all_local_plans", pk::make_list({plan}));
  add_field(root, "mcore_data", pk::make_dict({{pk::make_str("plan"), dataclass("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan",
                                                                              {{"items", pk::make_list({})}, {"mcore_data", pk::make_dict()}})},
                                               {pk::make_str("signal"), pk::make_object(pk::make_global("signal", "Signals"), pk::BuildOp::kReduce,
                                                                                        pk::make_tuple({pk::make_int(15)}))}}));
}

}  // namespace

TEST_CASE("DCP .metadata: save plans and Megatron's classes are opaque values, the checkpoint opens as before", "[ckpt][dcp]") {
  TestDir plain, planned;
  write_sample(plain.path());
  write_sample(planned.path());
  edit_metadata(planned.path(), [](auto& root) { add_save_plans(root); });
  const ckpt::Checkpoint want = ckpt::open_dcp(plain.path());
  const ckpt::Checkpoint c = ckpt::open_dcp(planned.path(), ckpt::MetaTrees::kKeep);
  REQUIRE(c.tensors.size() == want.tensors.size());
  for (std::size_t i = 0; i < c.tensors.size(); ++i) {
    CHECK(c.tensors[i].name == want.tensors[i].name);
    CHECK(c.tensors[i].chunks.size() == want.tensors[i].chunks.size());
  }
  CHECK(c.objects.size() == want.objects.size());
  const auto has_note = [&](const std::string& n) { return std::find(c.notes.begin(), c.notes.end(), n) != c.notes.end(); };
  CHECK(has_note("Metadata has extra attribute 'all_local_plans'"));
  CHECK(has_note("Metadata has extra attribute 'mcore_data'"));
  // --meta shows them by class, never built.
  const std::string tree = pk::repr(*c.meta_trees.front().second, 100000);
  CHECK(tree.find("torch.distributed.checkpoint.planner.SavePlan") != std::string::npos);
  CHECK(tree.find("signal.Signals") != std::string::npos);
  // The direct reader declines what it does not model, and the tree reader reads it.
  CHECK_FALSE(direct_reader_agrees(planned.path()));
  // Its tensors read as before.
  ckpt::ChunkReader reader(c);
  const auto& w = *c.find_tensor("model.w");
  CHECK(reader.read(w, w.chunks[1]).storage->read_vector(0, 4) == ckpt::ChunkReader(want).read(*want.find_tensor("model.w"), want.find_tensor("model.w")->chunks[1]).storage->read_vector(0, 4));
}

TEST_CASE("DCP .metadata: a plan that names code, or an opaque class where the index needs one, is refused with its offset", "[ckpt][dcp]") {
  TestDir dir;
  write_sample(dir.path());
  edit_metadata(dir.path(), [](auto& root) {
    add_save_plans(root, pk::make_object(pk::make_global("subprocess", "Popen"), pk::BuildOp::kReduce, pk::make_tuple({pk::make_str("ls")})));
  });
  REQUIRE_THROWS_MATCHES(ckpt::open_dcp(dir.path()), ckpt::Error, IsCkptError(ErrorKind::kFormat, kAnyOffset, "global 'subprocess.Popen' would run code"));
  TestDir info;
  write_sample(info.path());
  edit_metadata(info.path(), [](auto& root) {
    first_value(field(root, "storage_data")) = dataclass("megatron.core", "StorageInfo", {{"relative_path", pk::make_str("__0_0.distcp")}});
  });
  REQUIRE_THROWS_MATCHES(ckpt::open_dcp(info.path()), ckpt::Error, IsCkptError(ErrorKind::kFormat, kAnyOffset, "_StorageInfo"));
}

TEST_CASE("DCP .metadata corruption table", "[ckpt][dcp]") {
  struct Row {
    const char* defect;
    std::function<void(pk::ValuePtr&)> edit;
    const char* message;
  };
  const std::vector<Row> rows = {
      {"hostile global", [](auto& root) { field(root, "planner_data") = pk::make_object(pk::make_global("os", "system"), pk::BuildOp::kReduce, pk::make_tuple({pk::make_str("ls")})); },
       "global 'os.system' would run code when loaded"},
      {"eval", [](auto& root) { field(root, "version") = pk::make_global("builtins", "eval"); }, "global 'builtins.eval' would run code when loaded"},
      {"getattr of a special attribute",
       [](auto& root) { field(root, "version") = pk::make_object(pk::make_global("builtins", "getattr"), pk::BuildOp::kReduce,
                                                                 pk::make_tuple({pk::make_global("torch", "Size"), pk::make_str("__init__")})); },
       "getattr is only allowed to name an enum member"},
      {"path escape", [](auto& root) { field(first_value(field(root, "storage_data")), "relative_path") = pk::make_str("../outside"); },
       "relative_path '../outside' leaves the checkpoint directory"},
      {"absolute path", [](auto& root) { field(first_value(field(root, "storage_data")), "relative_path") = pk::make_str("/etc/passwd"); },
       "leaves the checkpoint directory"},
      {"unknown dtype", [](auto& root) {
         auto& props = field(first_value(field(root, "state_dict_metadata")), "properties");
         auto& state = std::get<std::unique_ptr<pk::Object>>(props->payload)->state;
         std::get<pk::Tuple>(state->payload).items[0] = pk::make_global("torch", "float128");
       },
       "dtype of 'model.w' is torch.float128, not a known torch dtype"},
      {"chunk past the tensor", [](auto& root) {
         auto& chunks = field(first_value(field(root, "state_dict_metadata")), "chunks");
         field(std::get<pk::List>(chunks->payload).items[1], "sizes") = pk::make_object(pk::make_global("torch", "Size"), pk::BuildOp::kReduce,
             pk::make_tuple({pk::make_tuple({pk::make_int(9), pk::make_int(3)})}));
       },
       "chunk of 'model.w' spans [3, 12) in dimension 0, past the tensor's size 5"},  // named, though read early (metadata_tree.cpp on_built)
      {"chunk rank", [](auto& root) {
         auto& chunks = field(first_value(field(root, "state_dict_metadata")), "chunks");
         field(std::get<pk::List>(chunks->payload).items[0], "offsets") = pk::make_object(pk::make_global("torch", "Size"), pk::BuildOp::kReduce,
             pk::make_tuple({pk::make_tuple({pk::make_int(0)})}));
       },
       "chunk of 'model.w' has 1-d offsets and 2-d sizes for a 2-d tensor"},
      {"negative length", [](auto& root) { field(first_value(field(root, "storage_data")), "length") = pk::make_int(-1); },
       "_StorageInfo.length is -1, expected a non-negative int"},
      {"not a Metadata", [](auto& root) { root = pk::make_dict(); }, "top-level object is a dict, expected a Metadata object"},
      {"key not a MetadataIndex", [](auto& root) { first_key(field(root, "storage_data")) = pk::make_str("x"); }, "expected a MetadataIndex"},
      {"storage item twice", [](auto& root) {
         auto& items = std::get<pk::Dict>(field(root, "storage_data")->payload).items;
         items.push_back(items.front());
       },
       "storage_data names an entry at the same offsets twice"},
      {"entry twice", [](auto& root) {
         auto& items = std::get<pk::Dict>(field(root, "state_dict_metadata")->payload).items;
         items.push_back(items.front());
       },
       "state_dict_metadata names 'model.w' twice"},
      {"tensor entry outside state_dict_metadata", [](auto& root) {
         field(root, "planner_data") = pk::make_dict({{pk::make_str("x"), first_value(field(root, "state_dict_metadata"))}});
       },
       "TensorStorageMetadata items are in two different dicts"},
  };
  for (const auto& row : rows) {
    SECTION(row.defect) {
      TestDir dir;
      write_sample(dir.path());
      edit_metadata(dir.path(), row.edit);
      // The offset is where the re-pickled tree puts the value: any, as long as it is named.
      REQUIRE_THROWS_MATCHES(ckpt::open_dcp(dir.path()), ckpt::Error, IsCkptError(ErrorKind::kFormat, kAnyOffset, row.message));
      CHECK_FALSE(direct_reader_agrees(dir.path()));  // the error is the tree reader's
      try {
        ckpt::open_dcp(dir.path());
      } catch (const ckpt::Error& e) {
        CHECK(e.source() == (dir / ".metadata").string());
      }
    }
  }
  SECTION("persistent ids are refused") {
    TestDir dir;
    write_sample(dir.path());
    edit_metadata(dir.path(), [](auto& root) { field(root, "version") = pk::make_persistent_id(pk::make_str("x")); });
    REQUIRE_THROWS_MATCHES(ckpt::open_dcp(dir.path()), ckpt::Error, IsCkptError(ErrorKind::kFormat, kAnyOffset, "persistent id (BINPERSID) is not allowed"));
  }
}

TEST_CASE("verify finds every problem: missing file, item past its end, a hole, an undecodable item", "[ckpt][dcp]") {
  TestDir dir;
  write_sample(dir.path());
  // A hole: drop w's second chunk from state_dict_metadata.
  edit_metadata(dir.path(), [](auto& root) {
    auto& chunks = field(first_value(field(root, "state_dict_metadata")), "chunks");
    std::get<pk::List>(chunks->payload).items.pop_back();
  });
  // A damaged item: the first bytes of rank 0's file.
  {
    std::fstream f(dir / "__0_0.distcp", std::ios::in | std::ios::out | std::ios::binary);
    f.write("XXXX", 4);
  }
  std::ostringstream report;
  CHECK_FALSE(ckpt::verify({dir.path(), ckpt::VerifyDepth::kStructure, ckpt::OutputFormat::kText}, report));
  const std::string text = report.str();
  CHECK(text.find("chunks of 'model.w' cover 9 of its 15 elements (a hole)") != std::string::npos);
  CHECK(text.find("storage_data entries belong to no chunk") != std::string::npos);
  CHECK(text.find("not a torch.save file") != std::string::npos);
  std::filesystem::remove(dir / "__1_0.distcp");
  std::ostringstream again;
  CHECK_FALSE(ckpt::verify({dir.path(), ckpt::VerifyDepth::kStructure, ckpt::OutputFormat::kText}, again));
  CHECK(again.str().find("file is missing") != std::string::npos);
}

TEST_CASE("an item whose dtype disagrees with the metadata is a mismatch", "[ckpt][dcp]") {
  TestDir dir;
  write_sample(dir.path());
  edit_metadata(dir.path(), [](auto& root) {
    auto& props = field(first_value(field(root, "state_dict_metadata")), "properties");
    auto& state = std::get<std::unique_ptr<pk::Object>>(props->payload)->state;
    std::get<pk::Tuple>(state->payload).items[0] = pk::make_global("torch", "int32");
  });
  auto c = ckpt::open_dcp(dir.path());
  ckpt::ChunkReader r(c);
  REQUIRE_THROWS_MATCHES(r.read(c.tensors[0], c.tensors[0].chunks[0]), ckpt::Error,
                         IsCkptError(ErrorKind::kMismatch, 0, "item of 'model.w' is float32, the metadata says int32"));
}

TEST_CASE("a DCP directory with Lightning's meta.pt", "[ckpt][dcp]") {
  TestDir dir;
  write_sample(dir.path());
  {
    ckpt::TorchSaveBuilder b;
    auto sink = ckpt::open_file_sink(dir / "meta.pt", ckpt::Overwrite::kNo);
    b.write(*sink, *pk::make_dict({{pk::make_str("epoch"), pk::make_int(2)}, {pk::make_str("global_step"), pk::make_int(40)}}));
    sink->commit();
  }
  auto c = ckpt::open_checkpoint(dir.path());
  CHECK(c.format == ckpt::Format::kLightningSharded);
  CHECK(c.metadata == std::vector<std::pair<std::string, std::string>>{{"epoch", "2"}, {"global_step", "40"}});
  CHECK(c.files.back().relative == "meta.pt");
  REQUIRE(c.meta_trees.size() == 1);
  CHECK(c.meta_trees[0].first == "meta.pt");
}

namespace {
// Everything open_dcp indexes, one line per chunk or object, for comparing two readings.
std::string index_of(const ckpt::Checkpoint& c) {
  std::string out;
  for (const auto& t : c.tensors) {
    for (const auto& ch : t.chunks) {
      out += t.name + " @" + std::to_string(t.position) + " [";
      for (auto o : ch.offsets) out += std::to_string(o) + ",";
      out += "] ";
      if (ch.location) out += c.files[ch.location->file].relative + ":" + std::to_string(ch.location->offset) + "+" + std::to_string(ch.location->length);
      out += "\n";
    }
  }
  for (const auto& o : c.objects) {
    out += o.name + " @" + std::to_string(o.position) + " " + (o.item ? std::to_string(o.item->offset) : "-") + "\n";
  }
  for (const auto& u : c.unreferenced_storage) out += "unreferenced " + u + "\n";
  return out;
}
}  // namespace

TEST_CASE("streamed .metadata: the index is the same in either dict order and with the tree kept", "[ckpt][dcp]") {
  TestDir dir;
  write_sample(dir.path());
  const std::string expected = index_of(ckpt::open_dcp(dir.path(), ckpt::MetaTrees::kKeep));
  CHECK(index_of(ckpt::open_dcp(dir.path())) == expected);
  CHECK(expected.find("model.w @0 [3,0,] __1_0.distcp:") != std::string::npos);
  // storage_data before state_dict_metadata (no writer does this, the format allows it): every
  // item is met before its chunk and placed at the end.
  edit_metadata(dir.path(), [](pk::ValuePtr& root) {
    auto* o = std::get<std::unique_ptr<pk::Object>>(root->payload).get();
    auto& items = std::get<pk::Dict>(o->state->payload).items;
    std::stable_partition(items.begin(), items.end(), [](const auto& kv) { return *kv.first->str() == "storage_data"; });
  });
  CHECK(index_of(ckpt::open_dcp(dir.path())) == expected);
  CHECK(direct_reader_agrees(dir.path()));
  // An item that belongs to no chunk is reported, in both readings.
  edit_metadata(dir.path(), [](pk::ValuePtr& root) {
    auto& items = std::get<pk::Dict>(field(root, "state_dict_metadata")->payload).items;
    items.erase(items.begin());
  });
  const std::string dropped = index_of(ckpt::open_dcp(dir.path()));
  CHECK(dropped == index_of(ckpt::open_dcp(dir.path(), ckpt::MetaTrees::kKeep)));
  CHECK(dropped.find("unreferenced model.w") != std::string::npos);
  CHECK(direct_reader_agrees(dir.path()));
}

TEST_CASE("the direct .metadata reader reads what the tree reader reads, or declines", "[ckpt][dcp]") {
  SECTION("what write_dcp writes, each layout, compressed or not, with planner_data") {
    for (auto layout : {ckpt::DcpLayout::kCurrent, ckpt::DcpLayout::kTorch113}) {
      for (auto compression : {ckpt::DcpCompression::kNone, ckpt::DcpCompression::kZstd}) {
        TestDir dir;
        write_sample(dir.path(), layout, compression);
        CHECK(direct_reader_agrees(dir.path()));
      }
    }
    TestDir dir;
    write_sample(dir.path());
    const auto c = ckpt::open_dcp(dir.path());
    CHECK_FALSE(c.planner_data.empty());
    CHECK(c.find_tensor("model.w")->chunks[1].location.has_value());
  }
  SECTION("many entries: planner_data made into trees as it comes, a chunk list in two batches") {
    TestDir dir;
    std::vector<ckpt::DcpWriteTensor> t;
    auto four_bytes = [] { return ckpt::memory_source(std::vector<std::byte>(4)); };
    for (int i = 0; i < 1500; ++i) {
      t.push_back({"model.layers." + std::to_string(i) + ".w", DType::kFloat32, {1}, {{i % 2, {0}, {1}, four_bytes()}}, false});
    }
    // 1,200 one-element chunks: CPython's pickler appends them 1,000 at a time.
    ckpt::DcpWriteTensor big{"model.big", DType::kFloat32, {1200}, {}, false};
    for (int k = 0; k < 1200; ++k) big.chunks.push_back({k % 2, {k}, {1}, four_bytes()});
    t.push_back(std::move(big));
    ckpt::DcpWriteOptions opts;
    opts.world_size = 2;
    opts.planner_data.set("model.layers.7.w", pk::make_tuple({pk::make_str("model"), pk::make_str("layers"), pk::make_int(7), pk::make_str("w")}));
    ckpt::write_dcp(dir.path(), t, {}, opts);
    CHECK(direct_reader_agrees(dir.path()));
    const auto c = ckpt::open_dcp(dir.path());
    CHECK(c.planner_data.size() == 1501);
    CHECK(pk::repr(*c.planner_data.find("model.layers.7.w")) == "('model', 'layers', 7, 'w')");
    CHECK(c.find_tensor("model.big")->chunks.size() == 1200);
    CHECK(c.find_tensor("model.big")->chunks[1199].location.has_value());
  }
  SECTION("what torch 1.13 wrote: chunks read at a glance but the first and the 0-d one") {
    // The first chunk names its class and field names (STACK_GLOBAL, strs) where later ones GET
    // them; optim.state.embed.step is 0-d.
    for (const char* name : {"dcp/torch113_2rank", "dcp/torch113_4rank"}) {
      ckpt::detail::DirectReadStats stats;
      CHECK(direct_reader_agrees(testdata(name), &stats));
      CHECK(stats.chunks_at_a_glance >= 9);
      CHECK(stats.chunks_by_opcode == 2);
      // storage_data's objects but the first pair and the MetadataIndex of the 0-d step
      CHECK(stats.objects_at_a_glance == 2 * (stats.chunks_at_a_glance + stats.chunks_by_opcode + 2) - 3);
      // Guessed to the end: right (no second reading), with every str, global and memory format kept.
      const auto guessed = guessing(testdata(name));
      CHECK_FALSE(guessed.reguessed);
      CHECK(guessed.guessed > 50);
    }
  }
  SECTION("chunks read at a glance where the pickle has the common shape, opcode by opcode elsewhere") {
    // NOTE [A chunk at a glance]: 1-d to 3-d chunks have it; 0-d and 4-d chunks do not, and a
    // chunk whose offsets a MetadataIndex shares (a GET of a memo index the chunk made) may not.
    TestDir dir;
    auto bytes_of = [](std::size_t n) { return ckpt::memory_source(std::vector<std::byte>(n)); };
    std::vector<ckpt::DcpWriteTensor> t;
    t.push_back({"model.a", DType::kFloat32, {600}, {{0, {0}, {300}, bytes_of(1200)}, {1, {300}, {300}, bytes_of(1200)}}, false});
    t.push_back({"model.b", DType::kFloat32, {2, 3, 70000}, {{0, {0, 0, 0}, {1, 3, 70000}, bytes_of(840000)}, {1, {1, 0, 0}, {1, 3, 70000}, bytes_of(840000)}}, false});
    t.push_back({"model.c", DType::kFloat32, {}, {{0, {}, {}, bytes_of(4)}}, false});
    t.push_back({"model.d", DType::kFloat32, {2, 1, 1, 1}, {{0, {0, 0, 0, 0}, {1, 1, 1, 1}, bytes_of(4)}, {1, {1, 0, 0, 0}, {1, 1, 1, 1}, bytes_of(4)}}, false});
    ckpt::DcpWriteOptions opts;
    opts.world_size = 2;
    ckpt::write_dcp(dir.path(), t, {}, opts);
    ckpt::detail::DirectReadStats stats;
    CHECK(direct_reader_agrees(dir.path(), &stats));
    // At a glance: model.a's second chunk (BININT2 ints) and model.b's (BININT1, BININT). By opcode:
    // model.a's first (the class and field names first appear there), model.c's and model.d's.
    CHECK(stats.chunks_at_a_glance == 3);
    CHECK(stats.chunks_by_opcode == 4);
    // NOTE [An object at a glance]: storage_data's 14 objects but the first pair (which names the
    // classes and fields) and the MetadataIndex of model.c (0-d offsets) and of model.d (4-d).
    CHECK(stats.objects_at_a_glance == 9);
    // model.a's second offsets shared with its MetadataIndex: the pickler GETs the chunk's Size.
    share_offsets(dir.path(), 0, "model.a");
    stats = {};
    CHECK(direct_reader_agrees(dir.path(), &stats));
    CHECK(stats.chunks_at_a_glance == 2);
    CHECK(stats.chunks_by_opcode == 5);
    CHECK(stats.objects_at_a_glance == 9);  // the shared Size is a GET, which a glance takes
    // Guessing keeps no Size (it needs the arena): the GET of it is a wrong guess, read again.
    CHECK(guessing(dir.path()).reguessed);
    // The same for a Size made opcode by opcode (model.d's 4-d offsets).
    TestDir four;
    ckpt::write_dcp(four.path(), t, {}, opts);
    share_offsets(four.path(), 3, "model.d");
    CHECK(direct_reader_agrees(four.path()));
    CHECK(guessing(four.path()).reguessed);
    // A negative offset (a BININT) in a chunk of the common shape: refused by the tree reader,
    // declined by the direct one.
    edit_metadata(dir.path(), [](pk::ValuePtr& root) {
      pk::ValuePtr chunk = std::get<pk::List>(field(std::get<pk::Dict>(field(root, "state_dict_metadata")->payload).items.at(1).second, "chunks")->payload).items.at(1);
      field(chunk, "offsets") = pk::make_object(pk::make_global("torch", "Size"), pk::BuildOp::kReduce, pk::make_tuple({pk::make_tuple({pk::make_int(-1), pk::make_int(0), pk::make_int(0)})}));
    });
    CHECK_THROWS_AS(ckpt::open_dcp(dir.path()), ckpt::Error);
    CHECK_FALSE(direct_reader_agrees(dir.path()));
    // The same in a MetadataIndex's offset (an object read at a glance otherwise).
    TestDir index;
    ckpt::write_dcp(index.path(), t, {}, opts);
    edit_metadata(index.path(), [](pk::ValuePtr& root) {
      for (auto& [key, info] : std::get<pk::Dict>(field(root, "storage_data")->payload).items) {
        if (*field(key, "fqn")->str() == "model.b") field(key, "offset") = pk::make_object(pk::make_global("torch", "Size"), pk::BuildOp::kReduce, pk::make_tuple({pk::make_tuple({pk::make_int(-1), pk::make_int(0), pk::make_int(0)})}));
      }
    });
    CHECK_THROWS_AS(ckpt::open_dcp(index.path()), ckpt::Error);
    CHECK_FALSE(direct_reader_agrees(index.path()));
  }
  SECTION("the hostile and broken corpus: declined, or read alike when only the data files are bad") {
    int declined = 0, agreed = 0;
    for (const auto& e : std::filesystem::directory_iterator(testdata("bad"))) {
      if (!std::filesystem::exists(e.path() / ".metadata")) continue;
      (direct_reader_agrees(e.path()) ? agreed : declined)++;
    }
    CHECK(declined >= 10);  // every .metadata the tree reader refuses (the corpus has more than ten)
    CHECK(agreed >= 1);
  }
  SECTION("a Metadata that is not a plain dataclass state, or a memo GET of a dict, is left to the tree reader") {
    TestDir dir;
    write_sample(dir.path());
    // Megatron's subclass from another module: the tree reader notes it, the direct reader declines.
    edit_metadata(dir.path(), [](pk::ValuePtr& root) {
      std::get<std::unique_ptr<pk::Object>>(root->payload)->callable = pk::make_global("megatron.core.dist_checkpointing", "Metadata");
    });
    CHECK_FALSE(direct_reader_agrees(dir.path()));
    CHECK(ckpt::open_dcp(dir.path()).notes.front().find("subclass") != std::string::npos);
    // One dict object under two fields: the pickler writes the second as a GET.
    TestDir shared;
    write_sample(shared.path());
    edit_metadata(shared.path(), [](pk::ValuePtr& root) { field(root, "planner_data") = pk::make_dict(); field(root, "version") = field(root, "planner_data"); });
    CHECK_FALSE(direct_reader_agrees(shared.path()));
    CHECK_NOTHROW(ckpt::open_dcp(shared.path()));
    // A dict of 1,000 key paths (planner_data's shape, which the direct reader turns into trees as
    // it comes) where state_dict_metadata belongs: the tree reader refuses it, the direct declines.
    TestDir paths;
    write_sample(paths.path());
    edit_metadata(paths.path(), [](pk::ValuePtr& root) {
      std::vector<std::pair<pk::ValuePtr, pk::ValuePtr>> items;
      for (int i = 0; i < 1000; ++i) items.emplace_back(pk::make_str("k" + std::to_string(i)), pk::make_tuple({pk::make_str("k")}));
      field(root, "state_dict_metadata") = pk::make_dict(std::move(items));
    });
    CHECK_THROWS_AS(ckpt::open_dcp(paths.path()), ckpt::Error);
    CHECK_FALSE(direct_reader_agrees(paths.path()));
  }
}

TEST_CASE("real PyTorch 2.11 dcp.save checkpoints (testdata/dcp/torch2): both readers agree, rank-local read as one", "[ckpt][dcp]") {
  for (const char* name : {"torch2_world1", "torch2_world2"}) {
    INFO(name);
    CHECK(direct_reader_agrees(testdata(std::string("dcp/torch2/") + name)));
  }
  // The same model saved by 2 ranks with and without collectives: the same index, less a note.
  ckpt::Checkpoint local = ckpt::open_dcp(testdata("dcp/torch2/torch2_world2_rank_local"));
  const ckpt::Checkpoint global = ckpt::open_dcp(testdata("dcp/torch2/torch2_world2"));
  CHECK(local.writer == global.writer + ", rank-local metadata (2 files)");
  same_tensors(local, global, /*locations=*/false);  // the files differ: each rank wrote its own
  CHECK(local.objects.size() == 1);  // "epoch", which both ranks saved
  CHECK(std::find(local.notes.begin(), local.notes.end(),
                  "1 chunks or items were saved by more than one rank (rank-local metadata); the lowest rank's copy is used") != local.notes.end());
}

TEST_CASE("real torch 2.4 Megatron .metadata: the direct reader reads it as the tree reader does", "[ckpt][dcp]") {
  const auto dir = shared_testdata_or_skip("LionRock-Research__Megatron-LM__simple-mcore-tp1-ckpt");
  // torch 2.4's own layout: StorageMeta with a pathlib.PosixPath checkpoint_id, BytesStorageMetadata
  // entries, and Megatron's extra mcore_data attribute (noted alike by both readers).
  CHECK(direct_reader_agrees(dir));
}

TEST_CASE("escape_name escapes control characters and bytes that are not UTF-8", "[ckpt][inspect]") {
  CHECK(ckpt::escape_name("model.0.weight") == "model.0.weight");
  CHECK(ckpt::escape_name("a\nb\\c\x1b[2J") == "a\\nb\\\\c\\x1b[2J");
  CHECK(ckpt::escape_name("\xc3\xa9t\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80") == "\xc3\xa9t\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");  // é, €, an emoji
  CHECK(ckpt::escape_name("float3\xa9") == "float3\\xa9");          // a lone continuation byte
  CHECK(ckpt::escape_name("\xc3") == "\\xc3");                      // cut short
  CHECK(ckpt::escape_name("\xc0\xaf") == "\\xc0\\xaf");             // overlong '/'
  CHECK(ckpt::escape_name("\xed\xa0\x80") == "\\xed\\xa0\\x80");    // a surrogate
  CHECK(ckpt::escape_name("\xf5\x80\x80\x80") == "\\xf5\\x80\\x80\\x80");  // past U+10FFFF
  CHECK(ckpt::escape_name("\x7f") == "\\x7f");
}

TEST_CASE("hostile .metadata: entries built inside storage_data do not stand in for real ones", "[ckpt][dcp]") {
  // storage_data first, each _StorageInfo carrying a list holding a TensorStorageMetadata (ints
  // doubled): those are made into entries, then dropped with their storage items before
  // state_dict_metadata is parsed; the real entries must be read as they are. (Whether a freed
  // token's address comes back for a real one depends on the allocator: the reader holds each
  // token until it is claimed, so that it cannot, which this case does not force.)
  TestDir dir;
  write_sample(dir.path());
  const auto clean = ckpt::open_dcp(dir.path());
  edit_metadata(dir.path(), [](pk::ValuePtr& root) {
    const pk::ValuePtr tsm = first_value(field(root, "state_dict_metadata"));
    for (auto& [k, info] : std::get<pk::Dict>(field(root, "storage_data")->payload).items) {
      auto doubled = pk::rebuild(tsm, [](const pk::Value& v) -> pk::ValuePtr {
        if (auto i = v.int64(); i && v.is<pk::Int>()) return pk::make_int(*i * 2);
        return nullptr;
      });
      std::get<pk::Dict>(std::get<std::unique_ptr<pk::Object>>(info->payload)->state->payload).items.emplace_back(pk::make_str("extra"), pk::make_list({doubled}));  // in a list: not a dict item
    }
    auto& state = std::get<pk::Dict>(std::get<std::unique_ptr<pk::Object>>(root->payload)->state->payload).items;
    std::stable_partition(state.begin(), state.end(), [](const auto& kv) { return *kv.first->str() == "storage_data"; });
  });
  const auto c = ckpt::open_dcp(dir.path());
  REQUIRE(c.tensors.size() == clean.tensors.size());
  for (std::size_t i = 0; i < c.tensors.size(); ++i) {
    CHECK(c.tensors[i].name == clean.tensors[i].name);
    CHECK(c.tensors[i].shape == clean.tensors[i].shape);
    REQUIRE(c.tensors[i].chunks.size() == clean.tensors[i].chunks.size());
    for (std::size_t k = 0; k < c.tensors[i].chunks.size(); ++k) {
      CHECK(c.tensors[i].chunks[k].sizes == clean.tensors[i].chunks[k].sizes);
      CHECK(c.tensors[i].chunks[k].location.has_value());
    }
  }
}
