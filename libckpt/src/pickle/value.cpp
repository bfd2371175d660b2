// SPDX-License-Identifier: Apache-2.0
// Value constructors, accessors and repr().
#include <cmath>
#include <cstdio>
#include <unordered_map>

#include "ckpt/pickle.hpp"
#include "ckpt/text.hpp"
#include "pickle/node_pool.hpp"

namespace ckpt::pickle {

void* Global::operator new(std::size_t size) { return pool::get(size); }
void Global::operator delete(void* p, std::size_t size) noexcept { pool::put(p, size); }
void* Object::operator new(std::size_t size) { return pool::get(size); }
void Object::operator delete(void* p, std::size_t size) noexcept { pool::put(p, size); }

namespace {

ValuePtr wrap(Payload p) {
  auto v = pool::new_node();
  v->payload = std::move(p);
  return v;
}

void seal_children(Value& parent) {
  auto seal = [&](const ValuePtr& c) {
    if (!c) return;
    c->sealed = true;
    parent.depth = std::max<std::uint16_t>(parent.depth, static_cast<std::uint16_t>(c->depth + 1));
  };
  std::visit(
      [&](auto& p) {
        using T = std::decay_t<decltype(p)>;
        if constexpr (std::is_same_v<T, List> || std::is_same_v<T, Tuple> || std::is_same_v<T, Set> ||
                      std::is_same_v<T, FrozenSet>) {
          for (auto& c : p.items) seal(c);
        } else if constexpr (std::is_same_v<T, Dict>) {
          for (auto& [k, v] : p.items) {
            seal(k);
            seal(v);
          }
        } else if constexpr (std::is_same_v<T, std::unique_ptr<Object>>) {
          seal(p->callable);
          seal(p->args);
          seal(p->kwargs);
          seal(p->state);
          for (auto& c : p->list_items) seal(c);
          for (auto& [k, v] : p->dict_items) {
            seal(k);
            seal(v);
          }
        } else if constexpr (std::is_same_v<T, PersistentId>) {
          seal(p.pid);
        }
      },
      parent.payload);
}

ValuePtr wrap_container(Payload p) {
  auto v = wrap(std::move(p));
  seal_children(*v);
  return v;
}

std::string canonical_module(std::string module) {
  if (module == "__builtin__") return "builtins";
  if (module == "copy_reg") return "copyreg";
  return module;
}

}  // namespace

namespace {

class Rebuilder {
 public:
  explicit Rebuilder(const std::function<ValuePtr(const Value&)>& replace) : replace_(replace) {}

  ValuePtr run(const ValuePtr& v) {
    if (!v) return v;
    if (auto it = memo_.find(v.get()); it != memo_.end()) return it->second;
    ValuePtr out = replace_(*v);
    if (!out) out = children(v);
    memo_.emplace(v.get(), out);
    return out;
  }

 private:
  // Rebuilds `v` when one of its children changed; returns `v` itself otherwise.
  ValuePtr children(const ValuePtr& v) {
    bool changed = false;
    auto map = [&](const ValuePtr& c) {
      ValuePtr n = run(c);
      changed |= n != c;
      return n;
    };
    auto items = [&](const std::vector<ValuePtr>& in) {
      std::vector<ValuePtr> out;
      out.reserve(in.size());
      for (const auto& c : in) out.push_back(map(c));
      return out;
    };
    auto pairs = [&](const std::vector<std::pair<ValuePtr, ValuePtr>>& in) {
      std::vector<std::pair<ValuePtr, ValuePtr>> out;
      out.reserve(in.size());
      for (const auto& [k, x] : in) {
        ValuePtr nk = map(k);
        out.emplace_back(std::move(nk), map(x));
      }
      return out;
    };
    Payload p = std::visit(
        [&](const auto& x) -> Payload {
          using T = std::decay_t<decltype(x)>;
          if constexpr (std::is_same_v<T, List> || std::is_same_v<T, Tuple> || std::is_same_v<T, Set> ||
                        std::is_same_v<T, FrozenSet>) {
            return T{items(x.items)};
          } else if constexpr (std::is_same_v<T, Dict>) {
            return Dict{pairs(x.items)};
          } else if constexpr (std::is_same_v<T, std::unique_ptr<Object>>) {
            auto o = std::make_unique<Object>();
            o->callable = map(x->callable);
            o->op = x->op;
            o->args = map(x->args);
            o->kwargs = map(x->kwargs);
            o->state = map(x->state);
            o->list_items = items(x->list_items);
            o->dict_items = pairs(x->dict_items);
            return o;
          } else if constexpr (std::is_same_v<T, PersistentId>) {
            return PersistentId{map(x.pid)};
          } else {
            return None{};  // a leaf: never rebuilt
          }
        },
        v->payload);
    if (!changed) return v;
    ValuePtr out = wrap_container(std::move(p));
    out->offset = v->offset;
    return out;
  }

