// SPDX-License-Identifier: Apache-2.0
// KeyPaths (NOTE [Compact key paths]): what flatten_state_dict writes is kept as cuts in the FQN
// and comes back as the same tuple; anything else comes back as the very value it was given.
#include <catch2/catch.hpp>

#include "ckpt/key_paths.hpp"

namespace pk = ckpt::pickle;

namespace {
pk::ValuePtr path(std::vector<pk::ValuePtr> keys) { return pk::make_tuple(std::move(keys)); }
pk::ValuePtr s(const char* t) { return pk::make_str(t); }
}  // namespace

TEST_CASE("key paths: flatten_state_dict's paths are kept compact and come back equal") {
  ckpt::KeyPaths kp;
  const std::vector<std::pair<std::string, pk::ValuePtr>> paths{
      {"model.layers.0.attn.weight", path({s("model"), s("layers.0.attn.weight")})},  // a module FQN is one key
      {"optimizer.state.layers.0.attn.weight.exp_avg", path({s("optimizer"), s("state"), s("layers.0.attn.weight"), s("exp_avg")})},
      {"optimizer.param_groups.0.lr", path({s("optimizer"), s("param_groups"), pk::make_int(0), s("lr")})},
      {"step", path({s("step")})},
      {"a.-3", path({s("a"), pk::make_int(-3)})},
      {"x.0", path({s("x"), s("0")})},  // a str "0", not the int 0
  };
  for (const auto& [fqn, p] : paths) kp.set(fqn, p);
  CHECK(kp.size() == paths.size());
  CHECK(kp.trees() == 0);
  for (const auto& [fqn, p] : paths) {
    INFO(fqn);
    REQUIRE(kp.contains(fqn));
    CHECK(pk::repr(*kp.find(fqn)) == pk::repr(*p));
  }
  CHECK(kp.find("x.0")->sequence()->at(1)->str() != nullptr);
  CHECK(kp.find("optimizer.param_groups.0.lr")->sequence()->at(2)->int64() == 0);
  CHECK_FALSE(kp.contains("model"));
  CHECK(kp.find("model") == nullptr);
  const auto names = kp.fqns();
  CHECK(std::is_sorted(names.begin(), names.end()));
  CHECK(names.size() == paths.size());
}

TEST_CASE("key paths: any other value is kept as it was given") {
  ckpt::KeyPaths kp;
  const pk::ValuePtr other_spelling = path({s("model"), s("w")});      // does not spell "model.weight"
  const pk::ValuePtr a_list = pk::make_list({s("model"), s("weight")});  // a list, not a tuple
  const pk::ValuePtr not_keys = path({s("model"), pk::make_float(1.5)});
  const pk::ValuePtr empty = path({});
  const pk::ValuePtr none = pk::make_none();
  kp.set("model.weight", other_spelling);
  kp.set("list", a_list);
  kp.set("float", not_keys);
  kp.set("empty", empty);
  kp.set("none", none);
  CHECK(kp.trees() == 5);
  CHECK(kp.find("model.weight") == other_spelling);  // the very node, offset and all
  CHECK(kp.find("list") == a_list);
  CHECK(kp.find("float") == not_keys);
  CHECK(kp.find("empty") == empty);
  CHECK(kp.find("none") == none);
}

TEST_CASE("key paths: set replaces, add keeps, a copy holds the same") {
  ckpt::KeyPaths kp;
  kp.set("m.w", path({s("m"), s("w")}));
  kp.set("m.w", path({s("m.w")}));  // the last pair of a key counts, as in a pickled dict
  CHECK(pk::repr(*kp.find("m.w")) == "('m.w',)");
  kp.add("m.w", path({s("m"), s("w")}));
  CHECK(pk::repr(*kp.find("m.w")) == "('m.w',)");
  kp.add("n", path({s("n")}));
  kp.set("odd", pk::make_list({s("odd")}));
  const ckpt::KeyPaths copy = kp;
  ckpt::KeyPaths assigned;
  assigned = copy;
  const ckpt::KeyPaths moved = std::move(kp);
  for (const ckpt::KeyPaths* k : std::vector<const ckpt::KeyPaths*>{&copy, &assigned, &moved}) {
    CHECK(k->size() == 3);
    CHECK(pk::repr(*k->find("m.w")) == "('m.w',)");
    CHECK(pk::repr(*k->find("n")) == "('n',)");
    CHECK(pk::repr(*k->find("odd")) == "['odd']");
  }
}

