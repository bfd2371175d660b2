// SPDX-License-Identifier: Apache-2.0
// The restricted pickle VM. See NOTE [The unpickler never calls anything] in ckpt/pickle.hpp.
#include <algorithm>
#include <array>
#include <cstdio>
#include <unordered_map>
#include <unordered_set>

#include "ckpt/error.hpp"
#include "ckpt/pickle.hpp"
#include "io/cursor.hpp"
#include "pickle/memo_scan.hpp"
#include "pickle/node_pool.hpp"
#include "pickle/opcodes.hpp"

namespace ckpt::pickle {
namespace {

class Unpickler {
 public:
  Unpickler(std::span<const std::byte> bytes, const std::string& source, std::uint64_t base, const ParseOptions& options)
      : in_(bytes, source, base), options_(options), referenced_(referenced_memo(bytes, options)) {}

  // The pickle's value. With `end`, bytes may follow its STOP and *end gets the position after it;
  // without, they are an error.
  ValuePtr run(std::uint64_t* end = nullptr) {
    if (in_.at_end()) in_.fail("empty pickle: no opcodes");
    std::uint64_t next_progress = options_.progress_every;
    while (true) {
      if (options_.on_progress && in_.position() >= next_progress) {
        options_.on_progress(in_.position());
        next_progress = in_.position() + options_.progress_every;
      }
      op_offset_ = in_.offset();
      const std::uint8_t code = in_.u8("opcode");
      if (code == op::kStop) {
        ValuePtr result = pop("STOP");
        if (end) {
          *end = in_.position();
        } else if (!in_.at_end()) {
          in_.fail_at(op_offset_ + 1, std::to_string(in_.remaining()) + " bytes follow the STOP opcode");
        }
        return result;
      }
      step(code);
      if (in_.at_end()) in_.fail("pickle ends without a STOP opcode");
    }
  }

 private:
  [[noreturn]] void fail(std::string message, ErrorKind kind = ErrorKind::kFormat) const {
    in_.fail_at(op_offset_, std::move(message), kind);
  }

  std::size_t fence() const { return marks_.empty() ? 0 : marks_.back(); }

