// SPDX-License-Identifier: Apache-2.0
// Fully sharded data parallelism (DESIGN.md "libfsdp"): a model's parameters are grouped into FSDP
// units (FlatUnit). A unit's parameters are flattened into one buffer, padded to a multiple of the
// group size, and each rank keeps its slice: the leaf the optimizer steps. Before a unit runs
// forward its parameters are all-gathered into the module (the module's own Parameters are pointed
// at views of the gathered buffer); FULL_SHARD frees them after forward and gathers them again when
// the unit's backward starts (a hook on its output), SHARD_GRAD_OP keeps them until backward ends,
// NO_SHARD never shards (every rank holds everything, gradients are all-reduced, as DDP).
// backward() runs the loss's backward, during which each unit's gradients (their average over
// ranks) are reduce-scattered into its slice's grad as soon as backward has them all, and the
// unit's full gradients freed.
//
// ShardedModel is what goes by the units; here its subclass FullyShardedSequential runs a
// torch::nn::Sequential's children in turn (a wrap policy groups them into units, by default one
// each), and fsdp/sharded_module.hpp's FullyShardedModule shards any module through the
// fsdp::Sharded submodules its own forward calls.
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include <c10/core/ScalarType.h>
#include <c10/core/TensorOptions.h>

#include <functional>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/precision.hpp"
#include "fsdp/process_group.hpp"

namespace torch::autograd {
struct Node;
}

namespace fsdp {

/// HYBRID_SHARD is FULL_SHARD within each replica of a DeviceMesh, gradients then averaged
/// across the replicas.
enum class ShardingStrategy { kFullShard, kShardGradOp, kNoShard, kHybridShard };
std::string_view to_string(ShardingStrategy s) noexcept;
/// "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"; throws fsdp::Error.
ShardingStrategy sharding_strategy_from_string(std::string_view name);

/// One unit: the parameters of one module, flattened and sharded.
class FlatUnit {
 public:
  struct Param {
    std::string fqn;              ///< as the module's named_parameters() gives it, under the unit's prefix
    torch::Tensor tensor;         ///< the module's own Parameter
    std::vector<std::int64_t> shape;
    std::int64_t offset = 0, numel = 0;  ///< in the flat buffer
    /// >= 0: the same Parameter as params()[alias_of] under another name (a tied weight), which it
    /// shares the flat buffer's slot with: in the state dict under both names, stepped once.
    int alias_of = -1;
  };

  /// Flattens `module`'s parameters, sharded over `group`; rank 0's values are broadcast so that
  /// every rank starts equal. The flat buffer lives where the parameters are (one device). HYBRID_SHARD: `group` is the shard group and `replicate` the
  /// replicate group of a DeviceMesh (gradients are averaged over both).
  FlatUnit(std::string prefix, torch::nn::Module& module, ProcessGroup& group, ShardingStrategy strategy,
           ProcessGroup* replicate = nullptr);
  /// One unit over several modules, each under its prefix (a wrap policy's group).
  FlatUnit(const std::vector<std::pair<std::string, torch::nn::Module*>>& members, ProcessGroup& group, ShardingStrategy strategy,
           ProcessGroup* replicate = nullptr);
  /// One unit over these parameters, by FQN; a Parameter met again under another name is an alias.
  FlatUnit(const std::vector<std::pair<std::string, torch::Tensor>>& params, ProcessGroup& group, ShardingStrategy strategy,
           ProcessGroup* replicate = nullptr);

