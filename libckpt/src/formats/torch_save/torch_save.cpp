// SPDX-License-Identifier: Apache-2.0
// torch.save archives: reading the record layout and the tensors of data.pkl, and writing them.
#include "ckpt/formats/torch_save.hpp"

#include <algorithm>
#include <charconv>
#include <unordered_set>

#include "ckpt/error.hpp"
#include "formats/torch_save/legacy.hpp"
#include "io/cursor.hpp"
#include "open_index.hpp"
#include "zip/crc32.hpp"
#include "zip/zip_reader.hpp"
#include "zip/zip_writer.hpp"

namespace ckpt {
namespace {

using pickle::GlobalKind;
using pickle::Value;
using pickle::ValuePtr;

std::string record_text(const SourcePtr& s) {
  auto bytes = s->read_vector(0, std::min<std::uint64_t>(s->size(), 64));
  return std::string(reinterpret_cast<const char*>(bytes.data()), bytes.size());
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

}  // namespace

void detail::refuse_legacy_torch_save(const ByteSource& src) {
  std::byte head[16] = {};
  const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(src.size(), sizeof head));
  src.read_at(0, std::span(head).first(n));
  if (n >= 2 && head[0] == std::byte{0x80} && static_cast<int>(head[1]) <= 5) {
    throw Error(ErrorKind::kUnsupported, src.name(), 0,
                "this is the legacy torch.save format (a bare pickle, from torch < 1.6 or "
                "_use_new_zipfile_serialization=False), which is not supported; load and re-save it with torch >= 1.6");
  }
  if (src.size() >= 262) {
    std::byte magic[5];
    src.read_at(257, magic);
    if (std::memcmp(magic, "ustar", 5) == 0) {
      throw Error(ErrorKind::kUnsupported, src.name(), 0,
                  "this is the legacy tar-based torch.save format (torch < 0.4), which is not supported");
    }
  }
}

namespace {

[[noreturn]] void refuse_non_zip(const ByteSource& src) {
  detail::refuse_legacy_torch_save(src);
  std::byte head[4] = {};
  const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(src.size(), sizeof head));
  src.read_at(0, std::span(head).first(n));
  char hex[64];
  std::snprintf(hex, sizeof hex, "%02x %02x %02x %02x", n > 0 ? static_cast<unsigned>(head[0]) : 0u,
                n > 1 ? static_cast<unsigned>(head[1]) : 0u, n > 2 ? static_cast<unsigned>(head[2]) : 0u,
                n > 3 ? static_cast<unsigned>(head[3]) : 0u);
  throw Error(ErrorKind::kFormat, src.name(), 0,
              std::string("not a torch.save file: starts with ") + hex + ", expected a zip archive (50 4b 03 04)");
}

// ---- reading ---------------------------------------------------------------------------------

class TreeReader {
 public:
  TreeReader(TorchSaveFile& file, const detail::ZipReader& zip, std::string pkl_name)
      : file_(file), zip_(zip), pkl_(std::move(pkl_name)) {}

  void walk(const ValuePtr& v, const std::string& path) {
    if (!v) return;
    if (auto t = as_tensor(*v)) {
      t->name = path;
      t->node = v;
      file_.tensors.push_back(std::move(*t));
      record_keys(path);
      return;
    }
    const auto* items = v->dict_items();
    const auto* seq = v->sequence();
    const pickle::Object* o = items ? nullptr : v->object();
    const bool walkable = items || seq || (o && (!o->list_items.empty() || !o->dict_items.empty() || (o->state && o->state->dict_items())));
    if (!walkable) {
      file_.objects.emplace_back(path, v);
      record_keys(path);
      return;
    }
    if (!visited_.insert(v.get()).second) return;  // shared containers are listed once
    if (items) {
      for (const auto& [k, x] : *items) walk_under(k, x, join(path, key_text(*k)));
    } else if (seq) {
      // A list or tuple's items: named by index, but a plain dict path cannot say list from tuple.
      for (std::size_t i = 0; i < seq->size(); ++i) walk_under(nullptr, (*seq)[i], join(path, std::to_string(i)));
    } else {
      // An object's items: their names, but no key path a plain dict could rebuild.
      keys_.push_back(nullptr);
      for (std::size_t i = 0; i < o->list_items.size(); ++i) walk(o->list_items[i], join(path, std::to_string(i)));
      for (const auto& [k, x] : o->dict_items) walk(x, join(path, key_text(*k)));
      if (o->state) walk_state(o->state, path);
      keys_.pop_back();
    }
  }

