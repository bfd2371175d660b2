// SPDX-License-Identifier: Apache-2.0
// DCP directories: `.metadata` interpreted into the Checkpoint index (see ckpt/formats/dcp.hpp).
#include "ckpt/formats/dcp.hpp"

#include <algorithm>
#include <charconv>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "ckpt/error.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "formats/dcp/index_builder.hpp"
#include "formats/dcp/metadata.hpp"
#include "text_helpers.hpp"

namespace ckpt {
namespace {

void require_inside(const std::filesystem::path& dir, const std::string& name) {
  if (!resolves_inside(dir, dir / name)) {
    throw Error(ErrorKind::kFormat, (dir / name).string(), std::nullopt, "is a symbolic link that leads outside the checkpoint directory");
  }
}

using pickle::GlobalKind;
using pickle::Value;
using pickle::ValuePtr;

class MetadataReader {
 public:
  MetadataReader(std::string source, Checkpoint& c) : source_(std::move(source)), c_(c) {}

  void read(const ValuePtr& root) {
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
    static const std::set<std::string, std::less<>> known{"state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"};
    if (state.items) {
      for (const auto& [k, v] : *state.items) {
        if (!known.count(*k->str())) c_.notes.push_back("Metadata has extra attribute '" + *k->str() + "'");
      }
    }
    const ValuePtr* version = state.find("version");
    b_.set_writer(cls->module, state.count("storage_meta") != 0, version && (*version)->str() ? (*version)->str() : nullptr);
    const ValuePtr& sdm = require(state, "state_dict_metadata", *root);
    const ValuePtr& sd = require(state, "storage_data", *root);
    // Items offer() took while parsing must have come from these two dicts.
    if (sdm_dict_ && sdm_dict_ != sdm.get()) fail(*sdm, "TensorStorageMetadata found outside state_dict_metadata");
    if (storage_dict_ && storage_dict_ != sd.get()) fail(*sd, "MetadataIndex found outside storage_data");
    read_state_dict_metadata(sdm);
    read_storage_data(sd);
    b_.finish();
    if (const ValuePtr* pd = state.find("planner_data")) read_planner_data(*pd);
  }

  // NOTE [Streaming .metadata]: state_dict_metadata and storage_data hold an entry per tensor and
  // an item per chunk, hundreds of thousands in a large checkpoint. The unpickler offers each item
  // as it is added to its dict; we turn it into the index at once and it is freed, so the tree of
  // .metadata is never whole in memory. Items are recognized by their classes; read() then checks
  // that they came from the two dicts where they belong, and reads whatever was left in them.
  bool offer(const Value& dict, const ValuePtr& k, const ValuePtr& v) {
    const GlobalKind vk = kind_of(*v);
    if ((vk == GlobalKind::kDcpTensorStorageMetadata || vk == GlobalKind::kDcpBytesStorageMetadata) && k->str()) {
      claim(sdm_dict_, dict, *v, "TensorStorageMetadata");
      state_dict_item(k, v);
      return true;
    }
    if (kind_of(*k) == GlobalKind::kDcpMetadataIndex) {
      claim(storage_dict_, dict, *k, "MetadataIndex");
      storage_item(k, v);
      return true;
    }
    return false;
  }

 private:
  [[noreturn]] void fail(const Value& at, const std::string& m) const { throw Error(ErrorKind::kFormat, source_, at.offset, m); }
  void claim(const Value*& owner, const Value& dict, const Value& at, std::string_view what) const {
    if (!owner) owner = &dict;
    if (owner != &dict) fail(at, std::string(what) + " items are in two different dicts");
  }

