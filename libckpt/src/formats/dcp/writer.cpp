// SPDX-License-Identifier: Apache-2.0
// The DCP writer (formats/dcp/write_plan.hpp) and write_dcp on top of it: data files first, `.metadata`
// last (see ckpt/formats/dcp.hpp).
#include <algorithm>
#include <chrono>
#include <mutex>
#include <optional>
#include <random>
#include <unordered_map>
#include <thread>

#include "ckpt/error.hpp"
#include "ckpt/formats/dcp.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "ckpt/sharding.hpp"
#include "ckpt/test_hooks.hpp"
#include "codecs/zstd.hpp"
#include "formats/dcp/write_plan.hpp"
#include "formats/torch_save/archive_plan.hpp"
#include "parallel.hpp"

namespace ckpt {
namespace detail {
namespace {

using pickle::ValuePtr;
namespace pk = pickle;

std::string uuid4() {
  std::random_device rd;
  std::uniform_int_distribution<int> d(0, 15);
  std::string s = "xxxxxxxx-xxxx-4xxx-yxxx-xxxxxxxxxxxx";
  const char* hex = "0123456789abcdef";
  for (char& c : s) {
    if (c == 'x') c = hex[d(rd)];
    else if (c == 'y') c = hex[8 + d(rd) % 4];
  }
  return s;
}

// The .metadata object tree, as CPython pickles DCP's dataclasses (docs/formats/dcp.md#metadata).
class MetadataBuilder {
 public:
  explicit MetadataBuilder(DcpLayout layout) : layout_(layout) {
    const std::string meta = layout == DcpLayout::kTorch113 ? "torch.distributed._shard.checkpoint.metadata"
                                                            : "torch.distributed.checkpoint.metadata";
    const std::string props = layout == DcpLayout::kTorch113 ? "torch.distributed._shard.sharded_tensor.metadata" : meta;
    const std::string fs = layout == DcpLayout::kTorch113 ? "torch.distributed._shard.checkpoint.filesystem"
                                                          : "torch.distributed.checkpoint.filesystem";
    metadata_ = pk::make_global(meta, "Metadata");
    tsm_ = pk::make_global(meta, "TensorStorageMetadata");
    csm_ = pk::make_global(meta, "ChunkStorageMetadata");
    bsm_ = pk::make_global(meta, "BytesStorageMetadata");
    index_ = pk::make_global(meta, "MetadataIndex");
    storage_meta_ = pk::make_global(meta, "StorageMeta");
    props_ = pk::make_global(props, "TensorProperties");
    memfmt_ = pk::make_global(props, layout == DcpLayout::kTorch113 ? "MEM_FORMAT_ENCODING" : "_MEM_FORMAT_ENCODING");
    info_ = pk::make_global(fs, "_StorageInfo");
    size_ = pk::make_global("torch", "Size");
    get_layout_ = pk::make_global("torch.serialization", "_get_layout");
    // Every field name now, so that persistent() names them all before anything is written.
    for (const char* f : {"properties", "size", "chunks", "offsets", "sizes", "fqn", "offset", "index", "relative_path",
                          "length", "transform_descriptors", "state_dict_metadata", "planner_data", "storage_data",
                          "storage_meta", "version", "checkpoint_id", "save_id", "load_id", "modules"}) {
      field(f);
    }
  }

