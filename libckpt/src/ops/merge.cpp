// SPDX-License-Identifier: Apache-2.0
#include "ckpt/ops/merge.hpp"


#include <algorithm>
#include <charconv>
#include <deque>
#include <functional>
#include <iterator>
#include <limits>
#include <map>
#include <memory>
#include <span>
#include <unordered_map>

#include "ckpt/cast.hpp"
#include "ckpt/copy.hpp"
#include "ckpt/error.hpp"
#include "ckpt/formats/hdf5.hpp"
#include "ckpt/formats/safetensors.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "ckpt/ops/validate.hpp"
#include "formats/torch_save/archive_plan.hpp"
#include "io/outputs.hpp"
#include "open_index.hpp"
#include "ops/assemble.hpp"
#include "text_helpers.hpp"

namespace ckpt {
namespace {

using pickle::Value;
using pickle::ValuePtr;

// One key of a planner_data path: a str (a dict key) or an int (a list index). Its text is a view
// of the input's own: the checkpoint's key paths, an entry's name, or a meta.pt key the Merger
// keeps (meta_names_).
struct Key {
  bool is_int = false;
  std::string_view text;
  std::int64_t index = 0;
  bool operator==(const Key& o) const { return is_int == o.is_int && (is_int ? index == o.index : text == o.text); }
  std::string display() const { return is_int ? std::to_string(index) : std::string(text); }
};

// A Key as the output tree keeps it, in half a Key's size: there is one per node of the output,
// which has a node per entry.
class PackedKey {
 public:
  explicit PackedKey(const Key& k) {
    if (k.is_int) {
      u_.index = k.index;
      size_ = kInt;
      return;
    }
    if (k.text.size() >= kInt) throw std::length_error("a key of 4 GiB");
    u_.text = k.text.data();
    size_ = static_cast<std::uint32_t>(k.text.size());
  }
  Key key() const { return size_ == kInt ? Key{true, {}, u_.index} : Key{false, {u_.text, size_}, 0}; }

 private:
  static constexpr std::uint32_t kInt = 0xffffffffu;
  union {
    const char* text;
    std::int64_t index;
  } u_{};
  std::uint32_t size_ = 0;
};
static_assert(sizeof(PackedKey) == 16);

// One entry to write, kept small because there is one per entry. Its key path is made when it is
// asked for (Merger::path), never kept; the value of an object is kept beside (Merger::values_).
struct Leaf {
  enum Kind : std::uint8_t { kTensor, kObject, kMeta } kind = kTensor;
  bool flat = false;     ///< its path is its name alone (a torch.save input whose leaves are not all keyed)
  bool int_key = false;  ///< kMeta: its key is an int, `name` its decimal text
  DType out{};
  std::uint32_t value = 0;  ///< objects and meta.pt entries: their value's index in Merger::values_
  std::string_view name;  ///< the entry's own name, or a meta.pt key's text (Merger::meta_names_)
  const TensorEntry* tensor = nullptr;
  const ObjectEntry* object = nullptr;  // kObject: the entry its value is read from
};
static_assert(sizeof(Leaf) <= 40);

// Where a storage of the output comes from (there is one per tensor, so it stays two words).
struct StorageSource {
  const TensorEntry* tensor = nullptr;  // assembled from its chunks, as `out`
  DType out{};
  std::uint32_t raw = 0;                // or, without a tensor, copied as Merger::raws_[raw] is (tensors inside objects)
};
static_assert(sizeof(StorageSource) <= 16);

// The nested output, built with torch's _traverse.set_element rules. A node holds its children,
// when it has any, out of line: nearly every node is a leaf, and a leaf should cost its key and
// a pointer, not an empty dict, list and hash map.
struct Node {
  enum Kind : std::uint8_t { kNone, kDict, kList, kLeaf } kind = kNone;
  const Leaf* leaf = nullptr;
  struct Children;
  std::unique_ptr<Children> c;  ///< a dict's or a list's, made when the first is added

  /// The child under `k` of a dict, or nullptr.
  Node* find(const Key& k);
  /// Appends a child under `k` to a dict (not there yet) and returns it.
  Node& add(const Key& k);
  /// A list's child `i`, the list grown with None nodes to hold it.
  Node& at(std::size_t i);
  std::span<std::pair<PackedKey, Node>> dict() const;
  std::span<Node> list() const;
};

struct Node::Children {
  std::vector<std::pair<PackedKey, Node>> dict;  ///< in insertion order, as a Python dict
  std::vector<Node> list;
  std::vector<std::uint32_t> slots;        ///< the dict's keys' indices, hashed (NOTE [Open index])

