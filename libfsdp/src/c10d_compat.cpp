// SPDX-License-Identifier: Apache-2.0
// See NOTE [c10d versions] in c10d_compat.hpp.
#include "c10d_compat.hpp"

#include <ATen/autocast_mode.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/version.h>
#if FSDP_HAS_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string_view>

namespace fsdp::detail {

struct C10dGroup {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> gloo;
#if FSDP_HAS_NCCL
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl;
#endif
  c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> gloo_options;  ///< kept for subgroups
  int rank = 0, size = 1;
  c10::Device device{c10::kCPU};  ///< NCCL: this rank's GPU
  std::chrono::milliseconds timeout{};
  std::string who;  ///< this process in errors: "rank 1 of 4", "rank 3 of 4 (shard group 1, rank 1 of 2)"
};

namespace {

std::string first_line(const char* what) {
  std::string s(what);
  const auto nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}

std::string seconds(std::chrono::milliseconds t) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g s", std::chrono::duration_cast<std::chrono::duration<double>>(t).count());
  return buf;
}

// Gloo (1.13 and 2.x) has no bfloat16 (nor int16): collectives that only move bytes move its bits
// as float16, which Gloo carries and never computes with there, and reductions run in float32 and
// are rounded back once.
bool gloo_lacks(const C10dGroup& g, const at::Tensor& t) {
#if FSDP_HAS_NCCL
  if (g.nccl) return false;
#else
  (void)g;
#endif
  return t.scalar_type() == at::kBFloat16;
}
at::Tensor as_bytes(const at::Tensor& t) { return t.view(at::kHalf); }

// NCCL moves GPU memory only: a host tensor (a loss to average, a checkpoint's scalar) goes
// through a copy on the group's device, and the result is copied back.
bool staged(const C10dGroup& g, const at::Tensor& t) { return g.device.is_cuda() && !t.is_cuda(); }
// Runs `f` on a copy of `t` on the group's device, then copies the result back into `t`.
template <typename F>
void through_device(const C10dGroup& g, at::Tensor& t, F&& f) {
  at::Tensor on = t.to(g.device);
  f(on);
  t.copy_(on);
}

// Runs one c10d call; its errors (a peer that died, a timeout) become fsdp::Error naming the
// operation and this rank.
template <typename F>
void guarded(const C10dGroup& g, std::string_view op, F&& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    throw Error(g.who + ": " + std::string(op) + " failed: " + first_line(e.what_without_backtrace()) + " (another rank died, stopped or is more than " +
                seconds(g.timeout) + " late)");
  } catch (const std::exception& e) {
    throw Error(g.who + ": " + std::string(op) + " failed: " + e.what());
  }
}

// Runs `f` on the backend's c10d group, waiting for its work.
template <typename F>
void run(C10dGroup& g, std::string_view op, F&& f) {
  guarded(g, op, [&] {
#if FSDP_HAS_NCCL
    if (g.nccl) {
      f(*g.nccl)->wait();
      return;
    }
#endif
    f(*g.gloo)->wait();
  });
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
    case ReduceOp::kSum:
    case ReduceOp::kAvg: return c10d::ReduceOp::SUM;  // Gloo has no AVG: summed, then divided
  }
  return c10d::ReduceOp::SUM;
}

bool loopback(const std::string& host) { return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1"; }

}  // namespace

void destroy(C10dGroup* g) noexcept { delete g; }