  // Storages that only tensors of kinds we do not list reference (quantized, sparse, subclasses)
  // are registered too, so that the file can be written back whole.
  void register_remaining_storages(const ValuePtr& root) {
    std::unordered_set<const Value*> seen;
    std::vector<const Value*> todo{root.get()};
    while (!todo.empty()) {
      const Value* v = todo.back();
      todo.pop_back();
      if (!v || !seen.insert(v).second) continue;
      std::visit(
          [&](const auto& p) {
            using T = std::decay_t<decltype(p)>;
            if constexpr (std::is_same_v<T, pickle::List> || std::is_same_v<T, pickle::Tuple> ||
                          std::is_same_v<T, pickle::Set> || std::is_same_v<T, pickle::FrozenSet>) {
              for (const auto& c : p.items) todo.push_back(c.get());
            } else if constexpr (std::is_same_v<T, pickle::Dict>) {
              for (const auto& [k, x] : p.items) {
                todo.push_back(k.get());
                todo.push_back(x.get());
              }
            } else if constexpr (std::is_same_v<T, std::unique_ptr<pickle::Object>>) {
              for (const ValuePtr* c : {&p->callable, &p->args, &p->kwargs, &p->state}) todo.push_back(c->get());
              for (const auto& c : p->list_items) todo.push_back(c.get());
              for (const auto& [k, x] : p->dict_items) {
                todo.push_back(k.get());
                todo.push_back(x.get());
              }
            } else if constexpr (std::is_same_v<T, pickle::PersistentId>) {
              register_storage(*v, p);
            }
          },
          v->payload);
    }
  }

 private:
  void register_storage(const Value& node, const pickle::PersistentId& p) {
    const auto* pid = p.pid ? p.pid->sequence() : nullptr;
    if (!pid || pid->size() != 5 || !(*pid)[2]->str()) return;
    if (file_.storage_index.count(*(*pid)[2]->str())) return;
    const pickle::Global* cls = (*pid)[1]->global();
    std::optional<DType> dtype;
    if (cls && cls->kind == GlobalKind::kUntypedStorage) dtype = DType::kUInt8;  // bytes, dtype unknown here
    std::shared_ptr<Value> holder(std::shared_ptr<Value>{}, const_cast<Value*>(&node));
    storage(node, holder, dtype);
  }

  // `x` under dict key `k`: a str key keeps the path rebuildable (DCP's convention, where an int is
  // a list index, leaves no room for int dict keys such as torch.optim's state has).
  void walk_under(const ValuePtr& k, const ValuePtr& x, const std::string& path) {
    keys_.push_back(k && k->str() ? k : nullptr);
    walk(x, path);
    keys_.pop_back();
  }

  void record_keys(const std::string& name) {
    if (keys_.empty() || std::find(keys_.begin(), keys_.end(), nullptr) != keys_.end()) return;
    file_.key_paths.emplace(name, keys_);  // the first of two leaves whose names collide keeps its path
  }

  void walk_state(const ValuePtr& state, const std::string& path) {
    if (const auto* items = state->dict_items()) {
      for (const auto& [k, x] : *items) walk(x, join(path, key_text(*k)));
    }
  }

  static std::string join(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }
  static std::string key_text(const Value& k) {
    if (const auto* s = k.str()) return *s;
    if (auto i = k.int64()) return std::to_string(*i);
    return pickle::repr(k, 200);
  }

  [[noreturn]] void fail(const Value& at, const std::string& message) const {
    throw Error(ErrorKind::kFormat, pkl_, at.offset, message);
  }

  std::int64_t int_arg(const Value& node, const ValuePtr& v, std::string_view what) const {
    auto i = v ? v->int64() : std::nullopt;
    if (!i) fail(node, std::string(what) + " is a " + (v ? v->type_name() : "missing value") + ", expected an int");
    return *i;
  }
  std::vector<std::int64_t> int_tuple(const Value& node, const ValuePtr& v, std::string_view what) const {
    const auto* seq = v ? v->sequence() : nullptr;
    // torch.Size(...) is accepted where a tuple is expected.
    if (!seq && v && v->callable_kind() == GlobalKind::kTorchSize) {
      const auto* args = v->object()->args->sequence();
      if (args && args->size() == 1) seq = (*args)[0]->sequence();
    }
    if (!seq) fail(node, std::string(what) + " is a " + (v ? v->type_name() : "missing value") + ", expected a tuple of ints");
    std::vector<std::int64_t> out;
    out.reserve(seq->size());
    for (const auto& x : *seq) {
      auto i = x->int64();
      if (!i) fail(node, std::string(what) + " holds a " + x->type_name() + ", expected ints");
      if (*i < 0) fail(node, std::string(what) + " holds " + std::to_string(*i) + ", expected values >= 0");
      out.push_back(*i);
    }
    return out;
  }

