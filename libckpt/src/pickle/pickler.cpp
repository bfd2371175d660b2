// SPDX-License-Identifier: Apache-2.0
// The pickler: writes a Value tree the way CPython's C pickler (_pickle.c) does, so that a tree
// read from a CPython pickle is written back byte for byte.
//
// NOTE [Pickler memo]
// CPython memoizes every str, bytes, non-empty tuple, list, dict, set, global and reduced object
// when it is first written, and writes a GET when the same object comes again. Our tree keeps the
// identity the memo gave (shared nodes), so memoizing by node address reproduces it. Globals are
// memoized by their `module.name` text instead: in Python one name is one object, so a CPython
// pickle never writes the same global twice. The constant 'latin1' that protocol 2 uses for bytes
// is one interned object in CPython too.
#include <bit>
#include <map>
#include <unordered_map>
#include <unordered_set>

#include "ckpt/error.hpp"
#include "ckpt/pickle.hpp"
#include "pickle/opcodes.hpp"

namespace ckpt::pickle {
namespace {

constexpr std::size_t kFrameSizeTarget = 64 * 1024;
constexpr std::size_t kFrameSizeMin = 4;
constexpr std::size_t kFrameHeaderSize = 9;
constexpr std::size_t kBatchSize = 1000;

std::vector<std::uint8_t> encode_long(std::int64_t x) {
  std::vector<std::uint8_t> b;
  if (x == 0) return b;
  auto u = static_cast<std::uint64_t>(x);
  for (int i = 0; i < 8; ++i) b.push_back(static_cast<std::uint8_t>(u >> (8 * i)));
  while (b.size() > 1) {
    const std::uint8_t last = b.back();
    const bool next_neg = (b[b.size() - 2] & 0x80) != 0;
    if ((last == 0x00 && !next_neg) || (last == 0xff && next_neg)) b.pop_back();
    else break;
  }
  return b;
}

class Pickler {
 public:
  Pickler(int protocol, const std::function<void(const PersistentId&)>& on_pid)
      : proto_(protocol), on_pid_(on_pid) {
    if (protocol < 2 || protocol > 5) {
      throw Error(ErrorKind::kInvalidArgument, "pickle protocol " + std::to_string(protocol) + " is not in [2, 5]");
    }
  }

  std::vector<std::byte> run(const Value& root) {
    const std::uint8_t header[2] = {op::kProto, static_cast<std::uint8_t>(proto_)};
    write(header, 2);
    framing_ = proto_ >= 4;
    save(root);
    write_op(op::kStop);
    commit_frame();
    drain();
    return std::move(out_);
  }

  // write_streamed(): see pickle.hpp.
  void stream_to(const std::unordered_map<const Value*, DictBatches>& streamed,
                 const std::function<void(std::span<const std::byte>)>& out, const std::vector<ValuePtr>& persistent) {
    streamed_ = &streamed;
    sink_ = &out;
    for (const auto& p : persistent) persistent_.insert(p.get());
  }

