// SPDX-License-Identifier: Apache-2.0
// The one file that sees both LibTorch and libckpt types (ARCHITECTURE.md).
#include <torch/torch.h>

#include <cstring>

#include "ckpt/checkpoint.hpp"
#include "ckpt/dcp.hpp"
#include "ckpt/sharding.hpp"
#include "ckpt/error.hpp"
#include "ckpt/ops/shard.hpp"
#include "fsdp/checkpoint.hpp"

namespace fsdp {
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

ckpt::SourcePtr bytes_of(const torch::Tensor& t) {
  const torch::Tensor c = t.contiguous();
  std::vector<std::byte> b(static_cast<std::size_t>(c.numel()) * static_cast<std::size_t>(c.element_size()));
  if (!b.empty()) std::memcpy(b.data(), c.data_ptr(), b.size());
  return ckpt::memory_source(std::move(b));
}

}  // namespace

void save_sharded(const std::filesystem::path& dir, FullyShardedSequential& model, ProcessGroup& group, const std::string& key) {
  const int rank = group.rank(), world = group.size();
  const auto state = model.full_state_dict();  // a collective
  std::vector<ckpt::DcpWriteTensor> tensors;
  ckpt::DcpWriteOptions options;
  options.world_size = world;
  options.overwrite = ckpt::Overwrite::kYes;
  for (const auto& [name, t] : state) {
    ckpt::DcpWriteTensor w;
    w.fqn = key + "." + name;
    w.dtype = to_ckpt(t.scalar_type());
    w.shape = t.sizes().vec();
    if (w.shape.empty()) {
      w.chunks.push_back({0, {}, {}, rank == 0 ? bytes_of(t) : nullptr});
    } else {
      const auto pieces = ckpt::chunk_pieces(w.shape[0], world);
      for (std::size_t r = 0; r < pieces.size(); ++r) {
        std::vector<std::int64_t> offsets(w.shape.size(), 0), sizes = w.shape;
        offsets[0] = pieces[r].first;
        sizes[0] = pieces[r].second;
        const bool mine = static_cast<int>(r) == rank;
        w.chunks.push_back({static_cast<int>(r), offsets, sizes, mine ? bytes_of(t.narrow(0, pieces[r].first, pieces[r].second)) : nullptr});
      }
    }
    options.planner_data[w.fqn] = {ckpt::pickle::make_str(key), ckpt::pickle::make_str(name)};
    tensors.push_back(std::move(w));
  }
  try {
    // An older checkpoint here stops being one before any of its files is replaced.
    if (rank == 0) {
      std::error_code ec;
      std::filesystem::remove(dir / ".metadata", ec);
    }
    group.barrier();
    ckpt::write_dcp_rank_files(dir, tensors, {}, options, rank);
    group.barrier();
    if (rank == 0) ckpt::write_dcp_metadata(dir, tensors, {}, options);
    group.barrier();
  } catch (const ckpt::Error& e) {
    throw Error("rank " + std::to_string(rank) + ": saving " + dir.string() + ": " + e.what());
  }
}

void load_sharded(const std::filesystem::path& dir, FullyShardedSequential& model, ProcessGroup& group, const std::string& key) {
  const std::string who = "rank " + std::to_string(group.rank()) + ": loading " + dir.string();
  try {
    const ckpt::Checkpoint c = ckpt::open_checkpoint(dir);
    const ckpt::ChunkReader reader(c, ckpt::FileAccess::kRead);
    torch::NoGradGuard no_grad;
    for (const auto& unit : model.units()) {
      if (!unit) continue;
      std::vector<torch::Tensor> values;
      for (const auto& p : unit->params()) {
        const ckpt::TensorEntry* t = c.find_tensor(key + "." + p.fqn);
        if (!t) throw Error(who + ": it has no '" + key + "." + p.fqn + "'");
        if (t->shape != p.shape) throw Error(who + ": '" + t->name + "' has shape of " + std::to_string(t->shape.size()) + " dims other than the model's");
        const c10::ScalarType dtype = from_ckpt(t->dtype, who + ": '" + t->name + "'");
        torch::Tensor full = torch::empty(t->shape, torch::TensorOptions().dtype(dtype));
        for (const ckpt::Chunk& chunk : t->chunks) {
          if (ckpt::box_volume(chunk.sizes) == 0) continue;
          const ckpt::ChunkData d = reader.read(*t, chunk);
          // The chunk's elements as a strided view over its bytes, copied into its box.
          std::int64_t last = d.storage_offset;
          for (std::size_t i = 0; i < d.shape.size(); ++i) last += (d.shape[i] - 1) * d.strides[i];
          std::vector<std::byte> bytes(static_cast<std::size_t>(last + 1) * ckpt::element_size(t->dtype));
          d.storage->read_at(0, bytes);
          torch::Tensor src = torch::from_blob(bytes.data(), {last + 1}, torch::TensorOptions().dtype(dtype)).as_strided(d.shape, d.strides, d.storage_offset);
          torch::Tensor dst = full;
          for (std::size_t i = 0; i < chunk.sizes.size(); ++i) dst = dst.narrow(static_cast<std::int64_t>(i), chunk.offsets[i], chunk.sizes[i]);
          dst.copy_(src);
        }
        values.push_back(full);
      }
      unit->load_full(values);
    }
  } catch (const ckpt::Error& e) {
    throw Error(who + ": " + e.what());
  }
  (void)group;
}

}  // namespace fsdp