  ValuePtr size(std::span<const std::int64_t> v) {
    std::vector<ValuePtr> xs;
    for (auto x : v) xs.push_back(pk::make_int(x));
    return pk::make_object(size_, pk::BuildOp::kReduce, pk::make_tuple({pk::make_tuple(std::move(xs))}));
  }
  ValuePtr tensor_meta(const DcpPlan& plan, const DcpPlanTensor& t) {
    ValuePtr props = pk::make_object(
        props_, pk::BuildOp::kNewObj, pk::make_tuple(),
        pk::make_tuple({pk::make_global("torch", std::string(name(t.dtype))),
                        pk::make_object(get_layout_, pk::BuildOp::kReduce, pk::make_tuple({pk::make_str("torch.strided")})),
                        pk::make_bool(t.requires_grad),
                        pk::make_object(memfmt_, pk::BuildOp::kReduce, pk::make_tuple({pk::make_int(0)})), pk::make_bool(false)}));
    std::vector<ValuePtr> chunks;
    for (std::size_t k = 0; k < t.chunk_count; ++k) {
      const DcpPlanChunk c = plan.chunks.get(t, k);
      chunks.push_back(dataclass(csm_, {{"offsets", size(c.offsets)}, {"sizes", size(c.sizes)}}));
    }
    return dataclass(tsm_, {{"properties", props}, {"size", size(t.shape)}, {"chunks", pk::make_list(std::move(chunks))}});
  }
  ValuePtr bytes_meta() { return pk::make_object(bsm_, pk::BuildOp::kNewObj, pk::make_tuple()); }
  ValuePtr index(const DcpItem& it) {
    std::vector<std::pair<std::string, ValuePtr>> f;
    f.reserve(3);  // (grown from one, GCC 12 -O3 warns falsely: -Warray-bounds)
    f.emplace_back("fqn", pk::make_str(std::string(it.fqn)));
    f.emplace_back("index", it.tensor ? pk::make_int(static_cast<std::int64_t>(it.chunk_index)) : pk::make_none());
    if (it.tensor) f.emplace_back("offset", size(it.offsets));
    return dataclass(index_, std::move(f));
  }
  ValuePtr info(const DcpItem& it, bool zstd) {
    std::vector<std::pair<std::string, ValuePtr>> f{{"relative_path", pk::make_str(std::string(it.file))},
                                                    {"offset", pk::make_int(static_cast<std::int64_t>(it.offset))},
                                                    {"length", pk::make_int(static_cast<std::int64_t>(it.length))}};
    if (zstd) f.emplace_back("transform_descriptors", pk::make_list({pk::make_str("stream.zstd/1")}));
    return dataclass(info_, std::move(f));
  }
  /// The nodes every entry shares: the field names (classes are memoized by name anyway).
  std::vector<ValuePtr> persistent() const {
    std::vector<ValuePtr> out;
    for (const auto& [k, v] : fields_) out.push_back(v);
    return out;
  }
  ValuePtr metadata(ValuePtr sdm, ValuePtr planner, ValuePtr storage) {
    std::vector<std::pair<std::string, ValuePtr>> f{{"state_dict_metadata", std::move(sdm)},
                                                    {"planner_data", std::move(planner)},
                                                    {"storage_data", std::move(storage)}};
    if (layout_ == DcpLayout::kCurrent) {
      f.emplace_back("storage_meta", dataclass(storage_meta_, {{"checkpoint_id", pk::make_none()},
                                                               {"save_id", pk::make_str(uuid4())},
                                                               {"load_id", pk::make_none()},
                                                               {"modules", pk::make_list()}}));
      f.emplace_back("version", pk::make_str("1.0.0"));
    }
    return dataclass(metadata_, std::move(f));
  }

 private:
  // Field names are interned strings in CPython: one node each, so they are written once and GET.
  ValuePtr field(const std::string& n) {
    auto& v = fields_[n];
    if (!v) v = pk::make_str(n);
    return v;
  }
  ValuePtr dataclass(const ValuePtr& cls, std::vector<std::pair<std::string, ValuePtr>> f) {
    std::vector<std::pair<ValuePtr, ValuePtr>> items;
    for (auto& [k, v] : f) items.emplace_back(field(k), std::move(v));
    return pk::make_object(cls, pk::BuildOp::kNewObj, pk::make_tuple(), pk::make_dict(std::move(items)));
  }

  DcpLayout layout_;
  ValuePtr metadata_, tsm_, csm_, bsm_, index_, storage_meta_, props_, memfmt_, info_, size_, get_layout_;
  std::map<std::string, ValuePtr> fields_;
};

TorchSaveWriteOptions item_options(DcpLayout layout) {
  return {"archive", layout == DcpLayout::kTorch113 ? TorchSaveLayout::kTorch113 : TorchSaveLayout::kCurrent};
}

// The archive of a tensor item depends only on its dtype and box: items of the same kind share it.
class ItemArchives {
 public:
  explicit ItemArchives(DcpLayout layout) : options_(item_options(layout)) {}
  const ArchivePlan& of(DType dtype, std::span<const std::int64_t> sizes) {
    if (auto it = plans_.find(std::pair{dtype, sizes}); it != plans_.end()) return *it->second;
    TorchSaveBuilder b;
    const std::size_t st = b.reserve_storage(dtype, box_volume(sizes));
    std::vector<std::int64_t> shape(sizes.begin(), sizes.end());
    auto plan = std::make_unique<ArchivePlan>("archive", plan_torch_save(*b.tensor(st, shape), options_, "a DCP item"));
    return *plans_.emplace(std::pair{dtype, std::move(shape)}, std::move(plan)).first->second;
  }
  const ArchivePlan& of(const DcpPlan& plan, const DcpFilePlan::Ref& r) {
    const DcpPlanTensor& t = plan.tensors[r.index];
    return of(t.dtype, plan.chunks.get(t, r.chunk).sizes);
  }

