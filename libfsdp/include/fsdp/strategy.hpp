// SPDX-License-Identifier: Apache-2.0
// fsdp::Strategy: the C++ counterpart of Lightning Fabric's FSDPStrategy (DESIGN.md "libfsdp").
// It holds the options FSDPStrategy's constructor takes and refuses the same contradictions there,
// joins the processes, wraps a model and makes its optimizer, and saves and loads checkpoints from
// a state of named objects, as Fabric's save/load do:
//
//   fsdp::Strategy strategy(fsdp::registered_strategy("fsdp"));
//   strategy.setup_environment(env);
//   auto& model = strategy.setup_module(make_model());
//   auto& optimizer = strategy.setup_optimizer({fsdp::OptimizerKind::kAdamW, 1e-3});
//   fsdp::State state{{"model", &model}, {"optimizer", &optimizer}, {"step", make_int(10)}};
//   strategy.save_checkpoint("ckpt", state);
//   auto rest = strategy.load_checkpoint("ckpt", state);  // state["step"] is the saved value again
//
// Lower-level pieces (FullyShardedSequential, ShardedOptimizer, save_sharded, ...) stay usable
// on their own; this class composes them with the seed's semantics and errors.
#pragma once

#include <torch/optim/optimizer.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "ckpt/pickle.hpp"
#include "fsdp/checkpoint.hpp"
#include "fsdp/fully_sharded.hpp"
#include "fsdp/optim.hpp"
#include "fsdp/process_group.hpp"
#include "fsdp/scheduler.hpp"
#include "fsdp/sharded_module.hpp"

