// SPDX-License-Identifier: Apache-2.0
// Fully sharded data parallelism over any torch::nn::Module (DESIGN.md "libfsdp"): the user's
// module keeps its own forward, with any signature, and marks the submodules that are FSDP units by
// declaring them as fsdp::Sharded<BlockImpl> (the counterpart of FSDP's wrap() inside
// enable_wrap, and of FSDP2's fully_shard(submodule)):
//
//   struct NetImpl : torch::nn::Module {
//     NetImpl() : block(register_module("block", std::make_shared<fsdp::Sharded<BlockImpl>>(64))) {}
//     std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, torch::Tensor mask) {
//       return block->forward(x, mask);
//     }
//     std::shared_ptr<fsdp::Sharded<BlockImpl>> block;
//   };
//   fsdp::FullyShardedModule<NetImpl> model(std::make_shared<NetImpl>(), group, fsdp::ShardingStrategy::kFullShard);
//   auto [y, z] = model.forward(x, mask);
//
// A Sharded submodule is its Impl (the same parameters, FQNs and methods) whose forward gathers its
// unit first and, under FULL_SHARD, frees it after, hooking its outputs so that the unit is
// gathered again when their gradients arrive; a WrapPolicy chooses which Sharded submodules are
// units (by default all of them: auto-wrap by type, path or size chooses among them), and the
// root unit holds every parameter no unit holds, gathered from the start of forward to the end of
// backward, as FSDP keeps the root's. Outside a FullyShardedModule a Sharded submodule is its
// Impl and nothing more.
#pragma once

#include <torch/nn/module.h>

#include <cstddef>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/fully_sharded.hpp"

namespace fsdp {

class ShardedModule;

namespace detail {

/// Reentrant activation checkpointing of one call: runs `run(inputs)` without a graph and returns
/// its outputs as the outputs of one autograd node. Its backward restores the RNG state forward had
/// (the CPU's and each input device's generator, as torch.utils.checkpoint's preserve_rng_state, so
/// dropout draws the same mask) and its autocast state, runs `run` again on the inputs detached,
/// with grad, and backpropagates the outputs' gradients through that. Outputs that are not
/// floating point get no gradient. `run` must compute the same function both times.
using Recompute = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>& inputs)>;
std::vector<torch::Tensor> checkpointed(const std::vector<torch::Tensor>& inputs, Recompute run);

// The tensors a value holds, in order, each visited as a Tensor& (to read or replace): a Tensor,
// an optional Tensor that has one, and those of tuples, pairs and vectors of these. Any other value
// holds none.
template <class F> void each_tensor(torch::Tensor& t, F&& f);
template <class F> void each_tensor(std::optional<torch::Tensor>& t, F&& f);
template <class T, class F> void each_tensor(std::vector<T>& v, F&& f);
template <class A, class B, class F> void each_tensor(std::pair<A, B>& p, F&& f);
template <class... T, class F> void each_tensor(std::tuple<T...>& t, F&& f);
template <class T, class F> void each_tensor(T&, F&&) {}

template <class F> void each_tensor(torch::Tensor& t, F&& f) { f(t); }
template <class F> void each_tensor(std::optional<torch::Tensor>& t, F&& f) {
  if (t) f(*t);
}
template <class T, class F> void each_tensor(std::vector<T>& v, F&& f) {
  for (T& x : v) each_tensor(x, f);
}
template <class A, class B, class F> void each_tensor(std::pair<A, B>& p, F&& f) {
  each_tensor(p.first, f);
  each_tensor(p.second, f);
}
template <class... T, class F> void each_tensor(std::tuple<T...>& t, F&& f) {
  std::apply([&](auto&... x) { (each_tensor(x, f), ...); }, t);
}
template <class T> std::vector<torch::Tensor> tensors_of(T& value) {
  std::vector<torch::Tensor> out;
  each_tensor(value, [&](torch::Tensor& t) { out.push_back(t); });
  return out;
}

/// What a Sharded submodule knows of the model that shards it (set by ShardedModule).
class UnitPoint {
 public:
  virtual ~UnitPoint() = default;
  /// The wrapped module's type ("ns::BlockImpl"), which WrapPolicy::module_types names.
  virtual std::string type_name() const = 0;

 protected:
  /// At the end of the Sharded submodule's construction: under deferred initialization (a
  /// FullyShardedModule made from a factory, on this thread), its unit is made and sharded now.
  void made(torch::nn::Module& self);
  bool sharded() const noexcept { return model_ != nullptr; }
  /// Before the wrapped forward: the unit gathered (and, forward prefetch, the next one started).
  void enter();
  /// Whether this call runs under activation checkpointing.
  bool checkpointing(const std::vector<torch::Tensor>& inputs) const;
  /// After it, with the tensors of its output: FULL_SHARD frees the unit, to be gathered again
  /// when the first of their gradients arrives.
  void leave(const std::vector<torch::Tensor>& outputs);