  static std::size_t hash(const Key& k) {
    return k.is_int ? std::hash<std::int64_t>{}(k.index) * 0x9e3779b97f4a7c15ull : std::hash<std::string_view>{}(k.text);
  }
  Node* find(const Key& k) {
    const std::size_t i = detail::open_index_find(slots, hash(k), [&](std::size_t j) { return dict[j].first.key() == k; });
    return i == detail::kNotIndexed ? nullptr : &dict[i].second;
  }
  Node& add(const Key& k) {
    dict.emplace_back(PackedKey(k), Node{});
    detail::open_index_add(slots, dict.size(), [&](std::size_t j) { return hash(dict[j].first.key()); });
    return dict.back().second;
  }
};

Node* Node::find(const Key& k) { return c ? c->find(k) : nullptr; }
Node& Node::add(const Key& k) {
  if (!c) c = std::make_unique<Children>();
  return c->add(k);
}
Node& Node::at(std::size_t i) {
  if (!c) c = std::make_unique<Children>();
  if (c->list.size() <= i) c->list.resize(i + 1);
  return c->list[i];
}
std::span<std::pair<PackedKey, Node>> Node::dict() const { return c ? std::span(c->dict) : std::span<std::pair<PackedKey, Node>>(); }
std::span<Node> Node::list() const { return c ? std::span(c->list) : std::span<Node>(); }


std::string path_text(const std::vector<Key>& path) {
  std::string s;
  for (const Key& k : path) s += (s.empty() ? "" : ".") + k.display();
  return s;
}

// `entries`: how many the output has, the most a list may hold (a list index is grown to with
// None, as torch does; past that it can only be a hostile path, which would ask for any memory).
void set_element(Node& root, const Leaf& leaf, const std::vector<Key>& path, std::size_t entries, const std::string& where) {
  auto fail = [&](const std::string& what) {
    throw Error(ErrorKind::kFormat, where, std::nullopt, "planner_data path " + path_text(path) + " of '" + std::string(leaf.name) + "' " + what);
  };
  // A child's node stays where it is while the walk goes below it (only its own children grow).
  auto slot = [&](Node& container, const Key& k) -> Node& {
    if (container.kind == Node::kDict) {
      if (Node* n = container.find(k)) return *n;
      return container.add(k);
    }
    if (container.kind != Node::kList) fail("goes through a value that is not a dict or list");
    if (!k.is_int || k.index < 0) fail("indexes a list with '" + k.display() + "'");
    if (static_cast<std::uint64_t>(k.index) >= entries) {
      fail("indexes a list at " + k.display() + ", past the " + std::to_string(entries) + " entries there are to put in it");
    }
    return container.at(static_cast<std::size_t>(k.index));
  };
  Node* cur = &root;
  for (std::size_t i = 1; i < path.size(); ++i) {
    Node& next = slot(*cur, path[i - 1]);
    if (next.kind == Node::kNone) next.kind = path[i].is_int ? Node::kList : Node::kDict;  // setdefault / None filled
    cur = &next;
  }
  Node& last = slot(*cur, path.back());
  last = Node{Node::kLeaf, &leaf, nullptr};
}

class Merger {
 public:
  Merger(const Checkpoint& c, Output& out, const MergeOptions& o) : c_(c), out_(out), output_(out.path()), o_(o), reader_(c, FileAccess::kRead) {}

  MergeResult run(bool dry_run) {
    if (out_.in_file_system()) detail::refuse_output_over_input(c_.root, output_);
    require_valid_index(c_);
    if (o_.format == MergeFormat::kHdf5 && !hdf5_available()) {
      throw Error(ErrorKind::kUnsupported, output_.string(), std::nullopt, "HDF5 is not available: " + hdf5_unavailable_reason());
    }
    if (o_.format == MergeFormat::kHdf5 && !out_.in_file_system()) {
      throw Error(ErrorKind::kUnsupported, output_.string(), std::nullopt, "HDF5 is written to a file only (libhdf5 lays the file out by its name)");
    }
    const bool shards = o_.format == MergeFormat::kSafetensors && o_.max_shard_size;
    if (o_.hf_config && o_.format != MergeFormat::kSafetensors) {
      throw Error(ErrorKind::kInvalidArgument, output_.string(), std::nullopt, "config.json goes with a safetensors output only");
    }
    if (o_.hf_config && !shards && !out_.in_file_system()) {
      throw Error(ErrorKind::kUnsupported, output_.string(), std::nullopt, "config.json goes beside a file in the file system, or into a directory output");
    }
    if (!dry_run) {
      out_.prepare(shards ? (o_.hf_config ? OutputKind::kHuggingFaceFolder : OutputKind::kSafetensorsDirectory) : OutputKind::kFile, o_.progress);
      if (o_.hf_config && !shards) check_output(config_beside(), OutputKind::kFile, o_.overwrite);
    }
    collect();
    check_selection();
    note_shared_storages();
    if (!renames_.empty() && o_.format == MergeFormat::kTorch && o_.layout == MergeLayout::kNested &&
        !std::all_of(leaves_.begin(), leaves_.end(), [](const Leaf& l) { return l.flat || l.kind == Leaf::kMeta; })) {
      throw Error(ErrorKind::kInvalidArgument, output_.string(), std::nullopt,
                  "--rename and --strip-prefix rename flat names: with --format torch, add --layout flat");
    }
    MergeResult r = o_.format == MergeFormat::kTorch ? torch(dry_run) : o_.format == MergeFormat::kHdf5 ? hdf5(dry_run) : safetensors(dry_run);
    check_casts(CastCheck::kReport);
    r.operation = Operation::kMerge;
    r.dry_run = dry_run;
    return r;
  }

