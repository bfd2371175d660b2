// SPDX-License-Identifier: Apache-2.0
// The one file that sees both LibTorch and libckpt types (ARCHITECTURE.md).
#include <torch/torch.h>

#include <cstring>

#include "ckpt/dcp.hpp"
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

}  // namespace fsdp
