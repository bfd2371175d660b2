// SPDX-License-Identifier: Apache-2.0
// write_dcp: data files first, `.metadata` last (see ckpt/dcp.hpp).
#include <zstd.h>

#include <random>
#include <set>

#include "ckpt/dcp.hpp"
#include "ckpt/error.hpp"
#include "ckpt/sharding.hpp"
#include "ckpt/torch_save.hpp"

namespace ckpt {
namespace {

using pickle::ValuePtr;
namespace pk = pickle;

// A window of a parent sink: offsets count from where the item starts, as DCP's per-item
// torch.save does (spec/FORMATS.md §3.4).
class ItemSink final : public ByteSink {
 public:
  explicit ItemSink(ByteSink& parent) : parent_(parent), base_(parent.offset()), name_(parent.name()) {}
  const std::string& name() const noexcept override { return name_; }
  void write(std::span<const std::byte> b) override { parent_.write(b); }
  using ByteSink::write;
  std::uint64_t offset() const noexcept override { return parent_.offset() - base_; }
  void commit() override {}

 private:
  ByteSink& parent_;
  std::uint64_t base_;
  std::string name_;
};

// Compresses what it is given into one zstd frame on the parent (stream.zstd/1); offset() counts
// the uncompressed bytes, which is what the item's zip offsets refer to.
class ZstdSink final : public ByteSink {
 public:
  explicit ZstdSink(ByteSink& parent) : parent_(parent), ctx_(ZSTD_createCCtx(), ZSTD_freeCCtx), name_(parent.name()) {
    if (!ctx_) internal_error("ZSTD_createCCtx failed");
    ZSTD_CCtx_setParameter(ctx_.get(), ZSTD_c_compressionLevel, 3);
    out_.resize(ZSTD_CStreamOutSize());
  }
  const std::string& name() const noexcept override { return name_; }
  void write(std::span<const std::byte> b) override {
    ZSTD_inBuffer in{b.data(), b.size(), 0};
    while (in.pos < in.size) pump(&in, ZSTD_e_continue);
    written_ += b.size();
  }
  using ByteSink::write;
  std::uint64_t offset() const noexcept override { return written_; }
  void commit() override {
    ZSTD_inBuffer in{nullptr, 0, 0};
    while (pump(&in, ZSTD_e_end) != 0) {
    }
  }

 private:
  std::size_t pump(ZSTD_inBuffer* in, ZSTD_EndDirective mode) {
    ZSTD_outBuffer ob{out_.data(), out_.size(), 0};
    const std::size_t r = ZSTD_compressStream2(ctx_.get(), &ob, in, mode);
    if (ZSTD_isError(r)) throw Error(ErrorKind::kIo, name_, std::nullopt, std::string("zstd: ") + ZSTD_getErrorName(r));
    parent_.write(std::span(out_).first(ob.pos));
    return r;
  }
  ByteSink& parent_;
  std::unique_ptr<ZSTD_CCtx, decltype(&ZSTD_freeCCtx)> ctx_;
  std::vector<std::byte> out_;
  std::uint64_t written_ = 0;
  std::string name_;
};

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

struct Item {
  std::string fqn;
  std::optional<std::vector<std::int64_t>> offsets;  // tensors only
  std::size_t chunk_index = 0;
  std::string file;
  std::uint64_t offset = 0, length = 0;
};

// The .metadata object tree, as CPython pickles DCP's dataclasses (spec/FORMATS.md §3.3).
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
  }