  // What copy tasks report: casts' damage, and (--verify) the CRCs of what they read.
  detail::TaskChecks checks() { return {&ledger_, o_.verify == Verify::kChecksums ? &crcs_ : nullptr}; }

  // Before an output is committed: --verify's records no task read whole, --strict-cast's damage.
  void before_commit() {
    if (o_.verify == Verify::kChecksums) crcs_.finish();
    check_casts(CastCheck::kStrict);
  }

  // What the copy's casts lost: an error before a commit with --strict-cast, else notes at the end.
  void check_casts(CastCheck when) const {
    if (o_.dtype && (when == CastCheck::kReport || o_.cast_check == CastCheck::kStrict)) {
      ledger_.conclude(*o_.dtype, when == CastCheck::kReport ? CastCheck::kReport : o_.cast_check, o_.progress, output_.string());
    }
  }

 private:
  // Whether the filters and --model-only keep the entry `name` under the top-level key `top`.
  // Every name goes through the filters, so that a pattern that matches none can be named.
  bool selected(std::string_view name, const Key& top) {
    const bool filtered = selection_.select(name);
    // A torch.save leaf without a key path is named by its flattened keys: "model.<fqn>".
    const bool flat_model = c_.format == Format::kTorchSave && !c_.planner_data.contains(name) && name.starts_with("model.");
    const bool in_model = flat_model || (!top.is_int && top.text == "model");
    models_ += in_model;
    return filtered && (!o_.model_only || in_model);
  }

  // `fqn`'s keys: its planner_data path (nested layout), else the FQN itself. `fqn` is an entry's
  // own name: the keys may be views of it.
  std::vector<Key> path_of(const std::string& fqn, MergeLayout layout) const {
    if (layout == MergeLayout::kNested && c_.planner_data.contains(fqn)) {
      std::vector<KeyPaths::KeyView> keys;
      if (!c_.planner_data.keys(fqn, keys)) {
        // Not a path of keys: what it is, and where.
        const ValuePtr value = c_.planner_data.find(fqn);
        const auto* seq = value->sequence();
        const std::string where = (c_.root / ".metadata").string();
        if (!seq || seq->empty()) {
          throw Error(ErrorKind::kFormat, where, value->offset, "planner_data of '" + fqn + "' is not a non-empty sequence of keys");
        }
        for (const ValuePtr& k : *seq) {
          if (!k->str() && !k->int64()) {
            throw Error(ErrorKind::kFormat, where, k->offset, "planner_data of '" + fqn + "' has a " + k->type_name() + " key");
          }
        }
      }
      std::vector<Key> path;
      path.reserve(keys.size());
      for (const KeyPaths::KeyView& k : keys) path.push_back({k.is_int, k.text, k.index});
      return path;
    }
    return {Key{false, fqn, 0}};
  }

  // `l`'s keys: a meta.pt key, its name alone, or its entry's path (path_of).
  std::vector<Key> path(const Leaf& l) const {
    if (l.kind == Leaf::kMeta) {
      if (!l.int_key) return {Key{false, l.name, 0}};
      Key k{true, {}, 0};
      std::from_chars(l.name.data(), l.name.data() + l.name.size(), k.index);
      return {k};
    }
    if (l.flat || (o_.layout == MergeLayout::kFlat && !renames_.empty())) return {Key{false, output_name(l), 0}};
    return path_of(l.tensor ? l.tensor->name : l.object->name, o_.layout);
  }

  // A flat leaf's name in the output: its own, or renamed (--rename, --strip-prefix), kept for the
  // Keys that view it.
  std::string_view output_name(const Leaf& l) const {
    if (renames_.empty()) return l.name;
    const std::size_t i = static_cast<std::size_t>(&l - leaves_.data());
    auto it = renamed_.find(i);
    if (it == renamed_.end()) it = renamed_.emplace(i, renames_.claim(l.name, output_.string())).first;
    return it->second;
  }

  // `l`'s keys as the options read them, whatever the output's layout: its stored path; where a
  // DCP checkpoint stores no nesting (torch 1.13 keeps flat FQNs only), the FQN's first component
  // is its top-level key, as torch 2.x would have stored it, so that --model-only and --key mean
  // the same for every version.
  std::vector<Key> logical_path(const Leaf& l) const {
    if (l.kind == Leaf::kMeta || l.flat) return path(l);
    const std::string& fqn = l.tensor ? l.tensor->name : l.object->name;
    std::vector<Key> keys = path_of(fqn, MergeLayout::kNested);
    if (!c_.planner_data.contains(fqn)) {  // no path stored: split where top_level_key says
      const std::string_view top = top_level_key(c_, fqn);
      if (!top.empty() && top.size() < fqn.size()) keys = {Key{false, top, 0}, Key{false, std::string_view(fqn).substr(top.size() + 1), 0}};
    }
    return keys;
  }

