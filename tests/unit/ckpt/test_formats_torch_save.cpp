// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <cstring>
#include <fstream>

#include "ckpt/checkpoint.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "ckpt/open.hpp"
#include "ckpt/ops/inspect.hpp"
#include "support/error_matchers.hpp"
#include "support/test_support.hpp"
#include "zip/crc32.hpp"
#include "zip/zip_writer.hpp"

using namespace fsdp_test;
using ckpt::DType;
using ckpt::ErrorKind;
namespace pk = ckpt::pickle;

namespace {

std::vector<std::byte> build_sample() {
  ckpt::TorchSaveBuilder b;
  std::vector<std::byte> f32(6 * 4), bf(2 * 2), f8(4);
  for (std::size_t i = 0; i < f32.size(); ++i) f32[i] = static_cast<std::byte>(i);
  const auto s0 = b.add_storage(DType::kFloat32, ckpt::memory_source(f32));
  const auto s1 = b.add_storage(DType::kBFloat16, ckpt::memory_source(bf));
  const auto s2 = b.add_storage(DType::kFloat8E4M3FN, ckpt::memory_source(f8));
  auto root = pk::make_dict({{pk::make_str("w"), b.parameter(b.tensor(s0, {2, 3}))},
                             {pk::make_str("wt"), b.tensor(s0, {3, 2}, {1, 3}, 0)},
                             {pk::make_str("tail"), b.tensor(s0, {2}, {1}, 4)},
                             {pk::make_str("b"), b.tensor(s1, {2})},
                             {pk::make_str("f8"), b.tensor(s2, {4})},
                             {pk::make_str("list"), pk::make_list({b.tensor(s1, {})})},
                             {pk::make_str("step"), pk::make_int(3)}});
  ckpt::MemorySink sink("mem.pt");
  b.write(sink, *root);
  return sink.take();
}

}  // namespace

TEST_CASE("torch.save round trip in memory", "[ckpt][torch_save]") {
  auto f = ckpt::read_torch_save(ckpt::memory_source(build_sample(), "mem.pt"));
  CHECK(f.archive_name == "archive");
  CHECK(f.version == 3);
  CHECK(f.records == std::vector<std::string>{"data.pkl", ".format_version", ".storage_alignment", "byteorder",
                                              "data/0", "data/1", "data/2", "version"});
  REQUIRE(f.tensors.size() == 6);
  CHECK(f.storages.size() == 3);
  const auto& w = f.tensors[0];
  CHECK(w.name == "w");
  CHECK(w.is_parameter);
  CHECK(w.requires_grad);
  CHECK(w.shape == std::vector<std::int64_t>{2, 3});
  CHECK(w.is_contiguous());
  CHECK(f.tensors[1].name == "wt");
  CHECK_FALSE(f.tensors[1].is_contiguous());
  CHECK(f.tensors[1].storage == w.storage);
  CHECK(f.tensors[2].storage_offset == 4);
  CHECK(f.tensors[4].dtype == DType::kFloat8E4M3FN);  // _rebuild_tensor_v3 + UntypedStorage
  CHECK(f.tensors[5].name == "list.0");
  CHECK(f.tensors[5].shape.empty());
  CHECK(f.storages[0].data->read_vector(4, 2) == std::vector<std::byte>{std::byte{4}, std::byte{5}});
  CHECK(f.storages[0].data->name() == "mem.pt[archive/data/0]");
}

TEST_CASE("committed fixture: torch 1.13's worked example", "[ckpt][torch_save]") {
  // testdata/README.md: tiny_state_dict.pt, 1743 bytes, written by testdata/gen/make_fixtures.py.
  const auto bytes = read_all(testdata("torch_save/tiny_state_dict.pt"));
  REQUIRE(bytes.size() == 1743);
  REQUIRE(ckpt::detail::crc32_update(0, bytes) == 0xb33919abu);
  auto f = ckpt::read_torch_save(ckpt::open_file(testdata("torch_save/tiny_state_dict.pt")));
  CHECK(f.archive_name == "tiny_state_dict");
  CHECK(f.records == std::vector<std::string>{"data.pkl", "data/0", "data/1", "data/2", "data/3", "version"});
  REQUIRE(f.tensors.size() == 5);
  CHECK(f.tensors[0].name == "model.w");
  CHECK(f.tensors[1].dtype == DType::kBFloat16);
  CHECK(f.storages[1].data->read_vector(0, 4) == std::vector<std::byte>{std::byte{0xc0}, std::byte{0x3f}, std::byte{0x00}, std::byte{0xc0}});
  CHECK(f.tensors[3].name == "model.view");
  CHECK(f.tensors[3].storage == f.tensors[2].storage);
  CHECK(f.tensors[3].storage_offset == 1);
  CHECK(f.tensors[4].name == "p");
  CHECK(f.tensors[4].is_parameter);
}