  const std::function<ValuePtr(const Value&)>& replace_;
  std::unordered_map<const Value*, ValuePtr> memo_;
};

}  // namespace

ValuePtr rebuild(const ValuePtr& root, const std::function<ValuePtr(const Value&)>& replace) {
  Rebuilder r(replace);
  return r.run(root);
}

const Global* Value::global() const noexcept {
  auto* g = std::get_if<std::unique_ptr<Global>>(&payload);
  return g ? g->get() : nullptr;
}
const Object* Value::object() const noexcept {
  auto* o = std::get_if<std::unique_ptr<Object>>(&payload);
  return o ? o->get() : nullptr;
}
const std::string* Value::str() const noexcept {
  auto* s = std::get_if<Str>(&payload);
  return s ? &s->text : nullptr;
}
std::optional<std::int64_t> Value::int64() const noexcept {
  auto* i = std::get_if<Int>(&payload);
  if (!i || !i->fits_int64()) return std::nullopt;
  return i->value;
}
const std::vector<ValuePtr>* Value::sequence() const noexcept {
  if (auto* t = std::get_if<Tuple>(&payload)) return &t->items;
  if (auto* l = std::get_if<List>(&payload)) return &l->items;
  return nullptr;
}
const std::vector<std::pair<ValuePtr, ValuePtr>>* Value::dict_items() const noexcept {
  if (auto* d = std::get_if<Dict>(&payload)) return &d->items;
  if (const Object* o = object()) {
    const GlobalKind k = callable_kind();
    const auto* args = o->args ? o->args->sequence() : nullptr;
    if ((k == GlobalKind::kOrderedDict || k == GlobalKind::kCounter) && o->op == BuildOp::kReduce && args &&
        args->empty() && o->list_items.empty()) {
      return &o->dict_items;
    }
  }
  return nullptr;
}
ValuePtr dict_value(const Value* dict, std::string_view key) {
  const auto* items = dict ? dict->dict_items() : nullptr;
  if (!items) return nullptr;
  for (const auto& [k, v] : *items) {
    if (k->str() && *k->str() == key) return v;
  }
  return nullptr;
}

std::optional<double> number_value(const Value* value) {
  if (!value) return std::nullopt;
  if (const double* d = value->get_if<double>()) return *d;
  if (const auto i = value->int64()) return static_cast<double>(*i);
  return std::nullopt;
}

GlobalKind Value::callable_kind() const noexcept {
  const Object* o = object();
  if (!o || !o->callable) return GlobalKind::kOpaque;
  const Global* g = o->callable->global();
  return g ? g->kind : GlobalKind::kOpaque;
}

std::string Value::type_name() const {
  return std::visit(
      [](const auto& p) -> std::string {
        using T = std::decay_t<decltype(p)>;
        if constexpr (std::is_same_v<T, None>) return "None";
        else if constexpr (std::is_same_v<T, bool>) return "bool";
        else if constexpr (std::is_same_v<T, Int>) return "int";
        else if constexpr (std::is_same_v<T, double>) return "float";
        else if constexpr (std::is_same_v<T, Str>) return "str";
        else if constexpr (std::is_same_v<T, Bytes>) return "bytes";
        else if constexpr (std::is_same_v<T, List>) return "list";
        else if constexpr (std::is_same_v<T, Tuple>) return "tuple";
        else if constexpr (std::is_same_v<T, Dict>) return "dict";
        else if constexpr (std::is_same_v<T, Set>) return "set";
        else if constexpr (std::is_same_v<T, FrozenSet>) return "frozenset";
        else if constexpr (std::is_same_v<T, std::unique_ptr<Global>>) return "global " + p->module + "." + p->name;
        else if constexpr (std::is_same_v<T, std::unique_ptr<Object>>) {
          const Global* g = p->callable ? p->callable->global() : nullptr;
          return g ? "object " + g->module + "." + g->name : std::string("object");
        } else return "persistent id";
      },
      payload);
}

ValuePtr make_none() { return wrap(None{}); }
ValuePtr make_bool(bool v) { return wrap(v); }
ValuePtr make_int(std::int64_t v) { return wrap(Int{v, {}}); }
ValuePtr make_float(double v) { return wrap(v); }
ValuePtr make_str(std::string text) { return wrap(Str{std::move(text)}); }
ValuePtr make_bytes(std::string data) { return wrap(Bytes{std::move(data)}); }
ValuePtr make_list(std::vector<ValuePtr> items) { return wrap_container(List{std::move(items)}); }
ValuePtr make_tuple(std::vector<ValuePtr> items) { return wrap_container(Tuple{std::move(items)}); }
ValuePtr make_dict(std::vector<std::pair<ValuePtr, ValuePtr>> items) { return wrap_container(Dict{std::move(items)}); }
ValuePtr make_global(std::string module, std::string name) {
  auto g = std::make_unique<Global>();
  g->module = canonical_module(std::move(module));
  g->name = std::move(name);
  g->kind = classify(g->module, g->name);
  return wrap(std::move(g));
}
ValuePtr make_object(ValuePtr callable, BuildOp op, ValuePtr args, ValuePtr state) {
  auto o = std::make_unique<Object>();
  o->callable = std::move(callable);
  o->op = op;
  o->args = args ? std::move(args) : make_tuple();
  o->state = std::move(state);
  return wrap_container(std::move(o));
}
ValuePtr make_persistent_id(ValuePtr pid) { return wrap_container(PersistentId{std::move(pid)}); }
ValuePtr make_ordered_dict(std::vector<std::pair<ValuePtr, ValuePtr>> items) {
  auto o = std::make_unique<Object>();
  o->callable = make_global("collections", "OrderedDict");
  o->args = make_tuple();
  o->dict_items = std::move(items);
  return wrap_container(std::move(o));
}

// ---- repr ------------------------------------------------------------------------------------

namespace {

class Repr {
 public:
  explicit Repr(std::size_t max) : max_(max) {}
  std::string take() { return std::move(out_); }

