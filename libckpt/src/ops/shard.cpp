// SPDX-License-Identifier: Apache-2.0
// shard: plan the output entries (flattening, geometry, DCP's deduplication), hand the DCP writer
// a plan whose chunks are assembled from the input's chunks, and commit (see ckpt/ops/shard.hpp).
#include "ckpt/ops/shard.hpp"

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <set>

#include "ckpt/cast.hpp"
#include "ckpt/error.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "ckpt/ops/validate.hpp"
#include "ckpt/sharding.hpp"
#include "formats/dcp/group_commit.hpp"
#include "formats/dcp/write_plan.hpp"
#include "formats/huggingface/dcp_storage_writer.hpp"
#include "io/outputs.hpp"
#include "memory.hpp"
#include "ops/assemble.hpp"
#include "text_helpers.hpp"

namespace ckpt {

namespace {

using pickle::Value;
using pickle::ValuePtr;
namespace pk = pickle;

std::string key_text(const Value& k, const std::string& where) {
  if (const std::string* s = k.str()) return *s;
  if (const bool* b = k.get_if<bool>()) return *b ? "True" : "False";  // str(True), as DCP's flattening does
  if (auto i = k.int64()) return std::to_string(*i);
  throw Error(ErrorKind::kUnsupported, where, k.offset, "a dict key of type " + k.type_name() + " cannot name a DCP entry");
}

std::string join(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }

class Sharder {
 public:
  // `spent`: the input, whose chunk lists may go once the data files are written, or nullptr.
  Sharder(const Checkpoint& c, Output& out, const ShardOptions& o, Checkpoint* spent = nullptr)
      : c_(c), spent_(spent), out_(out), output_(out.path()), o_(o), reader_(c, FileAccess::kRead) {}

  ShardResult run(bool dry_run) {
    check_options();
    collect();
    selection_.conclude(c_.root.string(), selection_.selected(), false, {}, o_.progress);
    place();
    ShardResult result = describe();
    result.dry_run = dry_run;
    detail::give_back_freed_memory();  // the input's parse, placing's order (NOTE [Giving freed memory back])
    if (dry_run) return result;
    write(result);
    return result;
  }

 private:
  void check_options() const {
    if (o_.world_size < 1) throw Error(ErrorKind::kInvalidArgument, "--world-size must be at least 1");
    if (o_.files_per_rank < 1) throw Error(ErrorKind::kInvalidArgument, "--files-per-rank must be at least 1");
    if (o_.process_count < 1 || o_.process_index < 0 || o_.process_index >= o_.process_count) {
      throw Error(ErrorKind::kInvalidArgument, "process " + std::to_string(o_.process_index) + " of " + std::to_string(o_.process_count) +
                                                   " is not a valid process rank");
    }
    if (hf() && (o_.process_count > 1 || o_.files_per_rank > 1 || o_.compression != DcpCompression::kNone)) {
      throw Error(ErrorKind::kInvalidArgument, "the Hugging Face storage format is written by one process, one file a rank, uncompressed");
    }
    if (o_.process_count > 1 && !out_.in_file_system()) {
      throw Error(ErrorKind::kInvalidArgument, output_.string(), std::nullopt, "several processes share an output in the file system only");
    }
    if (out_.in_file_system()) detail::refuse_output_over_input(c_.root, output_);
    require_valid_index(c_);
    out_.check(output_kind());
  }

  bool hf() const { return o_.format == ShardFormat::kHfSafetensors; }
  OutputKind output_kind() const { return hf() ? OutputKind::kSafetensorsDirectory : OutputKind::kDcpDirectory; }

  bool selected(std::string_view name) {
    if (selection_.select(name)) return true;
    ++dropped_;
    return false;
  }

  // The entry's planner_data path, unless the plan shares the input's, or it is (fqn,), which is
  // what .metadata gives an FQN without one: one of those per entry would grow with the index.
  void keep_path(std::string_view fqn, std::vector<ValuePtr> path) {
    if (plan_.shared_paths) return;
    if (path.size() == 1 && path[0]->str() && *path[0]->str() == fqn) return;
    plan_.planner_data.set(fqn, pk::make_tuple(std::move(path)));
  }