TEST_CASE("torch.save corruption table", "[ckpt][torch_save]") {
  const auto good = build_sample();
  const std::size_t pkl_at = 64;  // data.pkl's payload, first record
  // Where each error must point: a record's first data byte (docs/formats/torch_save.md#member-layout:
  // the header, the name, a 4-byte padding field, then up to the next multiple of 64), the end
  // record, or the opcode in data.pkl (offsets inside data.pkl count from its first byte).
  const auto in_good = [&](const std::string& text, std::size_t from = 0) { return find(good, text, from); };
  const auto data_of = [&](const std::string& record) { return (in_good(record) + record.size() + 4 + 63) / 64 * 64; };
  const std::size_t end_record = in_good(std::string("PK\x05\x06", 4));
  const std::size_t key7 = in_good(std::string("X\x01\x00\x00\x00" "1", 6), pkl_at);  // the second storage's key
  const std::size_t view = in_good("K\x04K\x02\x85", pkl_at);                           // a view's sizes
  const std::vector<PatchRow> rows = {
      {"not a zip", [](auto& b) { b[0] = std::byte{'X'}; }, ErrorKind::kFormat, 0, "not a torch.save file"},
      {"a pickle of another thing", [](auto& b) { b.assign({std::byte{0x80}, std::byte{2}, std::byte{'N'}, std::byte{'.'}}); },
       ErrorKind::kFormat, 0, "this is a pickle of a None, not a torch.save file"},
      {"no version record", [](auto& b) { auto at = find(b, "archive/version", 200); b[at + 8] = std::byte{'X'}; b[find(b, "archive/version", at + 1) + 8] = std::byte{'X'}; },
       ErrorKind::kFormat, end_record, "no 'archive/version' record"},
      {"bad version", [](auto& b) { auto at = find(b, "3\n", find(b, "archive/version")); b[at] = std::byte{'x'}; }, ErrorKind::kFormat,
       data_of("archive/version"), "is not an integer in [1, 10]"},
      {"big endian", [](auto& b) { auto at = find(b, "little"); std::memcpy(&b[at], "big   ", 6); }, ErrorKind::kUnsupported,
       in_good("little"), "big-endian storages"},
      {"unknown byteorder", [](auto& b) { auto at = find(b, "little"); std::memcpy(&b[at], "middle", 6); }, ErrorKind::kFormat,
       in_good("little"), "byteorder record is 'middle'"},
      {"storage key without record", [&](auto& b) { b[find(b, std::string("X\x01\x00\x00\x00" "1", 6), pkl_at) + 5] = std::byte{'7'}; },
       ErrorKind::kFormat, in_good("Q", key7) - pkl_at, "storage '7' has no record 'archive/data/7'"},  // its BINPERSID
      {"record size disagrees with numel", [&](auto& b) { b[find(b, "K\x06t", pkl_at) + 1] = std::byte{5}; },
       ErrorKind::kFormat, data_of("archive/data/0"), "holds 24 bytes, but its storage is 5 float32 elements"},
      {"view past the storage", [&](auto& b) { b[find(b, "K\x04K\x02\x85", pkl_at) + 1] = std::byte{5}; },
       // the REDUCE of _rebuild_tensor_v2 (the REDUCE before it makes the backward hooks' OrderedDict)
       ErrorKind::kFormat, in_good("R", in_good("R", view) + 1) - pkl_at, "reaches element 6 of storage '0', which has 6 elements"},
      {"persistent id tag", [&](auto& b) { b[find(b, "storage", pkl_at)] = std::byte{'S'}; }, ErrorKind::kFormat,
       in_good("Q", in_good("storage", pkl_at)) - pkl_at,
       "persistent id tag is not 'storage'"},
  };
  run_patch_table(good, rows, [](const std::vector<std::byte>& bad) { return ckpt::read_torch_save(ckpt::memory_source(bad, "mem.pt")); });

}