namespace fsdp {

/// FSDP's CPUOffload (the seed takes it or a bool): offload_params keeps each unit's shard, its
/// gradient and the optimizer state in host memory, computing on the GPU.
struct CpuOffload {
  bool offload_params = false;
  CpuOffload() = default;
  CpuOffload(bool offload) : offload_params(offload) {}  // NOLINT(google-explicit-constructor): cpu_offload = true, as the seed
};

/// FSDPStrategy's constructor arguments.
struct StrategyOptions {
  /// Fabric's accelerator: "cpu"; "cuda" (or "gpu"): each rank computes on the GPU its
  /// LOCAL_RANK names, modulo the GPUs visible; "auto": cuda when a GPU is visible, else cpu.
  std::string accelerator = "cpu";
  std::optional<Backend> process_group_backend;  ///< default: gloo on the CPU, nccl on CUDA
  std::chrono::milliseconds timeout = kDefaultTimeout;
  CpuOffload cpu_offload;
  /// The units' MixedPrecision, used as given; unset: the one `precision` implies.
  std::optional<MixedPrecision> mixed_precision;
  /// Lightning's precision (fsdp/precision.hpp): 32-true; bf16-mixed (bfloat16 gradient
  /// reduction, forward under forward_context()'s autocast); bf16-true (setup_module converts the
  /// model); 16-mixed (float16 autocast with a gradient scaler: CUDA only).
  std::string precision = "32-true";
  std::optional<WrapPolicy> auto_wrap_policy;
  /// Which modules run under activation checkpointing, in auto_wrap_policy's forms (by path, by
  /// module type name, by parameter count: FullyShardedSequential::set_activation_checkpointing).
  /// activation_checkpointing is its deprecated spelling (warned about, as the seed does); giving
  /// both is an error.
  std::optional<WrapPolicy> activation_checkpointing;
  std::optional<WrapPolicy> activation_checkpointing_policy;
  /// FSDP's backward_prefetch (BACKWARD_PRE when true, the default) and forward_prefetch.
  bool backward_prefetch = true;
  bool forward_prefetch = false;
  /// Whether a unit's reduce-scatter in backward overlaps the rest of backward
  /// (FullyShardedSequential::set_overlap_reduction); unset: on with NCCL, off with Gloo.
  std::optional<bool> overlap_reduction;
  std::string sharding_strategy = "FULL_SHARD";  ///< FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD
  std::string state_dict_type = "sharded";       ///< sharded (a DCP directory) or full (one torch.save file)
  /// HYBRID_SHARD's (replicas, shards); their product must be the world size.
  std::optional<std::pair<int, int>> device_mesh;
  /// An existing group to shard over instead of joining one from the environment (mutually
  /// exclusive with device_mesh).
  ProcessGroup* process_group = nullptr;
  /// Where warnings go (rank 0 only); default: stderr.
  std::function<void(const std::string&)> warn;
};

/// The registry's names: "fsdp" (the defaults) and "fsdp_cpu_offload" (cpu_offload set).
/// Throws fsdp::Error for any other name.
StrategyOptions registered_strategy(std::string_view name);
std::vector<std::string> registered_strategies();

/// This process's intra-op threads: torch::set_num_threads, and OpenBLAS's own thread pool when
/// LibTorch computes through OpenBLAS, which torch's setting does not reach (LibTorch sets
/// OpenMP's and MKL's only). An OpenBLAS built with pthreads (Debian's libopenblas0-pthread) keeps
/// a pool as large as the machine in every process, so local ranks each given their share of the
/// cores would still spin that many BLAS threads each and oversubscribe the machine (bench/train
/// shows the cost). Returns whether OpenBLAS was found and set.
bool set_num_threads(int threads);

/// One object of a checkpoint's state: the model set up by the strategy, its optimizer, an object
/// that saves itself as a value (a LambdaLR: its state_dict() is saved, and a load gives it the
/// saved value through load_state_dict()), or any other value. Values go to meta.pt, or to the
/// top level of a full checkpoint.
using StateItem = std::variant<ShardedModel*, ShardedOptimizer*, Stateful*, ckpt::pickle::ValuePtr>;
using State = std::map<std::string, StateItem>;
/// Lightning's filter: for a state key, which of its entries to save (the model's by parameter
/// FQN, a dict value's by key). Full checkpoints only.
using Filter = std::map<std::string, std::function<bool(const std::string& name)>>;

class Strategy {
 public:
  /// Checks the options as FSDPStrategy's constructor does; throws fsdp::Error.
  explicit Strategy(StrategyOptions options);
  ~Strategy();
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  /// Joins the processes the environment describes (torchrun's or SLURM's variables; none: a
  /// world of one), or takes options.process_group; makes the device mesh for HYBRID_SHARD.
  void setup_environment(const std::map<std::string, std::string>& env);
  ProcessGroup& group();
  int global_rank();
  int world_size();
  /// Where this rank's model computes (Fabric's root_device): the CPU, or its GPU. Inputs go
  /// there; setup_module moves the model there. After setup_environment.
  c10::Device root_device();