  // Resolves a ('storage', cls, key, location, numel) persistent id; `dtype` is v3's explicit dtype.
  std::size_t storage(const Value& node, const ValuePtr& v, std::optional<DType> dtype) {
    const auto* pid_holder = v ? v->get_if<pickle::PersistentId>() : nullptr;
    if (!pid_holder) fail(node, "tensor storage is a " + (v ? v->type_name() : std::string("missing value")) + ", expected a persistent id");
    const auto* pid = pid_holder->pid ? pid_holder->pid->sequence() : nullptr;
    if (!pid || !pid_holder->pid->is<pickle::Tuple>() || pid->size() != 5) {
      fail(*v, "storage persistent id is not a 5-tuple ('storage', class, key, location, numel)");
    }
    const auto* tag = (*pid)[0]->str();
    if (!tag || *tag != "storage") fail(*v, "persistent id tag is not 'storage'");
    const pickle::Global* cls = (*pid)[1]->global();
    if (!cls) fail(*v, "storage class is a " + (*pid)[1]->type_name() + ", expected a global");
    const auto* key = (*pid)[2]->str();
    const auto* location = (*pid)[3]->str();
    if (!key || !location) fail(*v, "storage key and location must be strings");
    const std::int64_t numel_i = int_arg(*v, (*pid)[4], "storage numel");
    if (numel_i < 0) fail(*v, "storage numel " + std::to_string(numel_i) + " is negative");
    std::uint64_t numel = static_cast<std::uint64_t>(numel_i);
    DType dt{};
    if (cls->kind == GlobalKind::kStorageClass) {
      dt = *dtype_from_storage_class(cls->name);
    } else if (cls->kind == GlobalKind::kUntypedStorage && dtype) {
      dt = *dtype;
      const std::size_t es = element_size(dt);
      if (numel % es != 0) {
        fail(*v, "untyped storage of " + std::to_string(numel) + " bytes is not a whole number of " +
                     std::string(name(dt)) + " elements");
      }
      numel /= es;
    } else {
      fail(*v, "storage class '" + cls->module + "." + cls->name + "' is not a torch storage class" +
                   (cls->kind == GlobalKind::kUntypedStorage ? " usable without a dtype" : ""));
    }
    if (auto it = file_.storage_index.find(*key); it != file_.storage_index.end()) {
      const TorchStorage& s = file_.storages[it->second];
      if (s.dtype != dt || s.numel != numel) {
        fail(*v, "storage '" + *key + "' is used as " + std::to_string(numel) + " " + std::string(name(dt)) +
                     " elements and as " + std::to_string(s.numel) + " " + std::string(name(s.dtype)));
      }
      return it->second;
    }
    const std::string record = file_.archive_name + "/data/" + *key;
    const detail::ZipEntry* e = zip_.find(record);
    if (!e) fail(*v, "storage '" + *key + "' has no record '" + record + "' in the archive");
    const std::uint64_t want = detail::checked_mul(numel, element_size(dt), pkl_, v->offset, "storage size");
    if (e->size != want) {
      throw Error(ErrorKind::kFormat, zip_.source()->name(), e->data_offset,
                  "record '" + record + "' holds " + std::to_string(e->size) + " bytes, but its storage is " +
                      std::to_string(numel) + " " + std::string(name(dt)) + " elements (" + std::to_string(want) +
                      " bytes)");
    }
    file_.storages.push_back({*key, dt, numel, *location, zip_.open(*e), e->crc32});
    file_.storage_index.emplace(*key, file_.storages.size() - 1);
    return file_.storages.size() - 1;
  }

