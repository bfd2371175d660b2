// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>
#include <unordered_map>

#include "ckpt/pickle.hpp"
#include "support/error_matchers.hpp"
#include "support/test_support.hpp"

using namespace fsdp_test;
using namespace std::string_literals;
using ckpt::ErrorKind;
namespace pk = ckpt::pickle;

namespace {
pk::ValuePtr parse(const std::string& s, const pk::ParseOptions& o = {}) { return pk::parse(bytes_of(s), "p", 0, o); }
std::string str(const std::vector<std::byte>& b) { return std::string(reinterpret_cast<const char*>(b.data()), b.size()); }
}  // namespace

TEST_CASE("pickle round trip of a built tree, protocols 2 and 4", "[ckpt][pickle]") {
  auto shared = pk::make_str("shared");
  auto root = pk::make_dict({{pk::make_str("a"), pk::make_list({pk::make_int(1), pk::make_int(-70000), pk::make_int(std::int64_t{1} << 40)})},
                             {pk::make_str("b"), shared},
                             {pk::make_str("c"), shared},
                             {pk::make_str("t"), pk::make_tuple({pk::make_none(), pk::make_bool(true), pk::make_float(2.5)})},
                             {pk::make_str("od"), pk::make_ordered_dict({{pk::make_str("k"), pk::make_bytes(std::string("\x00\xff", 2))}})}});
  for (int proto : {2, 4}) {
    auto bytes = pk::write(*root, proto);
    auto back = pk::parse(bytes, "p");
    if (proto == 4) {
      CHECK(pk::repr(*back) == pk::repr(*root));
    } else {  // protocol 2 has no bytes opcode: CPython's form is kept literally
      CHECK(pk::repr(*back).find("'k': _codecs.encode('\\x00\xc3\xbf', 'latin1')") != std::string::npos);
    }
    const auto* items = back->dict_items();
    REQUIRE(items);
    CHECK((*items)[1].second.get() == (*items)[2].second.get());  // sharing survives
    CHECK(pk::write(*back, proto) == bytes);
  }
  CHECK(pk::repr(*root) == "{'a': [1, -70000, 1099511627776], 'b': 'shared', 'c': 'shared', 't': (None, True, 2.5), "
                           "'od': collections.OrderedDict() + {'k': b'\\x00\\xff'}}");
}

TEST_CASE("CPython's exact encodings for ints, strings and bytes under protocol 2", "[ckpt][pickle]") {
  // Bytes taken from CPython 3.11 pickle.dumps(x, protocol=2).
  CHECK(str(pk::write(*pk::make_int(std::int64_t{1} << 40), 2)) == std::string("\x80\x02\x8a\x06\x00\x00\x00\x00\x00\x01.", 11));
  CHECK(str(pk::write(*pk::make_int(-1), 2)) == std::string("\x80\x02J\xff\xff\xff\xff.", 8));
  CHECK(str(pk::write(*pk::make_str("ab"), 2)) == std::string("\x80\x02X\x02\x00\x00\x00" "abq\x00.", 12));
  CHECK(str(pk::write(*pk::make_bytes("a"), 2)) ==
        std::string("\x80\x02" "c_codecs\nencode\nq\x00X\x01\x00\x00\x00" "aq\x01X\x06\x00\x00\x00latin1q\x02\x86q\x03Rq\x04.", 48));
  CHECK(str(pk::write(*pk::make_str("ab"), 4)) == std::string("\x80\x04\x95\x06\x00\x00\x00\x00\x00\x00\x00\x8c\x02" "ab\x94.", 17));
}

TEST_CASE("big ints are kept exactly", "[ckpt][pickle]") {
  // 2**64 as LONG1 with 9 bytes; -(2**70) with 9 bytes.
  auto v = parse(std::string("\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.", 14));
  const auto* i = v->get_if<pk::Int>();
  REQUIRE(i);
  CHECK_FALSE(i->fits_int64());
  CHECK(str(pk::write(*v, 2)) == std::string("\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.", 14));
  auto m = parse(std::string("\x80\x02\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80.", 13));  // -2**63 fits
  CHECK(m->int64() == std::numeric_limits<std::int64_t>::min());
}