  // The leaves in the order the checkpoint stores them, filtered.
  void collect() {
    // (stored position, entry): a tensor by its index, an object after them all. The leaves are
    // made once in that order, each as large as the vector they go into holds it.
    const std::size_t ntensors = c_.tensors.size();
    std::vector<std::pair<std::size_t, std::size_t>> order;
    order.reserve(ntensors + c_.objects.size());
    for (std::size_t i = 0; i < ntensors; ++i) order.emplace_back(c_.tensors[i].position, i);
    for (std::size_t i = 0; i < c_.objects.size(); ++i) {
      if (o_.format != MergeFormat::kTorch) {  // safetensors and HDF5: tensors only
        const Leaf l{Leaf::kObject, false, false, {}, 0, c_.objects[i].name, nullptr, &c_.objects[i]};
        if (selected(l.name, logical_path(l).front())) {
          not_tensor(l.name);
        } else {
          ++dropped_;
        }
        continue;
      }
      order.emplace_back(c_.objects[i].position, ntensors + i);
    }
    std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    leaves_.reserve(order.size());
    for (const auto& [pos, i] : order) {
      Leaf l;
      if (i < ntensors) {
        const TensorEntry& t = c_.tensors[i];
        l = Leaf{Leaf::kTensor, false, false, t.dtype, 0, t.name, &t, nullptr};
        l.out = cast_.out(t.name, t.dtype);
      } else {
        const ObjectEntry& e = c_.objects[i - ntensors];
        l = Leaf{Leaf::kObject, false, false, {}, 0, e.name, nullptr, &e};
      }
      if (!selected(l.name, logical_path(l).front())) {
        ++dropped_;
        continue;
      }
      if (l.object) l.value = keep_value(import(*l.object));
      leaves_.push_back(std::move(l));
    }
    // A torch.save input keeps its nesting only when every leaf written has its key path; else
    // every leaf is written under its flattened name, never a mix of the two.
    if (c_.format == Format::kTorchSave) {
      const bool keyed = std::all_of(leaves_.begin(), leaves_.end(), [&](const Leaf& l) { return c_.planner_data.contains(l.name); });
      if (!keyed) {
        for (Leaf& l : leaves_) l.flat = true;
      }
    }
    // Lightning's meta.pt: its top-level keys, merged in after the DCP part (safetensors and HDF5
    // hold none of them).
    {
      for (const CheckpointFile& f : c_.files) {
        if (f.relative != "meta.pt") continue;
        TorchSaveFile meta = read_torch_save(open_file(f.path));
        const auto* items = meta.root->dict_items();
        if (!items) throw Error(ErrorKind::kFormat, f.path.string(), meta.root->offset, "meta.pt holds a " + meta.root->type_name() + ", expected a dict");
        ValuePtr root = import_file(meta, f.path.string());
        for (const auto& [k, v] : *root->dict_items()) {
          if (!k->str() && !k->int64()) {
            throw Error(ErrorKind::kFormat, f.path.string(), k->offset, "meta.pt has a " + k->type_name() + " key");
          }
          // The key's text kept here: the leaf's name and its str key are views of it.
          meta_names_.push_back(k->str() ? *k->str() : std::to_string(*k->int64()));
          const Key key = k->str() ? Key{false, meta_names_.back(), 0} : Key{true, {}, *k->int64()};
          if (!selected(meta_names_.back(), key)) {
            meta_names_.pop_back();
            ++dropped_;
            continue;
          }
          if (o_.format != MergeFormat::kTorch) {
            not_tensor(meta_names_.back());
            continue;
          }
          leaves_.push_back(Leaf{Leaf::kMeta, false, key.is_int, {}, keep_value(v), meta_names_.back(), nullptr, nullptr});
        }
      }
    }
  }

  // An entry safetensors and HDF5 cannot hold: counted, and said at the end (note_left_out).
  void not_tensor(std::string_view name) {
    if (not_tensors_++ == 0) first_not_tensor_ = name;
    ++dropped_;
  }

  // A selection that selects nothing writes nothing (an empty checkpoint is no answer to a typo);
  // a filter that matched no entry is named either way.
  void check_selection() {
    std::vector<std::string> why;
    if (o_.model_only && models_ == 0) why.push_back("--model-only: no entry is under the top-level key 'model'");
    selection_.conclude(c_.root.string(), leaves_.size() + not_tensors_, o_.model_only, std::move(why), o_.progress);
  }

  // Tensors that are views of one storage (tied weights: an embedding and the output layer) are
  // each written whole, as their own tensor: said, since the output no longer ties them.
  void note_shared_storages() const {
    if (!o_.progress) return;
    std::map<std::pair<std::uint32_t, std::uint64_t>, std::vector<std::string_view>> by_storage;
    for (const Leaf& l : leaves_) {
      if (!l.tensor || l.tensor->chunks.size() != 1 || !l.tensor->chunks[0].location) continue;
      const ChunkLocation& loc = *l.tensor->chunks[0].location;
      if (loc.encoding == ChunkEncoding::kRaw) by_storage[{loc.file, loc.offset}].push_back(l.name);
    }
    for (const auto& [where, names] : by_storage) {
      if (names.size() < 2) continue;
      std::string list;
      for (const std::string_view n : names) list += (list.empty() ? "'" : ", '") + std::string(n) + "'";
      o_.progress->note(list + " share one storage (tied weights): each is written whole");
    }
  }

