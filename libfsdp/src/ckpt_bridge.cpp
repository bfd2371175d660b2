// SPDX-License-Identifier: Apache-2.0
// The one file that sees both LibTorch and libckpt types (ARCHITECTURE.md).
#include <torch/torch.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "ckpt/checkpoint.hpp"
#include "ckpt/error.hpp"
#include "ckpt/formats/dcp.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "ckpt/open.hpp"
#include "ckpt/ops/filter.hpp"
#include "ckpt/sharding.hpp"
#include "fsdp/checkpoint.hpp"

namespace fsdp {

Error::Error(std::string_view context, const ckpt::Error& cause)
    : Error(std::string(context) + ": " + cause.what(),
            cause.kind() == ckpt::ErrorKind::kInvalidArgument ? ErrorKind::kInvalidArgument : ErrorKind::kCheckpoint) {
  if (!cause.source().empty()) file_ = cause.source();
  offset_ = cause.offset();
}
namespace {

ckpt::DType to_ckpt(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float: return ckpt::DType::kFloat32;
    case c10::ScalarType::Double: return ckpt::DType::kFloat64;
    case c10::ScalarType::Half: return ckpt::DType::kFloat16;
    case c10::ScalarType::BFloat16: return ckpt::DType::kBFloat16;
    case c10::ScalarType::Long: return ckpt::DType::kInt64;
    case c10::ScalarType::Int: return ckpt::DType::kInt32;
    case c10::ScalarType::Bool: return ckpt::DType::kBool;
    case c10::ScalarType::Byte: return ckpt::DType::kUInt8;
    default: throw Error(std::string("cannot save a tensor of dtype ") + c10::toString(t));
  }
}

c10::ScalarType from_ckpt(ckpt::DType t, const std::string& what) {
  switch (t) {
    case ckpt::DType::kFloat32: return c10::ScalarType::Float;
    case ckpt::DType::kFloat64: return c10::ScalarType::Double;
    case ckpt::DType::kFloat16: return c10::ScalarType::Half;
    case ckpt::DType::kBFloat16: return c10::ScalarType::BFloat16;
    case ckpt::DType::kInt64: return c10::ScalarType::Long;
    case ckpt::DType::kInt32: return c10::ScalarType::Int;
    case ckpt::DType::kBool: return c10::ScalarType::Bool;
    case ckpt::DType::kUInt8: return c10::ScalarType::Byte;
    default: throw Error(what + " is " + std::string(ckpt::name(t)) + ", which cannot be loaded into a model here");
  }
}

/// A tensor's bytes in host memory, read where they lie (a tensor on a GPU, or not contiguous, is
/// copied first). The source keeps the tensor alive; its values must not change until it is read.
class TensorSource final : public ckpt::ByteSource {
 public:
  explicit TensorSource(const torch::Tensor& t) : t_(t.to(torch::kCPU).contiguous()) {}
  const std::string& name() const noexcept override { return name_; }
  std::uint64_t size() const noexcept override { return t_.nbytes(); }
  void read_at(std::uint64_t offset, std::span<std::byte> out) const override {
    check_range(offset, out.size(), "read");
    if (!out.empty()) std::memcpy(out.data(), bytes() + offset, out.size());
  }
  std::optional<std::span<const std::byte>> view(std::uint64_t offset, std::uint64_t length) const override {
    if (offset > size() || length > size() - offset) return std::nullopt;
    return std::span<const std::byte>(bytes() + offset, length);
  }

