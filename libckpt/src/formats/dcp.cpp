// SPDX-License-Identifier: Apache-2.0
// DCP directories: `.metadata` interpreted into the Checkpoint index (see ckpt/dcp.hpp).
#include "ckpt/dcp.hpp"

#include <charconv>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <unordered_set>

#include "ckpt/error.hpp"
#include "ckpt/torch_save.hpp"
#include "formats/dcp_metadata.hpp"

namespace ckpt {
namespace {

using pickle::GlobalKind;
using pickle::Value;
using pickle::ValuePtr;

class MetadataReader {
 public:
  MetadataReader(std::string source, Checkpoint& c) : source_(std::move(source)), c_(c) {}

  void read(const ValuePtr& root) {
    check_globals(root);
    const pickle::Object* o = root->object();
    const pickle::Global* cls = o && o->callable ? o->callable->global() : nullptr;
    if (!cls) fail(*root, "top-level object is a " + root->type_name() + ", expected a Metadata object");
    const auto state = fields(*root, "Metadata");
    if (cls->kind != GlobalKind::kDcpMetadata) {
      // A subclass from another module is accepted when it carries Metadata's fields.
      if (!state.count("state_dict_metadata") || !state.count("storage_data")) {
        fail(*root, "top-level object is " + cls->module + "." + cls->name + ", not a DCP Metadata (no state_dict_metadata/storage_data)");
      }
      c_.notes.push_back("Metadata is the subclass " + cls->module + "." + cls->name);
    }
    static const std::set<std::string> known{"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"};
    for (const auto& [k, v] : state) {
      if (!known.count(k)) c_.notes.push_back("Metadata has extra attribute '" + k + "'");
    }
    writer_guess(*cls, state);
    read_storage_data(require(state, "storage_data", *root));
    read_state_dict_metadata(require(state, "state_dict_metadata", *root));
    if (auto it = state.find("planner_data"); it != state.end()) read_planner_data(it->second);
  }

 private:
  [[noreturn]] void fail(const Value& at, const std::string& m) const { throw Error(ErrorKind::kFormat, source_, at.offset, m); }

  // NOTE [Hostile .metadata]: PyTorch unpickles .metadata with the unrestricted pickle.load, so a
  // crafted file runs code there. We refuse any global outside the allow-list, and getattr unless
  // it names a member of the memory-format enum; the root may be a Metadata subclass.
  void check_globals(const ValuePtr& root) {
    std::unordered_set<const Value*> seen;
    const Value* root_cls = root->object() ? root->object()->callable.get() : nullptr;
    std::vector<const Value*> todo{root.get()};
    while (!todo.empty()) {
      const Value* v = todo.back();
      todo.pop_back();
      if (!v || !seen.insert(v).second) continue;
      if (const pickle::Global* g = v->global()) {
        if (g->kind == GlobalKind::kOpaque && v != root_cls) {
          fail(*v, "global '" + g->module + "." + g->name + "' is not allowed in .metadata (refused, not executed)");
        }
        continue;
      }
      if (const pickle::Object* o = v->object()) {
        if (v->callable_kind() == GlobalKind::kBuiltinGetattr) {
          const auto* args = o->args->sequence();
          const bool enum_member = args && args->size() == 2 && (*args)[0]->global() &&
                                   (*args)[0]->global()->kind == GlobalKind::kDcpMemoryFormat && (*args)[1]->str();
          if (!enum_member) fail(*v, "getattr is only allowed on the memory-format enum (refused, not executed)");
        }
        for (const ValuePtr* c : {&o->callable, &o->args, &o->kwargs, &o->state}) todo.push_back(c->get());
        for (const auto& c : o->list_items) todo.push_back(c.get());
        for (const auto& [k, x] : o->dict_items) {
          todo.push_back(k.get());
          todo.push_back(x.get());
        }
        continue;
      }
      if (const auto* seq = v->sequence()) {
        for (const auto& c : *seq) todo.push_back(c.get());
      } else if (const auto* d = v->get_if<pickle::Dict>()) {
        for (const auto& [k, x] : d->items) {
          todo.push_back(k.get());
          todo.push_back(x.get());
        }
      } else if (const auto* s = v->get_if<pickle::Set>()) {
        for (const auto& c : s->items) todo.push_back(c.get());
      } else if (const auto* fs = v->get_if<pickle::FrozenSet>()) {
        for (const auto& c : fs->items) todo.push_back(c.get());
      }
    }
  }