 private:
  // Looked up by a chunk's sizes as the plan's table holds them (a span), without a copy.
  struct KindLess {
    using is_transparent = void;
    template <typename A, typename B>
    bool operator()(const A& a, const B& b) const {
      if (a.first != b.first) return a.first < b.first;
      return std::lexicographical_compare(a.second.begin(), a.second.end(), b.second.begin(), b.second.end());
    }
  };
  TorchSaveWriteOptions options_;
  std::map<std::pair<DType, std::vector<std::int64_t>>, std::unique_ptr<ArchivePlan>, KindLess> plans_;
};

std::uint64_t item_bytes(const DcpPlan& plan, const DcpFilePlan::Ref& r, ItemArchives& archives) {
  if (!r.tensor) return plan.objects[r.index].item->size();
  return archives.of(plan, r).size();
}

// Every file's items: what the item lists are reserved to (one per chunk: grown by doubling, a
// reshard's list of 300,000 held up to twice that at once).
std::size_t item_count(std::span<const DcpFilePlan> files) {
  std::size_t n = 0;
  for (const DcpFilePlan& f : files) n += f.items.size();
  return n;
}

DcpItem item_of(const DcpPlan& plan, const DcpFilePlan::Ref& r, const std::string& file, std::uint64_t offset, std::uint64_t length) {
  if (!r.tensor) return {plan.objects[r.index].fqn, false, {}, 0, file, offset, length};
  const DcpPlanTensor& t = plan.tensors[r.index];
  return {t.fqn, true, plan.chunks.get(t, r.chunk).offsets, r.chunk, file, offset, length};
}

// The chunk's tasks, made at offset 0 and sorted, written in order to `write` (the zstd path).
void stream_chunk(const DcpPlan& plan, const DcpFilePlan::Ref& r, std::uint64_t max_task, const CopyOptions& copy, Progress& progress,
                  std::mutex& progress_mutex, const std::function<void(std::span<const std::byte>)>& write) {
  std::vector<CopyTask> tasks;
  plan.add_tasks(tasks, r.index, r.chunk, 0, 0, max_task);
  std::sort(tasks.begin(), tasks.end(), [](const CopyTask& a, const CopyTask& b) { return a.offset < b.offset; });
  std::vector<std::byte> buffer, scratch;
  for (CopyTask& t : tasks) {
    if (copy.task_delay_ms) std::this_thread::sleep_for(std::chrono::milliseconds(copy.task_delay_ms));
    if (cancel_requested()) throw Error(ErrorKind::kCancelled, "interrupted; nothing was written");
    buffer.resize(static_cast<std::size_t>(t.length));
    t.fill(buffer, scratch);
    write(buffer);
    t.fill = nullptr;
    std::lock_guard lock(progress_mutex);
    progress.advance(t.length);
  }
}

std::vector<DcpItem> write_compressed(OutputFiles& into, const DcpPlan& plan, std::span<const DcpFilePlan> files,
                                      const CopyOptions& copy) {
  Progress& progress = copy.progress ? *copy.progress : no_progress();
  std::uint64_t total = 0;
  for (const DcpFilePlan& f : files) total += f.size;
  progress.start("compressing", total);
  const std::uint64_t max_task = task_bytes(copy.threads);
  std::vector<std::vector<DcpItem>> per_file(files.size());
  std::mutex progress_mutex;
  // Files are independent: each worker streams whole files, item after item, one frame each.
  detail::parallel_for<std::optional<ItemArchives>>(files.size(), copy.threads, [&](std::size_t i, std::optional<ItemArchives>& archives) {
    if (!archives) archives.emplace(plan.layout);
    const DcpFilePlan& f = files[i];
    auto sink = into.sequential(f.name);
    for (const DcpFilePlan::Ref& r : f.items) {
      const std::uint64_t at = sink->offset();
      const auto z = codecs::zstd_encoder(*sink, plan.zstd_level);
      if (!r.tensor) {
        const DcpPlanObject& o = plan.objects[r.index];
        stream_range(*o.item, 0, o.item->size(), [&](std::span<const std::byte> b) { z->write(b); });
      } else {
        archives->of(plan, r).stream(*z, [&](std::size_t, const auto& write) {
          stream_chunk(plan, r, max_task, copy, progress, progress_mutex, write);
        });
      }
      z->commit();
      test_hooks::crash_point("item");
      per_file[i].push_back(item_of(plan, r, f.name, at, sink->offset() - at));
    }
    sink->commit();
  });
  progress.finish();
  std::vector<DcpItem> items;
  for (auto& v : per_file) items.insert(items.end(), std::make_move_iterator(v.begin()), std::make_move_iterator(v.end()));
  return items;
}

// Walks every item of every file of a plan, in order, with where it goes (its file and offset) and
// its first CRC group. write_uncompressed walks three times (to lay the files out, to make the
// tasks as the engine needs them, to place the archives' tails); write_dcp_metadata(files) once,
// to say where each item went.
class ItemWalk {
 public:
  ItemWalk(const DcpPlan& plan, std::span<const DcpFilePlan> files, ItemArchives& archives) : plan_(plan), files_(files), archives_(archives) {
    skip_empty();
  }
  bool done() const noexcept { return file_ == files_.size(); }
  std::size_t file_index() const noexcept { return file_; }
  const DcpFilePlan& file() const noexcept { return files_[file_]; }
  const DcpFilePlan::Ref& ref() const noexcept { return files_[file_].items[item_]; }
  std::uint64_t at() const noexcept { return at_; }
  std::size_t group() const noexcept { return group_; }
  std::uint64_t length() const { return item_bytes(plan_, ref(), archives_); }
  /// The item's CRC groups: a bytes item is one, whose CRC is not needed; a tensor item one per
  /// storage record.
  std::size_t groups() const { return ref().tensor ? archives_.of(plan_, ref()).storage_count() : 1; }
  void next() {
    at_ += length();
    group_ += groups();
    if (++item_ == files_[file_].items.size()) {
      if (at_ != files_[file_].size) internal_error("write_dcp_files: a file's size differs from its plan");
      ++file_;
      item_ = 0;
      at_ = 0;
      skip_empty();
    }
  }

