// SPDX-License-Identifier: Apache-2.0
// NOTE [c10d versions] The one place that knows how LibTorch 1.13 and 2.x differ in c10d:
// constructing stores and process groups (Gloo's device, NCCL's options), which collectives a
// backend lacks (Gloo 1.13 has no reduce_scatter or _allgather_base), and waiting on work with a
// timeout; and, outside c10d, autocast's state (its per-device-named functions are deprecated from
// 2.4 on) and choosing this rank's CUDA device. Everything else in libfsdp calls these functions.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/process_group.hpp"

namespace fsdp::detail {

/// An opaque c10d process group (a c10d::ProcessGroupGloo or ProcessGroupNCCL) and its store.
struct C10dGroup;

void destroy(C10dGroup* group) noexcept;
using GroupPtr = std::unique_ptr<C10dGroup, void (*)(C10dGroup*)>;

/// Meets the other processes and makes the backend's group. Throws fsdp::Error.
GroupPtr make_group(const Rendezvous& where, Backend backend, std::chrono::milliseconds timeout);
/// A group of some of `parent`'s ranks, met through `parent`'s store under `name` (a PrefixStore,
/// as torch's new_group): only its members call this, each with its rank in it. `who` names this
/// process in errors.
GroupPtr make_subgroup(const C10dGroup& parent, const std::string& name, int rank, int size, const std::string& who);

void barrier(C10dGroup& g);
void broadcast(C10dGroup& g, at::Tensor& t, int root);
void all_reduce(C10dGroup& g, at::Tensor& t, ReduceOp op);
/// A collective started on the backend's threads and not yet waited for.
struct PendingWork;
void destroy(PendingWork* work) noexcept;
using PendingPtr = std::unique_ptr<PendingWork, void (*)(PendingWork*)>;
PendingPtr all_gather_start(C10dGroup& g, at::Tensor& out, const at::Tensor& in);
/// Waits for `work` (its errors are fsdp::Error, as a synchronous collective's).
void wait(C10dGroup& g, PendingWork& work);
/// `out` and `in` are held until the work is waited for. On Gloo, an all-reduce of a copy of `in`.
PendingPtr reduce_scatter_start(C10dGroup& g, at::Tensor& out, const at::Tensor& in, ReduceOp op);

/// The device a group's collectives run on: the CPU for Gloo, this rank's GPU for NCCL (whose
/// collectives take a host tensor through a copy there).
c10::Device device(const C10dGroup& g);

/// Autocast on one device type (CPU or CUDA): whether it is on, and its dtype.
struct AutocastState {
  bool enabled = false;
  c10::ScalarType dtype = c10::ScalarType::BFloat16;
};
AutocastState autocast_state(c10::DeviceType device);
/// Throws fsdp::Error for a device type autocast has no state for here.
void set_autocast_state(c10::DeviceType device, AutocastState state);

}  // namespace fsdp::detail
