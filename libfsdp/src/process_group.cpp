// SPDX-License-Identifier: Apache-2.0
#include "fsdp/process_group.hpp"

#include <algorithm>
#include <utility>
#include <charconv>
#include <cstdlib>

#include "c10d_compat.hpp"

namespace fsdp {

std::string_view to_string(Backend b) noexcept { return b == Backend::kNccl ? "nccl" : "gloo"; }

bool nccl_available() noexcept { return FSDP_HAS_NCCL != 0; }

Backend backend_from_string(std::string_view name) {
  if (name == "gloo") return Backend::kGloo;
  if (name == "nccl") {
    if (!nccl_available()) throw Error(ErrorKind::kUnsupported, "backend 'nccl' needs a LibTorch with CUDA; this build has none (use gloo)");
    return Backend::kNccl;
  }
  throw Error(ErrorKind::kInvalidArgument, "unknown process-group backend '" + std::string(name) + "' (gloo or nccl)");
}

namespace {

int number(const std::map<std::string, std::string>& env, const std::string& name) {
  const std::string& v = env.at(name);
  int out = 0;
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec != std::errc() || p != v.data() + v.size()) throw Error(name + "='" + v + "' is not a number");
  return out;
}

}  // namespace

std::string first_slurm_host(std::string_view list) {
  // The first entry: up to a ',' that is not inside brackets.
  int depth = 0;
  std::size_t end = 0;
  for (; end < list.size(); ++end) {
    if (list[end] == '[') ++depth;
    if (list[end] == ']') --depth;
    if (list[end] == ',' && depth == 0) break;
  }
  const std::string_view first = list.substr(0, end);
  const auto open = first.find('[');
  if (open == std::string_view::npos) return std::string(first);
  // "node[003-006,9]": the prefix and the first number of the range, zero padding kept.
  std::string_view range = first.substr(open + 1);
  const auto stop = range.find_first_of(",-]");
  return std::string(first.substr(0, open)) + std::string(range.substr(0, stop));
}

std::optional<Rendezvous> Rendezvous::from_environment(const std::map<std::string, std::string>& env) {
  Rendezvous r;
  auto get = [&](const char* k) -> const std::string* {
    auto it = env.find(k);
    return it == env.end() ? nullptr : &it->second;
  };
  if (get("RANK") && get("WORLD_SIZE")) {
    r.rank = number(env, "RANK");
    r.world_size = number(env, "WORLD_SIZE");
    r.local_rank = get("LOCAL_RANK") ? number(env, "LOCAL_RANK") : r.rank;
    if (get("MASTER_ADDR")) r.master_addr = *get("MASTER_ADDR");
    if (const std::string* agent = get("TORCHELASTIC_USE_AGENT_STORE"); agent && *agent == "True") {
      const std::string* attempt = get("TORCHELASTIC_RESTART_COUNT");
      r.agent_store_prefix = "/worker/attempt_" + (attempt ? *attempt : std::string("0"));
    }
  } else if (get("SLURM_PROCID") && get("SLURM_NTASKS")) {
    r.rank = number(env, "SLURM_PROCID");
    r.world_size = number(env, "SLURM_NTASKS");
    r.local_rank = get("SLURM_LOCALID") ? number(env, "SLURM_LOCALID") : 0;
    if (get("MASTER_ADDR")) r.master_addr = *get("MASTER_ADDR");
    else if (get("SLURM_JOB_NODELIST")) r.master_addr = first_slurm_host(*get("SLURM_JOB_NODELIST"));
  } else {
    return std::nullopt;
  }
  if (get("MASTER_PORT")) r.master_port = number(env, "MASTER_PORT");
  if (r.world_size < 1 || r.rank < 0 || r.rank >= r.world_size) {
    throw Error("rank " + std::to_string(r.rank) + " is not in a world of " + std::to_string(r.world_size));
  }
  if (r.master_port < 1 || r.master_port > 65535) throw Error("MASTER_PORT=" + std::to_string(r.master_port) + " is not a port");
  return r;
}