 private:
  void skip_empty() noexcept {
    while (file_ < files_.size() && files_[file_].items.empty()) ++file_;
  }
  const DcpPlan& plan_;
  std::span<const DcpFilePlan> files_;
  ItemArchives& archives_;
  std::size_t file_ = 0, item_ = 0, group_ = 0;
  std::uint64_t at_ = 0;
};

std::vector<DcpItem> write_uncompressed(OutputFiles& into, const DcpPlan& plan, std::span<const DcpFilePlan> files,
                                        const CopyOptions& copy, ItemPlaces places) {
  ItemArchives archives(plan.layout);
  const std::uint64_t max_task = task_bytes(copy.threads);
  std::vector<std::unique_ptr<PositionalSink>> sinks;
  std::vector<PositionalSink*> targets;
  std::vector<DcpItem> items;
  if (places == ItemPlaces::kReturn) items.reserve(item_count(files));
  std::uint64_t total = 0;
  for (const DcpFilePlan& f : files) {
    if (f.items.empty() && f.size != 0) internal_error("write_dcp_files: a file's size differs from its plan");
    sinks.push_back(into.positional(f.name));
    targets.push_back(sinks.back().get());
    sinks.back()->resize(f.size);
  }
  ItemWalk lay(plan, files, archives);
  for (; !lay.done(); lay.next()) {
    const DcpFilePlan::Ref& r = lay.ref();
    if (r.tensor) {
      const ArchivePlan& a = archives.of(plan, r);
      a.place_heads(*sinks[lay.file_index()], lay.at());
      for (const TorchSaveRecord rec : a.records()) total += rec.storage ? rec.size : 0;
    } else {
      total += lay.length();
    }
    if (places == ItemPlaces::kReturn) items.push_back(item_of(plan, r, lay.file().name, lay.at(), lay.length()));
  }
  const std::size_t groups = lay.group();
  ItemWalk make(plan, files, archives);
  const TaskSource next = [&](std::vector<CopyTask>& out) {
    if (make.done()) return false;
    const DcpFilePlan::Ref& r = make.ref();
    const std::size_t first = out.size();
    if (!r.tensor) {
      const DcpPlanObject& o = plan.objects[r.index];
      add_range_tasks(out, o.item, 0, o.item->size(), make.at(), make.group(), max_task);
    } else {
      const ArchivePlan& a = archives.of(plan, r);
      for (std::size_t i = 0, group = make.group(); i < a.records().size(); ++i) {
        if (a.records()[i].storage) plan.add_tasks(out, r.index, r.chunk, make.at() + a.data_offset(i), group++, max_task);
      }
    }
    for (std::size_t k = first; k < out.size(); ++k) out[k].sink = make.file_index();
    make.next();
    return true;
  };
  const std::vector<std::uint32_t> crcs = run_copy(targets, next, total, groups, copy);
  // The archives' tails, now that their CRCs are known: a third walk, rather than a list of where
  // each tensor item went, which would grow with the items.
  for (ItemWalk tail(plan, files, archives); !tail.done(); tail.next()) {
    if (!tail.ref().tensor) continue;
    const ArchivePlan& a = archives.of(plan, tail.ref());
    a.place_tail(*sinks[tail.file_index()], tail.at(), std::span(crcs).subspan(tail.group(), a.storage_count()));
  }
  for (auto& s : sinks) s->commit();
  return items;
}

}  // namespace

void DcpPlanChunks::add(DcpPlanTensor& t, int rank, std::span<const std::int64_t> offsets, std::span<const std::int64_t> sizes) {
  if (offsets.size() != t.shape.size() || sizes.size() != t.shape.size()) {
    throw Error(ErrorKind::kInvalidArgument, "tensor '" + std::string(t.fqn) + "': chunk rank differs from the tensor's");
  }
  if (t.chunk_count == 0) {
    t.first_chunk = ranks_.size();
    t.first_dim = dims_.size();
  } else if (t.first_chunk + t.chunk_count != ranks_.size()) {
    internal_error("DcpPlanChunks::add: a tensor's chunks must be added together");
  }
  if (t.chunk_count == 0xffffffffu) internal_error("DcpPlanChunks::add: more than 2^32 chunks in a tensor");
  ranks_.push_back(rank);
  dims_.insert(dims_.end(), offsets.begin(), offsets.end());
  dims_.insert(dims_.end(), sizes.begin(), sizes.end());
  ++t.chunk_count;
}

void validate_dcp_plan(const DcpPlan& plan) {
  if (plan.world_size < 1) throw Error(ErrorKind::kInvalidArgument, "world size must be at least 1");
  if (plan.files_per_rank < 1) throw Error(ErrorKind::kInvalidArgument, "files per rank must be at least 1");
  const int world = plan.world_size;
  // Every FQN once: views of the plan's names, sorted when all are in, never copies.
  std::vector<std::string_view> names;
  names.reserve(plan.tensors.size() + plan.objects.size());
  for (const DcpPlanTensor& t : plan.tensors) {
    const auto bad = [&](const std::string& m) { throw Error(ErrorKind::kInvalidArgument, "tensor '" + std::string(t.fqn) + "': " + m); };
    for (auto d : t.shape) {
      if (d < 0) bad("negative dimension");
    }
    if (t.chunk_count == 0) bad("no chunks");
    for (std::size_t i = 0; i < t.chunk_count; ++i) {
      const DcpPlanChunk c = plan.chunks.get(t, i);
      if (c.rank < 0 || c.rank >= world) bad("chunk rank " + std::to_string(c.rank) + " is not in [0, " + std::to_string(world) + ")");
      for (std::size_t d = 0; d < t.shape.size(); ++d) {
        if (c.offsets[d] < 0 || c.sizes[d] < 0 || c.offsets[d] + c.sizes[d] > t.shape[d]) bad("chunk passes the tensor's bounds");
      }
    }
    struct TensorChunks {  // the tensor's chunks as tiling_problems takes them
      const DcpPlan& plan;
      const DcpPlanTensor& t;
      std::size_t size() const { return t.chunk_count; }
      DcpPlanChunk operator[](std::size_t i) const { return plan.chunks.get(t, i); }
    };
    if (!t.shape.empty()) {
      tiling_problems(
          t.shape, TensorChunks{plan, t}, [&](std::size_t, std::size_t) { bad("chunks overlap"); },
          [&](std::optional<std::uint64_t> volume, std::uint64_t numel) {
            bad("chunks cover " + (volume ? std::to_string(*volume) : std::string("more than 2^64")) + " of " + std::to_string(numel) + " elements");
          });
    }
    names.push_back(t.fqn);
  }
  for (const DcpPlanObject& o : plan.objects) {
    if (o.rank < 0 || o.rank >= world) throw Error(ErrorKind::kInvalidArgument, "object '" + std::string(o.fqn) + "': rank out of range");
    names.push_back(o.fqn);
  }
  std::sort(names.begin(), names.end());
  if (const auto twice = std::adjacent_find(names.begin(), names.end()); twice != names.end()) {
    throw Error(ErrorKind::kInvalidArgument, "FQN '" + std::string(*twice) + "' given twice");
  }
}

std::uint32_t narrow_ref(std::size_t i) {
  if (i > 0xffffffffu) internal_error("plan_dcp_files: more than 2^32 entries or chunks");
  return static_cast<std::uint32_t>(i);
}

std::vector<DcpFilePlan> plan_dcp_files(const DcpPlan& plan) {
  ItemArchives archives(plan.layout);
  const auto k = static_cast<std::size_t>(plan.files_per_rank);
  std::vector<DcpFilePlan> files;
  for (int rank = 0; rank < plan.world_size; ++rank) {
    const std::size_t first = files.size();
    for (std::size_t n = 0; n < k; ++n) files.push_back({rank, "__" + std::to_string(rank) + "_" + std::to_string(n) + ".distcp", {}, 0});
    std::vector<DcpFilePlan::Ref> objects, tensors;
    for (std::size_t i = 0; i < plan.objects.size(); ++i) {
      if (plan.objects[i].rank == rank) objects.push_back({false, narrow_ref(i), 0});
    }
    for (std::size_t i = 0; i < plan.tensors.size(); ++i) {
      for (std::size_t c = 0; c < plan.tensors[i].chunk_count; ++c) {
        if (plan.chunks.get(plan.tensors[i], c).rank == rank) tensors.push_back({true, narrow_ref(i), narrow_ref(c)});
      }
    }
    auto chunk_bytes = [&](const DcpFilePlan::Ref& r) {
      const DcpPlanTensor& t = plan.tensors[r.index];
      return box_volume(plan.chunks.get(t, r.chunk).sizes) * element_size(t.dtype);
    };
    if (!plan.tensor_files.empty()) {  // placed by the caller, in plan order within each file
      files[first].items.insert(files[first].items.end(), objects.begin(), objects.end());
      for (const auto& r : tensors) files[first + static_cast<std::size_t>(plan.tensor_files[r.index])].items.push_back(r);
      continue;
    }
    if (k == 1) {  // the list as it is, made once (grown by doubling, a reshard's held up to twice its size)
      DcpFilePlan& f = files[first];
      f.items.reserve(objects.size() + tensors.size());
      f.items.insert(f.items.end(), objects.begin(), objects.end());
      f.items.insert(f.items.end(), tensors.begin(), tensors.end());
      continue;
    }
    std::stable_sort(tensors.begin(), tensors.end(), [&](const auto& a, const auto& b) { return chunk_bytes(a) > chunk_bytes(b); });
    for (std::size_t i = 0; i < objects.size(); ++i) files[first + i % k].items.push_back(objects[i]);
    std::vector<std::uint64_t> load(k, 0);
    for (const auto& r : tensors) {
      const std::size_t b = static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
      files[first + b].items.push_back(r);
      load[b] += chunk_bytes(r);
    }
  }
  for (DcpFilePlan& f : files) {
    for (const auto& r : f.items) f.size += item_bytes(plan, r, archives);
  }
  return files;
}

std::vector<DcpItem> write_dcp_files(OutputFiles& out, const DcpPlan& plan, std::span<const DcpFilePlan> files,
                                     const CopyOptions& copy, ItemPlaces places) {
  return plan.compression == DcpCompression::kZstd ? write_compressed(out, plan, files, copy)
                                                   : write_uncompressed(out, plan, files, copy, places);
}

namespace {

// .metadata of `plan` with `count` storage_data items, item(i) asked for in order, once each.
void write_metadata(OutputFiles& into, const DcpPlan& plan, std::size_t count, const std::function<DcpItem(std::size_t)>& item) {
  // NOTE [.metadata last]: only now, with every data file durable, does the directory become a
  // checkpoint, by the rename of .metadata.tmp (what DCP's FileSystemWriter.finish does).
  const bool zstd = plan.compression == DcpCompression::kZstd;
  MetadataBuilder mb(plan.layout);
  const std::vector<std::uint32_t> order = entry_order(plan.tensors, plan.objects);
  auto fqn_of = [&](std::size_t i) -> std::string_view {
    const std::uint32_t c = order[i];
    return c & kObjectEntry ? plan.objects[c & ~kObjectEntry].fqn : plan.tensors[c].fqn;
  };
  // The three dicts with an item per entry or chunk are made batch by batch while .metadata is
  // written, so a million chunks never stand in memory as a tree at once (pickle::write_streamed).
  auto batches = [](std::size_t total, auto make) {
    return [total, make](std::size_t done) {
      std::vector<std::pair<ValuePtr, ValuePtr>> out;
      for (std::size_t i = done; i < total && out.size() < 1000; ++i) out.push_back(make(i));
      return out;
    };
  };
  ValuePtr sdm = pk::make_dict(), storage = pk::make_dict();
  ValuePtr planner = plan.layout == DcpLayout::kCurrent ? pk::make_dict() : pk::make_none();
  std::unordered_map<const pk::Value*, pk::DictBatches> streamed;
  streamed[sdm.get()] = batches(order.size(), [&](std::size_t i) {
    const std::uint32_t c = order[i];
    return std::make_pair(pk::make_str(std::string(fqn_of(i))), c & kObjectEntry ? mb.bytes_meta() : mb.tensor_meta(plan, plan.tensors[c]));
  });
  streamed[storage.get()] = batches(count, [&](std::size_t i) {
    const DcpItem it = item(i);
    return std::make_pair(mb.index(it), mb.info(it, zstd));
  });
  if (plan.layout == DcpLayout::kCurrent) {
    streamed[planner.get()] = batches(order.size(), [&](std::size_t i) {
      ValuePtr k = pk::make_str(std::string(fqn_of(i)));
      ValuePtr path = plan.paths().find(fqn_of(i));
      return std::make_pair(k, path ? path : pk::make_tuple({k}));
    });
  }
  ValuePtr root = mb.metadata(sdm, planner, storage);
  test_hooks::crash_point("metadata");
  auto meta = into.sequential(".metadata", ".metadata.tmp");
  pk::write_streamed(*root, 4, streamed, [&](std::span<const std::byte> b) { meta->write(b); }, mb.persistent());
  meta->commit();
}

}  // namespace

void write_dcp_metadata(OutputFiles& out, const DcpPlan& plan, std::span<const DcpItem> items) {
  write_metadata(out, plan, items.size(), [&](std::size_t i) { return items[i]; });
}

void write_dcp_metadata(OutputFiles& out, const DcpPlan& plan, std::span<const DcpFilePlan> files) {
  if (plan.compression != DcpCompression::kNone) internal_error("write_dcp_metadata: compressed items' places are known only once written");
  // Each item's place follows from the plan, file after file (what write_uncompressed lays out).
  ItemArchives archives(plan.layout);
  ItemWalk walk(plan, files, archives);
  std::size_t next = 0;
  write_metadata(out, plan, item_count(files), [&](std::size_t i) {
    if (i != next++ || walk.done()) internal_error("write_dcp_metadata: items asked for out of order");
    const DcpItem it = item_of(plan, walk.ref(), walk.file().name, walk.at(), walk.length());
    walk.next();
    return it;
  });
}

std::vector<std::byte> bytes_item(const pickle::Value& value, DcpLayout layout,
                                  const std::function<SourcePtr(const std::string& key)>& storage_data) {
  MemorySink sink("a DCP bytes item");
  write_torch_save(sink, value, storage_data ? storage_data : [](const std::string&) { return SourcePtr(); }, item_options(layout));
  return sink.take();
}

}  // namespace detail

namespace {

// The plan write_dcp and the per-rank writes share. Chunks of ranks in `data_needed` (all, when
// empty) must carry their bytes; the others describe the box only.
// The plan of a save. `only_rank`, `only_file`: the chunks whose data must be there (a rank's, in
// one of its files); the others are described only.
detail::DcpPlan plan_of(const std::vector<DcpWriteTensor>& tensors, const std::vector<DcpWriteObject>& objects,
                        const DcpWriteOptions& options, std::optional<int> only_rank, std::optional<int> only_file = std::nullopt) {
  if (options.world_size < 1) throw Error(ErrorKind::kInvalidArgument, "world size must be at least 1");
  detail::DcpPlan plan;
  plan.world_size = options.world_size;
  plan.layout = options.layout;
  plan.compression = options.compression;
  plan.shared_paths = &options.planner_data;  // the options outlive the plan
  // Plan tensors and chunks are the given ones, in order; those outlive the plan too.
  plan.add_tasks = [&tensors](std::vector<CopyTask>& tasks, std::size_t tensor, std::size_t chunk, std::uint64_t base, std::size_t group,
                              std::uint64_t max_task) {
    const SourcePtr& data = tensors[tensor].chunks[chunk].data;
    if (!data) internal_error("write_dcp: a chunk of another rank was to be written");
    add_range_tasks(tasks, data, 0, data->size(), base, group, max_task);
  };
  std::size_t position = 0;
  const bool placed = std::any_of(tensors.begin(), tensors.end(), [](const DcpWriteTensor& t) { return t.file >= 0; });
  for (const DcpWriteTensor& t : tensors) {
    detail::DcpPlanTensor& p = plan.tensors.emplace_back(detail::DcpPlanTensor{.fqn = t.fqn, .position = position++, .dtype = t.dtype, .requires_grad = t.requires_grad, .shape = t.shape});
    const int file = std::max(t.file, 0);
    if (placed) {
      plan.tensor_files.push_back(file);
      plan.files_per_rank = std::max(plan.files_per_rank, file + 1);
    }
    for (const DcpWriteChunk& c : t.chunks) {
      const std::uint64_t need = box_volume(c.sizes) * element_size(t.dtype);
      const bool needed = (!only_rank || c.rank == *only_rank) && (!only_file || file == *only_file);
      if (needed && (!c.data || c.data->size() != need)) {
        throw Error(ErrorKind::kInvalidArgument, "tensor '" + t.fqn + "': chunk data holds " +
                                                     (c.data ? std::to_string(c.data->size()) : std::string("no")) +
                                                     " bytes, its box needs " + std::to_string(need));
      }
      plan.chunks.add(p, c.rank, c.offsets, c.sizes);
    }
  }
  for (const DcpWriteObject& o : objects) {
    plan.objects.push_back({o.fqn, position++, o.rank, memory_source(detail::bytes_item(*o.value, options.layout), o.fqn)});
  }
  detail::validate_dcp_plan(plan);
  return plan;
}

void create_dir(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error(ErrorKind::kIo, dir.string(), std::nullopt, "cannot create the directory: " + ec.message());
}

}  // namespace

void write_dcp(const std::filesystem::path& dir, const std::vector<DcpWriteTensor>& tensors,
               const std::vector<DcpWriteObject>& objects, const DcpWriteOptions& options) {
  std::error_code ec;
  if (options.overwrite == Overwrite::kNo && std::filesystem::exists(dir / ".metadata", ec)) {
    throw Error(ErrorKind::kInvalidArgument, dir.string(), std::nullopt, "holds a checkpoint already (use --force to replace it)");
  }
  const detail::DcpPlan plan = plan_of(tensors, objects, options, std::nullopt);
  create_dir(dir);
  const std::unique_ptr<OutputFiles> out = directory_files(dir);
  const std::vector<detail::DcpFilePlan> files = detail::plan_dcp_files(plan);
  if (plan.compression == DcpCompression::kNone) {
    detail::write_dcp_files(*out, plan, files, {}, detail::ItemPlaces::kFromPlan);
    detail::write_dcp_metadata(*out, plan, std::span<const detail::DcpFilePlan>(files));
    return;
  }
  const std::vector<detail::DcpItem> items = detail::write_dcp_files(*out, plan, files, {});
  detail::write_dcp_metadata(*out, plan, items);
}

void write_dcp_rank_files(const std::filesystem::path& dir, const std::vector<DcpWriteTensor>& tensors,
                          const std::vector<DcpWriteObject>& objects, const DcpWriteOptions& options, int rank, std::optional<int> file) {
  if (options.compression != DcpCompression::kNone) {
    throw Error(ErrorKind::kUnsupported, "a save shared by several processes is written uncompressed (the item offsets must follow from the plan)");
  }
  if (rank < 0 || rank >= options.world_size) throw Error(ErrorKind::kInvalidArgument, "rank " + std::to_string(rank) + " is not in the world");
  const detail::DcpPlan plan = plan_of(tensors, objects, options, rank, file);
  if (file && (*file < 0 || *file >= plan.files_per_rank)) throw Error(ErrorKind::kInvalidArgument, "file " + std::to_string(*file) + " is not one the tensors name");
  create_dir(dir);
  std::vector<detail::DcpFilePlan> mine;
  int n = 0;
  for (detail::DcpFilePlan& f : detail::plan_dcp_files(plan)) {
    if (f.rank != rank) continue;
    if (!file || n == *file) mine.push_back(std::move(f));
    ++n;
  }
  detail::write_dcp_files(*directory_files(dir), plan, mine, {}, detail::ItemPlaces::kFromPlan);
}

void write_dcp_metadata(const std::filesystem::path& dir, const std::vector<DcpWriteTensor>& tensors,
                        const std::vector<DcpWriteObject>& objects, const DcpWriteOptions& options) {
  if (options.compression != DcpCompression::kNone) {
    throw Error(ErrorKind::kUnsupported, "a save shared by several processes is written uncompressed (the item offsets must follow from the plan)");
  }
  const detail::DcpPlan plan = plan_of(tensors, objects, options, -1);
  const std::vector<detail::DcpFilePlan> files = detail::plan_dcp_files(plan);
  // Every data file must be there, whole, before .metadata makes the directory a checkpoint.
  for (const detail::DcpFilePlan& f : files) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(dir / f.name, ec);
    if (ec || size != f.size) {
      throw Error(ErrorKind::kIo, (dir / f.name).string(), std::nullopt,
                  ec ? "is missing: a rank has not written its files" : "holds " + std::to_string(size) + " bytes, the plan says " + std::to_string(f.size));
    }
  }
  detail::write_dcp_metadata(*directory_files(dir), plan, std::span<const detail::DcpFilePlan>(files));
}

}  // namespace ckpt