  std::optional<TorchTensor> as_tensor(const Value& v) {
    const pickle::Object* o = v.object();
    if (!o) return std::nullopt;
    const GlobalKind k = v.callable_kind();
    const auto* args = o->args ? o->args->sequence() : nullptr;
    if (!args) return std::nullopt;
    switch (k) {
      case GlobalKind::kRebuildParameter:
      case GlobalKind::kRebuildParameterWithState: {
        if (args->size() < 3) fail(v, "_rebuild_parameter takes at least 3 arguments, got " + std::to_string(args->size()));
        auto inner = as_tensor(*(*args)[0]);
        if (!inner) fail(v, "parameter wraps a " + (*args)[0]->type_name() + ", expected a tensor");
        const auto* rg = (*args)[1]->get_if<bool>();
        if (!rg) fail(v, "parameter requires_grad is a " + (*args)[1]->type_name() + ", expected a bool");
        inner->requires_grad = *rg;
        inner->is_parameter = true;
        return inner;
      }
      case GlobalKind::kRebuildFromTypeV2: {
        // _rebuild_from_type_v2(func, type, args, state): a tensor subclass; read func(*args).
        if (args->size() != 4 || !(*args)[2]->sequence()) return std::nullopt;
        const pickle::Global* f = (*args)[0]->global();
        if (!f) return std::nullopt;
        return rebuild(v, f->kind, *(*args)[2]->sequence());
      }
      default: return rebuild(v, k, *args);
    }
  }

  std::optional<TorchTensor> rebuild(const Value& v, GlobalKind k, const std::vector<ValuePtr>& args) {
    std::optional<DType> dtype;
    std::size_t min_args = 0, max_args = 0;
    switch (k) {
      case GlobalKind::kRebuildTensor: min_args = max_args = 4; break;
      case GlobalKind::kRebuildTensorV2: min_args = 6; max_args = 7; break;
      case GlobalKind::kRebuildTensorV3: min_args = 7; max_args = 8; break;
      default: return std::nullopt;
    }
    if (args.size() < min_args || args.size() > max_args) {
      fail(v, std::string(pickle::to_string(k)) + " takes " + std::to_string(min_args) +
                  (min_args == max_args ? "" : " or " + std::to_string(max_args)) + " arguments, got " +
                  std::to_string(args.size()));
    }
    if (k == GlobalKind::kRebuildTensorV3) {
      const pickle::Global* g = args[6]->global();
      if (!g || g->kind != GlobalKind::kDType) fail(v, "_rebuild_tensor_v3 dtype is a " + args[6]->type_name() + ", expected a torch dtype");
      dtype = dtype_from_torch_name(g->name);
    }
    TorchTensor t;
    t.storage = storage(v, args[0], dtype);
    const TorchStorage& s = file_.storages[t.storage];
    t.dtype = s.dtype;
    t.storage_offset = int_arg(v, args[1], "storage_offset");
    t.shape = int_tuple(v, args[2], "size");
    t.stride = int_tuple(v, args[3], "stride");
    if (k != GlobalKind::kRebuildTensor) {
      const auto* rg = args[4]->get_if<bool>();
      if (!rg) fail(v, "requires_grad is a " + args[4]->type_name() + ", expected a bool");
      t.requires_grad = *rg;
    }
    if (t.shape.size() != t.stride.size()) {
      fail(v, "size has " + std::to_string(t.shape.size()) + " dimensions but stride " + std::to_string(t.stride.size()));
    }
    if (t.storage_offset < 0) fail(v, "storage_offset " + std::to_string(t.storage_offset) + " is negative");
    // The last element a view touches must lie inside the storage.
    std::uint64_t last = static_cast<std::uint64_t>(t.storage_offset);
    bool empty = false;
    for (std::size_t d = 0; d < t.shape.size(); ++d) {
      if (t.shape[d] == 0) empty = true;
    }
    if (!empty) {
      for (std::size_t d = 0; d < t.shape.size(); ++d) {
        const std::uint64_t span = detail::checked_mul(static_cast<std::uint64_t>(t.shape[d] - 1),
                                                       static_cast<std::uint64_t>(t.stride[d]), pkl_, v.offset, "view extent");
        last = detail::checked_add(last, span, pkl_, v.offset, "view extent");
      }
      if (last >= s.numel) {
        fail(v, "tensor view reaches element " + std::to_string(last) + " of storage '" + s.key + "', which has " +
                    std::to_string(s.numel) + " elements");
      }
    }
    return t;
  }

  TorchSaveFile& file_;
  std::vector<ValuePtr> keys_;  ///< the keys from the root to the value walk() is at
  const detail::ZipReader& zip_;
  std::string pkl_;
  std::unordered_set<const Value*> visited_;
};

}  // namespace

std::uint64_t TorchTensor::numel() const noexcept {
  std::uint64_t n = 1;
  for (auto d : shape) n *= static_cast<std::uint64_t>(d);
  return n;
}