 private:
  const std::byte* bytes() const { return static_cast<const std::byte*>(t_.data_ptr()); }
  torch::Tensor t_;
  std::string name_ = "<tensor>";
};

ckpt::SourcePtr source_of(const torch::Tensor& t) { return std::make_shared<TensorSource>(t); }

/// A tensor of the state dict, described without chunks yet: `fqn`, its dtype and shape, its
/// chunks in file number `file` of their ranks.
ckpt::DcpWriteTensor described(const std::string& fqn, c10::ScalarType dtype, const std::vector<std::int64_t>& shape, int file) {
  ckpt::DcpWriteTensor w;
  w.fqn = fqn;
  w.dtype = to_ckpt(dtype);
  w.shape = shape;
  w.file = file;
  return w;
}

/// Adds rank `rank`'s chunks of elements [begin, end) of `w` (flattened in C order): one per box
/// of ckpt::flat_range_boxes. A tensor of no elements gets one empty chunk, by `rank`.
void add_chunks(ckpt::DcpWriteTensor& w, int rank, std::int64_t begin, std::int64_t end) {
  if (ckpt::box_volume(w.shape) == 0) {
    if (w.chunks.empty()) w.chunks.push_back({rank, std::vector<std::int64_t>(w.shape.size(), 0), w.shape, nullptr});
    return;
  }
  for (const ckpt::Box& b : ckpt::flat_range_boxes(w.shape, begin, end)) w.chunks.push_back({rank, b.offsets.vec(), b.sizes.vec(), nullptr});
}

/// Gives `rank`'s chunks of `w`, in order, the bytes of consecutive elements of `flat` (what
/// add_chunks described for it).
void fill(ckpt::DcpWriteTensor& w, int rank, const torch::Tensor& flat) {
  std::int64_t at = 0;
  for (ckpt::DcpWriteChunk& c : w.chunks) {
    if (c.rank != rank) continue;
    const auto n = static_cast<std::int64_t>(ckpt::box_volume(c.sizes));
    c.data = source_of(flat.narrow(0, at, n));
    at += n;
  }
}

ckpt::pickle::ValuePtr path_of(std::initializer_list<std::string> keys) {
  std::vector<ckpt::pickle::ValuePtr> out;
  for (const auto& k : keys) out.push_back(ckpt::pickle::make_str(k));
  return ckpt::pickle::make_tuple(std::move(out));
}

/// torch.optim's param_groups, each group's parameters named by FQN as FSDP's optim_state_dict
/// names them (those `kept` accepts).
ckpt::pickle::ValuePtr param_groups(const ShardedOptimizer& optimizer, const std::function<bool(const std::string&)>& kept) {
  namespace pk = ckpt::pickle;
  std::vector<pk::ValuePtr> out;
  for (const ShardedOptimizer::Group& group : optimizer.groups()) {
    std::vector<std::pair<pk::ValuePtr, pk::ValuePtr>> g;
    auto put = [&](const std::string& k, pk::ValuePtr v) { g.emplace_back(pk::make_str(k), std::move(v)); };
    put("lr", pk::make_float(group.lr));  // the current one, as torch's optimizer state holds it
    if (optimizer.options().kind == OptimizerKind::kAdamW) {
      put("betas", pk::make_tuple({pk::make_float(group.beta1), pk::make_float(group.beta2)}));
      put("eps", pk::make_float(group.eps));
      put("weight_decay", pk::make_float(group.weight_decay));
      put("amsgrad", pk::make_bool(false));
    } else {
      put("momentum", pk::make_float(group.momentum));
      put("dampening", pk::make_int(0));
      put("weight_decay", pk::make_float(group.weight_decay));
      put("nesterov", pk::make_bool(false));
    }
    put("maximize", pk::make_bool(false));
    put("foreach", pk::make_none());
    put("differentiable", pk::make_bool(false));
    if (optimizer.scheduled()) put("initial_lr", pk::make_float(group.initial_lr));  // LambdaLR's, added after the defaults
    std::vector<pk::ValuePtr> params;
    for (const auto& f : group.params) {
      if (!kept || kept(f)) params.push_back(pk::make_str(f));
    }
    put("params", pk::make_list(std::move(params)));
    out.push_back(pk::make_dict(std::move(g)));
  }
  return pk::make_list(std::move(out));
}

/// Elements [begin, end) of a tensor of the checkpoint, flattened in C order: read from the chunks
/// that hold the rows they lie in, and of each chunk only the bytes of those rows (a 0-d tensor:
/// its one element).
torch::Tensor read_range(const ckpt::ChunkReader& reader, const ckpt::TensorEntry* t, const std::string& fqn,
                         const std::vector<std::int64_t>& shape, std::int64_t begin, std::int64_t end, const std::string& who) {
  if (!t) throw Error(who + ": it has no '" + fqn + "'");
  if (t->shape != shape) throw Error(who + ": '" + t->name + "' has another shape than the model's");
  const c10::ScalarType dtype = from_ckpt(t->dtype, who + ": '" + t->name + "'");
  const std::size_t es = ckpt::element_size(t->dtype);
  const bool scalar = shape.empty();
  std::int64_t row = 1;
  for (std::size_t i = 1; i < shape.size(); ++i) row *= shape[i];
  if (row == 0 || begin == end) return torch::empty({end - begin}, torch::TensorOptions().dtype(dtype));
  const std::int64_t r0 = begin / row, r1 = scalar ? 1 : (end + row - 1) / row;  // the rows [r0, r1) hold the range
  std::vector<std::int64_t> band_shape = shape;
  if (!scalar) band_shape[0] = r1 - r0;
  torch::Tensor band = torch::empty(band_shape, torch::TensorOptions().dtype(dtype));
  for (const ckpt::Chunk& chunk : t->chunks) {
    const std::int64_t lo = scalar ? 0 : std::max(chunk.offsets[0], r0), hi = scalar ? 1 : std::min(chunk.offsets[0] + chunk.sizes[0], r1);
    if (lo >= hi || ckpt::box_volume(chunk.sizes) == 0) continue;
    const ckpt::ChunkData d = reader.read(*t, chunk);
    // The chunk's rows [lo, hi) as a strided view over the span of its bytes that holds them.
    std::vector<std::int64_t> sizes = d.shape;
    std::int64_t first = d.storage_offset;
    if (!scalar) {
      sizes[0] = hi - lo;
      first += (lo - chunk.offsets[0]) * d.strides[0];
    }
    std::int64_t last = first;
    for (std::size_t i = 0; i < sizes.size(); ++i) last += (sizes[i] - 1) * d.strides[i];
    std::vector<std::byte> bytes(static_cast<std::size_t>(last - first + 1) * es);
    d.storage->read_at(static_cast<std::uint64_t>(first) * es, bytes);
    torch::Tensor src = torch::from_blob(bytes.data(), {last - first + 1}, torch::TensorOptions().dtype(dtype)).as_strided(sizes, d.strides, 0);
    torch::Tensor dst = scalar ? band : band.narrow(0, lo - r0, hi - lo);
    for (std::size_t i = 1; i < chunk.sizes.size(); ++i) dst = dst.narrow(static_cast<std::int64_t>(i), chunk.offsets[i], chunk.sizes[i]);
    dst.copy_(src);
  }
  return band.reshape({-1}).narrow(0, begin - r0 * row, end - begin);
}

}  // namespace

// NOTE [A sharded save, as the shards lie]: each rank writes what its slice of each unit's flat
// buffer holds, where it lies, with no gather: parameter p's elements [b, e) in that slice are at
// most 2 * ndim - 1 boxes (ckpt::flat_range_boxes), each a chunk whose bytes are a view of the
// slice; optimizer moments are laid out as the slice and go the same way. A DCP reader takes the
// overlap of any saved box with what it wants (docs/formats/sharding.md#a-flat-slice-as-boxes),
// so the boxes need not be FSDP's dim-0 pieces. Under NO_SHARD every rank holds the whole buffer
// and rank r writes the r-th of world equal parts; under HYBRID_SHARD the first replica group
// writes. Every rank derives every rank's boxes from sizes alone (rank 0 writes .metadata of all),
// so no rank sends another anything. Consecutive units share a data file until their chunks reach
// SaveOptions::file_bytes; a file's chunks get their bytes just before it is written and let go
// after, which bounds what a copy to the host holds where the slices are on a GPU.

