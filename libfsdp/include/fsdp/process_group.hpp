// SPDX-License-Identifier: Apache-2.0
// The process group libfsdp shards over (DESIGN.md "libfsdp"): where this process sits among the
// others (torchrun's or SLURM's variables, or given), how they meet (a TCPStore hosted by rank 0,
// or a FileStore), and the collectives FSDP needs, on Gloo (CPU) or NCCL (CUDA, when the LibTorch
// found has it). Every collective waits at most the group's timeout; a rank that died or never
// came turns into an fsdp::Error that says which operation and which ranks, never a hang.
// The differences between LibTorch 1.13 and 2.x c10d live in src/c10d_compat.cpp alone.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/error.hpp"

namespace fsdp {

enum class Backend { kGloo, kNccl };
std::string_view to_string(Backend backend) noexcept;
/// "gloo" or "nccl"; throws fsdp::Error for anything else, and for nccl in a build without CUDA.
Backend backend_from_string(std::string_view name);
/// Whether this build can make an NCCL group (the LibTorch it was built against has CUDA).
bool nccl_available() noexcept;

/// Where this process sits and how it meets the others.
struct Rendezvous {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string file_store;  ///< non-empty: meet through a FileStore at this path instead of TCP
  /// Non-empty: torchrun's elastic agent already serves the TCP store at MASTER_PORT
  /// (TORCHELASTIC_USE_AGENT_STORE=True), so every rank, rank 0 too, connects to it as a client,
  /// under this prefix ("/worker/attempt_<TORCHELASTIC_RESTART_COUNT>"), as torch's env://
  /// rendezvous does.
  std::string agent_store_prefix;

  /// From torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, and the agent's
  /// store when it says so) or, when RANK is not
  /// set, SLURM (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, the first host of
  /// SLURM_JOB_NODELIST, MASTER_PORT or 29500). std::nullopt when neither is there; throws
  /// fsdp::Error for values that are not numbers or a rank outside the world.
  static std::optional<Rendezvous> from_environment(const std::map<std::string, std::string>& env);
};

/// The first host of a SLURM node list: "node[003-006,9],gpu1" -> "node003".
std::string first_slurm_host(std::string_view nodelist);

/// torch's default process-group timeout.
constexpr std::chrono::milliseconds kDefaultTimeout = std::chrono::minutes(30);

enum class ReduceOp { kSum, kAvg, kMax, kMin };

/// What this process's collectives have cost so far: their number and the wall time spent in
/// them (waiting for slower ranks included).
struct CollectiveStats {
  std::uint64_t calls = 0;
  std::chrono::steady_clock::duration time{};
};

namespace detail {
struct C10dGroup;
struct PendingWork;
}  // namespace detail

/// A collective started and not yet waited for (ProcessGroup::all_gather_async,
/// reduce_scatter_async): its output may be read only after wait(). Destroying it waits.
class PendingCollective {
 public:
  PendingCollective() = default;
  PendingCollective(PendingCollective&& other) noexcept;
  PendingCollective& operator=(PendingCollective&& other) noexcept;
  ~PendingCollective();
  /// Waits for it (at most the group's timeout; throws fsdp::Error as the collective would).
  void wait();
  bool pending() const noexcept { return work_ != nullptr; }

 private:
  friend class ProcessGroup;
  detail::C10dGroup* group_ = nullptr;
  detail::PendingWork* work_ = nullptr;
  CollectiveStats* stats_ = nullptr;
};

class ProcessGroup {
 public:
  /// Meets the other world_size - 1 processes (rank 0 hosts the TCPStore) within `timeout`.
  /// Throws fsdp::Error when they do not all come.
  ProcessGroup(const Rendezvous& where, Backend backend, std::chrono::milliseconds timeout = kDefaultTimeout);
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const noexcept;
  int size() const noexcept;
  Backend backend() const noexcept;
  /// Where its collectives run: the CPU for gloo; for nccl this rank's GPU (LOCAL_RANK's, modulo
  /// the GPUs visible), made the current CUDA device when the group was made. A host tensor given
  /// to an nccl collective goes through a copy there.
  c10::Device device() const noexcept;
  std::chrono::milliseconds timeout() const noexcept;
  const CollectiveStats& stats() const noexcept;

  void barrier();
  /// `tensor` on every rank becomes root's.
  void broadcast(at::Tensor& tensor, int root = 0);
  /// Element-wise reduction over every rank, in place (kAvg: the sum divided by size()).
  void all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  /// `out` (contiguous, size() × input.numel() elements) = every rank's `input`, in rank order.
  void all_gather(at::Tensor& out, const at::Tensor& input);
  /// all_gather started on the backend's own threads, so that computation can overlap it
  /// (FSDP's prefetch); `out` and `input` must stay alive until it is waited for.
  PendingCollective all_gather_async(at::Tensor& out, const at::Tensor& input);
  /// `out` (contiguous, input.numel() / size() elements) = this rank's slice of the element-wise
  /// reduction of every rank's `input`. On Gloo, which has no reduce-scatter, an all-reduce of a
  /// copy whose slice is kept.
  void reduce_scatter(at::Tensor& out, const at::Tensor& input, ReduceOp op = ReduceOp::kSum);
  /// reduce_scatter started on the backend's threads, so that computation can overlap it (FSDP's
  /// reduce-scatter in backward); `out` is written when it is waited for. `input` is held until
  /// then and must not change before (NCCL reads it on its own stream).
  PendingCollective reduce_scatter_async(at::Tensor& out, const at::Tensor& input, ReduceOp op = ReduceOp::kSum);

  /// A group of some of this group's ranks, as torch's new_group: `ranks` in this group's
  /// numbering, this process among them (its rank there is its index in `ranks`). They meet under
  /// `name` through this group's store; only the members call this, and every member must.
  std::unique_ptr<ProcessGroup> subgroup(const std::string& name, const std::vector<int>& ranks);

 private:
  struct Impl;
  explicit ProcessGroup(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// A (replicas × shards) mesh over a group, as torch's init_device_mesh((replicas, shards)):
/// rank r * shards + s is shard s of replica r. HYBRID_SHARD shards a unit within its replica
/// (the shard group: ranks r * shards ... r * shards + shards - 1) and averages gradients across
/// replicas (the replicate group: ranks s, shards + s, ...).
class DeviceMesh {
 public:
  /// Makes this rank's shard and replicate groups (a collective over `world`). Throws
  /// fsdp::Error when replicas × shards is not the world size.
  DeviceMesh(ProcessGroup& world, int replicas, int shards);

  ProcessGroup& world() noexcept { return world_; }
  ProcessGroup& shard_group() noexcept { return *shard_; }
  ProcessGroup& replicate_group() noexcept { return *replicate_; }
  int replicas() const noexcept { return replicas_; }
  int shards() const noexcept { return shards_; }

 private:
  ProcessGroup& world_;
  int replicas_, shards_;
  std::unique_ptr<ProcessGroup> shard_, replicate_;
};

}  // namespace fsdp