 private:
  // ---- output and framing --------------------------------------------------------------------
  void write(const void* data, std::size_t n) {
    if (framing_ && frame_start_ < 0) {
      frame_start_ = static_cast<std::ptrdiff_t>(out_.size());
      out_.resize(out_.size() + kFrameHeaderSize);
    }
    const auto* p = static_cast<const std::byte*>(data);
    out_.insert(out_.end(), p, p + n);
  }
  // Hands the bytes before the open frame to the sink (streamed writes only).
  void drain() {
    if (!sink_) return;
    const std::size_t done = frame_start_ >= 0 ? static_cast<std::size_t>(frame_start_) : out_.size();
    if (done == 0) return;
    (*sink_)(std::span<const std::byte>(out_.data(), done));
    out_.erase(out_.begin(), out_.begin() + static_cast<std::ptrdiff_t>(done));
    if (frame_start_ >= 0) frame_start_ -= static_cast<std::ptrdiff_t>(done);
  }
  void write_op(std::uint8_t code) { write(&code, 1); }
  void write_u8(std::uint8_t v) { write(&v, 1); }
  void write_le(std::uint64_t v, int n) {
    std::uint8_t b[8];
    for (int i = 0; i < n; ++i) b[i] = static_cast<std::uint8_t>(v >> (8 * i));
    write(b, static_cast<std::size_t>(n));
  }
  void commit_frame() {
    if (frame_start_ < 0) return;
    const auto start = static_cast<std::size_t>(frame_start_);
    const std::size_t len = out_.size() - start - kFrameHeaderSize;
    if (len >= kFrameSizeMin) {
      out_[start] = std::byte{op::kFrame};
      for (int i = 0; i < 8; ++i) out_[start + 1 + static_cast<std::size_t>(i)] = static_cast<std::byte>(len >> (8 * i));
    } else {
      out_.erase(out_.begin() + static_cast<std::ptrdiff_t>(start),
                 out_.begin() + static_cast<std::ptrdiff_t>(start + kFrameHeaderSize));
    }
    frame_start_ = -1;
  }
  void opcode_boundary() {
    if (frame_start_ >= 0 && out_.size() - static_cast<std::size_t>(frame_start_) - kFrameHeaderSize >= kFrameSizeTarget) {
      commit_frame();
    }
  }
  // A str or bytes payload of 64 KiB or more goes outside any frame (CPython _Pickler_write_bytes).
  void write_payload(const std::uint8_t* header, std::size_t header_size, const std::string& data) {
    const bool bypass = data.size() >= kFrameSizeTarget;
    const bool framing = framing_;
    if (bypass) {
      commit_frame();
      framing_ = false;
    }
    write(header, header_size);
    write(data.data(), data.size());
    framing_ = framing;
  }

  // ---- memo ----------------------------------------------------------------------------------
  void put(std::uint32_t idx) {
    if (proto_ >= 4) return write_op(op::kMemoize);
    if (idx < 256) {
      write_op(op::kBinPut);
      write_u8(static_cast<std::uint8_t>(idx));
    } else {
      write_op(op::kLongBinPut);
      write_le(idx, 4);
    }
  }
  void get(std::uint32_t idx) {
    if (idx < 256) {
      write_op(op::kBinGet);
      write_u8(static_cast<std::uint8_t>(idx));
    } else {
      write_op(op::kLongBinGet);
      write_le(idx, 4);
    }
  }
  std::uint32_t next_index() { return memo_count_++; }
  void memoize(const Value* v) {
    const std::uint32_t idx = next_index();
    memo_.emplace(v, idx);
    if (batch_nodes_ && !persistent_.count(v)) batch_nodes_->push_back(v);
    put(idx);
  }
  void memoize_anonymous() { put(next_index()); }
  bool try_get(const Value* v) {
    auto it = memo_.find(v);
    if (it == memo_.end()) return false;
    get(it->second);
    return true;
  }

  // ---- values --------------------------------------------------------------------------------
  void save(const Value& v) {
    opcode_boundary();
    std::visit([&](const auto& p) { save_payload(v, p); }, v.payload);
  }