void save_sharded(const std::filesystem::path& dir, ShardedModel& model, ProcessGroup& group, const SaveOptions& o) {
  const int rank = group.rank(), world = group.size();
  if (o.model_filter) throw Error("a sharded checkpoint cannot be filtered (it could not be loaded): save a full one");
  torch::NoGradGuard no_grad;
  const auto& units = model.units();
  const bool no_shard = model.strategy() == ShardingStrategy::kNoShard;
  const int writers = model.strategy() == ShardingStrategy::kHybridShard ? model.shard_group().size() : world;
  // The elements of unit u's flat buffer that rank r writes.
  auto written_by = [&](std::size_t u, int r) -> FlatUnit::Range {
    const std::int64_t padded = units[u]->padded_numel();
    if (no_shard) {
      const std::int64_t part = (padded + world - 1) / world;
      return {std::min(padded, r * part), std::min(padded, (r + 1) * part)};
    }
    if (r >= writers) return {};
    const std::int64_t part = padded / writers;
    return {r * part, (r + 1) * part};
  };
  // Calls f(i, begin, end): the elements [begin, end) of params()[i] that rank r writes, if any.
  auto each_range = [&](std::size_t u, int r, const auto& f) {
    const FlatUnit::Range w = written_by(u, r);
    const auto& params = units[u]->params();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const std::int64_t b = std::max(w.begin, params[i].offset), e = std::min(w.end, params[i].offset + params[i].numel);
      if (b < e) f(i, b - params[i].offset, e - params[i].offset);
    }
  };
  // Which file each unit's chunks go to (the same on every rank: from sizes alone).
  std::vector<int> file_of(units.size(), 0);
  {
    std::int64_t copies = 1;  // the parameters and each optimizer's moments
    for (const auto& [key, optimizer] : o.optimizers) copies += static_cast<std::int64_t>(optimizer->buffer_names().size());
    int file = 0;
    std::int64_t bytes = 0;
    for (std::size_t u = 0; u < units.size(); ++u) {
      if (!units[u]) continue;
      if (bytes >= o.file_bytes) {
        ++file;
        bytes = 0;
      }
      file_of[u] = file;
      bytes += units[u]->padded_numel() * static_cast<std::int64_t>(units[u]->shard().element_size()) * copies / writers;
    }
  }
  const int files = units.empty() ? 1 : *std::max_element(file_of.begin(), file_of.end()) + 1;
  // Every tensor described up front, every rank's chunks with it, in the model's order and then
  // each optimizer's; this rank's chunks get their data file by file.
  std::vector<ckpt::DcpWriteTensor> tensors;
  std::vector<ckpt::DcpWriteObject> objects;
  ckpt::DcpWriteOptions options;
  options.world_size = world;
  options.overwrite = ckpt::Overwrite::kYes;
  // What parameter i of unit u is saved as: tensors laid out as the parameter, each with the slice
  // its values are in (optimizer -1: the parameter's own shard).
  struct Target {
    std::size_t tensor;
    int optimizer = -1;
    std::string buffer;
  };
  std::vector<std::vector<std::vector<Target>>> targets(units.size());
  std::vector<std::size_t> whole;  // tensors rank 0 writes whole (buffers, steps), and what they hold
  std::vector<torch::Tensor> whole_values;
  auto add = [&](const std::string& fqn, c10::ScalarType dtype, const std::vector<std::int64_t>& shape, int file, ckpt::pickle::ValuePtr path) {
    tensors.push_back(described(fqn, dtype, shape, file));
    options.planner_data.set(fqn, std::move(path));
    return tensors.size() - 1;
  };
  auto add_whole = [&](const std::string& fqn, const torch::Tensor& value, int file, ckpt::pickle::ValuePtr path) {
    whole.push_back(add(fqn, value.scalar_type(), value.sizes().vec(), file, std::move(path)));
    whole_values.push_back(value.detach().reshape({-1}));
    add_chunks(tensors.back(), 0, 0, value.numel());
  };
  // Parameter i of unit u's values (optimizer k's `buffer` of them, k >= 0) as tensor `fqn`.
  auto add_sliced = [&](std::size_t u, std::size_t i, const std::string& fqn, ckpt::pickle::ValuePtr path, int k, const std::string& buffer) {
    const FlatUnit::Param& p = units[u]->params()[i];
    if (p.numel == 0) {  // no slice holds any of it
      add_whole(fqn, torch::empty(p.shape, units[u]->shard().options()), file_of[u], std::move(path));
    } else {
      targets[u][i].push_back({add(fqn, units[u]->shard().scalar_type(), p.shape, file_of[u], std::move(path)), k, buffer});
    }
  };
  {
    std::map<std::string, std::pair<std::size_t, std::size_t>> where;  // parameter -> unit, index
    std::map<std::string, torch::Tensor> buffers;
    for (std::size_t u = 0; u < units.size(); ++u) {
      if (!units[u]) continue;
      targets[u].resize(units[u]->params().size());
      for (std::size_t i = 0; i < units[u]->params().size(); ++i) where.emplace(units[u]->params()[i].fqn, std::pair{u, i});
    }
    std::vector<std::string> names;
    for (const auto& [name, at] : where) names.push_back(name);
    for (const auto& [name, t] : model.buffers()) {
      names.push_back(name);
      buffers.emplace(name, t);
    }
    for (const std::string& name : model.in_model_order(std::move(names))) {
      const auto w = where.find(name);
      if (w == where.end()) {
        add_whole(o.model_key + "." + name, buffers.at(name), 0, path_of({o.model_key, name}));  // whole on every rank
        continue;
      }
      const auto [u, i] = w->second;
      add_sliced(u, i, o.model_key + "." + name, path_of({o.model_key, name}), -1, {});
    }
  }
  for (std::size_t k = 0; k < o.optimizers.size(); ++k) {
    const auto& [key, optimizer] = o.optimizers[k];
    for (std::size_t u = 0; u < units.size(); ++u) {
      if (!units[u]) continue;
      for (std::size_t i = 0; i < units[u]->params().size(); ++i) {
        const FlatUnit::Param& p = units[u]->params()[i];
        if (!optimizer->group_of(p.fqn)) continue;  // not stepped (an alias never is)
        const std::string prefix = key + ".state." + p.fqn + ".";
        if (optimizer->options().kind == OptimizerKind::kAdamW) {  // replicated
          add_whole(prefix + "step", torch::tensor(static_cast<float>(optimizer->steps())), file_of[u], path_of({key, "state", p.fqn, "step"}));
        }
        for (const auto& b : optimizer->buffer_names()) add_sliced(u, i, prefix + b, path_of({key, "state", p.fqn, b}), static_cast<int>(k), b);
      }
    }
    objects.push_back({key + ".param_groups", param_groups(*optimizer, {}), 0});
    options.planner_data.set(key + ".param_groups", path_of({key, "param_groups"}));
  }
  for (std::size_t u = 0; u < units.size(); ++u) {
    if (!units[u]) continue;
    for (int r = 0; r < world; ++r) {
      each_range(u, r, [&](std::size_t i, std::int64_t b, std::int64_t e) {
        for (const Target& t : targets[u][i]) add_chunks(tensors[t.tensor], r, b, e);
      });
    }
  }
  try {
    // A checkpoint already at `dir` (a resumed run saving a step again) stays whole until the new
    // one is: the new one is written beside it, at a name every rank derives, and exchanged with it
    // at the end (NOTE [Atomic outputs]). What an earlier save left there is removed first.
    std::filesystem::path into = dir;
    const bool replacing = std::filesystem::exists(dir / ".metadata");
    if (replacing) into += ".partial";
    group.barrier();  // every rank has looked before anything changes
    if (rank == 0 && replacing) {
      std::error_code ec;
      std::filesystem::remove_all(into, ec);
    }
    group.barrier();
    std::size_t u = 0;
    for (int file = 0; file < files; ++file) {
      if (rank == 0) {
        for (std::size_t j = 0; j < whole.size(); ++j) {
          if (tensors[whole[j]].file == file) fill(tensors[whole[j]], 0, whole_values[j]);
        }
      }
      for (; u < units.size() && (!units[u] || file_of[u] == file); ++u) {
        if (!units[u]) continue;
        FlatUnit& unit = *units[u];
        each_range(u, rank, [&](std::size_t i, std::int64_t b, std::int64_t e) {
          for (const Target& t : targets[u][i]) {
            const torch::Tensor slice = t.optimizer < 0 ? unit.shard() : o.optimizers[static_cast<std::size_t>(t.optimizer)].optimizer->buffer(u, t.buffer);
            fill(tensors[t.tensor], rank, slice.detach().narrow(0, unit.params()[i].offset + b - unit.slice_begin(), e - b));
          }
        });
      }
      ckpt::write_dcp_rank_files(into, tensors, objects, options, rank, file);
      for (ckpt::DcpWriteTensor& t : tensors) {
        if (t.file == file) {
          for (ckpt::DcpWriteChunk& c : t.chunks) c.data = nullptr;
        }
      }
    }
    if (rank == 0 && o.meta) {
      auto sink = ckpt::open_file_sink(into / "meta.pt", ckpt::Overwrite::kYes);
      ckpt::TorchSaveBuilder().write(*sink, *o.meta);
      sink->commit();
    }
    group.barrier();
    if (rank == 0) {
      ckpt::write_dcp_metadata(into, tensors, objects, options);
      if (replacing) ckpt::replace_output(into, dir);
    }
    group.barrier();
  } catch (const ckpt::Error& e) {
    throw Error("rank " + std::to_string(rank) + ": saving " + dir.string(), e);
  }
}