 public:
  // NOTE [Hostile .metadata]: PyTorch unpickles .metadata with the unrestricted pickle.load, so a
  // crafted file runs code there. Here a global that would run code or reach the interpreter is
  // refused by the unpickler as it is read (pickle::runs_code, NOTE [What runs code]); any other
  // class is data: a value of it is kept as an opaque object (its class path and arguments, never
  // constructed), so newer writers' extra fields (save plans, Megatron's mcore_data) do not stop
  // the checkpoint from opening. Where the index needs a value (an entry, a chunk, a storage
  // item), its reader checks the class and refuses anything else with its offset.
  // NOTE [Entries as they are built]: a TensorStorageMetadata is made into its entry as soon as
  // BUILD finishes it, and a small token of the same class takes its place on the stack; its
  // tree is freed at once, not when SETITEMS hands over the batch of up to 1,000 entries that
  // holds it. The token is known by its address (a pickle cannot make one). One that does not
  // read cleanly is kept whole and reported, with its name, when its dict item is read.
  ValuePtr on_built(const Value& v) {
    if (kind_of(v) != GlobalKind::kDcpTensorStorageMetadata) return nullptr;
    std::optional<TensorEntry> t;
    try {
      t.emplace(tensor_entry(std::string(), v));
    } catch (const Error&) {
      return nullptr;
    }
    const pickle::Object* o = v.object();
    ValuePtr token = pickle::make_object(o->callable, o->op, pickle::make_tuple());
    token->offset = v.offset;
    built_.emplace(token.get(), Built{token, std::move(*t)});
    return token;
  }
  void on_object(const Value& v) {
    if (v.callable_kind() != GlobalKind::kBuiltinGetattr) return;
    if (!pickle::getattr_is_data(v)) fail(v, "getattr is only allowed to name an enum member, getattr(CLASS, 'MEMBER') (refused, not executed)");
  }

 private:

  // The attribute dict an object was given by BUILD (empty when it had none, like
  // BytesStorageMetadata), looked up by a linear scan: these objects have at most a handful.
  struct Fields {
    const std::vector<std::pair<ValuePtr, ValuePtr>>* items = nullptr;
    const ValuePtr* find(std::string_view key) const {
      if (!items) return nullptr;
      for (const auto& [k, v] : *items) {
        if (*k->str() == key) return &v;
      }
      return nullptr;
    }
    std::size_t count(std::string_view key) const { return find(key) ? 1 : 0; }
  };
  Fields fields(const Value& v, std::string_view what) const {
    const pickle::Object* o = v.object();
    if (!o) fail(v, std::string(what) + " is a " + v.type_name() + ", expected an object");
    Fields f;
    if (!o->state) return f;
    f.items = o->state->dict_items();
    if (!f.items) fail(v, std::string(what) + " state is a " + o->state->type_name() + ", expected a dict");
    for (const auto& [k, x] : *f.items) {
      if (!k->str()) fail(v, std::string(what) + " has a non-string attribute name");
    }
    return f;
  }
  const ValuePtr& require(const Fields& f, std::string_view key, const Value& at) const {
    const ValuePtr* v = f.find(key);
    if (!v) fail(at, "object lacks the field '" + std::string(key) + "'");
    return *v;
  }
  GlobalKind kind_of(const Value& v) const {
    const pickle::Object* o = v.object();
    const pickle::Global* g = o && o->callable ? o->callable->global() : nullptr;
    return g ? g->kind : GlobalKind::kOpaque;
  }
  // `what` (of `fqn` when given) names the size in errors; the message is built only then.
  Dims size_of(const ValuePtr& v, std::string_view what_, const std::string* fqn = nullptr) const {
    auto what = [&] { return std::string(what_) + (fqn ? " of '" + *fqn + "'" : std::string()); };
    const std::vector<ValuePtr>* seq = nullptr;
    if (kind_of(*v) == GlobalKind::kTorchSize) {
      const auto* args = v->object()->args->sequence();
      if (args && args->size() == 1) seq = (*args)[0]->sequence();
    } else {
      seq = v->sequence();
    }
    if (!seq) fail(*v, what() + " is a " + v->type_name() + ", expected a torch.Size");
    Dims out;
    for (const auto& x : *seq) {
      auto i = x->int64();
      if (!i || *i < 0) fail(*v, what() + " holds " + pickle::repr(*x, 40) + ", expected non-negative ints");  // v: the Size
      out.push_back(*i);
    }
    return out;
  }
  std::int64_t nonneg_int(const ValuePtr& v, const Value& at, std::string_view what) const {
    auto i = v->int64();
    if (!i || *i < 0) fail(at, std::string(what) + " is " + pickle::repr(*v, 40) + ", expected a non-negative int");
    return *i;
  }

  void read_storage_data(const ValuePtr& sd) {
    const auto* items = sd->dict_items();
    if (!items) fail(*sd, "storage_data is a " + sd->type_name() + ", expected a dict");
    for (const auto& [k, v] : *items) storage_item(k, v);
  }