  // The attribute dict an object was given by BUILD (empty when it had none, like BytesStorageMetadata).
  std::map<std::string, ValuePtr> fields(const Value& v, std::string_view what) const {
    const pickle::Object* o = v.object();
    if (!o) fail(v, std::string(what) + " is a " + v.type_name() + ", expected an object");
    std::map<std::string, ValuePtr> out;
    if (!o->state) return out;
    const auto* items = o->state->dict_items();
    if (!items) fail(v, std::string(what) + " state is a " + o->state->type_name() + ", expected a dict");
    for (const auto& [k, x] : *items) {
      if (!k->str()) fail(*k, std::string(what) + " has a non-string attribute name");
      out[*k->str()] = x;
    }
    return out;
  }
  const ValuePtr& require(const std::map<std::string, ValuePtr>& m, const std::string& key, const Value& at) const {
    auto it = m.find(key);
    if (it == m.end()) fail(at, "object lacks the field '" + key + "'");
    return it->second;
  }
  GlobalKind kind_of(const Value& v) const {
    const pickle::Object* o = v.object();
    const pickle::Global* g = o && o->callable ? o->callable->global() : nullptr;
    return g ? g->kind : GlobalKind::kOpaque;
  }
  std::vector<std::int64_t> size_of(const ValuePtr& v, std::string_view what) const {
    const std::vector<ValuePtr>* seq = nullptr;
    if (kind_of(*v) == GlobalKind::kTorchSize) {
      const auto* args = v->object()->args->sequence();
      if (args && args->size() == 1) seq = (*args)[0]->sequence();
    } else {
      seq = v->sequence();
    }
    if (!seq) fail(*v, std::string(what) + " is a " + v->type_name() + ", expected a torch.Size");
    std::vector<std::int64_t> out;
    for (const auto& x : *seq) {
      auto i = x->int64();
      if (!i || *i < 0) fail(*v, std::string(what) + " holds " + pickle::repr(*x, 40) + ", expected non-negative ints");
      out.push_back(*i);
    }
    return out;
  }
  std::int64_t nonneg_int(const ValuePtr& v, std::string_view what) const {
    auto i = v->int64();
    if (!i || *i < 0) fail(*v, std::string(what) + " is " + pickle::repr(*v, 40) + ", expected a non-negative int");
    return *i;
  }

  void writer_guess(const pickle::Global& cls, const std::map<std::string, ValuePtr>& state) {
    std::string w;
    if (cls.module == "torch.distributed._shard.checkpoint.metadata") {
      w = "torch 1.13 (torch.distributed._shard.checkpoint)";
    } else {
      w = "torch >= 2.0";
    }
    if (state.count("storage_meta")) w = "torch >= 2.4";
    if (auto it = state.find("version"); it != state.end() && it->second->str()) w += ", DCP version " + *it->second->str();
    writer_ = w;
    c_.writer = w;
  }

  struct Key {
    std::string fqn;
    bool tensor;
    std::vector<std::int64_t> offsets;
    auto operator<=>(const Key&) const = default;
  };