namespace {

// NOTE [A full save, streamed]: rank 0 writes the torch.save file record by record, and each
// storage's bytes come from a gather made when the writer first reads them: the units' parameters
// in the order the model's entries need them, then each optimizer's moments unit by unit. Every
// other rank makes the same gathers in the same order (they are collectives, so the ranks move
// together), and rank 0 lets each gather's values go once the writer has read the last storage
// that uses them. Rank 0 so holds about one unit's full values at a time, never the whole state.
class Gathers {
 public:
  /// One gather: unit `unit`'s parameters (optimizer < 0), or optimizer `optimizer`'s `buffer`.
  struct Op {
    std::size_t unit = 0;
    int optimizer = -1;
    std::string buffer;
  };

  Gathers(ShardedModel& model, const std::vector<NamedOptimizer>& optimizers, std::vector<Op> ops)
      : model_(model), optimizers_(optimizers), ops_(std::move(ops)), uses_(ops_.size(), 0), held_(ops_.size()) {}

  /// A storage rank 0 writes will read op `i`'s values.
  void use(std::size_t i) { ++uses_[i]; }
  /// Op `i`'s full values, one per parameter of its unit: every op up to it made first.
  const std::vector<torch::Tensor>& values(std::size_t i) {
    while (next_ <= i) run(next_++);
    return held_[i];
  }
  /// A storage that used op `i` has been read whole.
  void done(std::size_t i) {
    if (--uses_[i] == 0) held_[i].clear();
  }
  /// The ops no storage asked for (every op, on the other ranks).
  void finish() {
    while (next_ < ops_.size()) run(next_++);
  }