  ValuePtr pop(std::string_view op) {
    if (stack_.size() <= fence()) fail(std::string(op) + " needs a value but the stack is empty (stack underflow)");
    ValuePtr v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  ValuePtr& top(std::string_view op) {
    if (stack_.size() <= fence()) fail(std::string(op) + " needs a value but the stack is empty (stack underflow)");
    return stack_.back();
  }
  std::vector<ValuePtr> pop_mark(std::string_view op) {
    if (marks_.empty()) fail(std::string(op) + " without a preceding MARK");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    std::vector<ValuePtr> items(std::make_move_iterator(stack_.begin() + static_cast<std::ptrdiff_t>(m)),
                                std::make_move_iterator(stack_.end()));
    stack_.resize(m);
    return items;
  }
  void push(ValuePtr v) { stack_.push_back(std::move(v)); }

  // A child goes into `parent`: it is sealed, and parent's depth grows.
  void adopt(Value& parent, const ValuePtr& child) {
    if (!child) return;
    if (child.get() == &parent) fail("a value is put inside itself (recursive structures are not supported)",
                                     ErrorKind::kUnsupported);
    child->sealed = true;
    const int d = child->depth + 1;
    if (d > kMaxDepth) fail("values nest deeper than " + std::to_string(kMaxDepth) + " levels");
    if (d > parent.depth) parent.depth = static_cast<std::uint16_t>(d);
  }
  void expect_mutable(const Value& target, std::string_view op) {
    if (target.sealed) {
      fail(std::string(op) + " changes a " + target.type_name() +
               " that is already inside another value (recursive structures are not supported)",
           ErrorKind::kUnsupported);
    }
  }
  ValuePtr make(Payload p, std::span<const ValuePtr> children = {}) {
    auto v = pool::new_node();
    v->payload = std::move(p);
    v->offset = op_offset_;
    for (const auto& c : children) adopt(*v, c);
    return v;
  }

  // NOTE [Shared leaves]: None, the booleans, the empty tuple and the ints 0..255 are immutable
  // leaves that metadata pickles repeat by the hundred thousand; one node each per parse keeps the
  // tree small. Their `offset` is that of the first occurrence, so errors about a value cite the
  // object that holds it instead.
  const ValuePtr& shared(ValuePtr& slot, Payload p) {
    if (!slot) slot = make(std::move(p));
    return slot;
  }

  std::string text(std::span<const std::byte> b, std::string_view what) {
    std::string s(reinterpret_cast<const char*>(b.data()), b.size());
    if (!valid_utf8(s)) fail(std::string(what) + " is not valid UTF-8");
    return s;
  }

  ValuePtr make_global_value(std::string module, std::string name, ValuePtr module_str, ValuePtr name_str) {
    ValuePtr g = pickle::make_global(std::move(module), std::move(name));
    g->offset = op_offset_;
    auto* gp = std::get<std::unique_ptr<Global>>(g->payload).get();
    if (options_.code_globals == CodeGlobals::kRefuse && runs_code(gp->module, gp->name)) {
      fail("global '" + gp->module + "." + gp->name + "' would run code when loaded: this file is malicious or unsafe (refused, never executed)");
    }
    if (gp->kind == GlobalKind::kOpaque && options_.unknown_globals == UnknownGlobals::kRefuse) {
      fail("global '" + gp->module + "." + gp->name + "' is not allowed here (refused, not executed)");
    }
    gp->module_str = std::move(module_str);
    gp->name_str = std::move(name_str);
    if (options_.on_global) options_.on_global(*g);
    return g;
  }

  void add_list_items(Value& target, std::vector<ValuePtr> items, std::string_view op) {
    std::vector<ValuePtr>* dst = nullptr;
    if (auto* l = target.get_if<List>()) dst = &l->items;
    else if (auto* o = target.get_if<std::unique_ptr<Object>>()) dst = &(*o)->list_items;
    else fail(std::string(op) + " onto a " + target.type_name() + ", expected a list");
    expect_mutable(target, op);
    for (auto& it : items) {
      adopt(target, it);
      dst->push_back(std::move(it));
    }
  }
  void add_dict_items(Value& target, std::vector<ValuePtr> flat, std::string_view op) {
    if (flat.size() % 2 != 0) fail(std::string(op) + " with an odd number (" + std::to_string(flat.size()) + ") of keys and values");
    std::vector<std::pair<ValuePtr, ValuePtr>>* dst = nullptr;
    if (auto* d = target.get_if<Dict>()) dst = &d->items;
    else if (auto* o = target.get_if<std::unique_ptr<Object>>()) dst = &(*o)->dict_items;
    else fail(std::string(op) + " onto a " + target.type_name() + ", expected a dict");
    expect_mutable(target, op);
    const bool offer = options_.on_dict_item && target.is<Dict>();
    for (std::size_t i = 0; i < flat.size(); i += 2) {
      if (offer && options_.on_dict_item(target, flat[i], flat[i + 1])) continue;
      adopt(target, flat[i]);
      adopt(target, flat[i + 1]);
      dst->emplace_back(std::move(flat[i]), std::move(flat[i + 1]));
    }
  }

  void make_object_value(ValuePtr callable, BuildOp bop, ValuePtr args, ValuePtr kwargs, std::string_view op) {
    if (!args->is<Tuple>()) fail(std::string(op) + " arguments are a " + args->type_name() + ", expected a tuple");
    if (kwargs && !kwargs->is<Dict>()) fail(std::string(op) + " keyword arguments are a " + kwargs->type_name() + ", expected a dict");
    if (callable->is<None>() || callable->is<Int>() || callable->is<Str>()) {
      fail(std::string(op) + " calls a " + callable->type_name() + ", which is not callable");
    }
    auto o = std::make_unique<Object>();
    o->callable = callable;
    o->op = bop;
    o->args = args;
    o->kwargs = kwargs;
    auto v = pool::new_node();
    v->payload = std::move(o);
    v->offset = op_offset_;
    adopt(*v, callable);
    adopt(*v, args);
    adopt(*v, kwargs);
    if (options_.on_object) options_.on_object(*v);
    push(std::move(v));
  }

  // The memo: only the entries some GET refers to are kept (referenced_); `set_` records every
  // index that was set, since MEMOIZE numbers entries by len(memo).
  void memo_put(std::uint64_t index) {
    const ValuePtr& v = top("memo put");
    if (set_.insert(index)) ++memo_count_;
    if (referenced_.contains(index)) memo_.insert_or_assign(index, v);
  }
  std::uint64_t memo_size() const { return memo_count_; }
  void memo_get(std::uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) fail("memo index " + std::to_string(index) + " is not set (" + std::to_string(memo_count_) + " entries)");
    push(it->second);
  }

