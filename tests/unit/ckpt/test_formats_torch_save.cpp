// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <cstring>

#include "ckpt/checkpoint.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "ckpt/open.hpp"
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
      {"legacy pickle", [](auto& b) { b.assign({std::byte{0x80}, std::byte{2}, std::byte{'N'}, std::byte{'.'}}); },
       ErrorKind::kUnsupported, 0, "legacy torch.save format"},
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
