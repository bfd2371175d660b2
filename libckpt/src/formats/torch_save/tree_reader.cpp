// SPDX-License-Identifier: Apache-2.0
#include "formats/torch_save/tree_reader.hpp"

#include <algorithm>
#include <optional>
#include <unordered_set>

#include "ckpt/error.hpp"
#include "io/cursor.hpp"

namespace ckpt::detail {
namespace {

using pickle::GlobalKind;
using pickle::Value;
using pickle::ValuePtr;

class TreeReader {
 public:
  TreeReader(TorchSaveFile& file, std::string pkl_name, const LocateStorage& locate)
      : file_(file), pkl_(std::move(pkl_name)), locate_(locate) {}

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
    // A container the pickle shares (memoized and referenced again: torch.optim's state_dict()
    // shares one betas tuple among its groups) is listed under every path that reaches it, as
    // Python sees it under each key. One that contains itself is a cycle, listed once; and the
    // entries listed again are bounded, so that shared containers nested in each other (2^depth
    // paths) are refused rather than listed without end.
    if (on_path_.count(v.get())) return;
    const bool again = !walked_.insert(v.get()).second;
    if (again || relisting_ > 0) {
      const std::size_t n = items ? items->size() : seq ? seq->size() : o->list_items.size() + o->dict_items.size();
      relisted_ += n;
      if (relisted_ > kMaxRelisted) {
        fail(*v, "shared containers are reached by so many paths that listing them would exceed " + std::to_string(kMaxRelisted) +
                     " entries (a pickle built to expand)");
      }
    }
    on_path_.insert(v.get());
    relisting_ += again ? 1 : 0;
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
    relisting_ -= again ? 1 : 0;
    on_path_.erase(v.get());
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
    detail::checked_mul(numel, element_size(dt), pkl_, v->offset, "storage size");
    StorageBytes bytes = locate_(*key, dt, numel, *v);
    file_.storages.push_back({*key, dt, numel, *location, std::move(bytes.data), bytes.crc32});
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
  std::string pkl_;
  const LocateStorage& locate_;
  /// Entries that listing shared containers again may add (NOTE in walk()).
  static constexpr std::uint64_t kMaxRelisted = std::uint64_t{1} << 20;
  std::unordered_set<const Value*> walked_;   ///< containers listed at least once
  std::unordered_set<const Value*> on_path_;  ///< the containers from the root to the value walk() is at
  std::size_t relisting_ = 0;                 ///< > 0: inside a container listed again
  std::uint64_t relisted_ = 0;                ///< entries listed again so far
};

}  // namespace

void read_tree(TorchSaveFile& file, const std::string& pkl, const LocateStorage& locate) {
  TreeReader reader(file, pkl, locate);
  reader.walk(file.root, "");
  reader.register_remaining_storages(file.root);
}

}  // namespace ckpt::detail