  // What a safetensors or HDF5 output leaves out besides what was deselected, and how to keep it.
  void note_left_out(const std::string& format) const {
    if (!o_.progress) return;
    if (not_tensors_) {
      o_.progress->note("left out " + std::to_string(not_tensors_) + " entr" + (not_tensors_ == 1 ? "y" : "ies") +
                        " that " + (not_tensors_ == 1 ? "is" : "are") + " not a tensor (first: '" + first_not_tensor_ + "'): " + format +
                        " holds tensors only; --format torch keeps everything");
    }
    if (outside_key_) {
      o_.progress->note("left out " + std::to_string(outside_key_) + " tensor" + (outside_key_ == 1 ? "" : "s") +
                        " outside the top-level key '" + key_used_ + "' (first: '" + first_outside_key_ +
                        "'): --key KEY writes another key's tensors, --format torch keeps everything");
    }
  }

  std::uint32_t keep_value(ValuePtr v) {
    if (values_.size() >= 0xffffffffu) internal_error("merge: more than 2^32 objects");
    values_.push_back(std::move(v));
    return static_cast<std::uint32_t>(values_.size() - 1);
  }

  // An object entry's value; a bytes item's tensors get storages of the output.
  ValuePtr import(const ObjectEntry& e) {
    if (e.value || !e.item) return e.value ? e.value : pickle::make_none();
    SourcePtr item = reader_.item(*e.item);
    if (o_.verify == Verify::kChecksums) detail::verify_item(item);
    return import_file(read_torch_save(item), item->name());
  }

  // The root of `f` with its storages renumbered into the output's (copied as they are).
  ValuePtr import_file(const TorchSaveFile& f, const std::string& where) {
    std::map<std::string, std::string> keys;
    for (const TorchStorage& s : f.storages) {
      const std::size_t idx = builder_.reserve_storage(s.dtype, s.numel);
      keys[s.key] = builder_.storage_key(idx);
      storages_.resize(idx + 1);
      if (raws_.size() >= 0xffffffffu) throw std::length_error("more than 2^32 storages inside objects");
      storages_[idx].raw = static_cast<std::uint32_t>(raws_.size());
      raws_.push_back(s.data);
    }
    return pickle::rebuild(f.root, [&](const Value& v) -> ValuePtr {
      const auto* p = v.get_if<pickle::PersistentId>();
      if (!p) return nullptr;
      const auto* pid = p->pid ? p->pid->sequence() : nullptr;
      if (!pid || pid->size() != 5 || !(*pid)[2]->str() || !keys.count(*(*pid)[2]->str())) {
        throw Error(ErrorKind::kFormat, where, v.offset, "persistent id is not a storage of this archive");
      }
      return pickle::make_persistent_id(
          pickle::make_tuple({(*pid)[0], (*pid)[1], pickle::make_str(keys[*(*pid)[2]->str()]), (*pid)[3], (*pid)[4]}));
    });
  }

  // The output tree as pickle values. With `streamed`, a dict of more than a batch of entries (a
  // state dict's thousands) becomes a placeholder that data.pkl's writer fills batch by batch
  // (pickle::write_streamed), so that the tensors' pickle nodes never stand in memory all at
  // once; what is inside it is made whole, batch by batch. Storages are numbered as they are
  // written, in the order this walk gives them either way.
  ValuePtr to_value(const Node& n, std::unordered_map<const Value*, pickle::DictBatches>* streamed = nullptr) {
    constexpr std::size_t kBatch = 1000;  // pickle's batch, the most a DictBatches call may give
    auto key = [](const Key& k) { return k.is_int ? pickle::make_int(k.index) : pickle::make_str(std::string(k.text)); };
    switch (n.kind) {
      case Node::kNone: return pickle::make_none();
      case Node::kDict: {
        const std::span<std::pair<PackedKey, Node>> dict = n.dict();
        if (streamed && dict.size() > kBatch) {
          ValuePtr placeholder = pickle::make_dict({});
          streamed->emplace(placeholder.get(), [this, dict, key](std::size_t done) {
            std::vector<std::pair<ValuePtr, ValuePtr>> items;
            for (std::size_t i = done; i < dict.size() && i < done + kBatch; ++i) items.emplace_back(key(dict[i].first.key()), to_value(dict[i].second));
            return items;
          });
          return placeholder;
        }
        std::vector<std::pair<ValuePtr, ValuePtr>> items;
        for (const auto& [k, c] : dict) items.emplace_back(key(k.key()), to_value(c, streamed));
        return pickle::make_dict(std::move(items));
      }
      case Node::kList: {
        std::vector<ValuePtr> items;
        for (const Node& c : n.list()) items.push_back(to_value(c, streamed));
        return pickle::make_list(std::move(items));
      }
      case Node::kLeaf: {
        const Leaf& l = *n.leaf;
        if (l.kind != Leaf::kTensor) return values_[l.value];
        const std::size_t idx = builder_.reserve_storage(l.out, l.tensor->numel());
        storages_.resize(idx + 1);
        storages_[idx].tensor = l.tensor;
        storages_[idx].out = l.out;
        return builder_.tensor(idx, l.tensor->shape);
      }
    }
    return nullptr;
  }