  // The plan is made as the entries are found: its tensors and objects, in order, without chunks
  // (placing adds them) or ranks. `fqn` must outlive the plan: an input entry's name, or one kept
  // by keep().
  void add_tensor(std::string_view fqn, std::vector<ValuePtr> path, const TensorEntry* t) {
    if (!selected(fqn)) return;
    const DType out = cast_.out(fqn, t->dtype);  // decided on the input's name
    const std::string_view name = renamed(fqn, path);
    keep_path(name, std::move(path));
    plan_.tensors.push_back({.fqn = name, .position = position_++, .dtype = out, .requires_grad = t->requires_grad, .shape = t->shape});
    sources_.push_back(t);
  }

  void add_object(std::string_view fqn, std::vector<ValuePtr> path, SourcePtr item) {
    if (!selected(fqn)) return;
    const std::string_view name = renamed(fqn, path);
    keep_path(name, std::move(path));
    plan_.objects.push_back({name, position_++, -1, std::move(item)});
  }

  // The entry's FQN in the output (--rename, --strip-prefix), and `path` made to follow it. DCP's
  // FQN is its path's keys joined with '.', so the new FQN's '.'-separated parts are grouped into
  // keys as the old ones were: (fqn,) becomes (new fqn,), and ("model", "layers.0.w") renamed to
  // "net.h.0.w" becomes ("net", "h.0.w"). A rename that changes the number of parts of a nested
  // path has no such grouping, and is refused.
  std::string_view renamed(std::string_view fqn, std::vector<ValuePtr>& path) {
    if (o_.renames.empty()) return fqn;
    std::string name = renames_.claim(fqn, output_.string());
    if (name == fqn) return fqn;
    auto parts = [](std::string_view s) { return static_cast<std::size_t>(std::count(s.begin(), s.end(), '.')) + 1; };
    std::vector<std::size_t> group;  // each key's number of parts
    std::string joined;
    for (const ValuePtr& k : path) {
      const std::string text = k->str() ? *k->str() : k->int64() ? std::to_string(*k->int64()) : std::string("\x01");
      group.push_back(parts(text));
      joined += (joined.empty() ? "" : ".") + text;
    }
    const bool regroup = joined == fqn && std::all_of(path.begin(), path.end(), [](const ValuePtr& k) { return k->str() != nullptr; }) &&
                         (path.size() == 1 || parts(name) == parts(fqn));
    if (!regroup) {
      throw Error(ErrorKind::kInvalidArgument, c_.root.string(), std::nullopt,
                  "cannot rename '" + std::string(fqn) + "' to '" + name + "': its planner_data path " + pk::repr(*pk::make_tuple(path), 200) +
                      " nests its parts, and the new name has " + std::to_string(parts(name)) + " of them, not " + std::to_string(parts(fqn)) +
                      " (rename within the parts, or shard a flat checkpoint)");
    }
    if (path.size() == 1) {
      path = {pk::make_str(name)};
    } else {
      const std::vector<std::string> pieces = detail::split_dots(name);
      std::vector<ValuePtr> keys;
      std::size_t at = 0;
      for (const std::size_t n : group) {
        std::string key;
        for (std::size_t i = 0; i < n; ++i) key += (i ? "." : "") + pieces[at++];
        keys.push_back(pk::make_str(std::move(key)));
      }
      path = std::move(keys);
    }
    return keep(std::move(name));
  }

  std::vector<ValuePtr> keyed(const std::vector<ValuePtr>& path) const {
    // Built front to back (GCC 12 at -O3 misreads an insert at begin() as out of bounds).
    std::vector<ValuePtr> out;
    out.reserve(path.size() + 1);
    if (o_.key) out.push_back(pk::make_str(*o_.key));
    out.insert(out.end(), path.begin(), path.end());
    return out;
  }
  std::string keyed(const std::string& fqn) const { return o_.key ? join(*o_.key, fqn) : fqn; }
  // A name made here, kept for the plan, which views it.
  std::string_view keep(std::string name) { return names_.emplace_back(std::move(name)); }