 private:
  void run(std::size_t i) {
    const Op& op = ops_[i];
    const auto& unit = model_.units()[op.unit];
    std::vector<torch::Tensor> v = op.optimizer < 0 ? unit->unflatten(unit->shard().detach())
                                                    : unit->unflatten(optimizers_[static_cast<std::size_t>(op.optimizer)].optimizer->buffer(op.unit, op.buffer));
    if (uses_[i] > 0) held_[i] = std::move(v);
  }

  ShardedModel& model_;
  const std::vector<NamedOptimizer>& optimizers_;
  std::vector<Op> ops_;
  std::vector<std::int64_t> uses_;
  std::vector<std::vector<torch::Tensor>> held_;
  std::size_t next_ = 0;
};

/// The bytes of parameter `param` of gather `op`, made when the writer first reads them and let
/// go after it reads the last.
class GatheredSource : public ckpt::ByteSource {
 public:
  GatheredSource(Gathers& gathers, std::size_t op, std::size_t param, std::uint64_t size, std::string name)
      : gathers_(gathers), op_(op), param_(param), size_(size), name_(std::move(name)) {
    gathers_.use(op_);
  }
  const std::string& name() const noexcept override { return name_; }
  std::uint64_t size() const noexcept override { return size_; }
  void read_at(std::uint64_t offset, std::span<std::byte> out) const override {
    check_range(offset, out.size(), "read");
    if (out.empty()) return;
    if (!value_.defined()) {
      if (finished_) throw Error("saving: '" + name_ + "' was read again after its last byte");
      value_ = gathers_.values(op_)[param_].to(torch::kCPU).contiguous();
    }
    std::memcpy(out.data(), static_cast<const std::byte*>(value_.data_ptr()) + offset, out.size());
    if (offset + out.size() == size_) {  // the writer reads a storage once, front to back
      value_ = torch::Tensor();
      finished_ = true;
      gathers_.done(op_);
    }
  }

 private:
  Gathers& gathers_;
  std::size_t op_, param_;
  std::uint64_t size_;
  std::string name_;
  mutable torch::Tensor value_;
  mutable bool finished_ = false;
};

}  // namespace

void save_full(const std::filesystem::path& file, ShardedModel& model, ProcessGroup& group, const SaveOptions& o) {
  namespace pk = ckpt::pickle;
  torch::NoGradGuard no_grad;
  const bool writer = group.rank() == 0;
  const auto& units = model.units();
  // Every parameter's unit and place in it; the gathers in the order the entries need them.
  std::map<std::string, std::pair<std::size_t, std::size_t>> where;
  std::vector<std::string> names;
  for (std::size_t u = 0; u < units.size(); ++u) {
    if (!units[u]) continue;
    for (std::size_t i = 0; i < units[u]->params().size(); ++i) {
      where.emplace(units[u]->params()[i].fqn, std::pair{u, i});
      names.push_back(units[u]->params()[i].fqn);
    }
  }
  std::map<std::string, torch::Tensor> buffers;
  for (const auto& [name, t] : model.buffers()) {
    buffers.emplace(name, t.detach());
    names.push_back(name);
  }
  names = model.in_model_order(std::move(names));
  std::vector<Gathers::Op> ops;
  std::map<std::pair<std::size_t, int>, std::size_t> params_op;                   // (unit, -1) -> op
  std::map<std::tuple<std::size_t, int, std::string>, std::size_t> buffer_op;     // (unit, optimizer, buffer) -> op
  for (const std::string& name : names) {
    const auto w = where.find(name);
    if (w == where.end() || params_op.count({w->second.first, -1})) continue;
    params_op.emplace(std::pair{w->second.first, -1}, ops.size());
    ops.push_back({w->second.first, -1, {}});
  }
  for (std::size_t k = 0; k < o.optimizers.size(); ++k) {
    ShardedOptimizer& optimizer = *o.optimizers[k].optimizer;
    for (std::size_t u = 0; u < units.size(); ++u) {
      if (!units[u]) continue;
      const auto& ps = units[u]->params();
      if (std::none_of(ps.begin(), ps.end(), [&](const FlatUnit::Param& p) { return p.alias_of < 0 && optimizer.group_of(p.fqn); })) continue;
      for (const std::string& b : optimizer.buffer_names()) {
        buffer_op.emplace(std::tuple{u, static_cast<int>(k), b}, ops.size());
        ops.push_back({u, static_cast<int>(k), b});
      }
    }
  }
  Gathers gathers(model, o.optimizers, std::move(ops));
  if (!writer) {
    gathers.finish();  // rank 0's gathers, in its order
    group.barrier();
    return;
  }
  ckpt::TorchSaveBuilder builder;
  auto gathered = [&](std::size_t op, std::size_t u, std::size_t i, const std::string& name) {
    const FlatUnit::Param& p = units[u]->params()[i];
    const c10::ScalarType dtype = units[u]->shard().scalar_type();
    const std::uint64_t bytes = static_cast<std::uint64_t>(p.numel) * c10::elementSize(dtype);
    const std::size_t storage = builder.add_storage(to_ckpt(dtype), std::make_shared<GatheredSource>(gathers, op, i, bytes, name));
    return builder.tensor(storage, p.shape);
  };
  auto in_memory = [&](const torch::Tensor& t) {
    const std::size_t storage = builder.add_storage(to_ckpt(t.scalar_type()), source_of(t));
    return builder.tensor(storage, t.sizes().vec());
  };
  auto kept = [&](const std::string& fqn) { return !o.model_filter || o.model_filter(fqn); };
  std::vector<std::pair<pk::ValuePtr, pk::ValuePtr>> model_items;
  for (const std::string& name : names) {
    if (!kept(name)) continue;
    const auto w = where.find(name);
    model_items.emplace_back(pk::make_str(name), w == where.end() ? in_memory(buffers.at(name))
                                                                   : gathered(params_op.at({w->second.first, -1}), w->second.first, w->second.second, name));
  }
  std::vector<std::pair<pk::ValuePtr, pk::ValuePtr>> root;
  if (o.meta && o.meta->dict_items()) root = *o.meta->dict_items();
  root.emplace_back(pk::make_str(o.model_key), pk::make_dict(std::move(model_items)));
  for (std::size_t k = 0; k < o.optimizers.size(); ++k) {
    const auto& [key, optimizer] = o.optimizers[k];
    const bool has_step = optimizer->options().kind == OptimizerKind::kAdamW;
    std::vector<std::pair<pk::ValuePtr, pk::ValuePtr>> state;
    for (std::size_t u = 0; u < units.size(); ++u) {
      if (!units[u]) continue;
      for (std::size_t i = 0; i < units[u]->params().size(); ++i) {
        const FlatUnit::Param& p = units[u]->params()[i];
        if (p.alias_of >= 0 || !optimizer->group_of(p.fqn) || !kept(p.fqn)) continue;
        std::vector<std::pair<pk::ValuePtr, pk::ValuePtr>> per;
        if (has_step) per.emplace_back(pk::make_str("step"), in_memory(torch::tensor(static_cast<float>(optimizer->steps()))));
        for (const std::string& b : optimizer->buffer_names()) {
          per.emplace_back(pk::make_str(b), gathered(buffer_op.at({u, static_cast<int>(k), b}), u, i, key + ".state." + p.fqn + "." + b));
        }
        state.emplace_back(pk::make_str(p.fqn), pk::make_dict(std::move(per)));
      }
    }
    root.emplace_back(pk::make_str(key), pk::make_dict({{pk::make_str("state"), pk::make_dict(std::move(state))},
                                                        {pk::make_str("param_groups"), param_groups(*optimizer, kept)}}));
  }
  try {
    const auto replaces = std::filesystem::is_directory(file) ? ckpt::OutputKind::kDcpDirectory : ckpt::OutputKind::kFile;
    auto sink = ckpt::open_file_sink(file, ckpt::Overwrite::kYes, {}, replaces);
    builder.write(*sink, *pk::make_dict(std::move(root)));
    gathers.finish();  // those no entry kept, so that every rank makes the same gathers
    sink->commit();
  } catch (const ckpt::Error& e) {
    throw Error("rank 0: saving " + file.string(), e);
  }
  group.barrier();
}