  std::size_t file_index(const ValuePtr& name_node) {
    const std::string* name = name_node->str();
    if (!name) fail(*name_node, "relative_path is a " + name_node->type_name() + ", expected a str");
    std::filesystem::path p(*name);
    bool bad = name->empty() || p.is_absolute() || name->find('\0') != std::string::npos || name->front() == '/';
    for (const auto& part : p) bad = bad || part == "..";
    if (bad) fail(*name_node, "relative_path '" + *name + "' leaves the checkpoint directory (absolute or with '..')");
    if (auto it = file_by_name_.find(*name); it != file_by_name_.end()) return it->second;
    CheckpointFile f;
    f.relative = *name;
    f.path = c_.root / p;
    std::error_code ec;
    const auto sz = std::filesystem::file_size(f.path, ec);
    if (!ec) f.size = sz;
    c_.files.push_back(std::move(f));
    file_by_name_.emplace(*name, c_.files.size() - 1);
    return c_.files.size() - 1;
  }

  void read_storage_data(const ValuePtr& sd) {
    const auto* items = sd->dict_items();
    if (!items) fail(*sd, "storage_data is a " + sd->type_name() + ", expected a dict");
    for (const auto& [k, v] : *items) {
      if (kind_of(*k) != GlobalKind::kDcpMetadataIndex) fail(*k, "storage_data key is a " + k->type_name() + ", expected a MetadataIndex");
      if (kind_of(*v) != GlobalKind::kDcpStorageInfo) fail(*v, "storage_data value is a " + v->type_name() + ", expected a _StorageInfo");
      const auto kf = fields(*k, "MetadataIndex");
      const auto vf = fields(*v, "_StorageInfo");
      const ValuePtr& fqn = require(kf, "fqn", *k);
      if (!fqn->str()) fail(*fqn, "MetadataIndex.fqn is not a str");
      Key key{*fqn->str(), false, {}};
      if (auto it = kf.find("offset"); it != kf.end() && !it->second->is<pickle::None>()) {
        key.tensor = true;
        key.offsets = size_of(it->second, "MetadataIndex.offset");
      }
      ChunkLocation loc;
      loc.encoding = ChunkEncoding::kTorchSaveItem;
      loc.file = file_index(require(vf, "relative_path", *v));
      const auto off = static_cast<std::uint64_t>(nonneg_int(require(vf, "offset", *v), "_StorageInfo.offset"));
      const auto len = static_cast<std::uint64_t>(nonneg_int(require(vf, "length", *v), "_StorageInfo.length"));
      if (off + len < off) fail(*v, "_StorageInfo offset + length overflows");
      loc.offset = off;
      loc.length = len;
      if (auto it = vf.find("transform_descriptors"); it != vf.end() && !it->second->is<pickle::None>()) {
        const auto* seq = it->second->sequence();
        if (!seq) fail(*it->second, "transform_descriptors is not a list");
        for (const auto& t : *seq) {
          if (!t->str()) fail(*t, "transform descriptor is not a str");
          loc.transforms.push_back(*t->str());
        }
      }
      if (!storage_.emplace(key, loc).second) fail(*k, "storage_data names '" + key.fqn + "' at the same offsets twice");
    }
  }