  /// Points the module's parameters at the full values (all-gathered unless already there), in
  /// the parameter dtype when one is set.
  void gather();
  /// FSDP's param_dtype: the full values are gathered (and computed with) in `dtype` while the
  /// shard, which the optimizer steps, keeps its own (half the all-gather bytes for bfloat16 over
  /// float32). Their gradients are cast back to the shard's dtype.
  void set_param_dtype(std::optional<c10::ScalarType> dtype);
  /// Starts gathering the full values on the backend's threads (FSDP's prefetch); gather() then
  /// waits for them. Nothing when they are there already, or with NO_SHARD.
  void prefetch();
  /// Frees the full values (not with NO_SHARD), and drops a prefetch not yet used.
  void release();
  /// FSDP's CPUOffload(offload_params=True): the shard, and so its gradient and the optimizer's
  /// state, lives in host memory; each gather copies it to the compute device (the parameters')
  /// first, and each reduced slice comes back to the host. Nothing when the compute device is the
  /// CPU. Before the optimizer is made; not with NO_SHARD (throws fsdp::Error).
  void offload_shard();
  /// Where the module computes: its parameters' device when the unit was made.
  c10::Device compute_device() const noexcept { return compute_device_; }
  /// The module's gradients, averaged over ranks, into shard().grad() (this rank's slice); the
  /// module's own gradients are cleared. start_reduction() then finish_reduction().
  void reduce_gradients(std::optional<c10::ScalarType> reduce_dtype = std::nullopt);
  /// reduce_gradients in two halves, so that computation can overlap the reduce-scatter: start
  /// takes the module's gradients (clearing them) and starts reducing them on the backend's
  /// threads; finish waits and adds this rank's slice to shard().grad(). NO_SHARD all-reduces in
  /// start. Finishing nothing pending does nothing.
  void start_reduction(std::optional<c10::ScalarType> reduce_dtype = std::nullopt);
  void finish_reduction();
  /// A reduction started and not yet waited for.
  bool reducing() const noexcept { return reduction_.pending(); }
  /// The module's gradients as one padded flat buffer (zeros where a parameter has none); the
  /// module's own gradients are cleared. reduce_gradients() is this, a collective, and add_grad.
  torch::Tensor take_gradients();
  /// Adds `slice` (laid out as shard(), any dtype: cast to the shard's) to shard().grad(), which
  /// may become `slice` itself: the caller gives it up.
  void add_grad(torch::Tensor slice);
  /// Every parameter's full value of a tensor laid out as shard() is (an optimizer moment: this
  /// rank's slice of a flat buffer), in params() order: all-gathered, then split by parameter.
  /// A collective (but not with NO_SHARD, where `slice` is the whole buffer).
  std::vector<torch::Tensor> unflatten(const torch::Tensor& slice);
  /// What this rank's slice holds of each parameter: elements [begin, end) of its flattened value
  /// (begin == end: none), params() order. A load reads only these.
  struct Range {
    std::int64_t begin = 0, end = 0;
  };
  std::vector<Range> slice_ranges() const;
  /// The flat buffer's index of this rank's slice's first element (NO_SHARD: 0): parameter i's
  /// range sits in shard() from params()[i].offset + slice_ranges()[i].begin - slice_begin().
  std::int64_t slice_begin() const noexcept;
  /// Writes `pieces[i]`, params()[i]'s elements over slice_ranges()[i] (flat, any dtype: cast),
  /// into `slice`, a tensor laid out as shard(); an undefined piece, and an alias's, leave its
  /// place as it is.
  void put_pieces(torch::Tensor& slice, const std::vector<torch::Tensor>& pieces) const;
  /// Sets this rank's slice from `pieces` (put_pieces: what no piece covers is kept), the values
  /// of any world size's checkpoint. The full values are released.
  void load_pieces(const std::vector<torch::Tensor>& pieces);

  /// Each parameter's gradient accumulator (an alias: none), made while the parameter has its full
  /// shape and compute dtype, which autograd checks every gradient against for as long as the
  /// accumulator lives; a hook on it then serves every step. Keep them alive.
  std::vector<std::shared_ptr<torch::autograd::Node>> grad_accumulators();
  /// The optimizer's parameter: this rank's slice (NO_SHARD: all of it).
  torch::Tensor& shard() noexcept { return shard_; }
  const std::vector<Param>& params() const noexcept { return params_; }
  /// Puts every parameter's FQN under `prefix` (a unit made before its module's place was known).
  void name_under(const std::string& prefix) {
    for (Param& p : params_) p.fqn = prefix + "." + p.fqn;
  }
  bool gathered() const noexcept { return full_.defined(); }
  std::int64_t padded_numel() const noexcept { return padded_; }

 private:
  /// The dtype the full values are computed in (param_dtype, else the shard's), what a released
  /// parameter keeps too: changing a parameter's dtype would drop its gradient accumulator.
  c10::TensorOptions compute_options() const;
  /// This rank's slice as the full values are computed in (the shard itself without param_dtype).
  torch::Tensor shard_in_compute_dtype() const;
  /// Whether this rank's shard holds the whole unit: NO_SHARD, or a shard group of one (where
  /// PyTorch's FSDP switches to NO_SHARD): the full values are the shard's, with no all-gather.
  bool whole_here() const noexcept { return strategy_ == ShardingStrategy::kNoShard || group_.size() == 1; }