  const StorageSource& storage_of(const TorchSaveRecord& r) const {
    std::size_t idx = 0;
    const std::string_view key = r.storage_key();
    std::from_chars(key.data(), key.data() + key.size(), idx);
    return storages_.at(idx);
  }

  // The tasks that write each of `leaves` whole at its offset, one tensor a call (NOTE [Tasks made
  // as they are needed]), for a format that keeps no CRC (their group is ignored).
  TaskSource whole_tensors(const std::vector<const Leaf*>& leaves, const std::vector<std::uint64_t>& offsets) {
    return [this, &leaves, &offsets, i = std::size_t{0}](std::vector<CopyTask>& out) mutable {
      if (i == leaves.size()) return false;
      const Leaf& l = *leaves[i];
      detail::add_box_tasks(out, reader_, *l.tensor, detail::whole(*l.tensor), l.out, offsets[i], 0, task_bytes_, kNoMemoryBound, checks());
      return ++i < leaves.size();
    };
  }

  // Counts `l` in `r` (its tensor bytes) and, when asked for, lists it under `name` (default:
  // its own) in `file`.
  void report(MergeResult& r, const Leaf& l, const std::string& file, const std::string* name = nullptr) const {
    const std::uint64_t nbytes = l.tensor ? l.tensor->numel() * element_size(l.out) : 0;
    r.tensor_bytes += nbytes;
    if (!o_.report_entries) return;
    ResultEntry e;
    e.name = name ? *name : std::string(l.name);
    e.kind = l.kind == Leaf::kTensor ? "tensor" : l.kind == Leaf::kObject ? "object" : "meta";
    e.file = file;
    if (l.tensor) {
      e.dtype = l.out;
      e.shape = l.tensor->shape;
      e.nbytes = nbytes;
    }
    r.entries.push_back(std::move(e));
  }

  // The torch.save layout of the nested output, every record placed. data.pkl is pickled batch
  // by batch straight into `sink` at its data offset (with none, --dry-run, only counted): it is
  // the first record, so its data offset is known before its size, which changes it only from
  // 4 GiB up. The output tree and its pickle nodes go once it is made (before the copy); only the
  // records stay.
  detail::ArchivePlan torch_plan(PositionalSink* sink) {
    Node root;
    root.kind = Node::kDict;
    const std::string where = (c_.root / ".metadata").string();
    for (const Leaf& l : leaves_) {
      if (l.kind == Leaf::kMeta) {
        // dict.update: replaces a key in place, appends a new one.
        const Key key = path(l).front();
        Node* existing = root.find(key);
        *(existing ? existing : &root.add(key)) = Node{Node::kLeaf, &l, nullptr};
        continue;
      }
      set_element(root, l, path(l), leaves_.size(), where);
    }
    const auto ntensors = static_cast<std::size_t>(std::count_if(leaves_.begin(), leaves_.end(), [](const Leaf& l) { return l.kind == Leaf::kTensor; }));
    storages_.reserve(ntensors);
    std::unordered_map<const Value*, pickle::DictBatches> streamed;
    ValuePtr tree = to_value(root, &streamed);
    std::string archive = output_.stem().string();
    if (archive.empty()) archive = "archive";
    const std::uint64_t pkl_at = detail::ArchivePlan::first_data_offset(archive, "data.pkl");
    std::uint64_t pkl_end = pkl_at;
    // The pickler hands data.pkl over a batch of entries at a time, never the whole pickle.
    TorchSaveRecords records =
        plan_torch_save_streamed(*tree, streamed, builder_.shared_nodes(), {archive, TorchSaveLayout::kCurrent}, output_.string(),
                                 [&](std::span<const std::byte> b) {
                                   if (sink) sink->write_at(pkl_end, b);
                                   pkl_end += b.size();
                                 });
    detail::ArchivePlan plan(archive, std::move(records));
    if (plan.data_offset(0) != pkl_at) {
      throw Error(ErrorKind::kUnsupported, output_.string(), std::nullopt,
                  "data.pkl came to " + std::to_string(pkl_end - pkl_at) + " bytes; one of 4 GiB or more is not supported");
    }
    return plan;
  }