  void storage_item(const ValuePtr& k, const ValuePtr& v) {
    if (kind_of(*k) != GlobalKind::kDcpMetadataIndex) fail(*k, "storage_data key is a " + k->type_name() + ", expected a MetadataIndex");
    if (kind_of(*v) != GlobalKind::kDcpStorageInfo) fail(*v, "storage_data value is a " + v->type_name() + ", expected a _StorageInfo");
    const auto kf = fields(*k, "MetadataIndex");
    const auto vf = fields(*v, "_StorageInfo");
    const ValuePtr& fqn = require(kf, "fqn", *k);
    if (!fqn->str()) fail(*fqn, "MetadataIndex.fqn is not a str");
    bool tensor = false;
    Dims offsets;
    if (const ValuePtr* off = kf.find("offset"); off && !(*off)->is<pickle::None>()) {
      tensor = true;
      offsets = size_of(*off, "MetadataIndex.offset");
    }
    ChunkLocation loc;
    loc.encoding = ChunkEncoding::kItem;
    const ValuePtr& path = require(vf, "relative_path", *v);
    if (!path->str()) fail(*path, "relative_path is a " + path->type_name() + ", expected a str");
    loc.file = b_.file_index(*path->str(), path->offset);
    const auto off = static_cast<std::uint64_t>(nonneg_int(require(vf, "offset", *v), *v, "_StorageInfo.offset"));
    const auto len = static_cast<std::uint64_t>(nonneg_int(require(vf, "length", *v), *v, "_StorageInfo.length"));
    if (off + len < off) fail(*v, "_StorageInfo offset + length overflows");
    loc.offset = off;
    loc.length = len;
    if (const ValuePtr* td = vf.find("transform_descriptors"); td && !(*td)->is<pickle::None>()) {
      const auto* seq = (*td)->sequence();
      if (!seq) fail(*v, "transform_descriptors is not a list");
      std::vector<std::string> transforms;
      for (const auto& t : *seq) {
        if (!t->str()) fail(*v, "transform descriptor is not a str");
        transforms.push_back(*t->str());
      }
      if (!transforms.empty()) loc.layout = b_.layout(std::move(transforms));
    }
    b_.add_storage(*fqn->str(), tensor, std::move(offsets), std::move(loc), k->offset);
  }

  void read_state_dict_metadata(const ValuePtr& sdm) {
    const auto* items = sdm->dict_items();
    if (!items) fail(*sdm, "state_dict_metadata is a " + sdm->type_name() + ", expected a dict");
    for (const auto& [k, v] : *items) state_dict_item(k, v);
  }

  void state_dict_item(const ValuePtr& k, const ValuePtr& v) {
    if (!k->str()) fail(*k, "state_dict_metadata key is a " + k->type_name() + ", expected a str");
    const std::string& fqn = *k->str();
    const GlobalKind kind = kind_of(*v);
    if (kind == GlobalKind::kDcpBytesStorageMetadata) return b_.add_bytes(fqn, k->offset);
    if (kind != GlobalKind::kDcpTensorStorageMetadata) {
      fail(*v, "entry '" + fqn + "' is a " + v->type_name() + ", expected TensorStorageMetadata or BytesStorageMetadata");
    }
    auto built = built_.find(v.get());
    TensorEntry t = built != built_.end() ? std::move(built->second.entry) : tensor_entry(fqn, *v);
    if (built != built_.end()) built_.erase(built);
    t.name = fqn;
    b_.add_tensor(std::move(t), k->offset);
  }

  // A TensorStorageMetadata object as an entry named `fqn` (the name is used in messages only).
  TensorEntry tensor_entry(const std::string& fqn, const Value& v) const {
    const auto f = fields(v, "TensorStorageMetadata");
    TensorEntry t;
    t.name = fqn;
    read_properties(require(f, "properties", v), t);
    t.shape = size_of(require(f, "size", v), "size", &fqn);
    const ValuePtr& chunks = require(f, "chunks", v);
    const auto* seq = chunks->sequence();
    if (!seq) fail(*chunks, "chunks of '" + fqn + "' is not a list");
    t.chunks.reserve(seq->size());
    for (const auto& cv : *seq) {
      if (kind_of(*cv) != GlobalKind::kDcpChunkStorageMetadata) fail(*cv, "chunk of '" + fqn + "' is a " + cv->type_name());
      const auto cf = fields(*cv, "ChunkStorageMetadata");
      Chunk ch;
      ch.offsets = size_of(require(cf, "offsets", *cv), "chunk offsets", &fqn);
      ch.sizes = size_of(require(cf, "sizes", *cv), "chunk sizes", &fqn);
      if (std::string problem = detail::chunk_problem(fqn, t.shape, ch); !problem.empty()) fail(*cv, problem);
      t.chunks.push_back(std::move(ch));
    }
    return t;
  }