  ValuePtr size(const std::vector<std::int64_t>& v) {
    std::vector<ValuePtr> xs;
    for (auto x : v) xs.push_back(pk::make_int(x));
    return pk::make_object(size_, pk::BuildOp::kReduce, pk::make_tuple({pk::make_tuple(std::move(xs))}));
  }
  ValuePtr tensor_meta(const DcpWriteTensor& t) {
    ValuePtr props = pk::make_object(
        props_, pk::BuildOp::kNewObj, pk::make_tuple(),
        pk::make_tuple({pk::make_global("torch", std::string(name(t.dtype))),
                        pk::make_object(get_layout_, pk::BuildOp::kReduce, pk::make_tuple({pk::make_str("torch.strided")})),
                        pk::make_bool(t.requires_grad),
                        pk::make_object(memfmt_, pk::BuildOp::kReduce, pk::make_tuple({pk::make_int(0)})), pk::make_bool(false)}));
    std::vector<ValuePtr> chunks;
    for (const auto& c : t.chunks) chunks.push_back(dataclass(csm_, {{"offsets", size(c.offsets)}, {"sizes", size(c.sizes)}}));
    return dataclass(tsm_, {{"properties", props}, {"size", size(t.shape)}, {"chunks", pk::make_list(std::move(chunks))}});
  }
  ValuePtr bytes_meta() { return pk::make_object(bsm_, pk::BuildOp::kNewObj, pk::make_tuple()); }
  ValuePtr index(const Item& it) {
    std::vector<std::pair<std::string, ValuePtr>> f{{"fqn", pk::make_str(it.fqn)}};
    f.emplace_back("index", it.offsets ? pk::make_int(static_cast<std::int64_t>(it.chunk_index)) : pk::make_none());
    if (it.offsets) f.emplace_back("offset", size(*it.offsets));
    return dataclass(index_, std::move(f));
  }
  ValuePtr info(const Item& it, bool zstd) {
    std::vector<std::pair<std::string, ValuePtr>> f{{"relative_path", pk::make_str(it.file)},
                                                    {"offset", pk::make_int(static_cast<std::int64_t>(it.offset))},
                                                    {"length", pk::make_int(static_cast<std::int64_t>(it.length))}};
    if (zstd) f.emplace_back("transform_descriptors", pk::make_list({pk::make_str("stream.zstd/1")}));
    return dataclass(info_, std::move(f));
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

void validate(const DcpWriteTensor& t, int world) {
  const auto bad = [&](const std::string& m) { throw Error(ErrorKind::kInvalidArgument, "tensor '" + t.fqn + "': " + m); };
  std::uint64_t numel = 1, volume = 0;
  for (auto d : t.shape) {
    if (d < 0) bad("negative dimension");
    numel *= static_cast<std::uint64_t>(d);
  }
  if (t.chunks.empty()) bad("no chunks");
  for (std::size_t i = 0; i < t.chunks.size(); ++i) {
    const auto& c = t.chunks[i];
    if (c.rank < 0 || c.rank >= world) bad("chunk rank " + std::to_string(c.rank) + " is not in [0, " + std::to_string(world) + ")");
    if (c.offsets.size() != t.shape.size() || c.sizes.size() != t.shape.size()) bad("chunk rank differs from the tensor's");
    std::uint64_t v = 1;
    for (std::size_t d = 0; d < t.shape.size(); ++d) {
      if (c.offsets[d] < 0 || c.sizes[d] < 0 || c.offsets[d] + c.sizes[d] > t.shape[d]) bad("chunk passes the tensor's bounds");
      v *= static_cast<std::uint64_t>(c.sizes[d]);
    }
    if (!c.data || c.data->size() != v * element_size(t.dtype)) {
      bad("chunk data holds " + (c.data ? std::to_string(c.data->size()) : std::string("no")) + " bytes, its box needs " +
          std::to_string(v * element_size(t.dtype)));
    }
    volume += v;
    for (std::size_t k = 0; k < i && !t.shape.empty(); ++k) {
      if (intersect(c.offsets, c.sizes, t.chunks[k].offsets, t.chunks[k].sizes)) bad("chunks overlap");
    }
  }
  if (!t.shape.empty() && volume != numel) bad("chunks cover " + std::to_string(volume) + " of " + std::to_string(numel) + " elements");
}

}  // namespace

void write_dcp(const std::filesystem::path& dir, const std::vector<DcpWriteTensor>& tensors,
               const std::vector<DcpWriteObject>& objects, const DcpWriteOptions& options) {
  if (options.world_size < 1) throw Error(ErrorKind::kInvalidArgument, "world size must be at least 1");
  std::error_code ec;
  if (options.overwrite == Overwrite::kNo && std::filesystem::exists(dir / ".metadata", ec)) {
    throw Error(ErrorKind::kInvalidArgument, dir.string(), std::nullopt, "holds a checkpoint already (use --force to replace it)");
  }
  std::set<std::string> names;
  for (const auto& t : tensors) {
    validate(t, options.world_size);
    if (!names.insert(t.fqn).second) throw Error(ErrorKind::kInvalidArgument, "FQN '" + t.fqn + "' given twice");
  }
  for (const auto& o : objects) {
    if (o.rank < 0 || o.rank >= options.world_size) throw Error(ErrorKind::kInvalidArgument, "object '" + o.fqn + "': rank out of range");
    if (!names.insert(o.fqn).second) throw Error(ErrorKind::kInvalidArgument, "FQN '" + o.fqn + "' given twice");
  }
  std::filesystem::create_directories(dir, ec);
  if (ec) throw Error(ErrorKind::kIo, dir.string(), std::nullopt, "cannot create the directory: " + ec.message());

  const bool zstd = options.compression == DcpCompression::kZstd;
  const TorchSaveWriteOptions item_opts{"archive", options.layout == DcpLayout::kTorch113 ? TorchSaveLayout::kTorch113
                                                                                          : TorchSaveLayout::kCurrent};
  std::vector<Item> items;
  // Each rank's file: its bytes items first, then its tensor items (the order DCP writes).
  for (int rank = 0; rank < options.world_size; ++rank) {
    const std::string file = "__" + std::to_string(rank) + "_0.distcp";
    auto sink = open_file_sink(dir / file, Overwrite::kYes);
    auto write_item = [&](Item it, const std::function<void(ByteSink&)>& body) {
      it.file = file;
      it.offset = sink->offset();
      ItemSink window(*sink);
      if (zstd) {
        ZstdSink z(*sink);
        body(z);
        z.commit();
      } else {
        body(window);
      }
      it.length = sink->offset() - it.offset;
      items.push_back(std::move(it));
    };
    for (const auto& o : objects) {
      if (o.rank != rank) continue;
      write_item(Item{o.fqn, std::nullopt, 0, {}, 0, 0},
                 [&](ByteSink& s) { write_torch_save(s, *o.value, [](const std::string&) { return SourcePtr(); }, item_opts); });
    }
    for (const auto& t : tensors) {
      for (std::size_t i = 0; i < t.chunks.size(); ++i) {
        const auto& c = t.chunks[i];
        if (c.rank != rank) continue;
        write_item(Item{t.fqn, c.offsets, i, {}, 0, 0}, [&](ByteSink& s) {
          TorchSaveBuilder b;
          const auto st = b.add_storage(t.dtype, c.data);
          b.write(s, *b.tensor(st, c.sizes), item_opts);
        });
      }
    }
    sink->commit();
  }

  // NOTE [.metadata last]: only now, with every data file durable, does the directory become a
  // checkpoint, by the rename of .metadata.tmp (what DCP's FileSystemWriter.finish does).
  MetadataBuilder mb(options.layout);
  std::vector<std::pair<ValuePtr, ValuePtr>> sdm, storage, planner;
  for (const auto& t : tensors) sdm.emplace_back(pk::make_str(t.fqn), mb.tensor_meta(t));
  for (const auto& o : objects) sdm.emplace_back(pk::make_str(o.fqn), mb.bytes_meta());
  for (const auto& it : items) storage.emplace_back(mb.index(it), mb.info(it, zstd));
  ValuePtr planner_v = pk::make_none();
  if (options.layout == DcpLayout::kCurrent) {
    for (const auto& [k, v] : sdm) {
      auto pd = options.planner_data.find(*k->str());
      planner.emplace_back(k, pd != options.planner_data.end() ? pk::make_tuple(pd->second) : pk::make_tuple({k}));
    }
    planner_v = pk::make_dict(std::move(planner));
  }
  ValuePtr root = mb.metadata(pk::make_dict(std::move(sdm)), planner_v, pk::make_dict(std::move(storage)));
  auto meta = open_file_sink(dir / ".metadata", Overwrite::kYes, dir / ".metadata.tmp");
  meta->write(pk::write(*root, 4));
  meta->commit();
}

}  // namespace ckpt