 private:
  friend class fsdp::ShardedModule;
  ShardedModule* model_ = nullptr;
  std::size_t index_ = 0;  ///< among the model's points()
};

}  // namespace detail

/// A submodule that is an FSDP unit (or may be one: WrapPolicy) of the FullyShardedModule it is in:
/// `Impl` itself, its forward run between its unit's gather and release. Declare the member that
/// holds it with this type (`std::shared_ptr<fsdp::Sharded<BlockImpl>>`), so that its parent's
/// forward calls this forward, which takes and returns whatever Impl's does. Tensors among the
/// arguments (also in optionals, tuples, pairs and vectors) are the inputs activation
/// checkpointing keeps; tensors in the result are where backward gathers the unit again (a result
/// holding none keeps the unit gathered until backward ends).
template <class Impl>
class Sharded : public Impl, public detail::UnitPoint {
 public:
  template <class... A>
    requires std::is_constructible_v<Impl, A&&...> && (!(std::is_same_v<std::decay_t<A>, Sharded> || ...))
  explicit Sharded(A&&... args) : Impl(std::forward<A>(args)...) {
    made(*this);
  }

  std::string type_name() const override { return c10::demangle(typeid(Impl).name()); }

  template <class... Args>
  auto forward(Args&&... args) {
    using Out = std::decay_t<decltype(std::declval<Impl&>().forward(std::forward<Args>(args)...))>;
    if (!sharded()) return Out(Impl::forward(std::forward<Args>(args)...));
    enter();
    std::tuple<std::decay_t<Args>...> saved(args...);
    Out out = checkpointing(detail::tensors_of(saved)) ? checkpointed_forward<Out>(std::move(saved))
                                                       : Out(Impl::forward(std::forward<Args>(args)...));
    leave(detail::tensors_of(out));
    return out;
  }

 private:
  template <class Out, class Saved>
  Out checkpointed_forward(Saved saved) {
    auto slot = std::make_shared<std::optional<Out>>();
    // The call with `with` in place of the arguments' tensors, its result kept in `slot`.
    auto run = [this, saved, slot](const std::vector<torch::Tensor>& with) {
      Saved args = saved;
      std::size_t k = 0;
      detail::each_tensor(args, [&](torch::Tensor& t) { t = with[k++]; });
      slot->emplace(std::apply([this](auto&... a) { return Out(this->Impl::forward(a...)); }, args));
      return detail::tensors_of(**slot);
    };
    const std::vector<torch::Tensor> outputs = detail::checkpointed(detail::tensors_of(saved), std::move(run));
    Out out = std::move(**slot);
    slot->reset();
    std::size_t k = 0;
    detail::each_tensor(out, [&](torch::Tensor& t) { t = outputs[k++]; });
    return out;
  }
};

/// The non-template part of FullyShardedModule: the units found in the module, and what its
/// Sharded submodules call.
class ShardedModule : public ShardedModel {
 public:
  /// One Sharded submodule of the model.
  struct Point {
    std::string path;  ///< its FQN prefix ("model.layers.3")
    torch::nn::Module* module = nullptr;
    FlatUnit* unit = nullptr;  ///< its own unit; nullptr when the policy left it in its parent's
    bool checkpointed = false;
  };
  const std::vector<Point>& points() const noexcept { return points_; }
  /// The unit of the parameters no point's unit holds (nullptr: none).
  FlatUnit* root_unit() const noexcept { return root_unit_; }

  /// The points the policy chooses (by path, by the wrapped type's name, or holding at least
  /// min_num_params parameters) run under activation checkpointing.
  void set_activation_checkpointing(const WrapPolicy& which) override;

  ~ShardedModule() override;

 protected:
  ShardedModule(std::shared_ptr<torch::nn::Module> root, ProcessGroup& group, ProcessGroup& shard_group, ProcessGroup* replicate,
                ShardingStrategy strategy, MixedPrecision mixed, const WrapPolicy& policy);
  ShardedModule(std::shared_ptr<torch::nn::Module> root, DeviceMesh& mesh, ShardingStrategy strategy, MixedPrecision mixed,
                const WrapPolicy& policy);
  /// Deferred initialization: the root made by `make`, each Sharded submodule's unit made and
  /// sharded as soon as the submodule is (its full values freed then, before the next one is made),
  /// `prepare` (when set) applied to it first, and to the root before the root's unit.
  ShardedModule(const std::function<std::shared_ptr<torch::nn::Module>()>& make, ProcessGroup& group, ShardingStrategy strategy,
                MixedPrecision mixed, const WrapPolicy& policy, const std::function<void(torch::nn::Module&)>& prepare);
  const std::shared_ptr<torch::nn::Module>& root() const noexcept { return root_; }
  /// Around the root's forward: the root unit gathered; after it, freed unless backward follows
  /// (some output requires grad), as FSDP keeps the root's parameters from forward into backward.
  void begin_forward();
  void end_forward(bool backward_follows);
  /// A root input cast to the param dtype when it is floating point, as FSDP casts the root's.
  torch::Tensor cast_input(const torch::Tensor& t) const;