  void save_payload(const Value&, const None&) { write_op(op::kNone); }
  void save_payload(const Value&, bool b) { write_op(b ? op::kNewTrue : op::kNewFalse); }
  void save_payload(const Value&, const Int& i) {
    if (i.fits_int64()) {
      const std::int64_t x = i.value;
      if (x >= 0 && x <= 0xff) {
        write_op(op::kBinInt1);
        write_u8(static_cast<std::uint8_t>(x));
        return;
      }
      if (x >= 0 && x <= 0xffff) {
        write_op(op::kBinInt2);
        write_le(static_cast<std::uint64_t>(x), 2);
        return;
      }
      if (x >= -0x80000000LL && x <= 0x7fffffffLL) {
        write_op(op::kBinInt);
        write_le(static_cast<std::uint64_t>(static_cast<std::uint32_t>(static_cast<std::int32_t>(x))), 4);
        return;
      }
      return save_long_bytes(encode_long(x));
    }
    save_long_bytes(i.big);
  }
  void save_long_bytes(const std::vector<std::uint8_t>& b) {
    if (b.size() < 256) {
      write_op(op::kLong1);
      write_u8(static_cast<std::uint8_t>(b.size()));
    } else {
      write_op(op::kLong4);
      write_le(b.size(), 4);
    }
    write(b.data(), b.size());
  }
  void save_payload(const Value&, double d) {
    write_op(op::kBinFloat);
    const auto u = std::bit_cast<std::uint64_t>(d);
    std::uint8_t b[8];
    for (int i = 0; i < 8; ++i) b[i] = static_cast<std::uint8_t>(u >> (8 * (7 - i)));
    write(b, 8);
  }
  void save_str_text(const std::string& s) {
    const std::size_t n = s.size();
    std::uint8_t h[9];
    if (n <= 0xff && proto_ >= 4) {
      h[0] = op::kShortBinUnicode;
      h[1] = static_cast<std::uint8_t>(n);
      write_payload(h, 2, s);
    } else if (n > 0xffffffffu) {
      if (proto_ < 4) throw Error(ErrorKind::kInvalidArgument, "a str of 4 GiB or more needs pickle protocol 4");
      h[0] = op::kBinUnicode8;
      for (int i = 0; i < 8; ++i) h[1 + i] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(n) >> (8 * i));
      write_payload(h, 9, s);
    } else {
      h[0] = op::kBinUnicode;
      for (int i = 0; i < 4; ++i) h[1 + i] = static_cast<std::uint8_t>(n >> (8 * i));
      write_payload(h, 5, s);
    }
  }
  void save_payload(const Value& v, const Str& s) {
    if (try_get(&v)) return;
    save_str_text(s.text);
    memoize(&v);
  }
  void save_payload(const Value& v, const Bytes& b) {
    if (try_get(&v)) return;
    if (proto_ < 3) {
      // CPython: bytes below protocol 3 are _codecs.encode(<latin-1 text>, 'latin1'), or bytes().
      if (b.data.empty()) {
        save_global_text("builtins", "bytes", nullptr, nullptr);
        write_op(op::kEmptyTuple);
      } else {
        save_global_text("_codecs", "encode", nullptr, nullptr);
        std::string latin1;
        for (char ch : b.data) {
          const auto c = static_cast<unsigned char>(ch);
          if (c < 0x80) {
            latin1 += static_cast<char>(c);
          } else {
            latin1 += static_cast<char>(0xc0 | (c >> 6));
            latin1 += static_cast<char>(0x80 | (c & 0x3f));
          }
        }
        save_str_text(latin1);
        memoize_anonymous();
        if (latin1_index_) {
          get(*latin1_index_);
        } else {
          save_str_text("latin1");
          latin1_index_ = next_index();
          put(*latin1_index_);
        }
        write_op(op::kTuple2);
        memoize_anonymous();
      }
      write_op(op::kReduce);
      memoize(&v);
      return;
    }
    const std::size_t n = b.data.size();
    std::uint8_t h[9];
    if (n <= 0xff) {
      h[0] = op::kShortBinBytes;
      h[1] = static_cast<std::uint8_t>(n);
      write_payload(h, 2, b.data);
    } else if (n > 0xffffffffu && proto_ >= 4) {
      h[0] = op::kBinBytes8;
      for (int i = 0; i < 8; ++i) h[1 + i] = static_cast<std::uint8_t>(static_cast<std::uint64_t>(n) >> (8 * i));
      write_payload(h, 9, b.data);
    } else {
      h[0] = op::kBinBytes;
      for (int i = 0; i < 4; ++i) h[1 + i] = static_cast<std::uint8_t>(n >> (8 * i));
      write_payload(h, 5, b.data);
    }
    memoize(&v);
  }
  void save_payload(const Value& v, const Tuple& t) {
    if (t.items.empty()) return write_op(op::kEmptyTuple);
    if (try_get(&v)) return;
    const std::size_t n = t.items.size();
    if (n <= 3) {
      for (const auto& it : t.items) save(*it);
      write_op(n == 1 ? op::kTuple1 : n == 2 ? op::kTuple2 : op::kTuple3);
    } else {
      write_op(op::kMark);
      for (const auto& it : t.items) save(*it);
      write_op(op::kTuple);
    }
    memoize(&v);
  }
  void batch_appends(const std::vector<ValuePtr>& items) {
    for (std::size_t i = 0; i < items.size(); i += kBatchSize) {
      const std::size_t n = std::min(kBatchSize, items.size() - i);
      if (n > 1) {
        write_op(op::kMark);
        for (std::size_t k = 0; k < n; ++k) save(*items[i + k]);
        write_op(op::kAppends);
      } else {
        save(*items[i]);
        write_op(op::kAppend);
      }
    }
  }
  void batch_setitems(const std::vector<std::pair<ValuePtr, ValuePtr>>& items) {
    for (std::size_t i = 0; i < items.size(); i += kBatchSize) {
      const std::size_t n = std::min(kBatchSize, items.size() - i);
      if (n > 1) {
        write_op(op::kMark);
        for (std::size_t k = 0; k < n; ++k) {
          save(*items[i + k].first);
          save(*items[i + k].second);
        }
        write_op(op::kSetItems);
      } else {
        save(*items[i].first);
        save(*items[i].second);
        write_op(op::kSetItem);
      }
    }
  }
  void save_payload(const Value& v, const List& l) {
    if (try_get(&v)) return;
    write_op(op::kEmptyList);
    memoize(&v);
    batch_appends(l.items);
  }
  void save_payload(const Value& v, const Dict& d) {
    if (try_get(&v)) return;
    write_op(op::kEmptyDict);
    memoize(&v);
    if (streamed_) {
      if (auto it = streamed_->find(&v); it != streamed_->end()) return save_streamed_items(it->second);
    }
    batch_setitems(d.items);
  }
  // A streamed dict's items, batch by batch; each batch's nodes are forgotten by the memo after it.
  void save_streamed_items(const DictBatches& make) {
    if (batch_nodes_) throw Error(ErrorKind::kInvalidArgument, "a streamed dict inside another streamed dict's items");
    std::size_t done = 0;
    while (true) {
      std::vector<std::pair<ValuePtr, ValuePtr>> batch = make(done);
      if (batch.empty()) return;
      if (batch.size() > kBatchSize) throw Error(ErrorKind::kInvalidArgument, "a streamed dict batch holds more than 1000 items");
      std::vector<const Value*> made;
      batch_nodes_ = &made;
      batch_setitems(batch);
      batch_nodes_ = nullptr;
      for (const Value* n : made) memo_.erase(n);
      done += batch.size();
      batch.clear();
      drain();
    }
  }
  // Below protocol 4, sets are reduced: builtins.set([items]).
  void save_reduced_collection(const Value& v, std::string_view name, const std::vector<ValuePtr>& items) {
    save_global_text("builtins", std::string(name), nullptr, nullptr);
    write_op(op::kEmptyList);
    memoize_anonymous();
    batch_appends(items);
    write_op(op::kTuple1);
    memoize_anonymous();
    write_op(op::kReduce);
    memoize(&v);
  }
  void save_payload(const Value& v, const Set& s) {
    if (try_get(&v)) return;
    if (proto_ < 4) return save_reduced_collection(v, "set", s.items);
    write_op(op::kEmptySet);
    memoize(&v);
    for (std::size_t i = 0; i < s.items.size(); i += kBatchSize) {
      const std::size_t n = std::min(kBatchSize, s.items.size() - i);
      write_op(op::kMark);
      for (std::size_t k = 0; k < n; ++k) save(*s.items[i + k]);
      write_op(op::kAddItems);
    }
  }
  void save_payload(const Value& v, const FrozenSet& s) {
    if (try_get(&v)) return;
    if (proto_ < 4) return save_reduced_collection(v, "frozenset", s.items);
    write_op(op::kMark);
    for (const auto& it : s.items) save(*it);
    write_op(op::kFrozenSet);
    memoize(&v);
  }
  void save_global_text(const std::string& module, const std::string& name, const Value* module_str,
                        const Value* name_str) {
    const auto key = std::make_pair(module, name);
    if (auto it = globals_.find(key); it != globals_.end()) return get(it->second);
    if (proto_ >= 4) {
      save_interned_str(module, module_str, "m");
      save_interned_str(name, name_str, "n");
      write_op(op::kStackGlobal);
    } else {
      std::string m = module, n = name;
      if (proto_ < 3) {  // CPython's fix_imports: Python 3 names back to Python 2 ones
        if (m == "builtins") m = "__builtin__";
        else if (m == "copyreg") m = "copy_reg";
      }
      write_op(op::kGlobal);
      write(m.data(), m.size());
      write_op('\n');
      write(n.data(), n.size());
      write_op('\n');
    }
    const std::uint32_t idx = next_index();
    globals_.emplace(key, idx);
    put(idx);
  }
  // STACK_GLOBAL's strings: the nodes the tree kept, or one interned str per text.
  void save_interned_str(const std::string& text, const Value* node, const char* tag) {
    if (node) return save(*node);
    const std::string key = std::string(tag) + text;
    if (auto it = interned_.find(key); it != interned_.end()) return get(it->second);
    save_str_text(text);
    const std::uint32_t idx = next_index();
    interned_.emplace(key, idx);
    put(idx);
  }
  void save_payload(const Value&, const std::unique_ptr<Global>& g) {
    save_global_text(g->module, g->name, g->module_str.get(), g->name_str.get());
  }
  void save_payload(const Value& v, const std::unique_ptr<Object>& o) {
    if (try_get(&v)) return;
    save(*o->callable);
    save(*o->args);
    switch (o->op) {
      case BuildOp::kReduce: write_op(op::kReduce); break;
      case BuildOp::kNewObj: write_op(op::kNewObj); break;
      case BuildOp::kNewObjEx:
        if (proto_ < 4) {
          throw Error(ErrorKind::kInvalidArgument, "an object made by NEWOBJ_EX needs pickle protocol 4 or more");
        }
        if (o->kwargs) save(*o->kwargs);
        else write_op(op::kEmptyDict);
        write_op(op::kNewObjEx);
        break;
    }
    memoize(&v);
    batch_appends(o->list_items);
    batch_setitems(o->dict_items);
    if (o->state) {
      save(*o->state);
      write_op(op::kBuild);
    }
  }
  void save_payload(const Value&, const PersistentId& p) {
    save(*p.pid);
    write_op(op::kBinPersId);
    if (on_pid_) on_pid_(p);
  }