  void collect() {
    plan_.tensors.reserve(c_.tensors.size());  // a bound when the input is a DCP (untouched room is not resident)
    sources_.reserve(c_.tensors.size());
    const bool dcp = is_dcp(c_.format);
    if (dcp && o_.key) throw Error(ErrorKind::kInvalidArgument, "--key applies to input that is not a DCP directory (its FQNs are kept)");
    if (dcp) return collect_dcp();
    if (c_.format == Format::kTorchSave) return collect_torch_save();
    for (const TensorEntry& t : c_.tensors) {
      add_tensor(o_.key ? keep(keyed(t.name)) : std::string_view(t.name), keyed({pk::make_str(t.name)}), &t);
    }
  }

  void collect_dcp() {
    // The input's paths serve as the plan's when each is a tuple of keys (all but a tree kept as
    // read), since an FQN without one gets (fqn,) in both; otherwise each is made again.
    if (c_.planner_data.trees() == 0 && o_.renames.empty()) plan_.shared_paths = &c_.planner_data;
    auto path_of = [&](const std::string& fqn) { return plan_.shared_paths ? std::vector<ValuePtr>{} : planner_path(fqn); };
    for (const std::uint32_t code : detail::entry_order(c_.tensors, c_.objects)) {
      if (!(code & detail::kObjectEntry)) {
        const TensorEntry& t = c_.tensors[code];
        add_tensor(t.name, path_of(t.name), &t);
        continue;
      }
      const ObjectEntry& e = c_.objects[code & ~detail::kObjectEntry];
      if (!e.item) throw Error(ErrorKind::kFormat, c_.root.string(), std::nullopt, "entry '" + e.name + "' has no storage_data item");
      // The item as it is (a torch.save archive), transforms undone.
      SourcePtr item = reader_.item(*e.item);
      if (o_.verify == Verify::kChecksums) detail::verify_item(item);
      add_object(e.name, path_of(e.name), std::move(item));
    }
    for (const CheckpointFile& f : c_.files) {
      if (f.relative == "meta.pt") carry_meta(f);
    }
    // Megatron's torch_dist files beside the DCP part (open_dcp reads them but does not list them).
    for (const char* name : {"common.pt", "metadata.json"}) {
      std::error_code ec;
      if (std::filesystem::is_regular_file(c_.root / name, ec)) carried_.push_back({name, open_file(c_.root / name)});
    }
  }

  std::vector<ValuePtr> planner_path(const std::string& fqn) const {
    if (const ValuePtr keys = c_.planner_data.find(fqn)) {
      if (const auto* seq = keys->sequence(); seq && !seq->empty()) return *seq;
    }
    return {pk::make_str(fqn)};
  }

  // meta.pt as it is, unless the filters drop some of its keys.
  void carry_meta(const CheckpointFile& f) {
    SourcePtr src = open_file(f.path);
    auto meta = std::make_shared<TorchSaveFile>(read_torch_save(src));
    const auto* items = meta->root->dict_items();
    if (!items) throw Error(ErrorKind::kFormat, f.path.string(), meta->root->offset, "meta.pt holds a " + meta->root->type_name() + ", expected a dict");
    std::vector<std::pair<ValuePtr, ValuePtr>> kept;
    for (const auto& [k, v] : *items) {
      const std::string name = key_text(*k, f.path.string());
      if (!selected(name)) continue;
      meta_keys_.push_back(name);
      kept.emplace_back(k, v);
    }
    if (kept.size() == items->size()) {
      carried_.push_back({"meta.pt", src});
      return;
    }
    carried_.push_back({"meta.pt", memory_source(torch_save_bytes(pk::make_dict(std::move(kept)), *meta, "meta"), "meta.pt")});
  }

  // A torch.save archive of `root`, whose storages are those of `from`.
  static std::vector<std::byte> torch_save_bytes(const ValuePtr& root, const TorchSaveFile& from, const std::string& archive) {
    MemorySink sink(archive);
    write_torch_save(sink, *root, storages_of(from), {archive, TorchSaveLayout::kCurrent});
    return sink.take();
  }
  static std::function<SourcePtr(const std::string&)> storages_of(const TorchSaveFile& f) {
    return [&f](const std::string& key) -> SourcePtr {
      auto it = f.storage_index.find(key);
      return it == f.storage_index.end() ? nullptr : f.storages[it->second].data;
    };
  }