  void read_properties(const ValuePtr& p, TensorEntry& t) const {
    if (kind_of(*p) != GlobalKind::kDcpTensorProperties) fail(*p, "properties of '" + t.name + "' is a " + p->type_name());
    const ValuePtr& state = p->object()->state;
    ValuePtr dtype, rg;
    if (state && state->sequence() && state->sequence()->size() >= 3) {  // __getstate__: (dtype, layout, requires_grad, ...)
      dtype = (*state->sequence())[0];
      rg = (*state->sequence())[2];
    } else {
      const auto f = fields(*p, "TensorProperties");
      dtype = require(f, "dtype", *p);
      if (const ValuePtr* r = f.find("requires_grad")) rg = *r;
    }
    const pickle::Global* g = dtype->global();
    if (!g || g->kind != GlobalKind::kDType) fail(*p, "dtype of '" + t.name + "' is " + pickle::repr(*dtype, 60) + ", not a known torch dtype");
    t.dtype = *dtype_from_torch_name(g->name);
    if (rg && rg->get_if<bool>()) t.requires_grad = *rg->get_if<bool>();
  }

  void read_planner_data(const ValuePtr& pd) {
    if (pd->is<pickle::None>()) return;
    const auto* items = pd->dict_items();
    if (!items) fail(*pd, "planner_data is a " + pd->type_name() + ", expected a dict or None");
    for (const auto& [k, v] : *items) {
      if (k->str()) c_.planner_data.set(*k->str(), v);
    }
  }

  std::string source_;
  Checkpoint& c_;
  detail::DcpIndexBuilder b_{source_, c_};
  const Value* sdm_dict_ = nullptr;       ///< the dicts offer() took items from (compared only)
  const Value* storage_dict_ = nullptr;
  // By token (NOTE [Entries as they are built]). The token is held here until its entry is
  // claimed, so that its address, the key, is not reused by another while it is in the map.
  struct Built {
    ValuePtr token;
    TensorEntry entry;
  };
  std::unordered_map<const Value*, Built> built_;
};

std::optional<int> rank_of(const std::string& name) {
  // __{rank}_{n}.distcp
  if (!name.starts_with("__") || !name.ends_with(".distcp")) return std::nullopt;
  int r = 0;
  auto [p, ec] = std::from_chars(name.data() + 2, name.data() + name.size(), r);
  if (ec != std::errc() || *p != '_') return std::nullopt;
  return r;
}

// One .metadata file into `c` (whose root is the directory): the direct reader, or the tree.
void read_metadata_file(const std::filesystem::path& path, Checkpoint& c, MetaTrees trees) {
  SourcePtr src = open_mmap(path);
  std::vector<std::byte> owned;
  const std::span<const std::byte> bytes = src->whole(owned);
  // The pages each pass has read are given back behind it (the second pass faults them in again
  // from the page cache), so the file is never resident whole beside the index.
  detail::read_dcp_metadata(bytes, src->name(), c, trees, [&](std::uint64_t done) { src->release(0, done); });
}

// NOTE [Rank-local metadata]: a save with use_collectives=False (newest torch) has no .metadata.
// Each rank writes __{rank}.metadata, the Metadata of its own plan alone: its own chunks of each
// tensor, its own storage_data, its own __{rank}_N.distcp files. PyTorch gives each rank its own
// file to load; a tool that shows the whole checkpoint merges them, lowest rank first: files by
// name, entries by FQN (dtype and shape must agree), chunks and bytes items added when a lower
// rank has not already given the same box or item. A tensor that every rank held whole (nothing
// deduplicated it, as the collective planner would) is then one chunk, the lowest rank's copy,
// and a note says how many copies were set aside. Ranks must run from 0 without a gap: a rank
// whose file is missing did not finish its save.
class RankLocalMerge {
 public:
  explicit RankLocalMerge(Checkpoint& c) : c_(c) {}