  void step(std::uint8_t code) {
    switch (code) {
      case op::kProto: {
        const std::uint8_t v = in_.u8("protocol");
        if (v > 5) fail("pickle protocol " + std::to_string(v) + " is not in [0, 5]", ErrorKind::kUnsupported);
        return;
      }
      case op::kFrame: {
        const std::uint64_t n = in_.u64le("frame length");
        if (n > in_.remaining()) fail("frame of " + std::to_string(n) + " bytes passes the end (" + std::to_string(in_.remaining()) + " bytes remain)");
        return;
      }
      case op::kMark: marks_.push_back(stack_.size()); return;
      case op::kEmptyTuple: return push(shared(empty_tuple_, Tuple{}));
      case op::kTuple1:
      case op::kTuple2:
      case op::kTuple3: {
        const std::size_t n = code == op::kTuple1 ? 1u : code == op::kTuple2 ? 2u : 3u;
        std::vector<ValuePtr> items(n);
        for (std::size_t i = n; i-- > 0;) items[i] = pop("TUPLE");
        auto v = make(Tuple{}, items);
        v->get_if<Tuple>()->items = std::move(items);
        return push(std::move(v));
      }
      case op::kTuple: {
        auto items = pop_mark("TUPLE");
        auto v = make(Tuple{}, items);
        v->get_if<Tuple>()->items = std::move(items);
        return push(std::move(v));
      }
      case op::kEmptyList: return push(make(List{}));
      case op::kEmptyDict: return push(make(Dict{}));
      case op::kEmptySet: return push(make(Set{}));
      case op::kAppend: {
        ValuePtr x = pop("APPEND");
        return add_list_items(*top("APPEND"), {std::move(x)}, "APPEND");
      }
      case op::kAppends: {
        auto items = pop_mark("APPENDS");
        return add_list_items(*top("APPENDS"), std::move(items), "APPENDS");
      }
      case op::kSetItem: {
        ValuePtr v = pop("SETITEM");
        ValuePtr k = pop("SETITEM");
        return add_dict_items(*top("SETITEM"), {std::move(k), std::move(v)}, "SETITEM");
      }
      case op::kSetItems: {
        auto flat = pop_mark("SETITEMS");
        return add_dict_items(*top("SETITEMS"), std::move(flat), "SETITEMS");
      }
      case op::kAddItems: {
        auto items = pop_mark("ADDITEMS");
        Value& target = *top("ADDITEMS");
        auto* s = target.get_if<Set>();
        if (!s) fail("ADDITEMS onto a " + target.type_name() + ", expected a set");
        expect_mutable(target, "ADDITEMS");
        for (auto& it : items) {
          adopt(target, it);
          s->items.push_back(std::move(it));
        }
        return;
      }
      case op::kFrozenSet: {
        auto items = pop_mark("FROZENSET");
        auto v = make(FrozenSet{}, items);
        v->get_if<FrozenSet>()->items = std::move(items);
        return push(std::move(v));
      }
      case op::kNone: return push(shared(none_, None{}));
      case op::kNewTrue: return push(shared(true_, true));
      case op::kNewFalse: return push(shared(false_, false));
      case op::kBinInt1: {
        const std::uint8_t v = in_.u8("BININT1 operand");
        return push(shared(small_ints_[v], Int{v, {}}));
      }
      case op::kBinInt2: return push(make(Int{in_.u16le("BININT2 operand"), {}}));
      case op::kBinInt: return push(make(Int{in_.i32le("BININT operand"), {}}));
      case op::kLong1: {
        const std::uint8_t n = in_.u8("LONG1 length");
        return push(make(decode_long(in_.bytes(n, "LONG1 bytes"))));
      }
      case op::kLong4: {
        const std::uint32_t n = in_.u32le("LONG4 length");
        if (n > 0x7fffffffu) fail("LONG4 length " + std::to_string(n) + " is negative as an i32");
        return push(make(decode_long(in_.bytes(n, "LONG4 bytes"))));
      }
      case op::kBinFloat: return push(make(in_.f64be("BINFLOAT operand")));
      case op::kShortBinUnicode: {
        const std::uint8_t n = in_.u8("string length");
        return push(make(Str{text(in_.bytes(n, "string"), "string")}));
      }
      case op::kBinUnicode: {
        const std::uint32_t n = in_.u32le("string length");
        return push(make(Str{text(in_.bytes(n, "string"), "string")}));
      }
      case op::kBinUnicode8: {
        const std::uint64_t n = in_.u64le("string length");
        return push(make(Str{text(in_.bytes(n, "string"), "string")}));
      }
      case op::kShortBinString: {
        // A Python 2 str; torch loads these as text. Bytes that are not UTF-8 are kept as latin-1.
        const std::uint8_t n = in_.u8("string length");
        auto b = in_.bytes(n, "string");
        std::string s(reinterpret_cast<const char*>(b.data()), b.size());
        if (!valid_utf8(s)) {
          std::string u;
          for (char ch : s) {
            const auto c = static_cast<unsigned char>(ch);
            if (c < 0x80) {
              u += static_cast<char>(c);
            } else {
              u += static_cast<char>(0xc0 | (c >> 6));
              u += static_cast<char>(0x80 | (c & 0x3f));
            }
          }
          s = std::move(u);
        }
        return push(make(Str{std::move(s)}));
      }
      case op::kShortBinBytes: {
        const std::uint8_t n = in_.u8("bytes length");
        auto b = in_.bytes(n, "bytes");
        return push(make(Bytes{std::string(reinterpret_cast<const char*>(b.data()), b.size())}));
      }
      case op::kBinBytes: {
        const std::uint32_t n = in_.u32le("bytes length");
        auto b = in_.bytes(n, "bytes");
        return push(make(Bytes{std::string(reinterpret_cast<const char*>(b.data()), b.size())}));
      }
      case op::kBinBytes8: {
        const std::uint64_t n = in_.u64le("bytes length");
        auto b = in_.bytes(n, "bytes");
        return push(make(Bytes{std::string(reinterpret_cast<const char*>(b.data()), b.size())}));
      }
      case op::kGlobal: {
        std::string module = text(std::as_bytes(std::span(in_.line("GLOBAL module"))), "GLOBAL module");
        std::string name = text(std::as_bytes(std::span(in_.line("GLOBAL name"))), "GLOBAL name");
        if (module.empty() || name.empty()) fail("GLOBAL with an empty module or name");
        return push(make_global_value(std::move(module), std::move(name), nullptr, nullptr));
      }
      case op::kStackGlobal: {
        ValuePtr name = pop("STACK_GLOBAL");
        ValuePtr module = pop("STACK_GLOBAL");
        if (!module->str() || !name->str()) {
          fail("STACK_GLOBAL takes two strings, got " + module->type_name() + " and " + name->type_name());
        }
        std::string m = *module->str(), n = *name->str();
        return push(make_global_value(std::move(m), std::move(n), std::move(module), std::move(name)));
      }
      case op::kReduce: {
        ValuePtr args = pop("REDUCE");
        ValuePtr callable = pop("REDUCE");
        return make_object_value(std::move(callable), BuildOp::kReduce, std::move(args), nullptr, "REDUCE");
      }
      case op::kNewObj: {
        ValuePtr args = pop("NEWOBJ");
        ValuePtr cls = pop("NEWOBJ");
        return make_object_value(std::move(cls), BuildOp::kNewObj, std::move(args), nullptr, "NEWOBJ");
      }
      case op::kNewObjEx: {
        ValuePtr kwargs = pop("NEWOBJ_EX");
        ValuePtr args = pop("NEWOBJ_EX");
        ValuePtr cls = pop("NEWOBJ_EX");
        return make_object_value(std::move(cls), BuildOp::kNewObjEx, std::move(args), std::move(kwargs), "NEWOBJ_EX");
      }
      case op::kBuild: {
        ValuePtr state = pop("BUILD");
        Value& target = *top("BUILD");
        auto* o = target.get_if<std::unique_ptr<Object>>();
        if (!o) fail("BUILD on a " + target.type_name() + ", expected an object");
        expect_mutable(target, "BUILD");
        if ((*o)->state) fail("BUILD applied twice to one object", ErrorKind::kUnsupported);
        adopt(target, state);
        (*o)->state = std::move(state);
        if (options_.on_built && stack_.back().use_count() == 1) {
          if (ValuePtr r = options_.on_built(target)) stack_.back() = std::move(r);  // frees target
        }
        return;
      }
      case op::kBinPersId: {
        if (options_.persistent_ids == PersistentIds::kRefuse) fail("persistent id (BINPERSID) is not allowed here");
        ValuePtr pid = pop("BINPERSID");
        auto v = make(PersistentId{}, std::span(&pid, 1));
        v->get_if<PersistentId>()->pid = std::move(pid);
        return push(std::move(v));
      }
      case op::kBinPut: return memo_put(in_.u8("BINPUT index"));
      case op::kLongBinPut: return memo_put(in_.u32le("LONG_BINPUT index"));
      case op::kMemoize: return memo_put(memo_size());
      case op::kBinGet: return memo_get(in_.u8("BINGET index"));
      case op::kLongBinGet: return memo_get(in_.u32le("LONG_BINGET index"));
      default: break;
    }
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02x", code);
    fail(std::string("opcode ") + hex + " is not supported (docs/formats/pickle.md#opcodes lists those read)",
         ErrorKind::kUnsupported);
  }

  detail::Cursor in_;
  const ParseOptions& options_;
  std::uint64_t op_offset_ = 0;
  std::vector<ValuePtr> stack_;
  std::vector<std::size_t> marks_;
  IndexSet referenced_;
  IndexSet set_;
  std::unordered_map<std::uint64_t, ValuePtr> memo_;
  std::uint64_t memo_count_ = 0;
  ValuePtr none_, true_, false_, empty_tuple_;
  std::array<ValuePtr, 256> small_ints_;
};

}  // namespace

ValuePtr parse(std::span<const std::byte> bytes, const std::string& source, std::uint64_t base,
               const ParseOptions& options) {
  return Unpickler(bytes, source, base, options).run();
}

ValuePtr parse_prefix(std::span<const std::byte> bytes, const std::string& source, std::uint64_t& end, std::uint64_t base,
                      const ParseOptions& options) {
  return Unpickler(bytes, source, base, options).run(&end);
}

}  // namespace ckpt::pickle