  void read_state_dict_metadata(const ValuePtr& sdm) {
    const auto* items = sdm->dict_items();
    if (!items) fail(*sdm, "state_dict_metadata is a " + sdm->type_name() + ", expected a dict");
    std::set<Key> used;
    for (const auto& [k, v] : *items) {
      if (!k->str()) fail(*k, "state_dict_metadata key is a " + k->type_name() + ", expected a str");
      const std::string& fqn = *k->str();
      const GlobalKind kind = kind_of(*v);
      if (kind == GlobalKind::kDcpBytesStorageMetadata) {
        ObjectEntry e{fqn, nullptr, std::nullopt};
        Key key{fqn, false, {}};
        if (auto it = storage_.find(key); it != storage_.end()) {
          e.item = it->second;
          used.insert(key);
        }
        c_.objects.push_back(std::move(e));
        continue;
      }
      if (kind != GlobalKind::kDcpTensorStorageMetadata) {
        fail(*v, "entry '" + fqn + "' is a " + v->type_name() + ", expected TensorStorageMetadata or BytesStorageMetadata");
      }
      const auto f = fields(*v, "TensorStorageMetadata");
      TensorEntry t;
      t.name = fqn;
      read_properties(require(f, "properties", *v), t);
      t.shape = size_of(require(f, "size", *v), "size of '" + fqn + "'");
      const ValuePtr& chunks = require(f, "chunks", *v);
      const auto* seq = chunks->sequence();
      if (!seq) fail(*chunks, "chunks of '" + fqn + "' is not a list");
      for (const auto& cv : *seq) {
        if (kind_of(*cv) != GlobalKind::kDcpChunkStorageMetadata) fail(*cv, "chunk of '" + fqn + "' is a " + cv->type_name());
        const auto cf = fields(*cv, "ChunkStorageMetadata");
        Chunk ch;
        ch.offsets = size_of(require(cf, "offsets", *cv), "chunk offsets of '" + fqn + "'");
        ch.sizes = size_of(require(cf, "sizes", *cv), "chunk sizes of '" + fqn + "'");
        if (ch.offsets.size() != t.shape.size() || ch.sizes.size() != t.shape.size()) {
          fail(*cv, "chunk of '" + fqn + "' has " + std::to_string(ch.offsets.size()) + "-d offsets and " +
                        std::to_string(ch.sizes.size()) + "-d sizes for a " + std::to_string(t.shape.size()) + "-d tensor");
        }
        for (std::size_t d = 0; d < t.shape.size(); ++d) {
          if (ch.offsets[d] + ch.sizes[d] > t.shape[d]) {
            fail(*cv, "chunk of '" + fqn + "' spans [" + std::to_string(ch.offsets[d]) + ", " +
                          std::to_string(ch.offsets[d] + ch.sizes[d]) + ") in dimension " + std::to_string(d) +
                          ", past the tensor's size " + std::to_string(t.shape[d]));
          }
        }
        Key key{fqn, true, ch.offsets};
        if (auto it = storage_.find(key); it != storage_.end()) {
          ch.location = it->second;
          used.insert(key);
        }
        t.chunks.push_back(std::move(ch));
      }
      c_.tensors.push_back(std::move(t));
    }
    for (const auto& [key, loc] : storage_) {
      if (!used.count(key)) unused_.push_back(key.fqn);
    }
    if (!unused_.empty()) {
      c_.notes.push_back(std::to_string(unused_.size()) + " storage_data entries belong to no chunk (first: '" + unused_.front() + "')");
    }
  }

  void read_properties(const ValuePtr& p, TensorEntry& t) {
    if (kind_of(*p) != GlobalKind::kDcpTensorProperties) fail(*p, "properties of '" + t.name + "' is a " + p->type_name());
    const ValuePtr& state = p->object()->state;
    ValuePtr dtype, rg;
    if (state && state->sequence() && state->sequence()->size() >= 3) {  // __getstate__: (dtype, layout, requires_grad, ...)
      dtype = (*state->sequence())[0];
      rg = (*state->sequence())[2];
    } else {
      const auto f = fields(*p, "TensorProperties");
      dtype = require(f, "dtype", *p);
      if (auto it = f.find("requires_grad"); it != f.end()) rg = it->second;
    }
    const pickle::Global* g = dtype->global();
    if (!g || g->kind != GlobalKind::kDType) fail(*dtype, "dtype of '" + t.name + "' is " + pickle::repr(*dtype, 60) + ", not a known torch dtype");
    t.dtype = *dtype_from_torch_name(g->name);
    if (rg && rg->get_if<bool>()) t.requires_grad = *rg->get_if<bool>();
  }