  // DCP's flattening of a torch.save object (torch >= 2.4, docs/formats/dcp.md#flattening-and-planner-data).
  void collect_torch_save() {
    file_ = std::make_unique<TorchSaveFile>(read_torch_save(open_mmap(c_.root)));
    for (const TorchTensor& t : file_->tensors) tensor_of_.emplace(t.node.get(), &t);
    const auto* top = file_->root->dict_items();
    bool lightning = false;
    if (top) {
      for (const auto& [k, v] : *top) lightning = lightning || (k->str() && *k->str() == "model" && v->dict_items());
    }
    if (lightning && o_.key) throw Error(ErrorKind::kInvalidArgument, "--key applies to a bare state dict; this is a Lightning checkpoint (it has 'model')");
    if (!lightning) {
      flatten(file_->root, {}, "");
      return;
    }
    std::vector<std::pair<ValuePtr, ValuePtr>> meta;
    for (const auto& [k, v] : *top) {
      const std::string name = key_text(*k, c_.root.string());
      if ((name == "model" && v->dict_items()) || is_optimizer_state(*v)) {
        flatten(v, {pk::make_str(name)}, name);
      } else if (selected(name)) {
        meta_keys_.push_back(name);
        meta.emplace_back(k, v);
      }
    }
    if (!meta.empty()) carried_.push_back({"meta.pt", memory_source(torch_save_bytes(pk::make_dict(std::move(meta)), *file_, "meta"), "meta.pt")});
  }

  static bool is_optimizer_state(const Value& v) {
    const auto* items = v.dict_items();
    if (!items) return false;
    bool state = false, groups = false;
    for (const auto& [k, x] : *items) {
      state = state || (k->str() && *k->str() == "state" && x->dict_items());
      groups = groups || (k->str() && *k->str() == "param_groups" && x->is<pk::List>());
    }
    return state && groups;
  }

  bool non_terminal(const Value& v) const {
    const auto* list = v.get_if<pk::List>();
    if (!list) return false;
    return std::any_of(list->items.begin(), list->items.end(), [&](const ValuePtr& x) {
      return tensor_of_.count(x.get()) || x->dict_items() || non_terminal(*x);
    });
  }

  void flatten(const ValuePtr& v, std::vector<ValuePtr> path, const std::string& fqn) {
    if (auto it = tensor_of_.find(v.get()); it != tensor_of_.end()) {
      owned_.push_back(torch_save_tensor_entry(*file_, *it->second, 0));
      owned_.back().name = keyed(fqn);  // a deque's element: it never moves
      return add_tensor(owned_.back().name, keyed(std::move(path)), &owned_.back());
    }
    if (const auto* items = v->dict_items()) {
      for (const auto& [k, x] : *items) {
        const std::string name = key_text(*k, c_.root.string());
        std::vector<ValuePtr> p = path;
        p.push_back(pk::make_str(name));
        flatten(x, std::move(p), join(fqn, name));
      }
      return;  // an empty mapping contributes nothing, as in DCP
    }
    if (non_terminal(*v)) {
      const auto& items = v->get_if<pk::List>()->items;
      for (std::size_t i = 0; i < items.size(); ++i) {
        std::vector<ValuePtr> p = path;
        p.push_back(pk::make_int(static_cast<std::int64_t>(i)));
        flatten(items[i], std::move(p), join(fqn, std::to_string(i)));
      }
      return;
    }
    if (path.empty()) throw Error(ErrorKind::kFormat, c_.root.string(), v->offset, "holds a " + v->type_name() + ", not a state dict");
    add_object(keep(keyed(fqn)), keyed(std::move(path)),
               memory_source(detail::bytes_item(*v, DcpLayout::kCurrent, storages_of(*file_)), keyed(fqn)));
  }

  // ---- placement ---------------------------------------------------------------------------

  bool replicated(const detail::DcpPlanTensor& t) const {
    if (t.shape.empty() || t.shape[0] == 0) return true;
    return std::any_of(o_.replicate.begin(), o_.replicate.end(), [&](const std::string& g) { return detail::glob_match(g, std::string(t.fqn)); });
  }