  ProcessGroup& group_;
  ProcessGroup* replicate_;
  ShardingStrategy strategy_;
  c10::Device compute_device_{c10::kCPU};       ///< the parameters' (the shard's, unless offloaded)
  std::optional<c10::ScalarType> param_dtype_;  ///< set and not the shard's: the full values are a cast copy
  std::vector<Param> params_;
  std::int64_t total_ = 0, padded_ = 0;
  torch::Tensor shard_, full_;
  PendingCollective prefetch_;                ///< prefetch()'s all-gather
  torch::Tensor prefetched_, prefetch_input_;  ///< its output and input, alive until it is waited for
  PendingCollective reduction_;                ///< start_reduction()'s reduce-scatter
  /// whole_here(): shard().grad(), kept for take_gradients() to reuse once nothing else holds it.
  /// Not when sharded, where the buffer take_gradients() fills is the whole unit's, not the shard's.
  torch::Tensor spare_grad_;
  torch::Tensor reduced_;                      ///< its output: this rank's slice
};

/// A Sequential that can be a child of a Sequential (LibTorch's own cannot: its forward is a
/// template, which AnyModule refuses): one tensor in, each child's output the next one's input,
/// the last one's out. A wrap policy can open it (WrapPolicy).
class ChainImpl : public torch::nn::SequentialImpl {
 public:
  using SequentialImpl::SequentialImpl;
  torch::Tensor forward(torch::Tensor x) { return SequentialImpl::forward(std::move(x)); }
};
TORCH_MODULE(Chain);

/// Which modules become FSDP units (FSDP's auto_wrap_policy). The default: every child of the
/// Sequential with parameters is a unit of its own.
///
/// A policy reaches below the Sequential's children through Chains (a C++ module's forward is
/// opaque; a Chain's is known to be the chain of its children, and a Sequential subclass's may
/// not be): a child that is a Chain and that the policy does not make a unit whole is opened, its
/// children running in its place under the paths `child.0`, `child.1`, ... (or their names), and
/// so on down. Units, activation checkpointing and FQNs then go by those paths
/// (`h.3.attn.c_attn.weight`, as the module's own named_parameters() spells them). The default
/// policy opens nothing.
struct WrapPolicy {
  /// Set (or module_types): the modules it accepts, by path ("block3", "h.3"), are units of their
  /// own; the others with parameters share one unit, the root's (gathered from the first of them
  /// to run to the last).
  std::function<bool(const std::string& path)> own_unit;
  /// ModuleWrapPolicy's set of module classes, wherever they are in Chains: a module
  /// is accepted when its Module::name() ("ns::BlockImpl" for a class without a name of its own)
  /// is in the set whole, without its namespace ("BlockImpl"), or also without a trailing "Impl"
  /// ("Block", the TORCH_MODULE holder's name).
  std::set<std::string> module_types;
  /// > 0 (size_based_auto_wrap_policy, instead of the above): consecutive modules share a unit
  /// until it holds at least this many parameters; the remainder is the last unit. A Chain
  /// holding more than this many is opened.
  std::int64_t min_num_params = 0;
};

/// The units of a model and what goes by them: backward with its reductions, the shards the
/// optimizer steps, the state dict, prefetching and offloading. How a model's forward reaches its
/// units is the subclass's: FullyShardedSequential runs its children in turn, FullyShardedModule
/// (fsdp/sharded_module.hpp) lets the module's own forward run and its Sharded submodules gather
/// themselves. Checkpoints and optimizers take any ShardedModel.
class ShardedModel {
 public:
  virtual ~ShardedModel();
  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;

  /// loss.backward(), each unit's gradients reduce-scattered into its shard as soon as backward has
  /// them all (set_reduce_in_backward); what backward did not reduce goes after it in one
  /// collective (a bucket laid out rank by rank, each rank's part the units' slices in order),
  /// when the units share a dtype.
  /// With `sync` false (FSDP's no_sync, for gradient accumulation): loss.backward() alone, the
  /// gradients kept unsharded in the module until a backward with `sync` reduces their sum.
  void backward(const torch::Tensor& loss, bool sync = true);
  /// The shards: what the optimizer steps.
  std::vector<torch::Tensor> parameters();
  /// Every parameter's full value and every buffer by FQN, in the model's order (torch's
  /// state_dict order: a module's parameters, its buffers, then its children's); gathered from
  /// every rank, a collective, so every rank calls it.
  std::vector<std::pair<std::string, torch::Tensor>> full_state_dict();
  /// The modules' buffers by FQN (BatchNorm's running statistics, ...), the tensors themselves, in
  /// the model's order. FSDP leaves buffers unsharded: each rank holds its own, all equal to rank
  /// 0's when the model is made (FSDP's sync_module_states), and a state dict holds rank 0's.
  /// LibTorch has no non-persistent buffers: every one is in the state dict.
  std::vector<std::pair<std::string, torch::Tensor>> buffers() const;
  /// The same one unit at a time, in the units' order: `fn(fqn, full value)` for each parameter of
  /// a unit, whose full values are freed before the next unit is gathered (what a sharded save
  /// needs: never the whole model at once). A collective.
  void visit_full_state(const std::function<void(const std::string& fqn, const torch::Tensor& value)>& fn);
  /// `fqns` (parameters' and buffers' names) sorted in the model's order, full_state_dict()'s (a
  /// root unit holds leaves from both ends, so it is not the units' order).
  std::vector<std::string> in_model_order(std::vector<std::string> fqns) const;
  /// Bytes of parameters and gradients this rank holds between steps (its shards and their
  /// gradients), and of the whole model's parameters unsharded: that sharding is real.
  struct Bytes {
    std::int64_t parameters = 0, gradients = 0, unsharded_parameters = 0;
  };
  Bytes bytes() const;
  /// Frees every unit's full values (after a forward without backward, an evaluation, so that the
  /// next forward gathers what the optimizer has stepped since).
  void release();