  void value(const Value& v) {
    if (full()) return;
    std::visit([&](const auto& p) { emit(p); }, v.payload);
  }

 private:
  bool full() {
    if (out_.size() < max_) return false;
    if (!truncated_) {
      out_ += "...";
      truncated_ = true;
    }
    return true;
  }
  void put(std::string_view s) {
    if (!full()) out_ += s;
  }
  void quoted(std::string_view s, char prefix = 0) {
    if (prefix) out_ += prefix;
    out_ += '\'';
    for (char ch : s) {
      const auto c = static_cast<unsigned char>(ch);
      if (c == '\'' || c == '\\') {
        out_ += '\\';
        out_ += static_cast<char>(c);
      } else if (c < 0x20 || c == 0x7f || (prefix == 'b' && c >= 0x80)) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\x%02x", c);
        out_ += buf;
      } else {
        out_ += static_cast<char>(c);
      }
    }
    out_ += '\'';
  }
  void seq(const std::vector<ValuePtr>& items, std::string_view open, std::string_view close, bool tuple = false) {
    put(open);
    for (std::size_t i = 0; i < items.size() && !full(); ++i) {
      if (i) put(", ");
      value(*items[i]);
    }
    if (tuple && items.size() == 1) put(",");
    put(close);
  }
  void pairs(const std::vector<std::pair<ValuePtr, ValuePtr>>& items) {
    put("{");
    for (std::size_t i = 0; i < items.size() && !full(); ++i) {
      if (i) put(", ");
      value(*items[i].first);
      put(": ");
      value(*items[i].second);
    }
    put("}");
  }
  void emit(const None&) { put("None"); }
  void emit(bool b) { put(b ? "True" : "False"); }
  void emit(const Int& i) {
    if (i.fits_int64()) {
      put(std::to_string(i.value));
    } else {
      std::string hex = "0x";
      const bool neg = (i.big.back() & 0x80) != 0;
      for (auto it = i.big.rbegin(); it != i.big.rend(); ++it) {
        char buf[4];
        std::snprintf(buf, sizeof buf, "%02x", *it);
        hex += buf;
      }
      put("int(" + std::string(neg ? "two's complement " : "") + hex + ")");
    }
  }
  void emit(double d) { put(float_repr(d)); }
  void emit(const Str& s) {
    if (!full()) quoted(s.text);
  }
  void emit(const Bytes& b) {
    if (!full()) quoted(b.data, 'b');
  }
  void emit(const List& l) { seq(l.items, "[", "]"); }
  void emit(const Tuple& t) { seq(t.items, "(", ")", true); }
  void emit(const Set& s) { seq(s.items, "{", "}"); }
  void emit(const FrozenSet& s) { seq(s.items, "frozenset({", "})"); }
  void emit(const Dict& d) { pairs(d.items); }
  void emit(const std::unique_ptr<Global>& g) { put(g->module + "." + g->name); }
  void emit(const std::unique_ptr<Object>& o) {
    if (o->callable) value(*o->callable);
    if (o->op != BuildOp::kReduce) put(o->op == BuildOp::kNewObj ? ".__new__" : ".__new_ex__");
    if (o->args) {
      if (auto* t = o->args->get_if<Tuple>()) {
        seq(t->items, "(", ")");
      } else {
        put("(*");
        value(*o->args);
        put(")");
      }
    }
    if (!o->list_items.empty()) seq(o->list_items, " + [", "]");
    if (!o->dict_items.empty()) {
      put(" + ");
      pairs(o->dict_items);
    }
    if (o->state) {
      put(" with state ");
      value(*o->state);
    }
  }
  void emit(const PersistentId& p) {
    put("persistent_id");
    put("(");
    if (p.pid) value(*p.pid);
    put(")");
  }

  std::size_t max_;
  std::string out_;
  bool truncated_ = false;
};

}  // namespace

std::string repr(const Value& value, std::size_t max_chars) {
  Repr r(max_chars);
  r.value(value);
  return r.take();
}

}  // namespace ckpt::pickle