struct ProcessGroup::Impl {
  detail::GroupPtr group{nullptr, detail::destroy};
  Rendezvous where;
  Backend backend;
  std::chrono::milliseconds timeout;
  CollectiveStats stats;
  /// A world of one does its collectives locally, unless FSDP_TEST_REAL_COLLECTIVES is set
  /// (tests: one GPU can only hold a world of one, whose NCCL calls must run to be tested).
  bool local = true;
  c10::Device device{c10::kCPU};  ///< where its collectives run (the group's; a subgroup of one: its parent's)
};

namespace {

/// Adds the time from construction to destruction to `stats`: a collective's, or the wait for an
/// asynchronous one (its time spent beside computation is not counted).
class Timed {
 public:
  explicit Timed(CollectiveStats& stats) : stats_(stats), start_(std::chrono::steady_clock::now()) {}
  ~Timed() {
    stats_.time += std::chrono::steady_clock::now() - start_;
    ++stats_.calls;
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  CollectiveStats& stats_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace

ProcessGroup::ProcessGroup(const Rendezvous& where, Backend backend, std::chrono::milliseconds timeout) : impl_(std::make_unique<Impl>()) {
  if (where.world_size < 1 || where.rank < 0 || where.rank >= where.world_size) {
    throw Error("rank " + std::to_string(where.rank) + " is not in a world of " + std::to_string(where.world_size));
  }
  impl_->where = where;
  impl_->backend = backend;
  impl_->timeout = timeout;
  impl_->local = where.world_size == 1 && !std::getenv("FSDP_TEST_REAL_COLLECTIVES");
  impl_->group = detail::make_group(where, backend, timeout);
  impl_->device = detail::device(*impl_->group);
}

ProcessGroup::ProcessGroup(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

ProcessGroup::~ProcessGroup() = default;

std::unique_ptr<ProcessGroup> ProcessGroup::subgroup(const std::string& name, const std::vector<int>& ranks) {
  const auto me = std::find(ranks.begin(), ranks.end(), rank());
  if (me == ranks.end()) throw Error("rank " + std::to_string(rank()) + " is not a member of " + name);
  for (int r : ranks) {
    if (r < 0 || r >= size()) throw Error(name + ": rank " + std::to_string(r) + " is not in a group of " + std::to_string(size()));
  }
  auto impl = std::make_unique<Impl>();
  impl->where = impl_->where;
  impl->where.rank = static_cast<int>(me - ranks.begin());
  impl->where.world_size = static_cast<int>(ranks.size());
  impl->backend = impl_->backend;
  impl->timeout = impl_->timeout;
  impl->device = impl_->device;
  impl->local = ranks.size() == 1;
  const std::string who = "rank " + std::to_string(rank()) + " of " + std::to_string(size()) + " (" + name + ", rank " +
                          std::to_string(impl->where.rank) + " of " + std::to_string(ranks.size()) + ")";
  if (ranks.size() > 1) impl->group = detail::make_subgroup(*impl_->group, name, impl->where.rank, impl->where.world_size, who);
  return std::unique_ptr<ProcessGroup>(new ProcessGroup(std::move(impl)));
}

DeviceMesh::DeviceMesh(ProcessGroup& world, int replicas, int shards) : world_(world), replicas_(replicas), shards_(shards) {
  if (replicas < 1 || shards < 1 || replicas * shards != world.size()) {
    throw Error("a device mesh of " + std::to_string(replicas) + " x " + std::to_string(shards) + " does not fit a world of " +
                std::to_string(world.size()) + " (replicas x shards must equal the world size)");
  }
  const int r = world.rank() / shards, s = world.rank() % shards;
  std::vector<int> shard_ranks, replicate_ranks;
  for (int i = 0; i < shards; ++i) shard_ranks.push_back(r * shards + i);
  for (int i = 0; i < replicas; ++i) replicate_ranks.push_back(i * shards + s);
  shard_ = world.subgroup("shard group " + std::to_string(r), shard_ranks);
  replicate_ = world.subgroup("replicate group " + std::to_string(s), replicate_ranks);
}

int ProcessGroup::rank() const noexcept { return impl_->where.rank; }
int ProcessGroup::size() const noexcept { return impl_->where.world_size; }
Backend ProcessGroup::backend() const noexcept { return impl_->backend; }
c10::Device ProcessGroup::device() const noexcept { return impl_->device; }
std::chrono::milliseconds ProcessGroup::timeout() const noexcept { return impl_->timeout; }

const CollectiveStats& ProcessGroup::stats() const noexcept { return impl_->stats; }

void ProcessGroup::barrier() {
  if (impl_->local) return;  // a world of one: every collective is local
  Timed t(impl_->stats);
  detail::barrier(*impl_->group);
}

void ProcessGroup::broadcast(at::Tensor& tensor, int root) {
  if (root < 0 || root >= size()) throw Error("broadcast from rank " + std::to_string(root) + ", which is not in the group");
  if (impl_->local) return;
  Timed t(impl_->stats);
  detail::broadcast(*impl_->group, tensor, root);
}

void ProcessGroup::all_reduce(at::Tensor& tensor, ReduceOp op) {
  if (impl_->local) return;  // sum, average, max and min of one value are that value
  Timed t(impl_->stats);
  detail::all_reduce(*impl_->group, tensor, op);
}

void ProcessGroup::all_gather(at::Tensor& out, const at::Tensor& input) { all_gather_async(out, input).wait(); }

PendingCollective::PendingCollective(PendingCollective&& other) noexcept
    : group_(std::exchange(other.group_, nullptr)), work_(std::exchange(other.work_, nullptr)), stats_(std::exchange(other.stats_, nullptr)) {}

PendingCollective& PendingCollective::operator=(PendingCollective&& other) noexcept {
  if (this != &other) {
    try {
      wait();
    } catch (...) {  // an error is the next collective's to report
    }
    group_ = std::exchange(other.group_, nullptr);
    work_ = std::exchange(other.work_, nullptr);
    stats_ = std::exchange(other.stats_, nullptr);
  }
  return *this;
}

PendingCollective::~PendingCollective() {
  try {
    wait();
  } catch (...) {  // destruction does not throw; the next collective reports the failure
  }
}

void PendingCollective::wait() {
  if (!work_) return;
  detail::PendingPtr work(std::exchange(work_, nullptr), detail::destroy);
  Timed t(*stats_);
  detail::wait(*group_, *work);
}

PendingCollective ProcessGroup::all_gather_async(at::Tensor& out, const at::Tensor& input) {
  if (!out.is_contiguous() || out.numel() != input.numel() * size() || out.scalar_type() != input.scalar_type()) {
    throw Error("all_gather: the output must be contiguous, of the input's dtype and " + std::to_string(size()) + " times its size");
  }
  PendingCollective p;
  if (impl_->local) {
    out.copy_(input.reshape(out.sizes()));
    return p;
  }
  p.group_ = impl_->group.get();
  p.stats_ = &impl_->stats;
  p.work_ = detail::all_gather_start(*impl_->group, out, input).release();
  return p;
}

void ProcessGroup::reduce_scatter(at::Tensor& out, const at::Tensor& input, ReduceOp op) { reduce_scatter_async(out, input, op).wait(); }

PendingCollective ProcessGroup::reduce_scatter_async(at::Tensor& out, const at::Tensor& input, ReduceOp op) {
  if (!out.is_contiguous() || out.numel() * size() != input.numel() || out.scalar_type() != input.scalar_type()) {
    throw Error("reduce_scatter: the output must be contiguous, of the input's dtype and 1/" + std::to_string(size()) + " of its size");
  }
  PendingCollective p;
  if (impl_->local) {
    out.copy_(input.reshape(out.sizes()));
    return p;
  }
  p.group_ = impl_->group.get();
  p.stats_ = &impl_->stats;
  p.work_ = detail::reduce_scatter_start(*impl_->group, out, input, op).release();
  return p;
}

}  // namespace fsdp