  void add(Checkpoint part, const std::string& source) {
    std::vector<std::uint32_t> file(part.files.size());
    for (std::size_t i = 0; i < part.files.size(); ++i) {
      const auto [it, fresh] = files_.emplace(part.files[i].relative, static_cast<std::uint32_t>(c_.files.size()));
      if (fresh) c_.files.push_back(std::move(part.files[i]));
      file[i] = it->second;
    }
    auto relocate = [&](OptionalLocation& l) {
      if (l) l->file = file[l->file];
    };
    // The part's entries in the order it stores them, tensors and objects alike (each vector is
    // in that order already).
    std::size_t t = 0, o = 0;
    while (t < part.tensors.size() || o < part.objects.size()) {
      if (o == part.objects.size() || (t < part.tensors.size() && part.tensors[t].position < part.objects[o].position)) {
        add_tensor(std::move(part.tensors[t++]), source, relocate);
        continue;
      }
      ObjectEntry& e = part.objects[o++];
      relocate(e.item);
      if (const auto [it, fresh] = names_.emplace(e.name, Named{false, c_.objects.size()}); !fresh) {
        if (it->second.tensor) {
          throw Error(ErrorKind::kFormat, source, std::nullopt, "'" + e.name + "' is a bytes item here and a tensor in a lower rank's metadata");
        }
        ++copies_;
        continue;
      }
      e.position = c_.tensors.size() + c_.objects.size();
      c_.objects.push_back(std::move(e));
    }
    for (const std::string_view fqn : part.planner_data.fqns()) c_.planner_data.add(fqn, part.planner_data.find(fqn));
    for (auto& u : part.unreferenced_storage) c_.unreferenced_storage.push_back(std::move(u));
    for (auto& n : part.notes) {
      if (std::find(c_.notes.begin(), c_.notes.end(), n) == c_.notes.end()) c_.notes.push_back(std::move(n));
    }
    const std::string name = std::filesystem::path(source).filename().string();
    for (auto& [n, tree] : part.meta_trees) c_.meta_trees.emplace_back(n == ".metadata" ? name : n, std::move(tree));
    if (c_.writer.empty()) c_.writer = part.writer;
  }

  void finish(std::size_t ranks) {
    for (const std::size_t i : merged_) drop_copies(c_.tensors[i]);
    c_.writer += ", rank-local metadata (" + std::to_string(ranks) + " files)";
    if (copies_) {
      c_.notes.push_back(std::to_string(copies_) + " chunks or items were saved by more than one rank (rank-local metadata); the lowest rank's copy is used");
    }
  }

 private:
  template <class Relocate>
  void add_tensor(TensorEntry t, const std::string& source, const Relocate& relocate) {
    for (Chunk& ch : t.chunks) relocate(ch.location);
    const auto [it, fresh] = names_.emplace(t.name, Named{true, c_.tensors.size()});
    if (fresh) {
      t.position = c_.tensors.size() + c_.objects.size();
      c_.tensors.push_back(std::move(t));
      return;
    }
    if (!it->second.tensor) {
      throw Error(ErrorKind::kFormat, source, std::nullopt, "'" + t.name + "' is a tensor here and a bytes item in a lower rank's metadata");
    }
    TensorEntry& have = c_.tensors[it->second.index];
    if (have.dtype != t.dtype || have.shape != t.shape) {
      throw Error(ErrorKind::kFormat, source, std::nullopt,
                  "'" + t.name + "' is " + std::string(name(t.dtype)) + " " + detail::shape_text(t.shape) + " here and " +
                      std::string(name(have.dtype)) + " " + detail::shape_text(have.shape) + " in a lower rank's metadata");
    }
    if (!t.chunks.empty()) merged_.insert(it->second.index);
    for (Chunk& ch : t.chunks) have.chunks.push_back(std::move(ch));
  }
  // The chunks of a tensor that several ranks gave, less every box a lower rank gave already
  // (sorted by box, so that a rank-local checkpoint of many chunks costs n log n).
  void drop_copies(TensorEntry& t) {
    std::vector<std::size_t> order(t.chunks.size());
    for (std::size_t k = 0; k < order.size(); ++k) order[k] = k;
    auto box = [&](std::size_t k) { return std::tie(t.chunks[k].offsets, t.chunks[k].sizes); };
    std::stable_sort(order.begin(), order.end(), [&](std::size_t x, std::size_t y) { return box(x) < box(y); });
    std::vector<bool> copy(t.chunks.size(), false);
    for (std::size_t k = 1; k < order.size(); ++k) copy[order[k]] = box(order[k]) == box(order[k - 1]);
    std::size_t kept = 0;
    for (std::size_t k = 0; k < t.chunks.size(); ++k) {
      if (copy[k]) continue;
      if (kept != k) t.chunks[kept] = std::move(t.chunks[k]);
      ++kept;
    }
    copies_ += t.chunks.size() - kept;
    t.chunks.resize(kept);
  }