TEST_CASE("globals are classified by the one allow-list and never resolved", "[ckpt][pickle]") {
  CHECK(pk::classify("torch._utils", "_rebuild_tensor_v2") == pk::GlobalKind::kRebuildTensorV2);
  CHECK(pk::classify("torch", "bfloat16") == pk::GlobalKind::kDType);
  CHECK(pk::classify("torch", "float") == pk::GlobalKind::kOpaque);  // aliases never pickle
  CHECK(pk::classify("torch", "HalfStorage") == pk::GlobalKind::kStorageClass);
  CHECK(pk::classify("torch.distributed._shard.checkpoint.metadata", "Metadata") == pk::GlobalKind::kDcpMetadata);
  CHECK(pk::classify("torch.distributed.checkpoint.metadata", "MEM_FORMAT_ENCODING") == pk::GlobalKind::kDcpMemoryFormat);
  CHECK(pk::classify("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties") == pk::GlobalKind::kDcpTensorProperties);
  CHECK(pk::classify("torch.distributed.checkpoint.filesystem", "_StorageInfo") == pk::GlobalKind::kDcpStorageInfo);
  CHECK(pk::classify("pathlib._local", "PosixPath") == pk::GlobalKind::kPath);
  CHECK(pk::classify("os", "system") == pk::GlobalKind::kOpaque);
  auto v = parse("\x80\x02" "c__builtin__\nset\n)R.");
  CHECK(v->callable_kind() == pk::GlobalKind::kBuiltinSet);
  CHECK(v->object()->callable->global()->module == "builtins");
  // Globals that would run code are refused by default, with the reason ...
  REQUIRE_THROWS_MATCHES(parse("\x80\x02" "cos\nsystem\nX\x02\x00\x00\x00ls\x85R."s), ckpt::Error,
                         IsCkptError(ErrorKind::kFormat, 2, "global 'os.system' would run code when loaded"));
  CHECK(pk::runs_code("posix", "system"));
  CHECK(pk::runs_code("subprocess", "Popen"));
  CHECK(pk::runs_code("builtins", "eval"));
  CHECK_FALSE(pk::runs_code("collections", "OrderedDict"));
  CHECK_FALSE(pk::runs_code("torch._utils", "_rebuild_tensor_v2"));
  // ... and can be kept opaque, never resolved, when asked.
  pk::ParseOptions keep;
  keep.code_globals = pk::CodeGlobals::kKeep;
  auto evil = parse("\x80\x02" "cos\nsystem\nX\x02\x00\x00\x00ls\x85R."s, keep);
  CHECK(evil->callable_kind() == pk::GlobalKind::kOpaque);
  CHECK(pk::repr(*evil) == "os.system('ls')");
  pk::ParseOptions strict = keep;
  strict.unknown_globals = pk::UnknownGlobals::kRefuse;
  REQUIRE_THROWS_MATCHES(parse("\x80\x02" "cos\nsystem\nX\x02\x00\x00\x00ls\x85R."s, strict), ckpt::Error,
                         IsCkptError(ErrorKind::kFormat, 2, "global 'os.system' is not allowed here"));
}

