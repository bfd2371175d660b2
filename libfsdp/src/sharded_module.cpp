// SPDX-License-Identifier: Apache-2.0
#include "fsdp/sharded_module.hpp"

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <set>

#include "c10d_compat.hpp"
#include "fsdp/error.hpp"
#include "wrap_policy.hpp"

namespace fsdp {

namespace detail {
namespace {

struct RngState {
  c10::Device device;
  at::Tensor state;
};

// The generators' states of the CPU and of every device an input is on.
std::vector<RngState> rng_states(const std::vector<torch::Tensor>& inputs) {
  std::vector<c10::Device> devices{c10::Device(c10::kCPU)};
  for (const torch::Tensor& t : inputs) {
    if (t.defined() && std::find(devices.begin(), devices.end(), t.device()) == devices.end()) devices.push_back(t.device());
  }
  std::vector<RngState> out;
  for (const c10::Device& d : devices) {
    at::Generator g = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(g.mutex());
    out.push_back({d, g.get_state()});
  }
  return out;
}

void set_rng_states(const std::vector<RngState>& states) {
  for (const RngState& s : states) {
    at::Generator g = at::globalContext().defaultGenerator(s.device);
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(s.state);
  }
}

// The backward of a checkpointed call (detail::checkpointed).
struct RecomputeBackward : torch::autograd::Node {
  Recompute run;
  std::vector<torch::Tensor> inputs;
  std::vector<RngState> rng;
  c10::DeviceType device = c10::DeviceType::CPU;  // where autocast applied: the first input's
  AutocastState autocast;
  std::vector<std::size_t> output_at;  // per input of this node: which output of `run` it is