namespace {

// Up to `most` of `names`, joined by ", ", and how many more there are.
std::string some_of(const std::vector<std::string>& names, std::size_t most = 8) {
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < most; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > most) out += ", and " + std::to_string(names.size() - most) + " more";
  return out;
}

// The checkpoint's tensors below the model's key, by the names the model gives them: the key
// taken off, then the renames applied. Throws fsdp::Error when two names become one.
std::map<std::string, const ckpt::TensorEntry*> model_tensors(const ckpt::Checkpoint& c, const LoadOptions& o, const std::string& who) {
  const std::string prefix = o.model_key.empty() ? std::string() : o.model_key + ".";
  ckpt::EntryRenames renames(std::nullopt, o.renames);
  std::map<std::string, const ckpt::TensorEntry*> out;
  for (const ckpt::TensorEntry& t : c.tensors) {
    if (!t.name.starts_with(prefix)) continue;
    const std::string name = renames.apply(std::string_view(t.name).substr(prefix.size()));
    const auto [at, fresh] = out.emplace(name, &t);
    if (!fresh) throw Error(who + ": '" + at->second->name + "' and '" + t.name + "' both become '" + name + "'");
  }
  return out;
}

// Strict loading: every parameter of the model there (a tied weight under its first name at least),
// and nothing else, or one error naming both.
void check_names_match(const ShardedModel& model, const std::map<std::string, const ckpt::TensorEntry*>& found,
                       const ckpt::Checkpoint& c, const LoadOptions& o, const std::string& who) {
  std::set<std::string> known;
  std::vector<std::string> missing, unexpected;
  auto expect = [&](const std::string& fqn) {
    known.insert(fqn);
    if (!found.count(fqn)) missing.push_back(o.model_key.empty() ? fqn : o.model_key + "." + fqn);
  };
  for (const auto& unit : model.units()) {
    if (!unit) continue;
    for (const auto& p : unit->params()) {
      // A tied weight's second name may be absent, as Hugging Face's save_pretrained leaves it
      // out: its value is the first name's.
      if (p.alias_of >= 0) {
        known.insert(p.fqn);
      } else {
        expect(p.fqn);
      }
    }
  }
  for (const auto& b : model.buffers()) expect(b.first);
  for (const auto& [name, t] : found) {
    if (!known.count(name)) unexpected.push_back(t->name);
  }
  if (missing.empty() && unexpected.empty()) return;
  std::string message = who + ": the checkpoint does not hold the model's parameters, and only them";
  if (!missing.empty()) message += "; missing (" + std::to_string(missing.size()) + "): " + some_of(missing);
  if (!unexpected.empty()) message += "; unexpected (" + std::to_string(unexpected.size()) + "): " + some_of(unexpected);
  // Where the model's names sit under another key, say which.
  const auto first = std::find_if(known.begin(), known.end(), [&](const std::string& n) { return !found.count(n); });
  if (first != known.end()) {
    const std::string tail = "." + *first;
    for (const ckpt::TensorEntry& t : c.tensors) {
      if (t.name.ends_with(tail) && t.name.size() > tail.size()) {
        message += "; '" + *first + "' is there as '" + t.name + "': the model's entries sit under '" +
                   t.name.substr(0, t.name.size() - tail.size()) + "'";
        break;
      }
    }
  }
  throw Error(message + " (load with strict = false to keep what is missing and ignore the rest)");
}