  MergeResult torch(bool dry_run) {
    std::unique_ptr<PositionalSink> sink;
    if (!dry_run) sink = out_.file();
    const detail::ArchivePlan plan = torch_plan(sink.get());
    const TorchSaveRecords& records = plan.records();
    std::uint64_t data_bytes = 0;
    for (std::size_t i = 0; i < records.size(); ++i) {
      if (records[i].storage) data_bytes += records[i].size;
    }
    const std::uint64_t total = plan.size();

    MergeResult result;
    std::size_t ntensors = 0;
    const std::string file = output_.filename().string();
    for (const Leaf& l : leaves_) {
      report(result, l, file);
      ntensors += l.tensor ? 1 : 0;
    }
    result.files.push_back({output_, total, ntensors});
    result.dropped = dropped_;
    if (dry_run) return result;

    sink->resize(total);
    plan.place_heads(*sink, 0);
    // A storage record's tasks are made when the engine needs them (NOTE [Tasks made as they are
    // needed]); the storages are the CRC groups, in record order.
    std::size_t i = 0, group = 0;
    const TaskSource next = [&](std::vector<CopyTask>& out) {
      for (; i < records.size(); ++i) {
        if (!records[i].storage) continue;
        const StorageSource& s = storage_of(records[i]);
        if (s.tensor) {
          detail::add_box_tasks(out, reader_, *s.tensor, detail::whole(*s.tensor), s.out, plan.data_offset(i), group, task_bytes_,
                                kNoMemoryBound, checks());
        } else {
          const SourcePtr& raw = raws_.at(s.raw);
          add_range_tasks(out, raw, 0, raw->size(), plan.data_offset(i), group, task_bytes_);
        }
        ++i;
        ++group;
        return true;
      }
      return false;
    };
    const std::vector<std::uint32_t> crcs =
        run_copy(*sink, next, data_bytes, plan.storage_count(), {o_.threads, o_.progress, o_.task_delay_ms});
    plan.place_tail(*sink, 0, crcs);
    before_commit();
    sink->commit();
    return result;
  }

  MergeResult safetensors(bool dry_run) {
    // Which tensors, under which names.
    std::optional<std::string> key = o_.key;
    if (!key) {
      for (const Leaf& l : leaves_) {
        const std::vector<Key> keys = logical_path(l);
        if (keys.size() > 1 && !keys.front().is_int && keys.front().text == "model") {
          key = "model";
          break;
        }
      }
    }
    // Each tensor as the plan takes it (its name in the output, dtype and shape), and its leaf.
    std::vector<SafetensorsEntry> named;
    std::vector<std::uint32_t> named_leaves;  // indices into leaves_
    named.reserve(leaves_.size());
    named_leaves.reserve(leaves_.size());
    for (const Leaf& l : leaves_) {
      const std::vector<Key> keys = key ? logical_path(l) : std::vector<Key>();
      if (key && (keys.size() < 2 || keys.front().is_int || keys.front().text != *key)) {
        if (outside_key_++ == 0) first_outside_key_ = l.name;
        ++dropped_;
        continue;
      }
      std::string name = key ? path_text({keys.begin() + 1, keys.end()}) : std::string(l.name);
      if (!renames_.empty()) name = renames_.claim(name, output_.string());
      named.push_back({std::move(name), l.out, l.tensor->shape, nullptr});
      named_leaves.push_back(static_cast<std::uint32_t>(&l - leaves_.data()));
    }
    if (key) key_used_ = *key;
    if (named.empty()) {
      throw Error(ErrorKind::kInvalidArgument, c_.root.string(), std::nullopt,
                  key ? "no tensor is under the top-level key '" + *key + "' (see fsdp-ckpt-inspect for the entries)"
                      : std::string("no tensor is selected"));
    }
    const bool dir = o_.max_shard_size.has_value();
    const std::vector<std::pair<std::string, std::string>> metadata{
        {"format", "pt"}, {"source", c_.root.filename().string()}, {"source_format", std::string(to_string(c_.format))}};
    SafetensorsShardSet set = plan_safetensors_shards(std::move(named), o_.max_shard_size, metadata, output_.filename().string());
    struct Planned {
      std::string name;
      SafetensorsLayout layout;
      std::vector<const Leaf*> leaves;  // in layout order
    };
    std::vector<Planned> files;
    MergeResult result;
    for (SafetensorsShardSet::File& f : set.files) {
      Planned p{f.name, std::move(f.layout), {}};
      p.leaves.reserve(p.layout.order.size());
      for (std::size_t i = 0; i < p.layout.order.size(); ++i) {
        p.leaves.push_back(&leaves_[named_leaves[f.first + p.layout.order[i]]]);
        report(result, *p.leaves.back(), p.name, &p.layout.entries[i].name);
      }
      result.files.push_back({dir ? output_ / p.name : output_, p.layout.size, p.leaves.size()});
      files.push_back(std::move(p));
    }
    std::vector<std::uint32_t>().swap(named_leaves);
    const std::string index = std::move(set.index);
    if (!index.empty()) result.files.push_back({output_ / kSafetensorsIndexName, index.size(), 0});
    if (o_.hf_config) result.files.push_back({dir ? output_ / kHuggingFaceConfigName : config_beside(), o_.hf_config->size(), 0});
    result.dropped = dropped_;
    note_left_out("safetensors");
    if (dry_run) return result;

    for (const Planned& p : files) {
      auto sink = dir ? out_.directory().positional(p.name) : out_.file();
      sink->resize(p.layout.size);
      std::uint64_t at = 0;
      p.layout.write_head([&](std::span<const std::byte> b) {
        sink->write_at(at, b);
        at += b.size();
      });
      run_copy(*sink, whole_tensors(p.leaves, p.layout.begins), p.layout.size - p.layout.head_size, 0,  // no CRCs
               {o_.threads, o_.progress, o_.task_delay_ms});
      before_commit();
      sink->commit();
    }
    if (!index.empty()) write_whole(out_.directory().sequential(kSafetensorsIndexName), index);
    if (o_.hf_config && dir) write_whole(out_.directory().sequential(kHuggingFaceConfigName), *o_.hf_config);
    if (dir) out_.commit_directory();
    if (o_.hf_config && !dir) write_whole(open_file_sink(config_beside(), o_.overwrite), *o_.hf_config);
    return result;
  }