  /// Wraps `module` into FSDP units by the policy, sharded by the strategy, activation
  /// checkpointing applied; under a *-true precision the model is converted first (the deferred
  /// form converts each child as it is made; a model wrapped already is left as it is). The
  /// strategy owns the result.
  FullyShardedSequential& setup_module(torch::nn::Sequential module);
  /// module_init_context(empty_init=True)'s counterpart: the model as its children's makers, each
  /// made when the model reaches it and its unit sharded before the next child is made
  /// (FullyShardedSequential's deferred initialization), so no rank holds the whole model
  /// unsharded. Not under HYBRID_SHARD (throws fsdp::Error).
  FullyShardedSequential& setup_module(const std::vector<std::pair<std::string, ChildMaker>>& children);
  /// A model the user wrapped already (its units made as they chose): left as it is, as the
  /// seed leaves an FSDP-wrapped module. An auto_wrap_policy is then ignored, with the seed's
  /// warning; prefetching and activation checkpointing are applied. The strategy takes it over.
  FullyShardedSequential& setup_module(std::unique_ptr<FullyShardedSequential> wrapped);
  /// Any module: its fsdp::Sharded submodules are units as the auto_wrap_policy chooses (all of
  /// them without one), the root unit holds the rest (FullyShardedModule); under a *-true
  /// precision the module is converted first.
  template <class Impl>
  FullyShardedModule<Impl>& setup_module(std::shared_ptr<Impl> module) {
    group();
    prepare(*module);
    auto wrapped = mesh_ ? std::make_unique<FullyShardedModule<Impl>>(std::move(module), *mesh_, sharding_, mixed(), policy())
                         : std::make_unique<FullyShardedModule<Impl>>(std::move(module), group(), sharding_, mixed(), policy());
    return static_cast<FullyShardedModule<Impl>&>(adopt(std::move(wrapped)));
  }
  /// module_init_context(empty_init=True)'s counterpart for any module: `make` builds it, and each
  /// fsdp::Sharded submodule the auto_wrap_policy chooses (by type or size) is converted to the
  /// precision and device and sharded as soon as it is made (FullyShardedModule's deferred
  /// initialization), so no rank holds the whole model unsharded. Not under HYBRID_SHARD (throws
  /// fsdp::Error). Call it as setup_module<NetImpl>(factory).
  template <class Impl>
  FullyShardedModule<Impl>& setup_module(const std::function<std::shared_ptr<Impl>()>& make) {
    if (mesh_) throw Error("deferred initialization (a module made by a factory) is not available under HYBRID_SHARD; make the module whole");
    auto wrapped = std::make_unique<FullyShardedModule<Impl>>(make, group(), sharding_, mixed(), policy(), [this](torch::nn::Module& m) { prepare(m); });
    return static_cast<FullyShardedModule<Impl>&>(adopt(std::move(wrapped)));
  }
  /// An optimizer over the model's shards (setup_module first). The strategy owns it.
  ShardedOptimizer& setup_optimizer(const OptimizerOptions& options);
  /// Checks that a torch optimizer steps the model's shards: one made before setup_module (over
  /// the original parameters) references none, and is refused.
  void setup_optimizer(const torch::optim::Optimizer& optimizer);

  /// The global gradient norm of `norm_type` (2; any p > 0; infinity), clipped to `max_norm`.
  /// error_if_nonfinite: a NaN or infinite norm is an error and the gradients are left as they
  /// are. Under 16-mixed the gradients are unscaled first, and a step the scaler will skip returns
  /// infinity without clipping.
  double clip_gradients_norm(ShardedOptimizer& optimizer, double max_norm, double norm_type = 2.0, bool error_if_nonfinite = true);
  /// Every gradient element clamped into [-clip_value, clip_value], unscaled first under 16-mixed.
  /// The seed refuses this under FSDP; an elementwise clamp of each rank's slice is exactly
  /// torch.nn.utils.clip_grad_value_ of the whole gradients, so here it is done.
  void clip_gradients_value(ShardedOptimizer& optimizer, double clip_value);

  /// Lightning's precision plugin around backward and the step. 16-mixed: `optimizer` has a
  /// ShardedGradScaler (made by setup_optimizer); scale_loss multiplies the loss by its scale
  /// (run backward on the result), and optimizer_step steps unless a rank's gradients hold an inf
  /// or NaN, then updates the scale; returns whether it stepped. Any other precision: the loss as
  /// it is, and a plain step. With `lr`, the step is at that schedule's lr (ShardedOptimizer::
  /// step(lr)); without, at each group's lr as it stands (a LambdaLR's, or the groups' own).
  torch::Tensor scale_loss(const ShardedOptimizer& optimizer, const torch::Tensor& loss);
  bool optimizer_step(ShardedOptimizer& optimizer, std::optional<double> lr = std::nullopt);
  /// The optimizer's grad scaler under 16-mixed, else nullptr.
  ShardedGradScaler* grad_scaler(const ShardedOptimizer& optimizer);