  // NOTE [Pieces]: both layouts cut dim 0 into pieces of ceil(n / world) rows, piece k held by
  // rank k (torch.chunk's rule for FSDP, DTensor's Shard(0)); with DTensor's, the ranks past the
  // last piece each hold the empty piece at row n, one item that DCP deduplicates. So piece k
  // first appears in rank k's plan, and its holders are a range of ranks: {k}, or [k, world) for
  // the empty piece; a replicated tensor or a bytes item is one item held by every rank. Holders
  // follow from a chunk's place and are never kept: a list of them would grow with every chunk.
  std::vector<std::pair<std::int64_t, std::int64_t>> pieces(const detail::DcpPlanTensor& t) const {  // (first row, rows)
    if (o_.layout == ShardLayout::kFsdp) return chunk_pieces(t.shape[0], o_.world_size);
    std::vector<std::pair<std::int64_t, std::int64_t>> out;
    for (int r = 0; r < o_.world_size; ++r) {
      const auto piece = dtensor_piece(t.shape[0], o_.world_size, r);
      if (out.empty() || out.back() != piece) out.push_back(piece);  // equal empty pieces: one item
    }
    return out;
  }

  // DCP's deduplication (docs/formats/dcp.md#deduplication): items in order of first appearance (rank 0's
  // plan, then new items of rank 1, ...); each goes to the holder with the fewest planned bytes,
  // ties to the lowest rank; the owner's total grows by the item's bytes (1 for a bytes item).
  // Each tensor's pieces become its chunks in the plan's table first, and get their ranks here.
  void place() {
    const auto world = static_cast<std::size_t>(o_.world_size);
    std::vector<bool> whole(plan_.tensors.size());
    std::size_t nchunks = 0, ndims = 0;
    for (std::size_t i = 0; i < plan_.tensors.size(); ++i) {
      const detail::DcpPlanTensor& t = plan_.tensors[i];
      whole[i] = replicated(t);
      const std::size_t n = whole[i] ? 1 : pieces(t).size();
      nchunks += n;
      ndims += n * 2 * t.shape.size();
    }
    plan_.chunks.reserve(nchunks, ndims);
    for (std::size_t i = 0; i < plan_.tensors.size(); ++i) {
      detail::DcpPlanTensor& t = plan_.tensors[i];
      Dims offsets(std::vector<std::int64_t>(t.shape.size(), 0)), sizes = t.shape;
      if (whole[i]) {
        plan_.chunks.add(t, -1, offsets.span(), sizes.span());
        continue;
      }
      for (const auto& [begin, rows] : pieces(t)) {
        offsets[0] = begin;
        sizes[0] = rows;
        plan_.chunks.add(t, -1, offsets.span(), sizes.span());
      }
    }
    // Every item by the rank where it first appears, in state-dict order within a rank: a counting
    // sort of entry codes (entry_order), tensor i for each of its chunks (chunk k appears at rank k,
    // a whole one at 0), kObjectEntry | j for an object (at rank 0).
    const std::vector<std::uint32_t> entries = detail::entry_order(plan_.tensors, plan_.objects);
    auto each_item = [&](auto&& f) {  // f(code, rank where it first appears), in state-dict order
      for (const std::uint32_t code : entries) {
        if (code & detail::kObjectEntry) {
          f(code, 0);
          continue;
        }
        for (std::size_t k = 0; k < plan_.tensors[code].chunk_count; ++k) f(code, whole[code] ? 0 : k);
      }
    };
    std::vector<std::size_t> start(world + 1, 0);
    each_item([&](std::uint32_t, std::size_t r) { ++start[r + 1]; });
    for (std::size_t r = 0; r < world; ++r) start[r + 1] += start[r];
    std::vector<std::uint32_t> order(start[world]);
    {
      std::vector<std::size_t> at(start.begin(), start.end() - 1);
      each_item([&](std::uint32_t code, std::size_t r) { order[at[r]++] = code; });
    }
    std::vector<std::uint64_t> planned(world, 0);
    std::set<std::pair<std::uint64_t, int>> by_load;
    for (int r = 0; r < o_.world_size; ++r) by_load.insert({0, r});
    auto assign = [&](int first, int end, std::uint64_t bytes) {  // to a holder in [first, end)
      int owner = first;
      if (first == 0 && end == o_.world_size) {
        owner = by_load.begin()->second;
      } else {
        for (int r = first + 1; r < end; ++r) {
          if (planned[static_cast<std::size_t>(r)] < planned[static_cast<std::size_t>(owner)]) owner = r;
        }
      }
      const auto o = static_cast<std::size_t>(owner);
      by_load.erase({planned[o], owner});
      planned[o] += bytes ? bytes : 1;
      by_load.insert({planned[o], owner});
      return owner;
    };
    for (std::size_t r = 0; r < world; ++r) {
      for (std::size_t n = start[r]; n < start[r + 1]; ++n) {
        const std::uint32_t code = order[n];
        if (code & detail::kObjectEntry) {
          plan_.objects[code & ~detail::kObjectEntry].rank = assign(0, o_.world_size, 0);
          continue;
        }
        const detail::DcpPlanTensor& t = plan_.tensors[code];
        const std::size_t k = whole[code] ? 0 : r;
        const detail::DcpPlanChunk c = plan_.chunks.get(t, k);
        const int first = static_cast<int>(k);
        const int end = whole[code] || c.sizes[0] == 0 ? o_.world_size : first + 1;  // the empty piece: ranks [k, world)
        plan_.chunks.set_rank(t, k, assign(first, end, box_volume(c.sizes) * element_size(t.dtype)));
      }
    }
    // Chunk k's rank is at least k and below chunk k + 1's, so each tensor's chunks are in rank
    // order, the order .metadata lists them in (the ranks' plans one after another).
  }