GroupPtr make_group(const Rendezvous& where, Backend backend, std::chrono::milliseconds timeout) {
  auto g = std::make_unique<C10dGroup>();
  g->rank = where.rank;
  g->size = where.world_size;
  g->timeout = timeout;
  const std::string who = "rank " + std::to_string(where.rank) + " of " + std::to_string(where.world_size);
  g->who = who;
  try {
    if (!where.file_store.empty()) {
      g->store = c10::make_intrusive<c10d::FileStore>(where.file_store, where.world_size);
      g->store->setTimeout(timeout);
    } else {
      c10d::TCPStoreOptions o;
      o.port = static_cast<std::uint16_t>(where.master_port);
      o.isServer = where.rank == 0 && where.agent_store_prefix.empty();  // torchrun's agent serves it already
      o.numWorkers = static_cast<std::size_t>(where.world_size);
      o.waitWorkers = true;
      o.timeout = timeout;
      g->store = c10::make_intrusive<c10d::TCPStore>(where.master_addr, o);
      if (!where.agent_store_prefix.empty()) g->store = c10::make_intrusive<c10d::PrefixStore>(where.agent_store_prefix, g->store);
    }
    if (backend == Backend::kNccl) {
#if FSDP_HAS_NCCL
      // This rank's GPU: LOCAL_RANK's, as torchrun's scripts choose it (one rank per GPU).
      const int gpus = static_cast<int>(c10::cuda::device_count());
      if (gpus == 0) throw Error(who + ": backend nccl needs a GPU, and none is visible");
      g->device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(where.local_rank % gpus));
      c10::cuda::set_device(g->device.index());
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = timeout;
      g->nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(g->store, where.rank, where.world_size, opts);
      return GroupPtr(g.release(), destroy);
#else
      throw Error("this build has no NCCL: the LibTorch it was built against has no CUDA");
#endif
    }
    auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
    // GLOO_SOCKET_IFNAME as torch reads it; on one machine, the loopback interface.
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else if (where.file_store.empty() && loopback(where.master_addr)) {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    } else {
      opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
    g->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(g->store, where.rank, where.world_size, opts);
    g->gloo_options = opts;
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const std::string how = where.file_store.empty() ? "the TCP store at " + where.master_addr + ":" + std::to_string(where.master_port)
                                                     : "the file store " + where.file_store;
    throw Error(who + ": the " + std::to_string(where.world_size) + " processes did not all meet through " + how + " within " +
                seconds(timeout) + ": " + first_line(e.what()));
  }
  return GroupPtr(g.release(), destroy);
}

GroupPtr make_subgroup(const C10dGroup& parent, const std::string& name, int rank, int size, const std::string& who) {
  auto g = std::make_unique<C10dGroup>();
  g->rank = rank;
  g->size = size;
  g->device = parent.device;
  g->timeout = parent.timeout;
  g->who = who;
  try {
    g->store = c10::make_intrusive<c10d::PrefixStore>(name, parent.store);
#if FSDP_HAS_NCCL
    if (parent.nccl) {
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = parent.timeout;
      g->nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(g->store, rank, size, opts);
      return GroupPtr(g.release(), destroy);
    }
#endif
    g->gloo_options = parent.gloo_options;
    g->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(g->store, rank, size, parent.gloo_options);
  } catch (const std::exception& e) {
    throw Error(who + ": the " + std::to_string(size) + " processes of " + name + " did not all meet within " + seconds(parent.timeout) +
                ": " + first_line(e.what()));
  }
  return GroupPtr(g.release(), destroy);
}

void barrier(C10dGroup& g) {
  run(g, "barrier", [&](auto& pg) { return pg.barrier(); });
}

c10::Device device(const C10dGroup& g) { return g.device; }

void broadcast(C10dGroup& g, at::Tensor& t, int root) {
  if (staged(g, t)) return through_device(g, t, [&](at::Tensor& on) { broadcast(g, on, root); });
  std::vector<at::Tensor> v{gloo_lacks(g, t) ? as_bytes(t) : t};
  c10d::BroadcastOptions o;
  o.rootRank = root;
  o.timeout = g.timeout;
  run(g, "broadcast", [&](auto& pg) { return pg.broadcast(v, o); });
}

void all_reduce(C10dGroup& g, at::Tensor& t, ReduceOp op) {
  if (staged(g, t)) return through_device(g, t, [&](at::Tensor& on) { all_reduce(g, on, op); });
  if (gloo_lacks(g, t)) {
    at::Tensor wide = t.to(at::kFloat);
    all_reduce(g, wide, op);
    t.copy_(wide);
    return;
  }
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = to_c10d(op);
  o.timeout = g.timeout;
  run(g, "all_reduce", [&](auto& pg) { return pg.allreduce(v, o); });
  if (op == ReduceOp::kAvg) t.div_(g.size);
}

// c10d's work handle: c10d::ProcessGroup::Work in 1.13, c10d::Work in 2.x.
using WorkPtr = decltype(std::declval<c10d::ProcessGroupGloo&>().barrier(std::declval<const c10d::BarrierOptions&>()));

struct PendingWork {
  WorkPtr work;
  std::string_view op;  ///< in errors
  /// Once the work is done: a host output made on the GPU copied back, an average divided, a
  /// slice kept. It holds the tensors the work reads and writes until then.
  std::function<void()> then;
};

void destroy(PendingWork* work) noexcept { delete work; }

void wait(C10dGroup& g, PendingWork& work) {
  guarded(g, work.op, [&] { work.work->wait(); });
  if (work.then) work.then();
}