TEST_CASE("a tiny file that claims a huge storage fails before allocating", "[ckpt][torch_save]") {
  // data.pkl says 2**40 float32 elements; the record has 4 bytes. The check compares sizes only.
  auto pid = pk::make_persistent_id(pk::make_tuple({pk::make_str("storage"), pk::make_global("torch", "FloatStorage"),
                                                    pk::make_str("0"), pk::make_str("cpu"), pk::make_int(std::int64_t{1} << 40)}));
  auto t = pk::make_object(pk::make_global("torch._utils", "_rebuild_tensor_v2"), pk::BuildOp::kReduce,
                           pk::make_tuple({pid, pk::make_int(0), pk::make_tuple({pk::make_int(std::int64_t{1} << 40)}),
                                           pk::make_tuple({pk::make_int(1)}), pk::make_bool(false),
                                           pk::make_ordered_dict()}));
  ckpt::MemorySink sink;
  ckpt::detail::ZipWriter zip(sink, "archive");
  zip.add("data.pkl", pk::write(*t, 2));
  zip.add("data/0", std::vector<std::byte>(4));
  zip.add("version", bytes_of("3\n"));
  zip.finish();
  const auto bytes = sink.take();
  const std::size_t data0 = (find(bytes, "archive/data/0") + 14 + 4 + 63) / 64 * 64;  // the record's first byte
  REQUIRE_THROWS_MATCHES(ckpt::read_torch_save(ckpt::memory_source(bytes, "m")), ckpt::Error,
                         IsCkptError(ErrorKind::kFormat, data0, "holds 4 bytes, but its storage is 1099511627776 float32"));
}

TEST_CASE("a torch.save file's whole tree is kept only for --meta", "[ckpt][torch_save]") {
  const auto path = testdata("torch_save/tiny_state_dict.pt");
  const ckpt::Checkpoint plain = ckpt::open_checkpoint(path);
  CHECK(plain.meta_trees.empty());
  REQUIRE(plain.find_tensor("model.w"));
  const ckpt::Checkpoint kept = ckpt::open_checkpoint(path, ckpt::MetaTrees::kKeep);
  REQUIRE(kept.meta_trees.size() == 1);
  CHECK(kept.meta_trees[0].first == "tiny_state_dict.pt");
  CHECK(kept.meta_trees[0].second->dict_items());
}

TEST_CASE("torch.save: a class built from plain arguments is data (Megatron's signal.Signals), a call that runs code is refused", "[ckpt][torch_save]") {
  auto archive = [](const pk::ValuePtr& value) {
    ckpt::MemorySink sink;
    ckpt::detail::ZipWriter zip(sink, "archive");
    zip.add("data.pkl", pk::write(*pk::make_dict({{pk::make_str("exit_signal"), value}}), 2));
    zip.add("version", bytes_of("3\n"));
    zip.finish();
    return sink.take();
  };
  const auto signals = pk::make_object(pk::make_global("signal", "Signals"), pk::BuildOp::kReduce, pk::make_tuple({pk::make_int(15)}));
  const auto f = ckpt::read_torch_save(ckpt::memory_source(archive(signals), "common.pt"));
  REQUIRE(f.objects.size() == 1);
  CHECK(pk::repr(*f.objects[0].second, 200).find("signal.Signals") != std::string::npos);
  const auto trap = pk::make_object(pk::make_global("signal", "signal"), pk::BuildOp::kReduce, pk::make_tuple({pk::make_int(15), pk::make_none()}));
  REQUIRE_THROWS_MATCHES(ckpt::read_torch_save(ckpt::memory_source(archive(trap), "common.pt")), ckpt::Error,
                         IsCkptError(ErrorKind::kFormat, kAnyOffset, "global 'signal.signal' would run code"));
}