TEST_CASE("pickle corruption table", "[ckpt][pickle]") {
  struct Row {
    const char* defect;
    std::string bytes;
    ErrorKind kind;
    std::uint64_t offset;
    const char* message;
  };
  const std::vector<Row> rows = {
      {"empty", "", ErrorKind::kFormat, 0, "empty pickle"},
      {"no STOP", "\x80\x02N", ErrorKind::kFormat, 3, "without a STOP"},
      {"bytes after STOP", "N.xyz", ErrorKind::kFormat, 2, "3 bytes follow the STOP"},
      {"stack underflow", "\x80\x02" "a.", ErrorKind::kFormat, 2, "stack underflow"},
      {"pop across a mark", "N(a.", ErrorKind::kFormat, 2, "stack underflow"},
      {"TUPLE without MARK", "t.", ErrorKind::kFormat, 0, "without a preceding MARK"},
      {"memo index unset", "h\x05.", ErrorKind::kFormat, 0, "memo index 5 is not set"},
      {"string longer than the data", std::string("X\xff\xff\xff\x7f" "ab", 7), ErrorKind::kFormat, 5, "string needs 2147483647 bytes"},
      {"LONG4 longer than the data", std::string("\x8b\x00\x00\x00\x10", 5), ErrorKind::kFormat, 5, "LONG4 bytes needs"},
      {"frame past the end", std::string("\x95\x00\x10\x00\x00\x00\x00\x00\x00N.", 11), ErrorKind::kFormat, 0, "frame of"},
      {"refused opcode INST", "i__main__\nX\n.", ErrorKind::kUnsupported, 0, "opcode 0x69 is not supported"},
      {"refused opcode POP", "N0.", ErrorKind::kUnsupported, 1, "opcode 0x30"},
      {"unknown opcode", "\xff.", ErrorKind::kUnsupported, 0, "opcode 0xff"},
      {"protocol 6", "\x80\x06N.", ErrorKind::kUnsupported, 0, "protocol 6"},
      {"invalid UTF-8", std::string("X\x02\x00\x00\x00\xc3\x28.", 8), ErrorKind::kFormat, 0, "not valid UTF-8"},
      {"APPEND onto a dict", "}Na.", ErrorKind::kFormat, 2, "APPEND onto a dict"},
      {"SETITEMS odd count", "}(Nu.", ErrorKind::kFormat, 3, "odd number"},
      {"recursive list", "]q\x00h\x00" "a."s, ErrorKind::kUnsupported, 5, "inside itself"},
      {"changing a sealed list", "]q\x00\x85h\x00" "Na."s, ErrorKind::kUnsupported, 7, "already inside another value"},
      {"REDUCE args not a tuple", "cx\ny\nNR.", ErrorKind::kFormat, 6, "expected a tuple"},
      {"BUILD on an int", "K\x01NN" "b.", ErrorKind::kFormat, 4, "BUILD on a"},
      {"STACK_GLOBAL of non-strings", "K\x01K\x02\x93.", ErrorKind::kFormat, 4, "two strings"},
      {"GLOBAL without newline", "cmodule", ErrorKind::kFormat, 1, "no terminating newline"},
  };
  for (const auto& row : rows) {
    SECTION(row.defect) {
      REQUIRE_THROWS_MATCHES(parse(row.bytes), ckpt::Error, IsCkptError(row.kind, row.offset, row.message));
    }
  }
  SECTION("BINPERSID refused when asked") {
    pk::ParseOptions o;
    o.persistent_ids = pk::PersistentIds::kRefuse;
    REQUIRE_THROWS_MATCHES(parse("NQ.", o), ckpt::Error, IsCkptError(ErrorKind::kFormat, 1, "persistent id"));
  }
  SECTION("nesting deeper than the limit") {
    std::string deep;
    for (int i = 0; i < pk::kMaxDepth + 5; ++i) deep += "]";
    for (int i = 0; i < pk::kMaxDepth + 4; ++i) deep += "a";
    deep += ".";
    // the APPEND that makes the 1001st level
    REQUIRE_THROWS_MATCHES(parse(deep), ckpt::Error, IsCkptError(ErrorKind::kFormat, pk::kMaxDepth + 5 + pk::kMaxDepth, "nest deeper than 1000"));
  }
}