  /// Activation checkpointing (reentrant, as torch.utils.checkpoint's default, the RNG state
  /// restored for the recompute as its preserve_rng_state does): the modules `which` chooses, as a
  /// WrapPolicy chooses units (by path, own_unit; by type name, module_types; or those holding at
  /// least min_num_params parameters), keep no activations from forward but their inputs, and run
  /// forward again (under the autocast state forward had) when their backward comes. A module runs
  /// checkpointed only when one of its tensor inputs requires grad (not the first, the embedding of
  /// tokens). Which modules can be chosen is the subclass's.
  virtual void set_activation_checkpointing(const WrapPolicy& which) = 0;

  /// FSDP's prefetching: `backward` (BACKWARD_PRE, on by default as FSDP's) starts gathering the
  /// unit whose backward comes next when a unit's backward starts; `forward` (forward_prefetch,
  /// off by default) the next unit's when a unit's forward starts. The all-gather then runs on the
  /// backend's threads while this one computes. The arithmetic is the same either way.
  void set_prefetch(bool forward, bool backward);
  /// FSDP's post-backward reduction (on by default): each unit's gradients reduced as soon as
  /// backward has them all, its full gradients (and, FULL_SHARD, its gathered parameters) freed
  /// then, so that a rank holds one unit's full gradients at a time. Off: every unit's gradients
  /// stay until backward ends and go in one bucket (one collective, the whole model's gradients
  /// held at once).
  void set_reduce_in_backward(bool on) noexcept { reduce_in_backward_ = on; }
  /// Whether a unit's reduce-scatter in backward runs on the backend's threads while backward goes
  /// on (NOTE [Gradients reduced in backward]) or is waited for at once. The default: on with
  /// NCCL, where the GPU computes beside it; off with Gloo, whose reduction takes the very cores
  /// backward computes on, so overlapping there slows the step (bench/train measures both).
  /// The arithmetic is the same either way.
  void set_overlap_reduction(bool on) noexcept;
  bool overlap_reduction() const noexcept;
  /// FSDP's CPU offload for every unit (FlatUnit::offload_shard): shards, gradients and optimizer
  /// state in host memory, computation on the units' device. Before the optimizer is made.
  void offload_shards();
  /// How many unit reductions backward has made so far (tests: that the hooks run).
  std::int64_t reductions_in_backward() const noexcept;

  struct GradState;  ///< NOTE [Gradients reduced in backward] in fully_sharded.cpp

  ShardingStrategy strategy() const noexcept { return strategy_; }
  /// Every rank.
  ProcessGroup& group() noexcept { return group_; }
  /// The ranks a unit is sharded over: group() except under HYBRID_SHARD (the replica's ranks).
  ProcessGroup& shard_group() noexcept { return shard_group_; }
  const ProcessGroup& shard_group() const noexcept { return shard_group_; }
  const std::vector<std::unique_ptr<FlatUnit>>& units() const noexcept { return units_; }

 protected:
  /// HYBRID_SHARD needs `replicate` (throws fsdp::Error without it).
  ShardedModel(ProcessGroup& group, ProcessGroup& shard_group, ProcessGroup* replicate, ShardingStrategy strategy, MixedPrecision mixed);
  /// Where the state dict's names come from: modules under FQN prefixes ("" for the root).
  virtual std::vector<std::pair<std::string, const torch::nn::Module*>> state_roots() const = 0;