  std::string name() const override { return "fsdp::RecomputeBackward"; }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    if (!run) throw Error("a checkpointed module's backward ran twice (retain_graph is not supported with activation checkpointing)");
    std::vector<torch::Tensor> detached;
    for (const torch::Tensor& t : inputs) detached.push_back(t.defined() ? t.detach().requires_grad_(t.requires_grad()) : t);
    std::vector<torch::Tensor> outputs;
    {
      const std::vector<RngState> now = rng_states(inputs);  // torch.random.fork_rng
      set_rng_states(rng);
      const AutocastState was = autocast_state(device);
      set_autocast_state(device, autocast);
      torch::AutoGradMode grad_on(true);
      try {
        outputs = run(detached);
      } catch (...) {
        set_autocast_state(device, was);
        set_rng_states(now);
        throw;
      }
      set_autocast_state(device, was);
      if (autocast.enabled) at::autocast::clear_cache();
      set_rng_states(now);
    }
    std::vector<torch::Tensor> roots, root_grads;
    for (std::size_t i = 0; i < output_at.size(); ++i) {
      const torch::Tensor& out = outputs.at(output_at[i]);
      if (grads[i].defined() && out.requires_grad()) {
        roots.push_back(out);
        root_grads.push_back(grads[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    torch::autograd::variable_list out;
    for (const torch::Tensor& t : detached) out.push_back(t.defined() && t.requires_grad() ? t.grad() : torch::Tensor());
    return out;
  }

  void release_variables() override {
    run = nullptr;
    inputs.clear();
  }
};

}  // namespace

std::vector<torch::Tensor> checkpointed(const std::vector<torch::Tensor>& inputs, Recompute run) {
  std::shared_ptr<RecomputeBackward> node(new RecomputeBackward(), torch::autograd::deleteNode);
  node->rng = rng_states(inputs);
  for (const torch::Tensor& t : inputs) {
    if (t.defined()) {
      node->device = t.device().type();
      break;
    }
  }
  node->autocast = autocast_state(node->device);
  std::vector<torch::Tensor> outputs;
  {
    torch::NoGradGuard no_grad;
    outputs = run(inputs);
  }
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    torch::Tensor& out = outputs[i];
    if (!out.defined() || !(out.is_floating_point() || out.is_complex())) continue;
    out = out.detach();  // an input returned as it is stays the caller's own tensor
    torch::autograd::create_gradient_edge(out, node);
    node->output_at.push_back(i);
  }
  node->inputs = inputs;
  node->run = std::move(run);
  return outputs;
}

void UnitPoint::enter() { model_->enter(index_); }

bool UnitPoint::checkpointing(const std::vector<torch::Tensor>& inputs) const {
  if (!model_->points_[index_].checkpointed || !torch::GradMode::is_enabled()) return false;
  return std::any_of(inputs.begin(), inputs.end(), [](const torch::Tensor& t) { return t.defined() && t.requires_grad(); });
}

void UnitPoint::leave(const std::vector<torch::Tensor>& outputs) { model_->leave(index_, outputs); }

namespace {
thread_local ShardedModule* deferred_model = nullptr;  // whose root this thread is making (deferred initialization)
}  // namespace

void UnitPoint::made(torch::nn::Module& self) {
  if (deferred_model) deferred_model->made(self, type_name());
}

}  // namespace detail

namespace {

using detail::numel_of;

// Whether the policy makes (or checkpoints) this point, by path, by the wrapped type's name, or
// by size; the default policy takes every point.
detail::UnitPoint& point_of(const ShardedModule::Point& p) { return dynamic_cast<detail::UnitPoint&>(*p.module); }

Error tied_at_construction(const std::string& path) {
  return Error("'" + path + "' shares a Parameter with another module (a weight tied across units), which deferred initialization cannot " +
               "shard as it is made: make the module first");
}

bool chosen(const WrapPolicy& policy, std::int64_t numel, const std::string& path, const std::string& type_name) {
  if (policy.min_num_params > 0) return numel >= policy.min_num_params;
  return !detail::by_module(policy) || detail::accepts(policy, path, type_name);
}
bool chosen(const WrapPolicy& policy, const ShardedModule::Point& p) { return chosen(policy, numel_of(*p.module), p.path, point_of(p).type_name()); }

}  // namespace

ShardedModule::ShardedModule(std::shared_ptr<torch::nn::Module> root, DeviceMesh& mesh, ShardingStrategy strategy, MixedPrecision mixed,
                             const WrapPolicy& policy)
    : ShardedModule(std::move(root), mesh.world(), strategy == ShardingStrategy::kHybridShard ? mesh.shard_group() : mesh.world(),
                    strategy == ShardingStrategy::kHybridShard ? &mesh.replicate_group() : nullptr, strategy, mixed, policy) {}

ShardedModule::ShardedModule(std::shared_ptr<torch::nn::Module> root, ProcessGroup& group, ProcessGroup& shard_group, ProcessGroup* replicate,
                             ShardingStrategy strategy, MixedPrecision mixed, const WrapPolicy& policy)
    : ShardedModel(group, shard_group, replicate, strategy, mixed), root_(std::move(root)) {
  make_units(policy);
}

ShardedModule::ShardedModule(const std::function<std::shared_ptr<torch::nn::Module>()>& make, ProcessGroup& group, ShardingStrategy strategy,
                             MixedPrecision mixed, const WrapPolicy& policy, const std::function<void(torch::nn::Module&)>& prepare)
    : ShardedModel(group, group, nullptr, strategy, mixed) {
  if (strategy == ShardingStrategy::kHybridShard) throw Error("deferred initialization is not supported under HYBRID_SHARD: make the module first");
  if (policy.min_num_params <= 0 && policy.own_unit) {
    throw Error("deferred initialization chooses units by type or size as each is made; a policy by path needs the whole module: make it first");
  }
  if (detail::deferred_model) throw Error("a FullyShardedModule's factory made another FullyShardedModule from a factory");
  deferred_policy_ = &policy;
  prepare_ = prepare ? &prepare : nullptr;
  detail::deferred_model = this;
  try {
    root_ = make();
  } catch (...) {
    detail::deferred_model = nullptr;
    throw;
  }
  detail::deferred_model = nullptr;
  if (!root_) throw Error("the factory of a FullyShardedModule made no module");
  if (prepare_) (*prepare_)(*root_);
  make_units(policy);
  deferred_policy_ = nullptr;
  prepare_ = nullptr;
  made_.clear();
  made_numel_.clear();
}

void ShardedModule::made(torch::nn::Module& module, const std::string& type_name) {
  // Its parameters at their full sizes, those of Sharded submodules made before it included.
  std::int64_t full = 0;
  std::vector<std::pair<std::string, torch::Tensor>> fresh;  // those no unit holds yet
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    const auto it = made_numel_.find(item.value().unsafeGetTensorImpl());
    full += it != made_numel_.end() ? it->second : item.value().numel();
    if (it == made_numel_.end()) fresh.emplace_back(item.key(), item.value());
  }
  // No path yet: a deferred policy chooses by type or size (the constructor refuses one by path).
  if (!chosen(*deferred_policy_, full, std::string(), type_name) || fresh.empty()) return;
  if (prepare_) (*prepare_)(module);  // the Parameters stay themselves (set_data): `fresh` holds them
  for (const auto& [name, t] : fresh) made_numel_.emplace(t.unsafeGetTensorImpl(), t.numel());
  made_.emplace(&module, &make_unit(fresh));  // named under the module's place once it is known
}

void ShardedModule::make_units(const WrapPolicy& policy) {
  cast_buffers(*root_);
  // The points, outermost first (named_modules' order), and which are units.
  for (const auto& item : root_->named_modules("", /*include_self=*/false)) {
    auto* point = dynamic_cast<detail::UnitPoint*>(item.value().get());
    if (!point) continue;
    if (point->model_) throw Error("'" + item.key() + "' is sharded by another model already");
    points_.push_back({item.key(), item.value().get(), nullptr, false});
  }
  // Each parameter joins the unit of the innermost point above it that is a unit, else the root's;
  // a Parameter reached from two units (a weight tied across them) joins the root's, which is
  // gathered whenever either runs.
  std::vector<int> owner_of_point(points_.size(), -1);  // point -> unit number
  std::vector<std::size_t> unit_point;                   // unit number -> point
  const bool deferred = deferred_policy_ != nullptr;  // the points' units are made already (made_)
  for (std::size_t i = 0; i < points_.size(); ++i) {
    if (deferred ? made_.count(points_[i].module) > 0 : chosen(policy, points_[i]) && numel_of(*points_[i].module) > 0) {
      owner_of_point[i] = static_cast<int>(unit_point.size());
      unit_point.push_back(i);
    }
  }
  const auto params = root_->named_parameters(/*recurse=*/true);
  std::vector<int> owner(params.size(), -1);  // -1: the root's
  std::map<const void*, int> owner_of_tensor;
  for (std::size_t k = 0; k < params.size(); ++k) {
    const std::string& fqn = params[k].key();
    std::size_t best = 0;
    for (std::size_t i = 0; i < points_.size(); ++i) {
      const std::string& path = points_[i].path;
      if (owner_of_point[i] >= 0 && path.size() >= best && fqn.size() > path.size() && fqn.compare(0, path.size(), path) == 0 &&
          fqn[path.size()] == '.') {
        best = path.size();
        owner[k] = owner_of_point[i];
      }
    }
    auto [it, fresh] = owner_of_tensor.emplace(params[k].value().unsafeGetTensorImpl(), owner[k]);
    if (!fresh && it->second != owner[k]) it->second = -1;
  }
  for (std::size_t k = 0; k < params.size(); ++k) {
    if (owner_of_tensor.at(params[k].value().unsafeGetTensorImpl()) < 0) owner[k] = -1;
  }
  // Units in the order of their first parameter, the root's among them.
  std::map<int, std::vector<std::pair<std::string, torch::Tensor>>> members;
  std::vector<int> order;
  for (std::size_t k = 0; k < params.size(); ++k) {
    auto& m = members[owner[k]];
    if (m.empty()) order.push_back(owner[k]);
    m.emplace_back(params[k].key(), params[k].value());
  }
  std::vector<FlatUnit*> units;
  for (int u : order) {
    if (u < 0) {
      root_unit_ = &make_unit(members.at(u));
      units.push_back(root_unit_);
      continue;
    }
    Point& point = points_[unit_point[static_cast<std::size_t>(u)]];
    if (deferred) {
      point.unit = made_.at(point.module);
      std::set<const void*> want, has;
      for (const auto& [fqn, t] : members.at(u)) want.insert(t.unsafeGetTensorImpl());
      for (const FlatUnit::Param& p : point.unit->params()) has.insert(p.tensor.unsafeGetTensorImpl());
      if (want != has) throw tied_at_construction(point.path);
      point.unit->name_under(point.path);
    } else {
      point.unit = &make_unit(members.at(u));
    }
    units.push_back(point.unit);
  }
  if (deferred) {
    for (const Point& p : points_) {  // a unit made whose every Parameter is shared with another module
      const auto made = made_.find(p.module);
      if (made != made_.end() && std::find(units.begin(), units.end(), made->second) == units.end()) throw tied_at_construction(p.path);
    }
    order_units(units);  // as a module made whole orders them
  }
  for (std::size_t i = 0; i < points_.size(); ++i) {
    point_of(points_[i]).model_ = this;
    point_of(points_[i]).index_ = i;
  }
  install_grad_hooks();
  broadcast_buffers();
}

ShardedModule::~ShardedModule() {
  for (const Point& p : points_) point_of(p).model_ = nullptr;
}

std::vector<std::pair<std::string, const torch::nn::Module*>> ShardedModule::state_roots() const { return {{std::string(), root_.get()}}; }

void ShardedModule::set_activation_checkpointing(const WrapPolicy& which) {
  for (Point& p : points_) p.checkpointed = chosen(which, p);
}

torch::Tensor ShardedModule::cast_input(const torch::Tensor& t) const {
  return mixed_.param_dtype && t.defined() && t.is_floating_point() ? t.to(*mixed_.param_dtype) : t;
}

void ShardedModule::begin_forward() {
  last_order_ = std::exchange(order_, {});
  if (root_unit_) root_unit_->gather();
}

void ShardedModule::end_forward(bool backward_follows) {
  const bool frees = strategy_ == ShardingStrategy::kFullShard || strategy_ == ShardingStrategy::kHybridShard;
  if (root_unit_ && frees && !backward_follows) root_unit_->release();
}

void ShardedModule::enter(std::size_t point) {
  FlatUnit* unit = points_[point].unit;
  if (!unit) return;
  unit->gather();
  order_.push_back(unit);
  // forward_prefetch: the unit that ran after this one in the last forward, if it ran in the same order so far.
  const std::size_t at = order_.size() - 1;
  if (forward_prefetch_ && at + 1 < last_order_.size() && last_order_[at] == unit) last_order_[at + 1]->prefetch();
}

void ShardedModule::leave(std::size_t point, const std::vector<torch::Tensor>& outputs) {
  FlatUnit* unit = points_[point].unit;
  const bool frees = strategy_ == ShardingStrategy::kFullShard || strategy_ == ShardingStrategy::kHybridShard;
  if (!unit || !frees) return;
  std::vector<torch::Tensor> hooked;
  for (const torch::Tensor& t : outputs) {
    if (t.defined() && t.requires_grad()) hooked.push_back(t);
  }
  // No output to hook, while parameters of the unit may still be in a graph: kept gathered until
  // backward ends.
  if (hooked.empty() && torch::GradMode::is_enabled() && outputs.empty()) return;
  unit->release();
  // Gathered again when the first gradient of an output arrives; the unit that ran before it in
  // forward is the one backward needs next (BACKWARD_PRE).
  FlatUnit* prev = nullptr;
  if (backward_prefetch_) {
    auto at = std::find(order_.rbegin(), order_.rend(), unit);
    for (; at != order_.rend() && !prev; ++at) {
      if (*at != unit) prev = *at;
    }
  }
  for (torch::Tensor& t : hooked) {
    t.register_hook([unit, prev](torch::Tensor g) {
      unit->gather();
      if (prev) prev->prefetch();
      return g;
    });
  }
}

}  // namespace fsdp