namespace {

// A legacy torch.save file (docs/formats/torch_save.md#legacy-format) as _legacy_save writes it:
// magic number, protocol version, system info, {"w": 2x3 float32 view, "b": 2 bfloat16}, the sorted
// storage keys, then each storage's element count and bytes. `keys` replaces the key list, `view`
// makes w's storage a view of another (torch < 0.4).
std::vector<std::byte> build_legacy(std::optional<std::vector<std::string>> keys = std::nullopt, bool view = false) {
  auto pid = [&](const char* cls, const char* key, std::int64_t numel, pk::ValuePtr view_of) {
    return pk::make_persistent_id(pk::make_tuple({pk::make_str("storage"), pk::make_global("torch", cls), pk::make_str(key),
                                                  pk::make_str("cuda:0"), pk::make_int(numel), view_of ? view_of : pk::make_none()}));
  };
  auto tensor = [](pk::ValuePtr storage, std::int64_t offset, std::vector<std::int64_t> size, std::vector<std::int64_t> stride) {
    auto ints = [](const std::vector<std::int64_t>& v) {
      std::vector<pk::ValuePtr> items;
      for (auto x : v) items.push_back(pk::make_int(x));
      return pk::make_tuple(std::move(items));
    };
    return pk::make_object(pk::make_global("torch._utils", "_rebuild_tensor_v2"), pk::BuildOp::kReduce,
                           pk::make_tuple({storage, pk::make_int(offset), ints(size), ints(stride), pk::make_bool(false),
                                           pk::make_ordered_dict()}));
  };
  auto view_of = view ? pk::make_tuple({pk::make_str("140"), pk::make_int(0), pk::make_int(6)}) : nullptr;
  auto root = pk::make_ordered_dict({{pk::make_str("w"), tensor(pid("FloatStorage", "140", 7, view_of), 1, {2, 3}, {3, 1})},
                                     {pk::make_str("b"), tensor(pid("BFloat16Storage", "95", 2, nullptr), 0, {2}, {1})}});
  auto magic = pk::make_int(0);
  magic->payload = pk::Int{0, {0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19}};
  auto sys_info = pk::make_dict({{pk::make_str("protocol_version"), pk::make_int(1001)},
                                 {pk::make_str("little_endian"), pk::make_bool(true)},
                                 {pk::make_str("type_sizes"), pk::make_dict({{pk::make_str("short"), pk::make_int(2)}})}});
  std::vector<pk::ValuePtr> key_nodes;
  for (const auto& k : keys.value_or(std::vector<std::string>{"140", "95"})) key_nodes.push_back(pk::make_str(k));
  std::vector<std::byte> out;
  for (const auto& v : {magic, pk::make_int(1001), sys_info, root, pk::make_list(key_nodes)}) {
    const auto p = pk::write(*v, 2);
    out.insert(out.end(), p.begin(), p.end());
  }
  auto storage = [&](std::uint64_t numel, std::size_t nbytes, std::uint8_t first) {
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<std::byte>(numel >> (8 * i)));
    for (std::size_t i = 0; i < nbytes; ++i) out.push_back(static_cast<std::byte>(first + i));
  };
  storage(7, 28, 0);    // "140": 7 float32
  storage(2, 4, 100);   // "95": 2 bfloat16
  return out;
}

}  // namespace

TEST_CASE("legacy torch.save: pickles, then the storages in key-list order", "[ckpt][torch_save]") {
  const auto bytes = build_legacy();
  const auto src = ckpt::memory_source(bytes, "old.pt");
  CHECK(ckpt::looks_like_torch_save(*src));
  auto f = ckpt::read_torch_save(src);
  CHECK(f.legacy);
  CHECK(f.records.empty());
  REQUIRE(f.tensors.size() == 2);
  CHECK(f.tensors[0].name == "w");
  CHECK(f.tensors[0].storage_offset == 1);
  CHECK(f.tensors[0].shape == std::vector<std::int64_t>{2, 3});
  CHECK(f.tensors[1].dtype == DType::kBFloat16);
  REQUIRE(f.storages.size() == 2);
  CHECK(f.storages[0].location == "cuda:0");
  CHECK(f.storages[0].data->size() == 28);
  CHECK(f.storages[0].data->read_vector(0, 2) == std::vector<std::byte>{std::byte{0}, std::byte{1}});
  CHECK(f.storages[1].data->read_vector(0, 4) == std::vector<std::byte>{std::byte{100}, std::byte{101}, std::byte{102}, std::byte{103}});
  CHECK(ckpt::resolve_window(*f.storages[1].data).offset == bytes.size() - 4);
}