  void barrier();
  /// `value` as rank `src` has it, on every rank (the seed's broadcast of any picklable object):
  /// pickled there, unpickled here by the restricted unpickler, which runs nothing. A collective.
  ckpt::pickle::ValuePtr broadcast(const ckpt::pickle::ValuePtr& value, int src = 0);
  /// The seed's all_reduce: `tensor` reduced over every rank, by default to the mean (kAvg), or
  /// kSum, kMax, kMin; returns the result, `tensor` unchanged. A collective.
  torch::Tensor all_reduce(const torch::Tensor& tensor, ReduceOp op = ReduceOp::kAvg);

  /// Saves `state` as Fabric's FSDPStrategy does: state_dict_type sharded, a DCP directory at
  /// `path` (a file there is replaced) with every value that is neither model nor optimizer in
  /// meta.pt; full, one torch.save file written by rank 0 (a sharded checkpoint there is
  /// replaced, any other directory is an error), `filter` applied. Exactly one model; any number
  /// of optimizers (each under its key: several over one model step disjoint groups). A collective.
  void save_checkpoint(const std::filesystem::path& path, const State& state, const Filter& filter = {});
  /// Loads a sharded directory or a full file (told apart as the seed does) into the model and
  /// optimizer of `state`, at any world size; a Stateful of `state` loads the saved value of its
  /// key, and every other key receives the saved value of that name. strict: the model's parameters and the requested keys must all be there, and
  /// the checkpoint may hold no other parameter of the model. Returns what was saved but not asked
  /// for (a dict). A collective.
  ckpt::pickle::ValuePtr load_checkpoint(const std::filesystem::path& path, State& state, bool strict = true);
  /// The seed's load_checkpoint(path, module): `path` holds the module's own state dict, in any
  /// format libckpt reads (torch.save(model.state_dict()), a safetensors file, a Hugging Face
  /// folder, a DCP directory); load_weights with that key and those renames.
  void load_checkpoint(const std::filesystem::path& path, ShardedModel& module, bool strict = true);
  /// Weights for `module`, nothing else (fine-tuning from pretrained weights): the tensors of
  /// `path` below `key` (empty: all of them, a module's own state dict), renamed by `renames`
  /// (s/REGEX/REPLACEMENT/[g], in order), matched with the module's FQNs; strict as
  /// load_checkpoint. Each rank reads for itself; every rank calls it.
  void load_weights(const std::filesystem::path& path, ShardedModel& module, const std::string& key = {},
                    const std::vector<std::string>& renames = {}, bool strict = true);

  const StrategyOptions& options() const noexcept { return options_; }
  ShardingStrategy sharding_strategy() const noexcept { return sharding_; }
  Precision precision() const noexcept { return precision_; }
  /// The precision plugin's forward context: autocast to bfloat16 (bf16-mixed) or float16
  /// (16-mixed) on the root device while it lives; nothing for the other precisions. Run forward
  /// and the loss inside it. After setup_environment.
  Autocast forward_context();

 private:
  void warn(const std::string& message);
  /// The newest model: prefetching and activation checkpointing set as the options say.
  ShardedModel& adopt(std::unique_ptr<ShardedModel> model);
  /// What a model the strategy wraps gets: converted to the precision and moved to the root device;
  /// the mixed precision the options give (else the precision's), and their policy.
  void prepare(torch::nn::Module& module);
  MixedPrecision mixed() const;
  WrapPolicy policy() const;

  StrategyOptions options_;
  c10::DeviceType device_type_ = c10::DeviceType::CPU;  ///< the accelerator's
  std::optional<c10::Device> root_device_;           ///< set by setup_environment
  ShardingStrategy sharding_;
  Precision precision_ = Precision::k32True;
  std::unique_ptr<ProcessGroup> owned_group_;
  ProcessGroup* group_ = nullptr;
  std::unique_ptr<DeviceMesh> mesh_;
  std::vector<std::unique_ptr<ShardedModel>> modules_;
  std::vector<std::unique_ptr<ShardedOptimizer>> optimizers_;
  std::map<const ShardedOptimizer*, std::unique_ptr<ShardedGradScaler>> scalers_;  ///< 16-mixed
  std::filesystem::path store_;  ///< the FileStore of a world of one, removed at the end
};

}  // namespace fsdp