TEST_CASE("key paths: many names across blocks stay where they were put") {
  ckpt::KeyPaths kp;
  for (int i = 0; i < 20000; ++i) {
    const std::string fqn = "model.layers." + std::to_string(i) + ".a_rather_long_parameter_name.weight";
    kp.set(fqn, path({s("model"), pk::make_str(fqn.substr(6))}));
  }
  CHECK(kp.size() == 20000);
  CHECK(kp.trees() == 0);
  CHECK(pk::repr(*kp.find("model.layers.12345.a_rather_long_parameter_name.weight")) ==
        "('model', 'layers.12345.a_rather_long_parameter_name.weight')");
}

TEST_CASE("key paths: set_spelled keeps keys given as texts as set() keeps their tuple, and refuses what does not spell the FQN") {
  ckpt::KeyPaths by_text, by_tree;
  using K = ckpt::KeyPaths::Key;
  const std::vector<K> lr{{"optimizer", false}, {"param_groups", false}, {"0", true}, {"lr", false}};
  CHECK(by_text.set_spelled("optimizer.param_groups.0.lr", lr));
  by_tree.set("optimizer.param_groups.0.lr", path({s("optimizer"), s("param_groups"), pk::make_int(0), s("lr")}));
  CHECK(pk::repr(*by_text.find("optimizer.param_groups.0.lr")) == pk::repr(*by_tree.find("optimizer.param_groups.0.lr")));
  CHECK(by_text.find("optimizer.param_groups.0.lr")->sequence()->at(2)->int64() == 0);
  const std::vector<K> neg{{"a", false}, {"-3", true}};
  CHECK(by_text.set_spelled("a.-3", neg));
  CHECK(pk::repr(*by_text.find("a.-3")) == "('a', -3)");
  // Not spelling it: nothing set.
  const std::vector<K> other{{"model", false}, {"w", false}};
  CHECK_FALSE(by_text.set_spelled("model.weight", other));
  CHECK_FALSE(by_text.set_spelled("model", std::vector<K>{}));
  CHECK_FALSE(by_text.set_spelled("model.w.x", other));
  CHECK_FALSE(by_text.contains("model.weight"));
  CHECK_FALSE(by_text.contains("model"));
  // It replaces what was set before, a tree too.
  by_text.set("odd", pk::make_list({s("odd")}));
  CHECK(by_text.set_spelled("odd", std::vector<K>{{"odd", false}}));
  CHECK(pk::repr(*by_text.find("odd")) == "('odd',)");
  CHECK(by_text.size() == 3);
}

TEST_CASE("key paths: keys() sees each path in place, as find() makes it, and refuses what is no path of keys") {
  ckpt::KeyPaths kp;
  kp.set("optimizer.param_groups.0.lr", path({s("optimizer"), s("param_groups"), pk::make_int(0), s("lr")}));  // compact
  kp.set("a.b", path({s("a"), pk::make_int(7)}));  // kept as a tree: its keys do not spell the FQN
  kp.set("l", pk::make_list({s("l"), pk::make_int(-2)}));  // a list: a tree too
  kp.set("bad", path({s("bad"), pk::make_float(1.5)}));
  kp.set("none", pk::make_none());
  REQUIRE(kp.trees() == 4);
  // What keys() gives, written as find()'s tuple would be.
  auto seen = [&](std::string_view fqn) {
    std::vector<ckpt::KeyPaths::KeyView> keys;
    REQUIRE(kp.keys(fqn, keys));
    std::string out = "(";
    for (const auto& k : keys) out += (out.size() > 1 ? ", " : "") + (k.is_int ? std::to_string(k.index) : "'" + std::string(k.text) + "'");
    return out + (keys.size() == 1 ? ",)" : ")");
  };
  CHECK(seen("optimizer.param_groups.0.lr") == pk::repr(*kp.find("optimizer.param_groups.0.lr")));
  CHECK(seen("a.b") == pk::repr(*kp.find("a.b")));
  CHECK(seen("l") == "('l', -2)");
  // The views stay valid: the compact one's are cuts of the FQN kept inside.
  std::vector<ckpt::KeyPaths::KeyView> keys;
  REQUIRE(kp.keys("optimizer.param_groups.0.lr", keys));
  kp.set("another.name", path({s("another"), s("name")}));
  CHECK(keys[1].text == "param_groups");
  CHECK(keys[2].is_int);
  CHECK(keys[2].index == 0);
  CHECK_FALSE(kp.keys("bad", keys));
  CHECK(keys.empty());
  CHECK_FALSE(kp.keys("none", keys));
  CHECK_FALSE(kp.keys("missing", keys));
}