bool TorchTensor::is_contiguous() const noexcept {
  std::int64_t expected = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    if (shape[i] != 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

bool looks_like_torch_save(const ByteSource& source) {
  if (source.size() < 4) return false;
  std::byte head[4];
  source.read_at(0, head);
  return head[0] == std::byte{'P'} && head[1] == std::byte{'K'} && head[2] == std::byte{3} && head[3] == std::byte{4};
}

TorchSaveFile read_torch_save(SourcePtr source) {
  if (!looks_like_torch_save(*source)) refuse_non_zip(*source);
  detail::ZipReader zip(source);
  TorchSaveFile file;
  const auto& entries = zip.entries();
  if (entries.empty()) throw Error(ErrorKind::kFormat, source->name(), zip.eocd_offset(), "zip archive has no records");
  const std::string& first = entries.front().name;
  const auto slash = first.find('/');
  if (slash == std::string::npos || slash == 0) {
    throw Error(ErrorKind::kFormat, source->name(), entries.front().local_header_offset,
                "first record '" + first + "' is not inside a folder (torch.save puts every record under one)");
  }
  file.archive_name = first.substr(0, slash);
  const std::string prefix = file.archive_name + "/";
  for (const auto& e : entries) {
    if (!e.name.starts_with(prefix)) {
      throw Error(ErrorKind::kFormat, source->name(), e.local_header_offset,
                  "record '" + e.name + "' is outside the archive folder '" + file.archive_name + "/'");
    }
    file.records.push_back(e.name.substr(prefix.size()));
  }

  const detail::ZipEntry* version = zip.find(prefix + "version");
  if (!version) version = zip.find(prefix + ".data/version");
  if (!version) {
    throw Error(ErrorKind::kFormat, source->name(), zip.eocd_offset(),
                "archive has no '" + prefix + "version' record (torch.load requires it)");
  }
  {
    const std::string text = trim(record_text(zip.open(*version)));
    int v = 0;
    auto [p, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    if (ec != std::errc() || p != text.data() + text.size() || v < 1 || v > 10) {
      throw Error(ErrorKind::kFormat, source->name(), version->data_offset,
                  "version record '" + text.substr(0, 20) + "' is not an integer in [1, 10]");
    }
    file.version = v;
  }
  if (const detail::ZipEntry* bo = zip.find(prefix + "byteorder")) {
    const std::string text = trim(record_text(zip.open(*bo)));
    if (text == "big") {
      throw Error(ErrorKind::kUnsupported, source->name(), bo->data_offset,
                  "big-endian storages (byteorder 'big') are not supported");
    }
    if (text != "little") {
      throw Error(ErrorKind::kFormat, source->name(), bo->data_offset,
                  "byteorder record is '" + text.substr(0, 20) + "', expected 'little' or 'big'");
    }
  }
  if (const detail::ZipEntry* c = zip.find(prefix + "constants.pkl")) {
    throw Error(ErrorKind::kUnsupported, source->name(), c->local_header_offset,
                "this is a TorchScript archive (it has constants.pkl), not a torch.save checkpoint");
  }
  const detail::ZipEntry* pkl = zip.find(prefix + "data.pkl");
  if (!pkl) throw Error(ErrorKind::kFormat, source->name(), zip.eocd_offset(), "archive has no '" + prefix + "data.pkl' record");
  SourcePtr pkl_src = zip.open(*pkl);
  std::vector<std::byte> owned;
  std::span<const std::byte> bytes;
  if (auto v = pkl_src->view(0, pkl_src->size())) {
    bytes = *v;
  } else {
    owned = pkl_src->read_vector(0, pkl_src->size());
    bytes = owned;
  }
  file.root = pickle::parse(bytes, pkl_src->name());
  TreeReader reader(file, zip, pkl_src->name());
  reader.walk(file.root, "");
  reader.register_remaining_storages(file.root);
  return file;
}

// ---- writing ---------------------------------------------------------------------------------

TorchSaveRecord TorchSaveRecords::operator[](std::size_t i) const {
  auto literal = [](const Literal& l) {
    return TorchSaveRecord{l.name, l.written ? l.size : l.bytes.size(), l.bytes, false, l.written};
  };
  if (i < head_.size()) return literal(head_[i]);
  i -= head_.size();
  if (i < sizes_.size()) return TorchSaveRecord{storage_name(i), sizes_[i], {}, true, std::nullopt};
  return literal(tail_.at(i - sizes_.size()));
}

std::string_view TorchSaveRecords::storage_name(std::size_t s) const {
  const std::size_t begin = s == 0 ? 0 : name_ends_[s - 1];
  return std::string_view(names_).substr(begin, name_ends_[s] - begin);
}

void TorchSaveRecords::add_literal(std::string name, std::vector<std::byte> bytes, std::optional<std::uint32_t> written, std::uint64_t size) {
  (sizes_.empty() ? head_ : tail_).push_back({std::move(name), std::move(bytes), written, size});
}

void TorchSaveRecords::set_literal(std::size_t i, std::vector<std::byte> bytes, std::optional<std::uint32_t> written, std::uint64_t size) {
  Literal& l = i < head_.size() ? head_[i] : tail_.at(i - head_.size() - sizes_.size());
  l.bytes = std::move(bytes);
  l.written = written;
  l.size = size;
}

bool TorchSaveRecords::add_storage(std::string_view key, std::uint64_t size) {
  auto hash = [](std::string_view k) { return std::hash<std::string_view>()(k); };
  auto key_of = [&](std::size_t s) { return storage_name(s).substr(5); };
  if (detail::open_index_find(slots_, hash(key), [&](std::size_t s) { return key_of(s) == key; }) != detail::kNotIndexed) return false;
  if (!tail_.empty()) internal_error("TorchSaveRecords: a storage record after the last literal one");
  if (names_.size() + 5 + key.size() > 0xffffffffu) throw std::length_error("torch.save record names past 4 GiB");
  names_ += "data/";
  names_ += key;
  name_ends_.push_back(static_cast<std::uint32_t>(names_.size()));
  sizes_.push_back(size);
  detail::open_index_add(slots_, sizes_.size(), [&](std::size_t s) { return hash(key_of(s)); });
  return true;
}

void TorchSaveRecords::sort_storages(const std::function<bool(std::string_view, std::string_view)>& less) {
  std::vector<std::uint32_t> order(sizes_.size());
  for (std::size_t s = 0; s < order.size(); ++s) order[s] = static_cast<std::uint32_t>(s);
  std::stable_sort(order.begin(), order.end(), [&](std::uint32_t x, std::uint32_t y) {
    return less(storage_name(x).substr(5), storage_name(y).substr(5));
  });
  std::string names;
  names.reserve(names_.size());
  std::vector<std::uint32_t> ends(order.size());
  std::vector<std::uint64_t> sizes(order.size());
  for (std::size_t s = 0; s < order.size(); ++s) {
    names += storage_name(order[s]);
    ends[s] = static_cast<std::uint32_t>(names.size());
    sizes[s] = sizes_[order[s]];
  }
  names_ = std::move(names);
  name_ends_ = std::move(ends);
  sizes_ = std::move(sizes);
  std::vector<std::uint32_t>().swap(slots_);  // keys are looked up only while records are added
}

namespace {
using OnPersistentId = std::function<void(const pickle::PersistentId&)>;

std::vector<std::byte> text_bytes(std::string_view text) {
  const auto b = std::as_bytes(std::span(text.data(), text.size()));
  return {b.begin(), b.end()};
}

// The records of a torch.save archive whose data.pkl `pickle_root(on_pid, records)` pickles into
// record 0 (TorchSaveRecords::set_literal), calling on_pid for each persistent id; a storage
// record is made for each storage key when first met.
TorchSaveRecords plan_records(const TorchSaveWriteOptions& options, const std::string& target,
                              const std::function<void(const OnPersistentId&, TorchSaveRecords&)>& pickle_root) {
  TorchSaveRecords records;
  records.add_literal("data.pkl", {});
  if (options.layout == TorchSaveLayout::kCurrent) {
    records.add_literal(".format_version", text_bytes("1"));
    records.add_literal(".storage_alignment", text_bytes("64"));
    records.add_literal("byteorder", text_bytes("little"));
  }
  auto on_pid = [&](const pickle::PersistentId& p) {
    const auto* pid = p.pid ? p.pid->sequence() : nullptr;
    if (!pid || pid->size() != 5 || !(*pid)[0]->str() || *(*pid)[0]->str() != "storage" || !(*pid)[1]->global() ||
        !(*pid)[2]->str() || !(*pid)[4]->int64() || *(*pid)[4]->int64() < 0) {
      throw Error(ErrorKind::kInvalidArgument, target, std::nullopt,
                  "persistent id is not a torch storage tuple ('storage', class, key, location, numel)");
    }
    const pickle::Global* cls = (*pid)[1]->global();
    std::uint64_t es = 1;
    if (cls->kind == GlobalKind::kStorageClass) es = element_size(*dtype_from_storage_class(cls->name));
    else if (cls->kind != GlobalKind::kUntypedStorage) {
      throw Error(ErrorKind::kInvalidArgument, target, std::nullopt,
                  "storage class '" + cls->module + "." + cls->name + "' is not a torch storage class");
    }
    records.add_storage(*(*pid)[2]->str(), static_cast<std::uint64_t>(*(*pid)[4]->int64()) * es);
  };
  pickle_root(on_pid, records);
  // torch 1.13 writes storages in sorted(key) order, strings compared ("10" before "2"); torch 2.x
  // with .format_version 1 in numeric key order.
  auto numeric = [](std::string_view k) {
    std::uint64_t v = 0;
    auto [p, ec] = std::from_chars(k.data(), k.data() + k.size(), v);
    return std::pair{ec == std::errc() && p == k.data() + k.size() ? 0 : 1, v};
  };
  if (options.layout == TorchSaveLayout::kTorch113) {
    records.sort_storages([](std::string_view x, std::string_view y) { return x < y; });
  } else {
    records.sort_storages([&](std::string_view x, std::string_view y) { return numeric(x) < numeric(y); });
  }
  records.add_literal("version", text_bytes("3\n"));
  return records;
}
}  // namespace

TorchSaveRecords plan_torch_save(const Value& root, const TorchSaveWriteOptions& options, const std::string& target) {
  return plan_records(options, target, [&](const OnPersistentId& on_pid, TorchSaveRecords& records) {
    records.set_literal(0, pickle::write(root, 2, on_pid));
  });
}

TorchSaveRecords plan_torch_save_streamed(const Value& root, const std::unordered_map<const Value*, pickle::DictBatches>& streamed,
                                          const std::vector<ValuePtr>& persistent, const TorchSaveWriteOptions& options,
                                          const std::string& target, const std::function<void(std::span<const std::byte>)>& pkl_out) {
  return plan_records(options, target, [&](const OnPersistentId& on_pid, TorchSaveRecords& records) {
    std::uint32_t crc = 0;
    std::uint64_t size = 0;
    pickle::write_streamed(
        root, 2, streamed,
        [&](std::span<const std::byte> b) {
          crc = detail::crc32_update(crc, b);
          size += b.size();
          pkl_out(b);
        },
        persistent, on_pid);
    records.set_literal(0, {}, crc, size);
  });
}

void write_torch_save(ByteSink& sink, const Value& root, const std::function<SourcePtr(const std::string&)>& storage_data,
                      const TorchSaveWriteOptions& options) {
  const TorchSaveRecords records = plan_torch_save(root, options, sink.name());
  std::vector<SourcePtr> data(records.size());
  for (std::size_t i = 0; i < records.size(); ++i) {
    const TorchSaveRecord r = records[i];
    if (!r.storage) continue;
    data[i] = storage_data(std::string(r.storage_key()));
    if (!data[i] || data[i]->size() != r.size) {
      throw Error(ErrorKind::kInvalidArgument, sink.name(), std::nullopt,
                  "storage '" + std::string(r.storage_key()) + "' needs " + std::to_string(r.size) + " bytes, its data has " +
                      (data[i] ? std::to_string(data[i]->size()) : std::string("none")));
    }
  }
  detail::ZipWriter zip(sink, options.archive_name);
  for (std::size_t i = 0; i < records.size(); ++i) {
    const TorchSaveRecord r = records[i];
    if (!data[i]) {
      zip.add(r.name, r.bytes);
      continue;
    }
    zip.begin_record(r.name, r.size);
    stream_range(*data[i], 0, r.size, [&](std::span<const std::byte> piece) { zip.write(piece); });
    zip.end_record();
  }
  zip.finish();
}

TorchSaveBuilder::TorchSaveBuilder(StorageKeys keys)
    : key_nodes_(keys),
      tag_(pickle::make_str("storage")),
      location_(pickle::make_str("cpu")),
      hooks_global_(pickle::make_global("collections", "OrderedDict")) {}

std::size_t TorchSaveBuilder::add_storage(DType dtype, SourcePtr data) {
  if (data->size() % element_size(dtype) != 0) {
    throw Error(ErrorKind::kInvalidArgument, data->name(), std::nullopt,
                std::to_string(data->size()) + " bytes are not a whole number of " + std::string(name(dtype)) + " elements");
  }
  const std::uint64_t nbytes = data->size();
  storages_.push_back({nbytes, dtype});
  data_.resize(storages_.size());
  data_.back() = std::move(data);
  if (key_nodes_ == StorageKeys::kShared) keys_.push_back(key(storages_.size() - 1));
  return storages_.size() - 1;
}

std::size_t TorchSaveBuilder::reserve_storage(DType dtype, std::uint64_t numel) {
  storages_.push_back({numel * element_size(dtype), dtype});
  if (key_nodes_ == StorageKeys::kShared) keys_.push_back(key(storages_.size() - 1));
  return storages_.size() - 1;
}

std::string TorchSaveBuilder::storage_key(std::size_t storage) const {
  if (storage >= storages_.size()) internal_error("TorchSaveBuilder::storage_key: no such storage");
  return std::to_string(storage);
}

pickle::ValuePtr TorchSaveBuilder::key(std::size_t storage) const {
  if (storage < keys_.size()) return keys_[storage];
  return pickle::make_str(std::to_string(storage));
}

pickle::ValuePtr TorchSaveBuilder::tensor(std::size_t storage, std::vector<std::int64_t> shape) {
  std::vector<std::int64_t> stride(shape.size());
  std::int64_t s = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    stride[i] = s;
    s *= shape[i];
  }
  return tensor(storage, std::move(shape), std::move(stride), 0);
}

pickle::ValuePtr TorchSaveBuilder::tensor(std::size_t storage, std::vector<std::int64_t> shape,
                                          std::vector<std::int64_t> stride, std::int64_t storage_offset) {
  if (storage >= storages_.size()) internal_error("TorchSaveBuilder::tensor: no such storage");
  const Storage& s = storages_[storage];
  const DTypeInfo& di = info(s.dtype);
  const bool legacy = !di.storage_class.empty();
  const std::int64_t numel = static_cast<std::int64_t>(s.nbytes / di.element_size);
  auto ints = [](const std::vector<std::int64_t>& v) {
    std::vector<ValuePtr> out;
    for (auto x : v) out.push_back(pickle::make_int(x));
    return pickle::make_tuple(std::move(out));
  };
  ValuePtr pid = pickle::make_persistent_id(pickle::make_tuple(
      {tag_, legacy ? global("torch", std::string(di.storage_class)) : global("torch.storage", "UntypedStorage"),
       key(storage), location_, pickle::make_int(legacy ? numel : static_cast<std::int64_t>(s.nbytes))}));
  std::vector<ValuePtr> args{pid, pickle::make_int(storage_offset), ints(shape), ints(stride), pickle::make_bool(false),
                             pickle::make_object(hooks_global_, pickle::BuildOp::kReduce, pickle::make_tuple())};
  if (!legacy) args.push_back(global("torch", std::string(di.name)));
  return pickle::make_object(global("torch._utils", legacy ? "_rebuild_tensor_v2" : "_rebuild_tensor_v3"),
                             pickle::BuildOp::kReduce, pickle::make_tuple(std::move(args)));
}

pickle::ValuePtr TorchSaveBuilder::global(const std::string& module, const std::string& name) {
  const std::string key = module + "." + name;
  auto it = globals_.find(key);
  if (it == globals_.end()) it = globals_.emplace(key, pickle::make_global(module, name)).first;
  return it->second;
}

pickle::ValuePtr TorchSaveBuilder::parameter(pickle::ValuePtr tensor, bool requires_grad) {
  return pickle::make_object(pickle::make_global("torch._utils", "_rebuild_parameter"), pickle::BuildOp::kReduce,
                             pickle::make_tuple({std::move(tensor), pickle::make_bool(requires_grad),
                                                 pickle::make_object(hooks_global_, pickle::BuildOp::kReduce, pickle::make_tuple())}));
}

void TorchSaveBuilder::write(ByteSink& sink, const Value& root, const TorchSaveWriteOptions& options) const {
  write_torch_save(
      sink, root,
      [&](const std::string& key) -> SourcePtr {
        std::size_t i = 0;
        auto [p, ec] = std::from_chars(key.data(), key.data() + key.size(), i);
        if (ec != std::errc() || p != key.data() + key.size() || i >= storages_.size()) return nullptr;
        return i < data_.size() ? data_[i] : nullptr;
      },
      options);
}

}  // namespace ckpt