 private:
  friend class detail::UnitPoint;
  std::vector<std::pair<std::string, const torch::nn::Module*>> state_roots() const override;
  /// The units of the points and the root's, in the order of their first parameters; under
  /// deferred initialization the points' units are made already (made_).
  void make_units(const WrapPolicy& policy);
  /// Deferred initialization: a Sharded submodule made now.
  void made(torch::nn::Module& module, const std::string& type_name);
  void enter(std::size_t point);
  void leave(std::size_t point, const std::vector<torch::Tensor>& outputs);

  std::shared_ptr<torch::nn::Module> root_;
  std::vector<Point> points_;
  FlatUnit* root_unit_ = nullptr;
  std::vector<FlatUnit*> order_, last_order_;  ///< the point units as this forward ran them, and the last one
  // Deferred initialization, while the root is made: the policy, `prepare`, the units made so far
  // by submodule, and the full size of each parameter they hold.
  const WrapPolicy* deferred_policy_ = nullptr;
  const std::function<void(torch::nn::Module&)>* prepare_ = nullptr;
  std::map<const torch::nn::Module*, FlatUnit*> made_;
  std::map<const void*, std::int64_t> made_numel_;
};

/// Any module sharded: its Sharded submodules are units (as the policy chooses), the root unit
/// holds the rest. forward(args...) is the module's own; FQNs are its named_parameters().
template <class Impl>
class FullyShardedModule final : public ShardedModule {
 public:
  FullyShardedModule(std::shared_ptr<Impl> module, ProcessGroup& group, ShardingStrategy strategy, MixedPrecision mixed = {},
                     const WrapPolicy& policy = {})
      : ShardedModule(module, group, group, nullptr, strategy, mixed, policy), module_(std::move(module)) {}
  /// HYBRID_SHARD over `mesh`; any other strategy shards over the mesh's whole world.
  FullyShardedModule(std::shared_ptr<Impl> module, DeviceMesh& mesh, ShardingStrategy strategy, MixedPrecision mixed = {},
                     const WrapPolicy& policy = {})
      : ShardedModule(module, mesh, strategy, mixed, policy), module_(std::move(module)) {}
  /// FSDP's deferred initialization (a model built on the meta device and materialized unit by
  /// unit): the module made by `make`, each Sharded submodule the policy chooses (by type or size:
  /// a policy by path needs the whole model, and is refused) made into its unit and sharded as
  /// soon as it is constructed, so no rank ever holds the whole model unsharded; what no unit
  /// holds is the root's unit. Made in the same order from the same seed, the values equal the
  /// module made whole. `prepare`, when set, is applied to each such submodule before it is
  /// sharded and to the module before the root's unit (a dtype or device conversion, which must
  /// leave what it converted already as it is); without it the factory makes the module in the
  /// dtype and on the device it computes in. A Parameter shared by a unit and another module cannot
  /// be sharded this way (throws fsdp::Error). Not HYBRID_SHARD.
  FullyShardedModule(const std::function<std::shared_ptr<Impl>()>& make, ProcessGroup& group, ShardingStrategy strategy, MixedPrecision mixed = {},
                     const WrapPolicy& policy = {}, const std::function<void(torch::nn::Module&)>& prepare = {})
      : ShardedModule([&make] { return std::shared_ptr<torch::nn::Module>(make()); }, group, strategy, mixed, policy, prepare),
        module_(std::static_pointer_cast<Impl>(root())) {}

  template <class... Args>
  auto forward(Args&&... args) {
    begin_forward();
    auto out = module_->forward(cast(std::forward<Args>(args))...);
    bool backward_follows = false;
    detail::each_tensor(out, [&](torch::Tensor& t) { backward_follows = backward_follows || t.requires_grad(); });
    end_forward(backward_follows);
    return out;
  }
  Impl& module() noexcept { return *module_; }
  const std::shared_ptr<Impl>& ptr() const noexcept { return module_; }

 private:
  template <class A>
  decltype(auto) cast(A&& a) const {
    if constexpr (std::is_same_v<std::decay_t<A>, torch::Tensor>) return cast_input(a);
    else return std::forward<A>(a);
  }

  std::shared_ptr<Impl> module_;
};

}  // namespace fsdp