  /// One unit over these parameters, by FQN (a Parameter met again is an alias), in the param dtype.
  FlatUnit& make_unit(const std::vector<std::pair<std::string, torch::Tensor>>& params);
  /// units() in this order (the same units).
  void order_units(const std::vector<FlatUnit*>& order);
  FlatUnit& make_unit(const std::vector<std::pair<std::string, torch::nn::Module*>>& members);
  void cast_buffers(torch::nn::Module& m);  ///< to MixedPrecision's buffer_dtype
  void broadcast_buffers();                 ///< rank 0's to every rank
  void install_grad_hooks();                ///< once the units are made

  ProcessGroup& group_;
  ProcessGroup& shard_group_;
  ProcessGroup* replicate_;
  ShardingStrategy strategy_;
  MixedPrecision mixed_;
  std::vector<std::unique_ptr<FlatUnit>> units_;
  bool forward_prefetch_ = false, backward_prefetch_ = true;
  bool reduce_in_backward_ = true;
  std::shared_ptr<GradState> grads_;
};

/// Makes one child of a model (FullyShardedSequential's deferred initialization).
using ChildMaker = std::function<torch::nn::AnyModule()>;

/// A Sequential's children run in turn, each unit gathered before its first child runs.
class FullyShardedSequential final : public ShardedModel {
 public:
  /// Sharded over every rank of `group` (HYBRID_SHARD needs the other constructor: throws fsdp::Error).
  FullyShardedSequential(torch::nn::Sequential model, ProcessGroup& group, ShardingStrategy strategy, MixedPrecision mixed = {},
                         const WrapPolicy& policy = {});
  /// FSDP's deferred initialization (Fabric's init_module(empty_init=True), a model built on the
  /// meta device and materialized unit by unit): the model as its children's makers, called in
  /// order, each unit sharded and its full values freed as soon as its children are made, so no
  /// rank ever holds the whole model unsharded. Made in order from a seeded generator, the values
  /// equal the whole model's. A child that shares a Parameter with a unit made already (a tied
  /// head) cannot join it: throws fsdp::Error. Not HYBRID_SHARD.
  FullyShardedSequential(const std::vector<std::pair<std::string, ChildMaker>>& children, ProcessGroup& group, ShardingStrategy strategy,
                         MixedPrecision mixed = {}, const WrapPolicy& policy = {});
  /// HYBRID_SHARD over `mesh` (sharded within each replica, replicated across); any other
  /// strategy shards over the mesh's whole world as the first constructor does.
  FullyShardedSequential(torch::nn::Sequential model, DeviceMesh& mesh, ShardingStrategy strategy, MixedPrecision mixed = {},
                         const WrapPolicy& policy = {});

  /// Runs the model, each unit gathered before it runs (and, FULL_SHARD, freed after).
  torch::Tensor forward(torch::Tensor input);

  /// Activation checkpointing of the modules run (leaves()) whose path `which` accepts.
  void set_activation_checkpointing(std::function<bool(const std::string& path)> which);
  /// The same, the leaves chosen as a WrapPolicy chooses units. Only modules forward runs are
  /// chosen: one inside a Chain the wrap policy left whole is run by the Chain.
  void set_activation_checkpointing(const WrapPolicy& which) override;

  /// One module forward runs in turn: a child of the model, or of a Chain the wrap policy opened
  /// (WrapPolicy).
  struct Leaf {
    std::string path;  ///< "block3"; "h.3" inside the child h
    std::shared_ptr<torch::nn::SequentialImpl> owner;
    std::size_t index = 0;  ///< in owner
    torch::nn::AnyModule& module() const;
  };
  /// The modules forward runs, in order.
  const std::vector<Leaf>& leaves() const noexcept { return leaves_; }

 private:
  FullyShardedSequential(torch::nn::Sequential model, ProcessGroup& group, ProcessGroup& shard_group, ProcessGroup* replicate,
                         ShardingStrategy strategy, MixedPrecision mixed, const WrapPolicy& policy);

  std::vector<std::pair<std::string, const torch::nn::Module*>> state_roots() const override;
  void link_units();  ///< prefetch neighbours, unit ends and the final unit, from leaf_unit_

  torch::nn::Sequential model_;
  std::vector<Leaf> leaves_;
  std::vector<bool> checkpointed_;  ///< per leaf
  std::vector<FlatUnit*> leaf_unit_;              ///< per leaf: its unit, or nullptr (no parameters)
  std::vector<bool> ends_unit_;                   ///< per leaf: the last leaf of its unit
  std::vector<FlatUnit*> next_unit_, prev_unit_;  ///< per leaf: the nearest other unit after it, before it
  FlatUnit* final_unit_ = nullptr;                ///< the unit whose last leaf runs last
};

}  // namespace fsdp