  ShardResult describe() {
    plan_.world_size = o_.world_size;
    plan_.files_per_rank = o_.files_per_rank;
    plan_.compression = o_.compression;
    plan_.zstd_level = o_.zstd_level;
    ShardResult r;
    r.operation = Operation::kShard;
    r.world_size = o_.world_size;
    r.process_index = o_.process_index;
    r.process_count = o_.process_count;
    r.compressed = o_.compression == DcpCompression::kZstd;
    r.dropped = dropped_;
    // A chunk's elements are made from the plan's box and dtype and the planned tensor's source.
    plan_.add_tasks = [this](std::vector<CopyTask>& tasks, std::size_t tensor, std::size_t chunk, std::uint64_t base, std::size_t group,
                             std::uint64_t max_task) {
      const detail::DcpPlanTensor& planned = plan_.tensors[tensor];
      const detail::DcpPlanChunk c = plan_.chunks.get(planned, chunk);
      detail::add_box_tasks(tasks, reader_, *sources_[tensor], Box{Dims(c.offsets), Dims(c.sizes)}, planned.dtype, base, group, max_task,
                            o_.max_memory, {&ledger_, o_.verify == Verify::kChecksums ? &crcs_ : nullptr});
    };
    auto nbytes = [](const detail::DcpPlanTensor& t) { return box_volume(t.shape) * element_size(t.dtype); };  // in the output dtype
    for (const detail::DcpPlanTensor& t : plan_.tensors) r.tensor_bytes += nbytes(t);
    if (o_.report_entries) {  // what the plan holds, as the result shows it
      for (const std::uint32_t code : detail::entry_order(plan_.tensors, plan_.objects)) {
        if (code & detail::kObjectEntry) {
          const detail::DcpPlanObject& o = plan_.objects[code & ~detail::kObjectEntry];
          r.entries.push_back({std::string(o.fqn), "object", std::nullopt, {}, 0, {{o.rank, {}, {}}}, {}});
          continue;
        }
        const detail::DcpPlanTensor& t = plan_.tensors[code];
        ResultEntry out{std::string(t.fqn), "tensor", t.dtype, t.shape, nbytes(t), {}, {}};
        for (std::size_t k = 0; k < t.chunk_count; ++k) {
          const detail::DcpPlanChunk c = plan_.chunks.get(t, k);
          out.chunks.push_back({c.rank, Dims(c.offsets), Dims(c.sizes)});
        }
        r.entries.push_back(std::move(out));
      }
      for (const std::string& k : meta_keys_) r.entries.push_back({k, "meta", std::nullopt, {}, 0, {}, {}});
    }
    detail::validate_dcp_plan(plan_);
    if (hf()) {
      hf_files_ = detail::plan_hf_storage_files(plan_, output_.string());
      for (const detail::HfStorageFile& f : hf_files_) r.files.push_back({output_ / f.name, f.layout.size, f.chunks.size(), true});
      note_left_out();
      return r;
    }
    files_ = detail::plan_dcp_files(plan_);
    for (const detail::DcpFilePlan& f : files_) {
      r.files.push_back({output_ / f.name, f.size, f.items.size(), mine(f.rank)});
    }
    for (const auto& [name, src] : carried_) r.files.push_back({output_ / name, src->size(), 0, o_.process_index == 0});
    return r;
  }