namespace pk = ckpt::pickle;

// The param_groups saved for the optimizer under `key`: a torch.save file's own (below `root`), an
// object of that name (ours), or the leaves `<key>.param_groups.<i>.<field>` that PyTorch's
// flatten_state_dict makes of them (dcp.save), put together again. Null when there are none.
pk::ValuePtr saved_param_groups(const ckpt::Checkpoint& c, const ckpt::ChunkReader& reader, const pk::Value* root, const std::string& key) {
  if (root) return pk::dict_value(pk::dict_value(root, key).get(), "param_groups");
  const std::string whole = key + ".param_groups", prefix = whole + ".";
  std::map<std::int64_t, std::vector<std::pair<pk::ValuePtr, pk::ValuePtr>>> groups;
  for (const ckpt::ObjectEntry& o : c.objects) {
    if (o.name == whole) return reader.object_value(o);
    if (!o.name.starts_with(prefix)) continue;
    const std::string rest = o.name.substr(prefix.size());
    const std::size_t dot = rest.find('.');
    if (dot == std::string::npos || dot == 0 || !std::all_of(rest.begin(), rest.begin() + static_cast<std::ptrdiff_t>(dot), ::isdigit)) continue;
    groups[std::stoll(rest.substr(0, dot))].emplace_back(pk::make_str(rest.substr(dot + 1)), reader.object_value(o));
  }
  if (groups.empty()) return nullptr;
  std::vector<pk::ValuePtr> list;
  for (auto& [i, fields] : groups) list.push_back(pk::make_dict(std::move(fields)));
  return pk::make_list(std::move(list));
}

// Matches the checkpoint's param_groups (`saved`, null: none) with the optimizer's: as many
// groups, each holding the same parameters, named by FQN or by torch.optim's integer ids (which
// number the groups' parameters in order, what FSDP's _rekey_optimizer_state_if_needed maps to
// names); restores each group's hyperparameters. Returns how the checkpoint's state names each
// parameter the optimizer steps (its FQN, or its id). Throws fsdp::Error for another grouping.
std::map<std::string, std::string> restore_param_groups(ShardedOptimizer& optimizer, const pk::ValuePtr& saved, const std::string& who,
                                                        const std::string& key) {
  std::map<std::string, std::string> state_names;
  std::vector<std::string> by_id;  // torch.optim's ids: the groups' parameters in order
  for (const ShardedOptimizer::Group& g : optimizer.groups()) by_id.insert(by_id.end(), g.params.begin(), g.params.end());
  for (const std::string& fqn : by_id) {
    if (optimizer.group_of(fqn)) state_names.emplace(fqn, fqn);
  }
  if (!saved) return state_names;
  const std::string where = who + ": optimizer '" + key + "'";
  const auto* groups = saved->sequence();
  if (!groups) throw Error(where + ": its param_groups is a " + saved->type_name() + ", not a list");
  if (groups->size() != optimizer.groups().size()) {
    throw Error(where + " has " + std::to_string(groups->size()) + " parameter groups, this optimizer " +
                std::to_string(optimizer.groups().size()) + ": its state is for another grouping of the parameters");
  }
  for (std::size_t i = 0; i < groups->size(); ++i) {
    const pk::Value* g = (*groups)[i].get();
    ShardedOptimizer::Group mine = optimizer.groups()[i];
    const pk::ValuePtr params = pk::dict_value(g, "params");
    if (!params || !params->sequence()) throw Error(where + ": parameter group " + std::to_string(i) + " lists no params");
    std::set<std::string> there;
    for (const pk::ValuePtr& p : *params->sequence()) {
      if (p->str()) {
        there.insert(*p->str());
      } else if (const auto id = p->int64(); id && *id >= 0 && static_cast<std::size_t>(*id) < by_id.size()) {
        there.insert(by_id[static_cast<std::size_t>(*id)]);
        state_names[by_id[static_cast<std::size_t>(*id)]] = std::to_string(*id);
      } else {
        throw Error(where + ": parameter group " + std::to_string(i) + " lists " + p->type_name() +
                    (p->int64() ? " " + std::to_string(*p->int64()) : std::string()) + ", which names no parameter of this optimizer");
      }
    }
    const std::set<std::string> here(mine.params.begin(), mine.params.end());
    if (there != here) {
      std::vector<std::string> only_there, only_here;
      std::set_difference(there.begin(), there.end(), here.begin(), here.end(), std::back_inserter(only_there));
      std::set_difference(here.begin(), here.end(), there.begin(), there.end(), std::back_inserter(only_here));
      throw Error(where + ": parameter group " + std::to_string(i) + " holds other parameters than this optimizer's" +
                  (only_there.empty() ? std::string() : "; there, not here: " + some_of(only_there)) +
                  (only_here.empty() ? std::string() : "; here, not there: " + some_of(only_here)) +
                  " (its state is for another grouping of the parameters)");
    }
    if (const auto v = pk::number_value(pk::dict_value(g, "lr").get())) mine.lr = *v;
    if (const auto v = pk::number_value(pk::dict_value(g, "initial_lr").get())) mine.initial_lr = *v;
    if (const auto v = pk::number_value(pk::dict_value(g, "weight_decay").get())) mine.weight_decay = *v;
    if (const auto v = pk::number_value(pk::dict_value(g, "eps").get())) mine.eps = *v;
    if (const auto v = pk::number_value(pk::dict_value(g, "momentum").get())) mine.momentum = *v;
    if (const pk::ValuePtr betas = pk::dict_value(g, "betas"); betas && betas->sequence() && betas->sequence()->size() == 2) {
      mine.beta1 = pk::number_value((*betas->sequence())[0].get()).value_or(mine.beta1);
      mine.beta2 = pk::number_value((*betas->sequence())[1].get()).value_or(mine.beta2);
    }
    optimizer.set_group(i, mine);
  }
  return state_names;
}

}  // namespace