TEST_CASE("legacy torch.save corruption table", "[ckpt][torch_save]") {
  const auto good = build_legacy();
  const auto in_good = [&](const std::string& text, std::size_t from = 0) { return find(good, text, from); };
  const std::size_t protocol = in_good(std::string("M\xe9\x03", 3));          // BININT2 1001, the second pickle
  const std::size_t little = in_good("little_endian") + 13 + 2;                 // its BINPUT, then NEWTRUE
  const std::size_t count140 = good.size() - (8 + 4) - (8 + 28);               // the first storage's element count
  const std::vector<PatchRow> rows = {
      {"not the magic number", [](auto& b) { b[4] = std::byte{0}; }, ErrorKind::kFormat, 0, "this is a pickle of a int, not a torch.save file"},
      {"protocol version", [&](auto& b) { b[protocol + 1] = std::byte{0xea}; }, ErrorKind::kFormat, protocol,
       "protocol version is 1002, expected 1001"},
      {"big-endian", [&](auto& b) { b[little] = std::byte{0x89}; }, ErrorKind::kUnsupported, little, "big-endian"},
      {"element count", [&](auto& b) { b[count140] = std::byte{6}; }, ErrorKind::kFormat, count140,
       "storage '140' holds 6 elements here, but the object's tensors say 7 float32"},
      {"truncated storage", [](auto& b) { b.resize(b.size() - 1); }, ErrorKind::kFormat, good.size() - 4,
       "storage '95' of 4 bytes at offset"},
      {"truncated count", [&](auto& b) { b.resize(count140 + 3); }, ErrorKind::kFormat, count140, "the element count of storage '140'"},
      {"no storage bytes", [&](auto& b) { b.resize(count140); }, ErrorKind::kFormat, count140, "the element count of storage '140'"},
      // the REDUCE of _rebuild_tensor_v2 (the REDUCE before it makes the backward hooks' OrderedDict)
      {"view past the storage", [&](auto& b) { b[find(b, "K\x01K\x02K\x03", 0) + 1] = std::byte{2}; }, ErrorKind::kFormat,
       in_good("R", in_good("R", in_good("K\x01K\x02K\x03")) + 1), "reaches element 7 of storage '140', which has 7 elements"},
  };
  run_patch_table(good, rows, [](const std::vector<std::byte>& bad) { return ckpt::read_torch_save(ckpt::memory_source(bad, "old.pt")); });

  // Key lists that disagree with the object: the error is at the list (its EMPTY_LIST, after the
  // fifth pickle's PROTO) or at the key.
  auto read = [](std::vector<std::byte> b) { return ckpt::read_torch_save(ckpt::memory_source(std::move(b), "old.pt")); };
  const auto list_at = [](const std::vector<std::byte>& b) { return find(b, std::string("\x80\x02]", 3)) + 2; };
  const std::string key140("X\x03\x00\x00\x00" "140", 8);
  const auto unlisted = build_legacy(std::vector<std::string>{"140"});
  REQUIRE_THROWS_MATCHES(read(unlisted), ckpt::Error,
                         IsCkptError(ErrorKind::kFormat, list_at(unlisted), "storage '95', which the object's tensors use, is not in the list"));
  const auto twice = build_legacy(std::vector<std::string>{"140", "140", "95"});
  REQUIRE_THROWS_MATCHES(read(twice), ckpt::Error,
                         IsCkptError(ErrorKind::kFormat, find(twice, key140, find(twice, key140, list_at(twice)) + 1),
                                     "storage key '140' is listed twice"));
  const auto unused = build_legacy(std::vector<std::string>{"140", "95", "7"});
  REQUIRE_THROWS_MATCHES(read(unused), ckpt::Error,
                         IsCkptError(ErrorKind::kFormat, find(unused, std::string("X\x01\x00\x00\x00" "7", 6), list_at(unused)),
                                     "storage key '7' is listed, but no tensor of the object uses it"));
  const auto view = build_legacy(std::nullopt, true);
  REQUIRE_THROWS_MATCHES(read(view), ckpt::Error,  // at the persistent id's BINPERSID
                         IsCkptError(ErrorKind::kUnsupported, find(view, "Q", find(view, "cuda:0")), "saved as a view of a storage (torch < 0.4)"));
  // The tar of torch < 0.4 is named, not read.
  std::vector<std::byte> tar(1024);
  std::memcpy(&tar[257], "ustar", 5);
  REQUIRE_THROWS_MATCHES(read(tar), ckpt::Error, IsCkptError(ErrorKind::kUnsupported, 0, "tar-based torch.save format (torch < 0.4)"));
}

TEST_CASE("verify --deep checks every record's CRC-32 through the driver's file checks", "[ckpt][torch_save]") {
  // tiny_state_dict.pt with its version record changed from "3" to "4": still a valid file, but
  // the central directory's CRC of that record no longer matches; only the deep check reads it.
  auto bytes = read_all(testdata("torch_save/tiny_state_dict.pt"));
  const std::size_t version = find(bytes, "3\n", find(bytes, "tiny_state_dict/version") + 23);
  bytes[version] = std::byte{'4'};
  TestDir dir;
  {
    std::ofstream(dir / "changed.pt", std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  }
  CHECK(ckpt::check_checkpoint({dir / "changed.pt", ckpt::VerifyDepth::kStructure, ckpt::OutputFormat::kText}).ok());
  const ckpt::VerifyReport deep = ckpt::check_checkpoint({dir / "changed.pt", ckpt::VerifyDepth::kDeep, ckpt::OutputFormat::kText});
  REQUIRE(deep.problems.size() == 1);
  CHECK(deep.problems[0].offset == version);
  CHECK(deep.problems[0].message.find("CRC") != std::string::npos);
  // The legacy format records no CRC: its deep check reads the storages and passes.
  CHECK(ckpt::check_checkpoint({testdata("torch_save/legacy_tiny_state_dict.pt"), ckpt::VerifyDepth::kDeep, ckpt::OutputFormat::kText}).ok());
}