PendingPtr all_gather_start(C10dGroup& g, at::Tensor& out, const at::Tensor& in) {
  auto pending = std::make_unique<PendingWork>();
  pending->op = "all_gather";
  at::Tensor target = out;
  if (staged(g, out) || staged(g, in)) {
    target = out.to(g.device);
    pending->then = [host = out, target]() mutable { host.copy_(target); };
  }
  // Gloo 1.13 has no _allgather_base: one output view per rank into the flat result.
  const bool bytes = gloo_lacks(g, in);
  at::Tensor flat = bytes ? as_bytes(target.view({-1})) : target.view({-1});
  const std::int64_t n = in.numel();
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < g.size; ++r) outputs[0].push_back(flat.narrow(0, r * n, n));
  at::Tensor input = in.to(g.device).contiguous().view({-1});
  std::vector<at::Tensor> inputs{bytes ? as_bytes(input) : input};
  c10d::AllgatherOptions o;
  o.timeout = g.timeout;
  guarded(g, "all_gather", [&] {
#if FSDP_HAS_NCCL
    if (g.nccl) {
      pending->work = g.nccl->allgather(outputs, inputs, o);
      return;
    }
#endif
    pending->work = g.gloo->allgather(outputs, inputs, o);
  });
  return PendingPtr(pending.release(), destroy);
}

PendingPtr reduce_scatter_start(C10dGroup& g, at::Tensor& out, const at::Tensor& in, ReduceOp op) {
  auto pending = std::make_unique<PendingWork>();
  pending->op = "reduce_scatter";
  const std::int64_t n = out.numel();
  const int size = g.size;
#if FSDP_HAS_NCCL
  if (g.nccl) {
    // A host output is made on the GPU and copied back once done.
    const bool host = staged(g, out);
    at::Tensor output = host ? at::empty({n}, out.options().device(g.device)) : out.view({-1});
    at::Tensor input = in.to(g.device).contiguous().view({-1});
    c10d::ReduceScatterOptions o;
    o.reduceOp = to_c10d(op);
    o.timeout = g.timeout;
    guarded(g, "reduce_scatter", [&] { pending->work = g.nccl->_reduce_scatter_base(output, input, o); });
    pending->then = [out, output, input, op, size, host]() mutable {
      if (op == ReduceOp::kAvg) output.div_(size);
      if (host) out.view({-1}).copy_(output);
    };
    return PendingPtr(pending.release(), destroy);
  }
#endif
  // Gloo has no reduce-scatter (1.13 refuses it): all-reduce a copy (in float32 for bfloat16,
  // which Gloo cannot reduce) and keep this rank's slice.
  at::Tensor all = gloo_lacks(g, in) ? in.contiguous().view({-1}).to(at::kFloat) : in.contiguous().view({-1}).clone();
  std::vector<at::Tensor> v{all};
  c10d::AllreduceOptions o;
  o.reduceOp = to_c10d(op);
  o.timeout = g.timeout;
  guarded(g, "reduce_scatter", [&] { pending->work = g.gloo->allreduce(v, o); });
  pending->then = [out, all, op, size, rank = g.rank, n]() mutable {
    at::Tensor mine = all.narrow(0, rank * n, n);
    if (op == ReduceOp::kAvg) mine.div_(size);
    out.view({-1}).copy_(mine);
  };
  return PendingPtr(pending.release(), destroy);
}

// NOTE [c10d versions]: at::autocast's per-device functions came in 2.4, and its CPU- and
// GPU-named ones are deprecated since.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
AutocastState autocast_state(c10::DeviceType d) { return {at::autocast::is_autocast_enabled(d), at::autocast::get_autocast_dtype(d)}; }
void set_autocast_state(c10::DeviceType d, AutocastState state) {
  at::autocast::set_autocast_dtype(d, state.dtype);
  at::autocast::set_autocast_enabled(d, state.enabled);
}
#else
AutocastState autocast_state(c10::DeviceType d) {
  if (d == c10::DeviceType::CUDA) return {at::autocast::is_enabled(), at::autocast::get_autocast_gpu_dtype()};
  return {at::autocast::is_cpu_enabled(), at::autocast::get_autocast_cpu_dtype()};
}
void set_autocast_state(c10::DeviceType d, AutocastState state) {
  if (d == c10::DeviceType::CUDA) {
    at::autocast::set_autocast_gpu_dtype(state.dtype);
    at::autocast::set_enabled(state.enabled);
  } else if (d == c10::DeviceType::CPU) {
    at::autocast::set_autocast_cpu_dtype(state.dtype);
    at::autocast::set_cpu_enabled(state.enabled);
  } else {
    throw Error("autocast on " + c10::DeviceTypeName(d) + " is not supported (cpu or cuda)");
  }
}
#endif

}  // namespace fsdp::detail