ckpt::pickle::ValuePtr load_sharded(const std::filesystem::path& dir, ShardedModel& model, ProcessGroup& group,
                                    const LoadOptions& o) {
  const std::string who = "rank " + std::to_string(group.rank()) + ": loading " + dir.string();
  ckpt::pickle::ValuePtr meta;
  try {
    const ckpt::Checkpoint c = ckpt::open_checkpoint(dir);
    const ckpt::ChunkReader reader(c, ckpt::FileAccess::kRead);
    const std::map<std::string, const ckpt::TensorEntry*> found = model_tensors(c, o, who);
    if (o.strict) check_names_match(model, found, c, o, who);
    auto find = [&](const std::string& name) -> const ckpt::TensorEntry* {
      const auto it = found.find(name);
      return it == found.end() ? nullptr : it->second;
    };
    torch::NoGradGuard no_grad;
    if (c.format == ckpt::Format::kTorchSave) {
      meta = ckpt::read_torch_save(ckpt::open_file(dir)).root;
    } else if (ckpt::is_dcp(c.format) && std::filesystem::exists(dir / "meta.pt")) {
      meta = ckpt::read_torch_save(ckpt::open_file(dir / "meta.pt")).root;
    }
    // Each optimizer's groups first: how its state names each parameter.
    std::vector<std::map<std::string, std::string>> state_names;
    for (const auto& [key, optimizer] : o.optimizers) {
      const pk::ValuePtr saved = saved_param_groups(c, reader, c.format == ckpt::Format::kTorchSave ? meta.get() : nullptr, key);
      state_names.push_back(restore_param_groups(*optimizer, saved, who, key));
    }
    std::vector<std::optional<std::int64_t>> steps(o.optimizers.size());
    for (std::size_t u = 0; u < model.units().size(); ++u) {
      const auto& unit = model.units()[u];
      if (!unit) continue;
      // Each rank reads only what its slice holds of each parameter (an alias shares its
      // original's place); a parameter the checkpoint lacks (not strict) keeps its value, one
      // without optimizer state keeps its zeros there.
      const std::vector<FlatUnit::Range> ranges = unit->slice_ranges();
      auto pieces = [&](const std::function<const ckpt::TensorEntry*(const FlatUnit::Param&, std::string& name)>& entry) {
        std::vector<torch::Tensor> out;
        for (std::size_t i = 0; i < unit->params().size(); ++i) {
          const FlatUnit::Param& p = unit->params()[i];
          std::string name;
          const ckpt::TensorEntry* t = p.alias_of >= 0 || ranges[i].begin == ranges[i].end ? nullptr : entry(p, name);
          out.push_back(name.empty() ? torch::Tensor() : read_range(reader, t, name, p.shape, ranges[i].begin, ranges[i].end, who));
        }
        return out;
      };
      unit->load_pieces(pieces([&](const FlatUnit::Param& p, std::string& name) {
        const ckpt::TensorEntry* t = find(p.fqn);
        if (t) name = p.fqn;
        return t;
      }));
      for (std::size_t k = 0; k < o.optimizers.size(); ++k) {
        const auto& [key, optimizer] = o.optimizers[k];
        // The state's name of parameter p's `b` ("" for a parameter without state: none).
        auto state = [&, &key = key](const FlatUnit::Param& p, const std::string& b) {
          const auto it = state_names[k].find(p.fqn);
          return it == state_names[k].end() ? std::string() : key + ".state." + it->second + "." + b;
        };
        for (const auto& b : optimizer->buffer_names()) {
          unit->put_pieces(optimizer->buffer(u, b), pieces([&](const FlatUnit::Param& p, std::string& name) {
            name = state(p, b);
            return name.empty() ? nullptr : c.find_tensor(name);  // required: read_range names what is missing
          }));
        }
        for (const FlatUnit::Param& p : unit->params()) {
          const std::string step = state(p, "step");
          const ckpt::TensorEntry* t = step.empty() || steps[k] ? nullptr : c.find_tensor(step);
          if (t) steps[k] = static_cast<std::int64_t>(read_range(reader, t, step, {}, 0, 1, who).item<double>());
        }
      }
    }
    for (std::size_t k = 0; k < o.optimizers.size(); ++k) o.optimizers[k].optimizer->set_steps(steps[k].value_or(0));
    // Buffers whole, on every rank (a buffer the checkpoint lacks, not strict, keeps its value).
    for (auto& [name, b] : model.buffers()) {
      const ckpt::TensorEntry* t = find(name);
      if (!t) continue;
      b.copy_(read_range(reader, t, name, b.sizes().vec(), 0, b.numel(), who).reshape(b.sizes()));
    }
  } catch (const ckpt::Error& e) {
    throw Error(who, e);
  }
  (void)group;
  return meta;
}

}  // namespace fsdp