  void read_planner_data(const ValuePtr& pd) {
    if (pd->is<pickle::None>()) return;
    const auto* items = pd->dict_items();
    if (!items) fail(*pd, "planner_data is a " + pd->type_name() + ", expected a dict or None");
    for (const auto& [k, v] : *items) {
      if (k->str()) c_.planner_data[*k->str()] = v;
    }
  }

  std::string source_;
  Checkpoint& c_;
  std::string writer_;
  std::map<Key, ChunkLocation> storage_;
  std::map<std::string, std::size_t> file_by_name_;
  std::vector<std::string> unused_;
};

std::optional<int> rank_of(const std::string& name) {
  // __{rank}_{n}.distcp
  if (!name.starts_with("__") || !name.ends_with(".distcp")) return std::nullopt;
  int r = 0;
  auto [p, ec] = std::from_chars(name.data() + 2, name.data() + name.size(), r);
  if (ec != std::errc() || *p != '_') return std::nullopt;
  return r;
}

}  // namespace

void detail::read_dcp_metadata(std::span<const std::byte> bytes, const std::string& source, Checkpoint& c) {
  pickle::ParseOptions o;
  o.persistent_ids = pickle::PersistentIds::kRefuse;
  ValuePtr root = pickle::parse(bytes, source, 0, o);
  c.meta_trees.emplace_back(".metadata", root);
  MetadataReader(source, c).read(root);
}

Checkpoint open_dcp(const std::filesystem::path& dir) {
  Checkpoint c;
  c.root = dir;
  c.format = Format::kDcp;
  const auto meta_path = dir / ".metadata";
  SourcePtr src = open_mmap(meta_path);
  std::vector<std::byte> owned;
  auto bytes = src->view(0, src->size());
  if (!bytes) {
    owned = src->read_vector(0, src->size());
    bytes = owned;
  }
  detail::read_dcp_metadata(*bytes, src->name(), c);

  // World size: the ranks whose data files the metadata names or the directory holds (a rank with
  // nothing to write still leaves an empty file).
  int max_rank = -1;
  for (const auto& f : c.files) {
    if (auto r = rank_of(f.relative)) max_rank = std::max(max_rank, *r);
  }
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (auto r = rank_of(e.path().filename().string())) max_rank = std::max(max_rank, *r);
  }
  if (max_rank >= 0) c.world_size = max_rank + 1;

  // Lightning's meta.pt: the rest of the state.
  if (std::filesystem::exists(dir / "meta.pt", ec)) {
    c.format = Format::kLightningSharded;
    try {
      TorchSaveFile meta = read_torch_save(open_mmap(dir / "meta.pt"));
      c.meta_trees.emplace_back("meta.pt", meta.root);
      if (const auto* items = meta.root->dict_items()) {
        for (const auto& [k, v] : *items) {
          c.metadata.emplace_back(k->str() ? *k->str() : pickle::repr(*k, 80), pickle::repr(*v, 200));
        }
      }
      c.files.push_back({"meta.pt", dir / "meta.pt", std::filesystem::file_size(dir / "meta.pt")});
    } catch (Error& e) {
      e.add_context("reading Lightning's meta.pt");
      throw;
    }
  }
  // Megatron torch_dist: metadata.json and common.pt beside the DCP files.
  if (std::filesystem::exists(dir / "metadata.json", ec)) {
    std::ifstream in(dir / "metadata.json");
    auto j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_object()) {
      for (auto& [k, v] : j.items()) c.metadata.emplace_back(k, v.dump());
    }
    c.notes.push_back("Megatron torch_dist layout: metadata.json" + std::string(std::filesystem::exists(dir / "common.pt", ec) ? " and common.pt" : ""));
  }
  if (std::filesystem::exists(dir / "common.pt", ec)) {
    try {
      TorchSaveFile common = read_torch_save(open_mmap(dir / "common.pt"));
      c.meta_trees.emplace_back("common.pt", common.root);
    } catch (Error& e) {
      e.add_context("reading common.pt");
      throw;
    }
  }
  return c;
}

}  // namespace ckpt