  int proto_;
  const std::function<void(const PersistentId&)>& on_pid_;
  std::vector<std::byte> out_;
  bool framing_ = false;
  std::ptrdiff_t frame_start_ = -1;
  std::uint32_t memo_count_ = 0;
  std::unordered_map<const Value*, std::uint32_t> memo_;
  std::map<std::pair<std::string, std::string>, std::uint32_t> globals_;
  std::unordered_map<std::string, std::uint32_t> interned_;
  std::optional<std::uint32_t> latin1_index_;
  const std::unordered_map<const Value*, DictBatches>* streamed_ = nullptr;
  const std::function<void(std::span<const std::byte>)>* sink_ = nullptr;
  std::unordered_set<const Value*> persistent_;
  std::vector<const Value*>* batch_nodes_ = nullptr;  ///< memo entries of the batch being written
};

}  // namespace

std::vector<std::byte> write(const Value& root, int protocol, const std::function<void(const PersistentId&)>& on_pid) {
  return Pickler(protocol, on_pid).run(root);
}

void write_streamed(const Value& root, int protocol, const std::unordered_map<const Value*, DictBatches>& streamed,
                    const std::function<void(std::span<const std::byte>)>& out, const std::vector<ValuePtr>& persistent,
                    const std::function<void(const PersistentId&)>& on_pid) {
  Pickler p(protocol, on_pid);
  p.stream_to(streamed, out, persistent);
  p.run(root);
}

}  // namespace ckpt::pickle