TEST_CASE("write_streamed: a dict made batch by batch is written as write() writes it whole", "[ckpt][pickle]") {
  // 2500 items: three batches. Every value holds the persistent node `tag` (memoized once, GET
  // after) and fresh nodes that die with their batch (their addresses come back in later ones).
  auto tag = pk::make_str("tag");
  auto item = [&](std::size_t i) {
    auto k = pk::make_str("layer." + std::to_string(i));
    return std::make_pair(k, pk::make_tuple({tag, pk::make_int(static_cast<std::int64_t>(i)), pk::make_list({pk::make_str("x" + std::to_string(i % 7))}), k}));
  };
  const std::size_t n = 2500;
  std::vector<std::pair<pk::ValuePtr, pk::ValuePtr>> all;
  for (std::size_t i = 0; i < n; ++i) all.push_back(item(i));
  auto whole = pk::make_dict({{pk::make_str("before"), tag}, {pk::make_str("items"), pk::make_dict(all)}, {pk::make_str("after"), tag}});
  auto placeholder = pk::make_dict();
  auto streamed_root = pk::make_dict({{pk::make_str("before"), tag}, {pk::make_str("items"), placeholder}, {pk::make_str("after"), tag}});
  std::unordered_map<const pk::Value*, pk::DictBatches> streamed;
  std::size_t calls = 0;
  streamed[placeholder.get()] = [&](std::size_t done) {
    ++calls;
    std::vector<std::pair<pk::ValuePtr, pk::ValuePtr>> out;
    for (std::size_t i = done; i < n && out.size() < 1000; ++i) out.push_back(item(i));
    return out;
  };
  std::vector<std::byte> got;
  std::size_t pieces = 0;
  pk::write_streamed(*streamed_root, 4, streamed, [&](std::span<const std::byte> b) {
    got.insert(got.end(), b.begin(), b.end());
    ++pieces;
  }, {tag});
  CHECK(calls == 4);     // three batches and the empty one that ends the dict
  CHECK(pieces >= 3);    // bytes left as frames completed, not all at the end
  CHECK(got == pk::write(*whole, 4));
  // When `tag` is first met inside a batch and not persistent, each batch writes it again:
  // other bytes, the same value.
  auto whole2 = pk::make_dict({{pk::make_str("items"), pk::make_dict(all)}});
  auto root2 = pk::make_dict({{pk::make_str("items"), placeholder}});
  std::vector<std::byte> loose;
  pk::write_streamed(*root2, 4, streamed, [&](std::span<const std::byte> b) { loose.insert(loose.end(), b.begin(), b.end()); });
  CHECK(loose != pk::write(*whole2, 4));
  CHECK(pk::repr(*pk::parse(loose, "p"), 1 << 20) == pk::repr(*whole2, 1 << 20));
}

TEST_CASE("on_built replaces an object BUILD has finished, unless a later GET refers to it", "[ckpt][pickle]") {
  // [A(state 1), A(state 2), the second again]: the first object is offered and replaced; the
  // second is memoized and fetched again, so it is kept (replacing it would break the sharing).
  auto cls = pk::make_global("m", "A");
  auto a1 = pk::make_object(cls, pk::BuildOp::kNewObj, pk::make_tuple(), pk::make_int(1));
  auto a2 = pk::make_object(cls, pk::BuildOp::kNewObj, pk::make_tuple(), pk::make_int(2));
  auto root = pk::make_list({a1, a2, a2});
  auto bytes = pk::write(*root, 4);
  int offered = 0;
  pk::ParseOptions o;
  o.unknown_globals = pk::UnknownGlobals::kKeepOpaque;
  o.on_built = [&](const pk::Value& v) -> pk::ValuePtr {
    ++offered;
    CHECK(v.object()->state->int64() == 1);  // only the unshared object is offered, with its state
    return pk::make_str("record " + std::to_string(*v.object()->state->int64()));
  };
  auto back = pk::parse(bytes, "p", 0, o);
  CHECK(offered == 1);
  const auto& items = *back->sequence();
  REQUIRE(items.size() == 3);
  CHECK(*items[0]->str() == "record 1");
  CHECK(items[1]->object()->state->int64() == 2);
  CHECK(items[1] == items[2]);  // still one shared object
}

TEST_CASE("on_scanned reports the first pass's progress, before on_progress reports the second's", "[ckpt][pickle]") {
  std::vector<pk::ValuePtr> items;
  for (int i = 0; i < 200; ++i) items.push_back(pk::make_str("item " + std::to_string(i)));
  const auto bytes = pk::write(*pk::make_list(items), 4);
  std::vector<std::pair<char, std::uint64_t>> calls;
  pk::ParseOptions o;
  o.progress_every = 256;
  o.on_scanned = [&](std::uint64_t at) { calls.emplace_back('s', at); };
  o.on_progress = [&](std::uint64_t at) { calls.emplace_back('p', at); };
  auto back = pk::parse(bytes, "p", 0, o);
  CHECK(back->sequence()->size() == 200);
  REQUIRE(calls.size() >= 4);
  CHECK(calls.front().first == 's');
  CHECK(calls.back().first == 'p');
  std::size_t first_p = 0;
  while (calls[first_p].first == 's') ++first_p;
  for (std::size_t i = 1; i < calls.size(); ++i) {
    CHECK(calls[i].second <= bytes.size());
    if (i != first_p) CHECK(calls[i].second > calls[i - 1].second);  // each pass moves forward
    if (i > first_p) CHECK(calls[i].first == 'p');  // the scan is done before parsing starts
  }
}