  struct Named {
    bool tensor;
    std::size_t index;
  };
  Checkpoint& c_;
  std::map<std::string, std::uint32_t> files_;
  std::unordered_map<std::string, Named> names_;
  std::set<std::size_t> merged_;  ///< tensors that more than one rank gave chunks of
  std::size_t copies_ = 0;
};

}  // namespace

std::vector<std::filesystem::path> detail::rank_local_metadata(const std::filesystem::path& dir) {
  std::vector<std::pair<int, std::filesystem::path>> found;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with("__") || !name.ends_with(".metadata")) continue;
    int r = 0;
    auto [p, err] = std::from_chars(name.data() + 2, name.data() + name.size(), r);
    if (err != std::errc() || r < 0 || std::string_view(p) != ".metadata") continue;
    found.emplace_back(r, e.path());
  }
  std::sort(found.begin(), found.end());
  for (std::size_t i = 0; i < found.size(); ++i) {
    if (found[i].first != static_cast<int>(i)) {
      throw Error(ErrorKind::kFormat, (dir / ("__" + std::to_string(i) + ".metadata")).string(), std::nullopt,
                  "missing: the directory has rank-local metadata up to __" + std::to_string(found.back().first) +
                      ".metadata, and a rank without its file did not finish its save (incomplete checkpoint)");
    }
  }
  std::vector<std::filesystem::path> out;
  for (auto& [r, p] : found) out.push_back(std::move(p));
  return out;
}

void detail::read_dcp_metadata(std::span<const std::byte> bytes, const std::string& source, Checkpoint& c, MetaTrees trees,
                               const std::function<void(std::uint64_t)>& release) {
  // The direct reader first (NOTE [The direct .metadata reader]); the tree when it declines, or
  // when the tree is to be kept.
  if (trees == MetaTrees::kDrop && read_dcp_metadata_direct(bytes, source, c, release)) return;
  read_dcp_metadata_tree(bytes, source, c, trees, release);
}

void detail::read_dcp_metadata_tree(std::span<const std::byte> bytes, const std::string& source, Checkpoint& c, MetaTrees trees,
                                    const std::function<void(std::uint64_t)>& release) {
  MetadataReader reader(source, c);
  pickle::ParseOptions o;
  o.persistent_ids = pickle::PersistentIds::kRefuse;
  o.on_object = [&](const Value& v) { reader.on_object(v); };
  // Kept trees must be whole; otherwise items are consumed as they come (NOTE [Streaming .metadata]).
  if (trees == MetaTrees::kDrop) {
    o.on_dict_item = [&](const Value& d, const ValuePtr& k, const ValuePtr& v) { return reader.offer(d, k, v); };
    o.on_built = [&](const Value& v) { return reader.on_built(v); };
  }
  o.on_scanned = release;
  o.on_progress = release;
  ValuePtr root = pickle::parse(bytes, source, 0, o);
  reader.read(root);
  if (trees == MetaTrees::kKeep) c.meta_trees.emplace_back(".metadata", root);
}

Checkpoint open_dcp(const std::filesystem::path& dir, MetaTrees trees) {
  Checkpoint c;
  c.root = dir;
  c.format = Format::kDcp;
  const auto meta_path = dir / ".metadata";
  std::error_code ec;
  const auto rank_local = std::filesystem::exists(meta_path, ec) ? std::vector<std::filesystem::path>{} : detail::rank_local_metadata(dir);
  if (rank_local.empty()) {
    read_metadata_file(meta_path, c, trees);
  } else {  // NOTE [Rank-local metadata]
    RankLocalMerge merge(c);
    for (const auto& path : rank_local) {
      require_inside(dir, path.filename().string());
      Checkpoint part;
      part.root = dir;
      part.format = Format::kDcp;
      read_metadata_file(path, part, trees);
      merge.add(std::move(part), path.string());
    }
    merge.finish(rank_local.size());
  }

  // World size: the ranks whose data files the metadata names or the directory holds (a rank with
  // nothing to write still leaves an empty file).
  int max_rank = -1;
  for (const auto& f : c.files) {
    if (auto r = rank_of(f.relative)) max_rank = std::max(max_rank, *r);
  }
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    if (auto r = rank_of(e.path().filename().string())) max_rank = std::max(max_rank, *r);
  }
  if (max_rank >= 0) c.world_size = max_rank + 1;
  if (!rank_local.empty()) c.world_size = std::max(c.world_size.value_or(0), static_cast<int>(rank_local.size()));

  // Lightning's meta.pt: the rest of the state.
  for (const char* name : {"meta.pt", "common.pt", "metadata.json"}) require_inside(dir, name);
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
  c.items = detail::dcp_items();
  detail::resolve_safetensors_items(c);
  return c;
}

}  // namespace ckpt