  // What the Hugging Face storage cannot hold: said, not silently lost.
  void note_left_out() const {
    if (!o_.progress) return;
    if (!plan_.objects.empty()) {
      o_.progress->note("left out " + std::to_string(plan_.objects.size()) + " entr" + (plan_.objects.size() == 1 ? "y" : "ies") +
                        " that " + (plan_.objects.size() == 1 ? "is" : "are") + " not a tensor (first: '" +
                        std::string(plan_.objects.front().fqn) + "'): the Hugging Face storage holds tensors only; --format dcp keeps everything");
    }
    for (const auto& [name, src] : carried_) o_.progress->note("left out " + name + ": the Hugging Face storage holds tensors only");
  }

  // DCP's Hugging Face storage: every file in the output's directory, put in place whole.
  void write_hf() {
    out_.prepare(OutputKind::kSafetensorsDirectory, o_.progress);
    detail::write_hf_storage_files(out_.directory(), plan_, hf_files_, {o_.threads, o_.progress, o_.task_delay_ms});
    if (o_.verify == Verify::kChecksums) crcs_.finish();
    if (o_.dtype) ledger_.conclude(*o_.dtype, o_.cast_check, o_.progress, output_.string());
    out_.commit_directory();
  }

  bool mine(int rank) const { return rank % o_.process_count == o_.process_index; }

  // ---- writing -----------------------------------------------------------------------------

  void write(ShardResult& result) {
    if (hf()) {
      write_hf();
      result.committed = true;
      return;
    }
    const bool distributed = o_.process_count > 1;
    // Several processes meet in `<output>.partial` (NOTE [Several processes, one DCP]); one builds
    // the output's directory alone.
    std::filesystem::path shared = output_;
    shared += ".partial";
    detail::DcpGroupCommit group(shared, o_.process_index, o_.process_count,
                                 distributed ? detail::dcp_plan_fingerprint(plan_, c_.root.string(), o_.process_count) : std::string(),
                                 o_.timeout);
    std::unique_ptr<OutputFiles> shared_files;
    if (distributed) {
      group.begin();
      shared_files = directory_files(shared);
    } else {
      out_.prepare(OutputKind::kDcpDirectory, o_.progress);
    }
    OutputFiles& dir = distributed ? *shared_files : out_.directory();
    // This process's files: all of them (no copy) unless processes share the work.
    std::vector<detail::DcpFilePlan> some_files;
    for (const auto& f : files_) {
      if (distributed && mine(f.rank)) some_files.push_back(f);
    }
    const std::span<const detail::DcpFilePlan> mine_files = distributed ? std::span<const detail::DcpFilePlan>(some_files) : files_;
    // One process writing uncompressed: where each item went follows from the plan, and is made
    // again as .metadata is written rather than held through the copy and it.
    const bool from_plan = !distributed && plan_.compression == DcpCompression::kNone;
    std::vector<detail::DcpItem> items;
    try {
      items = detail::write_dcp_files(dir, plan_, mine_files, {o_.threads, o_.progress, o_.task_delay_ms},
                                      from_plan ? detail::ItemPlaces::kFromPlan : detail::ItemPlaces::kReturn);
      if (o_.verify == Verify::kChecksums) crcs_.finish();  // a damaged record fails like a copy
      if (o_.dtype) ledger_.conclude(*o_.dtype, o_.cast_check, o_.progress, output_.string());  // strict: fails like a copy
    } catch (const std::exception& e) {
      if (distributed) group.failed(e.what());  // one process's directory goes with the output
      throw;
    }
    // Sizes as written (compressed files differ from the plan).
    for (ResultFile& f : result.files) {
      if (f.written_here && f.path.parent_path() == output_ && f.path.extension() == ".distcp") f.size = dir.size_of(f.path.filename().string());
    }
    if (o_.process_index != 0) {
      group.done(items);
      return;
    }
    std::vector<detail::DcpItem> others = group.wait_for_others();
    items.insert(items.end(), std::make_move_iterator(others.begin()), std::make_move_iterator(others.end()));
    std::size_t nitems = items.size();
    if (from_plan) {
      for (const auto& f : files_) nitems += f.items.size();
    }
    for (const auto& [name, src] : carried_) {
      auto sink = dir.sequential(name);
      stream_range(*src, 0, src->size(), [&](std::span<const std::byte> b) { sink->write(b); });
      sink->commit();
    }
    if (distributed) {
      // Only the planned files stay: markers and leftovers of an earlier run go.
      std::set<std::string> keep{".metadata"};
      for (const auto& f : files_) keep.insert(f.name);
      for (const auto& [name, src] : carried_) keep.insert(name);
      for (const auto& d : std::filesystem::directory_iterator(shared)) {
        if (!keep.count(d.path().filename().string())) std::filesystem::remove_all(d.path());
      }
    }
    if (spent_) {
      for (TensorEntry& t : spent_->tensors) std::vector<Chunk>().swap(t.chunks);  // copied: .metadata names the plan's
    }
    detail::give_back_freed_memory();  // the copy's records, the input's chunk lists
    if (from_plan) {
      detail::write_dcp_metadata(dir, plan_, std::span<const detail::DcpFilePlan>(files_));
    } else {
      detail::write_dcp_metadata(dir, plan_, std::span<const detail::DcpItem>(items));
    }
    result.files.push_back({output_ / ".metadata", dir.size_of(".metadata"), nitems, true});
    for (ResultFile& f : result.files) {
      if (!f.written_here) f.size = dir.size_of(f.path.filename().string());  // another process's
    }
    if (distributed) {
      detail::move_into_place(shared, output_);
    } else {
      out_.commit_directory();
    }
    result.committed = true;
  }