  // Where config.json goes beside a file output.
  std::filesystem::path config_beside() const { return output_.parent_path() / kHuggingFaceConfigName; }

  static void write_whole(std::unique_ptr<ByteSink> sink, const std::string& text) {
    sink->write(text.data(), text.size());
    sink->commit();
  }

  MergeResult hdf5(bool dry_run) {
    std::vector<Hdf5Dataset> datasets;
    MergeResult result;
    std::vector<const Leaf*> leaves;
    for (const Leaf& l : leaves_) {
      std::vector<std::string> path;
      for (const Key& k : this->path(l)) path.push_back(k.display());
      // The dataset's path renamed as its name joined with '.' (a flat leaf's one key is renamed already).
      if (!renames_.empty() && !l.flat && o_.layout != MergeLayout::kFlat) {
        std::string joined;
        for (const std::string& p : path) joined += (joined.empty() ? "" : ".") + p;
        path = detail::split_dots(renames_.claim(joined, output_.string()));
      }
      datasets.push_back({std::move(path), l.out, l.tensor->shape});
      leaves.push_back(&l);
      report(result, l, output_.filename().string());
    }
    if (leaves.empty()) throw Error(ErrorKind::kInvalidArgument, c_.root.string(), std::nullopt, "no tensor is selected");
    result.dropped = dropped_;
    note_left_out("HDF5");
    // The size is known once libhdf5 has laid the file out; a dry run reports the tensor bytes.
    result.files.push_back({output_, result.tensor_bytes, leaves.size()});
    if (dry_run) return result;
    auto sink = out_.file();
    const std::vector<std::uint64_t> offsets = create_hdf5_layout(
        sink->temp_path(), datasets,
        {{"writer", "fsdp-ckpt-merge"}, {"source", c_.root.filename().string()}, {"source_format", std::string(to_string(c_.format))}});
    // HDF5 keeps no CRC: none is computed.
    run_copy(*sink, whole_tensors(leaves, offsets), result.tensor_bytes, 0, {o_.threads, o_.progress, o_.task_delay_ms});
    before_commit();
    sink->commit();
    std::error_code ec;
    result.files.back().size = std::filesystem::file_size(output_, ec);
    return result;
  }

  const Checkpoint& c_;
  Output& out_;
  std::filesystem::path output_;  ///< out_.path(), the name results and errors give
  const MergeOptions& o_;
  ChunkReader reader_;
  std::vector<Leaf> leaves_;
  std::vector<ValuePtr> values_;  ///< objects' and meta.pt entries' values, storages already renumbered
  std::deque<std::string> meta_names_;  ///< the names of kMeta leaves (a deque: they never move)
  std::size_t dropped_ = 0;
  EntrySelection selection_{o_.filters};
  CastScope cast_{c_, o_.dtype, o_.cast_include};
  CastLedger ledger_;
  detail::PassingCrcs crcs_;
  static constexpr std::uint64_t kNoMemoryBound = std::numeric_limits<std::uint64_t>::max();
  std::size_t models_ = 0;          ///< entries under the top-level key "model"
  std::size_t not_tensors_ = 0;     ///< objects and meta.pt keys a tensors-only format leaves out
  std::string first_not_tensor_;
  std::size_t outside_key_ = 0;     ///< tensors outside safetensors' --key
  std::string first_outside_key_, key_used_;
  TorchSaveBuilder builder_{StorageKeys::kPerView};  // one view a storage
  std::vector<StorageSource> storages_;
  std::vector<SourcePtr> raws_;
  std::uint64_t task_bytes_ = task_bytes(o_.threads);
  mutable EntryRenames renames_ = o_.renames;  ///< with the names it has made, to refuse two made one
  mutable std::unordered_map<std::size_t, std::string> renamed_;  ///< a flat leaf's output name, by its index
};

}  // namespace

MergeResult merge(const Checkpoint& input, Output& output, const MergeOptions& options, bool dry_run) {
  Merger m(input, output, options);
  return m.run(dry_run);
}

MergeResult merge(const Checkpoint& input, const std::filesystem::path& output, const MergeOptions& options, bool dry_run) {
  const std::unique_ptr<Output> out = open_file_output(output, options.overwrite);
  return merge(input, *out, options, dry_run);
}

}  // namespace ckpt
