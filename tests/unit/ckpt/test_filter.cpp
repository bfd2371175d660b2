// SPDX-License-Identifier: Apache-2.0
#include <catch2/catch.hpp>

#include "ckpt/error.hpp"
#include "ckpt/ops/filter.hpp"
#include "support/error_matchers.hpp"

using ckpt::EntryRenames;
using ckpt::ErrorKind;
using fsdp_test::IsCkptError;

TEST_CASE("entry renames: --rename works as sed's s command, after --strip-prefix", "[ckpt][filter]") {
  SECTION("the prefix, then each rule in order") {
    const EntryRenames r("_orig_mod.", {"s/^transformer\\./model./", "s/\\.h\\.([0-9]+)\\./.layers.\\1./"});
    CHECK(r.apply("_orig_mod.transformer.h.3.attn.weight") == "model.layers.3.attn.weight");
    CHECK(r.apply("lm_head.weight") == "lm_head.weight");  // neither the prefix nor a rule applies
  }
  SECTION("first match, or every one with g; & is the match; another delimiter; an escaped one") {
    CHECK(EntryRenames(std::nullopt, {"s/a/b/"}).apply("aaa") == "baa");
    CHECK(EntryRenames(std::nullopt, {"s/a/b/g"}).apply("aaa") == "bbb");
    CHECK(EntryRenames(std::nullopt, {"s/w/[&]/"}).apply("w.x") == "[w].x");
    CHECK(EntryRenames(std::nullopt, {"s|a/b|c|"}).apply("a/b.x") == "c.x");
    CHECK(EntryRenames(std::nullopt, {"s/a\\/b/c/"}).apply("a/b") == "c");
    CHECK(EntryRenames(std::nullopt, {"s/x/$1/"}).apply("x") == "$1");  // $ is literal, as in sed
  }
  SECTION("a rename that is not an s command, or does not compile, is refused by name") {
    REQUIRE_THROWS_MATCHES(EntryRenames(std::nullopt, {"y/a/b/"}), ckpt::Error, IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "'y/a/b/': not an s command"));
    REQUIRE_THROWS_MATCHES(EntryRenames(std::nullopt, {"s/a/b"}), ckpt::Error, IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "no closing delimiter"));
    REQUIRE_THROWS_MATCHES(EntryRenames(std::nullopt, {"s/a/b/x"}), ckpt::Error, IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "unknown flags 'x'"));
    REQUIRE_THROWS_MATCHES(EntryRenames(std::nullopt, {"s/(/b/"}), ckpt::Error, IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "does not compile"));
  }
  SECTION("two names made one are refused, naming both; the same name claimed again is not") {
    EntryRenames r(std::nullopt, {"s/^(enc|dec)\\./m./"});
    CHECK(r.claim("enc.w", "out") == "m.w");
    CHECK(r.claim("enc.w", "out") == "m.w");
    CHECK(r.claim("dec.b", "out") == "m.b");
    REQUIRE_THROWS_MATCHES(r.claim("dec.w", "out"), ckpt::Error,
                           IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "make 'enc.w' and 'dec.w' both 'm.w'"));
    EntryRenames all("w", {});
    REQUIRE_THROWS_MATCHES(all.claim("w", "out"), ckpt::Error, IsCkptError(ErrorKind::kInvalidArgument, std::nullopt, "an empty name"));
  }
}