  const Checkpoint& c_;
  Checkpoint* spent_;
  Output& out_;
  std::filesystem::path output_;  ///< out_.path(), the name results and errors give
  const ShardOptions& o_;
  ChunkReader reader_;
  std::unique_ptr<TorchSaveFile> file_;                // torch.save input
  std::map<const Value*, const TorchTensor*> tensor_of_;
  std::deque<TensorEntry> owned_;                      // torch.save input's entries (stable addresses)
  std::deque<std::string> names_;                      // FQNs made here (keep()), which entries and the plan view
  std::vector<const TensorEntry*> sources_;            // each planned tensor's source
  std::size_t position_ = 0;                           // the next entry's, among tensors and objects
  std::vector<std::pair<std::string, SourcePtr>> carried_;  // meta.pt, common.pt, metadata.json
  std::vector<std::string> meta_keys_;
  std::size_t dropped_ = 0;
  EntrySelection selection_{o_.filters};
  CastScope cast_{c_, o_.dtype, o_.cast_include};
  CastLedger ledger_;
  detail::PassingCrcs crcs_;
  detail::DcpPlan plan_;
  std::vector<detail::DcpFilePlan> files_;
  std::vector<detail::HfStorageFile> hf_files_;
  EntryRenames renames_ = o_.renames;  ///< with the names it has made, to refuse two made one
};

}  // namespace

ShardResult shard(const Checkpoint& input, Output& output, const ShardOptions& options, bool dry_run) {
  Sharder s(input, output, options);
  return s.run(dry_run);
}

ShardResult shard(Checkpoint&& input, Output& output, const ShardOptions& options, bool dry_run) {
  Sharder s(input, output, options, &input);
  return s.run(dry_run);
}

ShardResult shard(const Checkpoint& input, const std::filesystem::path& output, const ShardOptions& options, bool dry_run) {
  const std::unique_ptr<Output> out = open_file_output(output, options.overwrite);
  return shard(input, *out, options, dry_run);
}

ShardResult shard(Checkpoint&& input, const std::filesystem::path& output, const ShardOptions& options, bool dry_run) {
  const std::unique_ptr<Output> out = open_file_output(output, options.overwrite);
  return shard(std::move(input), *out, options, dry_run);
}

}  // namespace ckpt
