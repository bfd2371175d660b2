// SPDX-License-Identifier: Apache-2.0
#include "fsdp/fully_sharded.hpp"

#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/torch.h>

#include <algorithm>
#include <map>
#include <set>
#include <string_view>
#include <utility>

#include "c10d_compat.hpp"
#include "fsdp/script_module.hpp"
#include "fsdp/sharded_module.hpp"
#include "wrap_policy.hpp"

namespace fsdp {

namespace {

// The prefix of a child's parameters' FQNs: its name, except a TorchScript module's, whose FQNs
// are its own (it is the whole model).
std::string fqn_prefix(const std::string& child, const torch::nn::Module& m) {
  return dynamic_cast<const ScriptModuleImpl*>(&m) ? std::string() : child;
}

using detail::numel_of;

using detail::by_module;
bool wraps_whole(const WrapPolicy& p, const std::string& path, const torch::nn::Module& m) { return detail::accepts(p, path, m.name()); }

// Appends the module(s) forward runs for `owner`'s child `index` at `path`: the child, or, when
// it is a Chain the policy opens (WrapPolicy), its children's, recursively.
void add_leaves(const std::shared_ptr<torch::nn::SequentialImpl>& owner, std::size_t index, const std::string& path, const WrapPolicy& policy,
                std::vector<FullyShardedSequential::Leaf>& out) {
  if (auto nested = std::dynamic_pointer_cast<ChainImpl>(owner->ptr(index))) {
    const bool opens = policy.min_num_params > 0 ? numel_of(*nested) > policy.min_num_params : by_module(policy) && !wraps_whole(policy, path, *nested);
    if (opens) {
      const auto names = nested->named_children();
      for (std::size_t i = 0; i < names.size(); ++i) add_leaves(nested, i, path + "." + names[i].key(), policy, out);
      return;
    }
  }
  out.push_back({path, owner, index});
}

// FSDP's auto-wrap rules, one leaf at a time: which group (future unit) a leaf with parameters
// joins, groups numbered by their first leaf.
struct Grouper {
  const WrapPolicy& policy;
  int groups = 0;
  int root = -1;  // the group of the leaves no policy wrapped (FSDP's root)
  int open = -1;  // min_num_params: the group still taking leaves
  std::int64_t open_numel = 0;

  int assign(const std::string& path, const torch::nn::Module& m, std::int64_t numel) {
    if (policy.min_num_params > 0) {
      // Consecutive leaves share a unit until it holds min_num_params.
      if (open < 0 || open_numel >= policy.min_num_params) {
        open = groups++;
        open_numel = 0;
      }
      open_numel += numel;
      return open;
    }
    if (!by_module(policy) || wraps_whole(policy, path, m)) return groups++;
    if (root < 0) root = groups++;
    return root;
  }
  /// Whether group `g` takes no more leaves (the root's and an open group's end with the model).
  bool complete(int g) const {
    if (policy.min_num_params > 0) return g != open || open_numel >= policy.min_num_params;
    return g != root;
  }
};

}  // namespace

torch::nn::AnyModule& FullyShardedSequential::Leaf::module() const { return *(owner->begin() + static_cast<std::ptrdiff_t>(index)); }

std::string_view to_string(ShardingStrategy s) noexcept {
  switch (s) {
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard: return "NO_SHARD";
    case ShardingStrategy::kHybridShard: return "HYBRID_SHARD";
  }
  return "FULL_SHARD";
}

ShardingStrategy sharding_strategy_from_string(std::string_view name) {
  if (name == "FULL_SHARD") return ShardingStrategy::kFullShard;
  if (name == "SHARD_GRAD_OP") return ShardingStrategy::kShardGradOp;
  if (name == "NO_SHARD") return ShardingStrategy::kNoShard;
  if (name == "HYBRID_SHARD") return ShardingStrategy::kHybridShard;
  throw Error(ErrorKind::kInvalidArgument, "unknown sharding strategy '" + std::string(name) + "' (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD or HYBRID_SHARD)");
}

FlatUnit::FlatUnit(std::string prefix, torch::nn::Module& module, ProcessGroup& group, ShardingStrategy strategy, ProcessGroup* replicate)
    : FlatUnit(std::vector<std::pair<std::string, torch::nn::Module*>>{{std::move(prefix), &module}}, group, strategy, replicate) {}

namespace {
std::vector<std::pair<std::string, torch::Tensor>> named_parameters_of(const std::vector<std::pair<std::string, torch::nn::Module*>>& members) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& [prefix, module] : members) {
    for (auto& item : module->named_parameters(/*recurse=*/true)) out.emplace_back(prefix.empty() ? item.key() : prefix + "." + item.key(), item.value());
  }
  return out;
}
}  // namespace

FlatUnit::FlatUnit(const std::vector<std::pair<std::string, torch::nn::Module*>>& members, ProcessGroup& group, ShardingStrategy strategy,
                   ProcessGroup* replicate)
    : FlatUnit(named_parameters_of(members), group, strategy, replicate) {}

FlatUnit::FlatUnit(const std::vector<std::pair<std::string, torch::Tensor>>& params, ProcessGroup& group, ShardingStrategy strategy,
                   ProcessGroup* replicate)
    : group_(group), replicate_(replicate), strategy_(strategy) {
  if ((strategy == ShardingStrategy::kHybridShard) != (replicate != nullptr)) {
    throw Error("HYBRID_SHARD, and only it, takes a replicate group (a DeviceMesh)");
  }
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> flat;
  const std::string name = params.empty() ? std::string() : params.front().first;
  std::optional<c10::ScalarType> dtype;
  std::optional<c10::Device> device;
  std::map<const void*, std::size_t> seen;  // a Parameter met again under another name is an alias
  for (const auto& [fqn, p] : params) {
    if (auto it = seen.find(p.unsafeGetTensorImpl()); it != seen.end()) {
      const Param& first = params_[it->second];
      params_.push_back({fqn, p, first.shape, first.offset, first.numel, static_cast<int>(it->second)});
      continue;
    }
    seen.emplace(p.unsafeGetTensorImpl(), params_.size());
    if (!dtype) dtype = p.scalar_type();
    if (p.scalar_type() != *dtype) throw Error("unit '" + name + "' mixes parameter dtypes; flatten needs one dtype");
    if (!device) device = p.device();
    if (p.device() != *device) {
      throw Error("unit '" + name + "' has parameters on " + device->str() + " and on " + p.device().str() + "; move the model to one device first");
    }
    params_.push_back({fqn, p, p.sizes().vec(), total_, p.numel()});
    total_ += p.numel();
    flat.push_back(p.detach().reshape({-1}));
  }
  if (params_.empty()) throw Error("unit '" + name + "' has no parameters");
  const std::int64_t world = strategy_ == ShardingStrategy::kNoShard ? 1 : group_.size();
  padded_ = (total_ + world - 1) / world * world;
  compute_device_ = *device;
  torch::Tensor full = torch::zeros({padded_}, torch::TensorOptions().dtype(*dtype).device(*device));
  full.narrow(0, 0, total_).copy_(torch::cat(flat));
  group_.broadcast(full, 0);  // every rank starts from rank 0's values
  if (replicate_) replicate_->broadcast(full, 0);
  const std::int64_t n = padded_ / world;
  const std::int64_t rank = strategy_ == ShardingStrategy::kNoShard ? 0 : group_.rank();
  shard_ = full.narrow(0, rank * n, n).clone().set_requires_grad(true);
  if (strategy_ == ShardingStrategy::kNoShard) {
    gather();  // the module computes with views of the very tensor the optimizer steps
  } else {
    for (Param& p : params_) p.tensor.set_data(torch::empty({0}, shard_.options().requires_grad(false)));
  }
}

std::vector<std::shared_ptr<torch::autograd::Node>> FlatUnit::grad_accumulators() {
  torch::NoGradGuard no_grad;
  const auto compute = compute_options();
  std::vector<std::shared_ptr<torch::autograd::Node>> out;
  for (Param& p : params_) {
    if (p.alias_of >= 0) {
      out.push_back(nullptr);
      continue;
    }
    // A released parameter stands in with its full shape on one element of storage meanwhile.
    const torch::Tensor held = p.tensor.detach();
    const bool stand_in = p.tensor.sizes().vec() != p.shape || p.tensor.scalar_type() != compute.dtype();
    if (stand_in) p.tensor.set_data(torch::empty_strided(p.shape, std::vector<std::int64_t>(p.shape.size(), 0), compute));
    out.push_back(torch::autograd::impl::grad_accumulator(p.tensor));
    // Released again in the compute dtype: set_data to another dtype would drop the accumulator.
    if (stand_in) p.tensor.set_data(held.numel() == 0 ? torch::empty({0}, compute) : held);
  }
  return out;
}

// Without a param dtype or offloading, the very tensor the optimizer steps.
torch::Tensor FlatUnit::shard_in_compute_dtype() const { return shard_.detach().to(compute_device_, param_dtype_.value_or(shard_.scalar_type())); }

torch::TensorOptions FlatUnit::compute_options() const {
  return shard_.options().device(compute_device_).dtype(param_dtype_.value_or(shard_.scalar_type())).requires_grad(false);
}

void FlatUnit::offload_shard() {
  if (compute_device_.is_cpu() || shard_.device().is_cpu()) return;  // on the host already
  if (strategy_ == ShardingStrategy::kNoShard) throw Error(ErrorKind::kInvalidArgument, "cpu_offload with NO_SHARD is not supported: the module computes with the shard itself");
  torch::NoGradGuard no_grad;
  release();
  shard_ = shard_.detach().to(torch::kCPU).set_requires_grad(true);
}

void FlatUnit::set_param_dtype(std::optional<c10::ScalarType> dtype) {
  release();
  const bool was = full_.defined();  // NO_SHARD's views of the shard
  param_dtype_ = dtype && *dtype != shard_.scalar_type() ? dtype : std::nullopt;
  if (was && param_dtype_) {
    full_ = torch::Tensor();
    gather();
  }
}

void FlatUnit::prefetch() {
  if (full_.defined() || prefetched_.defined() || whole_here()) return;
  torch::NoGradGuard no_grad;
  prefetch_input_ = shard_in_compute_dtype();
  prefetched_ = torch::empty({padded_}, prefetch_input_.options().requires_grad(false));
  prefetch_ = group_.all_gather_async(prefetched_, prefetch_input_);
}

void FlatUnit::gather() {
  if (full_.defined()) return;
  torch::NoGradGuard no_grad;
  if (prefetched_.defined()) {
    prefetch_.wait();
    full_ = std::exchange(prefetched_, torch::Tensor());
    prefetch_input_ = torch::Tensor();
  } else if (whole_here()) {
    full_ = shard_in_compute_dtype();  // without a param dtype: the very tensor the optimizer steps
  } else {
    const torch::Tensor mine = shard_in_compute_dtype();
    full_ = torch::empty({padded_}, mine.options().requires_grad(false));
    group_.all_gather(full_, mine);
  }
  for (Param& p : params_) p.tensor.set_data(full_.narrow(0, p.offset, p.numel).view(p.shape));
}

void FlatUnit::release() {
  if (prefetched_.defined()) {  // gathered before a step that will change the shard: stale after it
    prefetch_.wait();
    prefetched_ = prefetch_input_ = torch::Tensor();
  }
  // NO_SHARD computes with views of the shard itself, unless they are a cast copy, which goes stale
  // when the optimizer steps.
  if ((strategy_ == ShardingStrategy::kNoShard && !param_dtype_) || !full_.defined()) return;
  // The Parameters keep their identity (autograd's saved references see the next gather) but no
  // storage of their own.
  for (Param& p : params_) p.tensor.set_data(torch::empty({0}, compute_options()));
  full_ = torch::Tensor();
}

torch::Tensor FlatUnit::take_gradients() {
  torch::NoGradGuard no_grad;
  // Every element is written once: a gradient, or zero where a parameter has none and in the padding.
  // The shard's last gradient, once nothing else holds it (the optimizer's zero_grad() let it go):
  // a new buffer of the whole unit would be new pages to fault in at every step.
  torch::Tensor grads = std::exchange(spare_grad_, torch::Tensor());
  const bool free = grads.defined() && grads.use_count() == 1 && grads.storage().use_count() == 1 && grads.device() == compute_device_;
  if (!free) grads = torch::empty({padded_}, shard_.options().device(compute_device_).requires_grad(false));
  grads.narrow(0, total_, padded_ - total_).zero_();
  for (Param& p : params_) {
    if (p.alias_of >= 0) continue;  // the Parameter met first under another name: its region is done
    torch::Tensor region = grads.narrow(0, p.offset, p.numel);
    if (p.tensor.grad().defined()) region.copy_(p.tensor.grad().reshape({-1}));
    else region.zero_();
    p.tensor.mutable_grad() = torch::Tensor();
  }
  return grads;
}

void FlatUnit::add_grad(torch::Tensor slice) {
  torch::NoGradGuard no_grad;
  // Where the shard is (the host, offloaded), in its dtype: `slice` itself when it is so already.
  slice = slice.to(shard_.device(), shard_.scalar_type());
  if (shard_.grad().defined()) shard_.mutable_grad().add_(slice);  // accumulation across backward calls
  else shard_.mutable_grad() = std::move(slice);
}

void FlatUnit::reduce_gradients(std::optional<c10::ScalarType> reduce_dtype) {
  start_reduction(reduce_dtype);
  finish_reduction();
}

void FlatUnit::start_reduction(std::optional<c10::ScalarType> reduce_dtype) {
  finish_reduction();  // one at a time: the slice it adds to is the same
  torch::Tensor grads = take_gradients();
  if (reduce_dtype) grads = grads.to(*reduce_dtype);
  if (whole_here()) {
    group_.all_reduce(grads, ReduceOp::kAvg);                        // NO_SHARD (a group of one: nothing)
    if (replicate_) replicate_->all_reduce(grads, ReduceOp::kAvg);  // HYBRID_SHARD of one rank a replica
    add_grad(std::move(grads));
    spare_grad_ = shard_.grad();  // the size of the whole unit here, and held anyway until zero_grad()
    return;
  }
  reduced_ = torch::empty({shard_.numel()}, grads.options());
  reduction_ = group_.reduce_scatter_async(reduced_, grads, ReduceOp::kAvg);
}

void FlatUnit::finish_reduction() {
  if (!reduced_.defined()) return;
  torch::Tensor mine = std::exchange(reduced_, torch::Tensor());
  reduction_.wait();
  if (replicate_) replicate_->all_reduce(mine, ReduceOp::kAvg);  // HYBRID_SHARD: across the replicas
  add_grad(std::move(mine));
}

std::vector<torch::Tensor> FlatUnit::unflatten(const torch::Tensor& slice) {
  torch::NoGradGuard no_grad;
  if (slice.numel() != shard_.numel()) throw Error("unflatten: " + std::to_string(slice.numel()) + " elements for a slice of " + std::to_string(shard_.numel()));
  torch::Tensor full = slice.detach().contiguous();
  if (strategy_ != ShardingStrategy::kNoShard) {
    full = torch::empty({padded_}, slice.options().requires_grad(false));
    group_.all_gather(full, slice.detach().contiguous());
  }
  std::vector<torch::Tensor> out;
  for (const Param& p : params_) out.push_back(full.narrow(0, p.offset, p.numel).view(p.shape).clone());
  return out;
}

std::int64_t FlatUnit::slice_begin() const noexcept { return (strategy_ == ShardingStrategy::kNoShard ? 0 : group_.rank()) * shard_.numel(); }

std::vector<FlatUnit::Range> FlatUnit::slice_ranges() const {
  const std::int64_t lo = slice_begin(), hi = lo + shard_.numel();
  std::vector<Range> out;
  for (const Param& p : params_) {
    const std::int64_t b = std::max(lo, p.offset), e = std::min(hi, p.offset + p.numel);
    out.push_back(b < e ? Range{b - p.offset, e - p.offset} : Range{});
  }
  return out;
}

void FlatUnit::put_pieces(torch::Tensor& slice, const std::vector<torch::Tensor>& pieces) const {
  torch::NoGradGuard no_grad;
  if (pieces.size() != params_.size()) throw Error("load: " + std::to_string(pieces.size()) + " pieces for " + std::to_string(params_.size()) + " parameters");
  if (slice.numel() != shard_.numel()) throw Error("load: a slice of " + std::to_string(slice.numel()) + " elements, the shard has " + std::to_string(shard_.numel()));
  const std::int64_t lo = slice_begin();
  const std::vector<Range> ranges = slice_ranges();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const Range r = ranges[i];
    if (!pieces[i].defined() || params_[i].alias_of >= 0 || r.begin == r.end) continue;
    if (pieces[i].numel() != r.end - r.begin) {
      throw Error("load: '" + params_[i].fqn + "': " + std::to_string(pieces[i].numel()) + " elements for this rank's " + std::to_string(r.end - r.begin));
    }
    slice.narrow(0, params_[i].offset + r.begin - lo, r.end - r.begin).copy_(pieces[i].reshape({-1}));
  }
}

void FlatUnit::load_pieces(const std::vector<torch::Tensor>& pieces) {
  torch::NoGradGuard no_grad;
  release();
  torch::Tensor shard = shard_.detach();
  put_pieces(shard, pieces);
  if (strategy_ == ShardingStrategy::kNoShard) {
    full_ = torch::Tensor();
    gather();
  }
}

FullyShardedSequential::FullyShardedSequential(torch::nn::Sequential model, ProcessGroup& group, ShardingStrategy strategy, MixedPrecision mixed,
                                               const WrapPolicy& policy)
    : FullyShardedSequential(std::move(model), group, group, nullptr, strategy, mixed, policy) {}

FullyShardedSequential::FullyShardedSequential(torch::nn::Sequential model, DeviceMesh& mesh, ShardingStrategy strategy, MixedPrecision mixed,
                                               const WrapPolicy& policy)
    : FullyShardedSequential(std::move(model), mesh.world(), strategy == ShardingStrategy::kHybridShard ? mesh.shard_group() : mesh.world(),
                             strategy == ShardingStrategy::kHybridShard ? &mesh.replicate_group() : nullptr, strategy, mixed, policy) {}

ShardedModel::ShardedModel(ProcessGroup& group, ProcessGroup& shard_group, ProcessGroup* replicate, ShardingStrategy strategy,
                           MixedPrecision mixed)
    : group_(group), shard_group_(shard_group), replicate_(replicate), strategy_(strategy), mixed_(mixed) {
  if (strategy == ShardingStrategy::kHybridShard && !replicate) {
    throw Error("HYBRID_SHARD needs a device mesh (replicas x shards): construct with a DeviceMesh");
  }
  if (!mixed_.reduce_dtype) mixed_.reduce_dtype = mixed_.param_dtype;  // FSDP's default
}

ShardedModel::~ShardedModel() = default;

FullyShardedSequential::FullyShardedSequential(torch::nn::Sequential model, ProcessGroup& group, ProcessGroup& shard_group,
                                               ProcessGroup* replicate, ShardingStrategy strategy, MixedPrecision mixed,
                                               const WrapPolicy& policy)
    : ShardedModel(group, shard_group, replicate, strategy, mixed), model_(std::move(model)) {
  cast_buffers(*model_);
  const auto children = model_->named_children();
  for (std::size_t i = 0; i < children.size(); ++i) add_leaves(model_.ptr(), i, children[i].key(), policy, leaves_);
  // Which group each leaf with parameters joins: groups[g] lists (FQN prefix, module) in model order.
  std::vector<std::vector<std::pair<std::string, torch::nn::Module*>>> groups;
  std::vector<int> group_of(leaves_.size(), -1);
  Grouper grouper{policy};
  for (std::size_t i = 0; i < leaves_.size(); ++i) {
    torch::nn::Module* m = leaves_[i].module().ptr().get();
    const std::int64_t numel = numel_of(*m);
    if (numel == 0) continue;
    const int g = grouper.assign(leaves_[i].path, *m, numel);
    if (static_cast<std::size_t>(g) == groups.size()) groups.emplace_back();
    groups[static_cast<std::size_t>(g)].emplace_back(fqn_prefix(leaves_[i].path, *m), m);
    group_of[i] = g;
  }
  // A Parameter that two groups share (a tied head: the embedding's weight) must live in one unit,
  // as FSDP requires: such groups merge, their leaves kept in model order.
  std::vector<int> parent(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) parent[g] = static_cast<int>(g);
  auto find = [&](int g) {
    while (parent[static_cast<std::size_t>(g)] != g) g = parent[static_cast<std::size_t>(g)];
    return g;
  };
  std::map<const void*, int> owner;
  bool merged = false;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (const auto& member : groups[g]) {
      for (const auto& p : member.second->parameters(true)) {
        auto [it, fresh] = owner.emplace(p.unsafeGetTensorImpl(), static_cast<int>(g));
        const int a = find(it->second), b = find(static_cast<int>(g));
        if (!fresh && a != b) {
          parent[static_cast<std::size_t>(std::max(a, b))] = std::min(a, b);
          merged = true;
        }
      }
    }
  }
  if (merged) {
    std::vector<std::vector<std::pair<std::string, torch::nn::Module*>>> joined;
    std::map<int, int> index;  // root group -> joined group, numbered by first leaf
    for (std::size_t i = 0; i < leaves_.size(); ++i) {
      if (group_of[i] < 0) continue;
      auto [it, fresh] = index.emplace(find(group_of[i]), static_cast<int>(joined.size()));
      if (fresh) joined.emplace_back();
      torch::nn::Module* m = leaves_[i].module().ptr().get();
      joined[static_cast<std::size_t>(it->second)].emplace_back(fqn_prefix(leaves_[i].path, *m), m);
      group_of[i] = it->second;
    }
    groups = std::move(joined);
  }
  std::vector<FlatUnit*> made;
  for (const auto& members : groups) made.push_back(&make_unit(members));
  for (std::size_t i = 0; i < leaves_.size(); ++i) leaf_unit_.push_back(group_of[i] < 0 ? nullptr : made[static_cast<std::size_t>(group_of[i])]);
  link_units();
  broadcast_buffers();
}

FullyShardedSequential::FullyShardedSequential(const std::vector<std::pair<std::string, ChildMaker>>& children, ProcessGroup& group,
                                               ShardingStrategy strategy, MixedPrecision mixed, const WrapPolicy& policy)
    : ShardedModel(group, group, nullptr, strategy, mixed) {
  // NOTE [Deferred initialization]: each child is made when the model reaches it, and a unit is
  // flattened and sharded (its full values freed) as soon as its group is complete, before the
  // next child is made: a rank holds at most the open groups' children unsharded (one unit; under
  // a policy with a root unit, the root's children too, until the end). The makers run in model
  // order, so a seeded initialization gives the values the whole model would have.
  Grouper grouper{policy};
  std::vector<std::vector<std::pair<std::string, torch::nn::Module*>>> groups;
  std::vector<FlatUnit*> made;
  std::vector<int> group_of;
  std::map<const void*, std::string> sharded;  // the parameters of units made already, and a child of theirs
  auto make = [&](std::size_t g) {
    made[g] = &make_unit(groups[g]);
    for (const auto& member : groups[g]) {
      for (const auto& p : member.second->parameters(true)) sharded.emplace(p.unsafeGetTensorImpl(), member.first);
    }
  };
  for (const auto& [name, maker] : children) {
    torch::nn::AnyModule child = maker();
    model_->push_back(name, child);
    cast_buffers(*model_->ptr(model_->size() - 1));
    const std::size_t first = leaves_.size();
    add_leaves(model_.ptr(), model_->size() - 1, name, policy, leaves_);
    for (std::size_t i = first; i < leaves_.size(); ++i) {
      const std::string& path = leaves_[i].path;
      torch::nn::Module& m = *leaves_[i].module().ptr();
      for (const auto& p : m.parameters(true)) {
        if (auto it = sharded.find(p.unsafeGetTensorImpl()); it != sharded.end()) {
          throw Error("'" + path + "' shares a parameter with '" + it->second +
                      "', whose unit is made already: deferred initialization cannot put them in one unit (make the model whole)");
        }
      }
      const std::int64_t numel = numel_of(m);
      if (numel == 0) {
        group_of.push_back(-1);
        continue;
      }
      const int g = grouper.assign(path, m, numel);
      if (static_cast<std::size_t>(g) == groups.size()) {
        groups.emplace_back();
        made.push_back(nullptr);
      }
      groups[static_cast<std::size_t>(g)].emplace_back(fqn_prefix(path, m), &m);
      group_of.push_back(g);
      if (grouper.complete(g)) make(static_cast<std::size_t>(g));
    }
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    if (!made[g]) make(g);  // the root's, and a last group short of min_num_params
  }
  // In the order of their first leaf, as the whole model's are.
  std::vector<std::unique_ptr<FlatUnit>> ordered;
  for (FlatUnit* u : made) {
    auto it = std::find_if(units_.begin(), units_.end(), [&](const auto& x) { return x.get() == u; });
    ordered.push_back(std::move(*it));
  }
  units_ = std::move(ordered);
  for (int g : group_of) leaf_unit_.push_back(g < 0 ? nullptr : made[static_cast<std::size_t>(g)]);
  link_units();
  broadcast_buffers();
}

FlatUnit& ShardedModel::make_unit(const std::vector<std::pair<std::string, torch::Tensor>>& params) {
  units_.push_back(std::make_unique<FlatUnit>(params, shard_group_, strategy_, replicate_));
  units_.back()->set_param_dtype(mixed_.param_dtype);
  return *units_.back();
}

void ShardedModel::order_units(const std::vector<FlatUnit*>& order) {
  std::vector<std::unique_ptr<FlatUnit>> ordered;
  for (FlatUnit* u : order) {
    auto it = std::find_if(units_.begin(), units_.end(), [u](const std::unique_ptr<FlatUnit>& x) { return x.get() == u; });
    if (it == units_.end() || !*it) throw Error("order_units: a unit that is not the model's, or one named twice");
    ordered.push_back(std::move(*it));
  }
  if (ordered.size() != units_.size()) throw Error("order_units: not every unit");
  units_ = std::move(ordered);
}

FlatUnit& ShardedModel::make_unit(const std::vector<std::pair<std::string, torch::nn::Module*>>& members) {
  return make_unit(named_parameters_of(members));
}

void ShardedModel::cast_buffers(torch::nn::Module& m) {
  if (!mixed_.buffer_dtype) return;
  torch::NoGradGuard no_grad;
  for (auto& b : m.buffers(true)) {
    if (b.is_floating_point()) b.set_data(b.to(*mixed_.buffer_dtype));
  }
}

void ShardedModel::broadcast_buffers() {
  torch::NoGradGuard no_grad;
  for (auto& [fqn, b] : buffers()) {
    // Gloo broadcasts no bool: its bytes go as uint8.
    torch::Tensor t = b.scalar_type() == torch::kBool ? b.to(torch::kUInt8) : b.contiguous();
    group_.broadcast(t, 0);
    if (!t.is_same(b)) b.copy_(t);
  }
}

// NOTE [Gradients reduced in backward]: as FSDP's post-backward hook, each unit's gradients are
// reduced (reduce-scattered into its shard) as soon as backward has accumulated the last of its
// parameters' gradients, and their full values freed with the unit's gathered parameters
// (FULL_SHARD), so a rank holds one unit's full gradients at a time instead of the whole model's.
// The hook sits on each parameter's gradient accumulator, kept alive here so that it outlives the
// graph of one step; it reaches this state (on the heap: the model may be moved) through a weak
// pointer, so that the accumulators it keeps do not keep it. Every rank runs the same backward,
// so the collectives come in the same order.
//
// Overlapped (set_overlap_reduction), the reduce-scatter runs on the backend's threads while
// backward goes on to the next unit (as FSDP's runs on its own stream): a unit's reduction is
// finished (waited for, its slice added to the shard's gradient) when the next unit's starts, so
// at most one is in flight with its buffers, and the last when backward ends.
struct ShardedModel::GradState {
  std::vector<FlatUnit*> units;
  std::optional<c10::ScalarType> reduce_dtype;
  bool frees = false;  // FULL_SHARD, HYBRID_SHARD: a reduced unit's gathered parameters go too
  bool syncing = false;
  std::vector<int> expected, remaining;  // per unit: parameters whose gradients backward brings
  std::vector<bool> reduced;             // per unit: reduced by this backward already
  std::int64_t reductions = 0;
  bool overlap = false;
  FlatUnit* in_flight = nullptr;  // overlapping: the unit whose reduction was started last
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators;

  void on_gradient(std::size_t u) {
    if (!syncing || reduced[u] || --remaining[u] > 0) return;
    drain();
    units[u]->start_reduction(reduce_dtype);
    if (overlap) in_flight = units[u];
    else units[u]->finish_reduction();
    reduced[u] = true;
    ++reductions;
    if (frees) units[u]->release();
  }
  void drain() {
    if (FlatUnit* u = std::exchange(in_flight, nullptr)) u->finish_reduction();
  }
};

namespace {
struct GradHook : torch::autograd::FunctionPostHook {
  GradHook(std::weak_ptr<ShardedModel::GradState> s, std::size_t u) : state(std::move(s)), unit(u) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs, const torch::autograd::variable_list&) override {
    if (auto s = state.lock()) s->on_gradient(unit);
    return outputs;
  }
  std::weak_ptr<ShardedModel::GradState> state;
  std::size_t unit;
};
}  // namespace

void ShardedModel::install_grad_hooks() {
  grads_ = std::make_shared<GradState>();
  GradState& g = *grads_;
  g.reduce_dtype = mixed_.reduce_dtype;
  g.overlap = shard_group_.backend() == Backend::kNccl;
  g.frees = strategy_ == ShardingStrategy::kFullShard || strategy_ == ShardingStrategy::kHybridShard;
  g.expected.assign(units_.size(), 0);
  g.remaining.assign(units_.size(), 0);
  g.reduced.assign(units_.size(), false);
  for (std::size_t u = 0; u < units_.size(); ++u) {
    g.units.push_back(units_[u].get());
    for (std::shared_ptr<torch::autograd::Node>& acc : units_[u]->grad_accumulators()) {
      if (!acc) continue;  // an alias accumulates once, as its first name
      acc->add_post_hook(std::make_unique<GradHook>(grads_, u));
      g.accumulators.push_back(std::move(acc));
      ++g.expected[u];
    }
  }
}

std::int64_t ShardedModel::reductions_in_backward() const noexcept { return grads_ ? grads_->reductions : 0; }
void ShardedModel::set_overlap_reduction(bool on) noexcept { grads_->overlap = on; }
bool ShardedModel::overlap_reduction() const noexcept { return grads_->overlap; }

void FullyShardedSequential::link_units() {
  install_grad_hooks();
  // Prefetch order: the nearest other unit after and before each leaf.
  next_unit_.assign(leaf_unit_.size(), nullptr);
  prev_unit_.assign(leaf_unit_.size(), nullptr);
  for (std::size_t i = 0; i < leaf_unit_.size(); ++i) {
    for (std::size_t j = i + 1; j < leaf_unit_.size() && !next_unit_[i]; ++j) {
      if (leaf_unit_[j] && leaf_unit_[j] != leaf_unit_[i]) next_unit_[i] = leaf_unit_[j];
    }
    for (std::size_t j = i; j-- > 0 && !prev_unit_[i];) {
      if (leaf_unit_[j] && leaf_unit_[j] != leaf_unit_[i]) prev_unit_[i] = leaf_unit_[j];
    }
  }
  // A unit ends at its last leaf; the unit whose last leaf runs last is the first backward needs.
  ends_unit_.assign(leaf_unit_.size(), false);
  std::vector<FlatUnit*> seen;
  for (std::size_t i = leaf_unit_.size(); i-- > 0;) {
    FlatUnit* unit = leaf_unit_[i];
    if (!unit || std::find(seen.begin(), seen.end(), unit) != seen.end()) continue;
    if (seen.empty()) final_unit_ = unit;
    seen.push_back(unit);
    ends_unit_[i] = true;
  }
}

torch::Tensor FullyShardedSequential::forward(torch::Tensor x) {
  // FSDP casts the root's floating-point input to the parameter dtype.
  if (mixed_.param_dtype && x.is_floating_point()) x = x.to(*mixed_.param_dtype);
  // A unit is gathered when its first leaf runs and, under FULL_SHARD, freed after its last; the
  // unit whose last leaf runs last is the first backward needs, so it stays gathered from forward
  // into backward, as PyTorch FSDP keeps the root's (no gather freed and redone).
  std::size_t i = 0;
  for (const Leaf& leaf : leaves_) {
    torch::nn::AnyModule& child = leaf.module();
    FlatUnit* unit = leaf_unit_[i];
    if (unit) unit->gather();
    if (forward_prefetch_ && next_unit_[i]) next_unit_[i]->prefetch();  // overlaps this child's compute
    if (checkpointed_.size() > i && checkpointed_[i] && x.requires_grad() && torch::GradMode::is_enabled()) {
      x = detail::checkpointed({x}, [c = &child](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{c->forward(in[0])}; })[0];
    } else {
      x = child.forward(x);
    }
    const bool frees = strategy_ == ShardingStrategy::kFullShard || strategy_ == ShardingStrategy::kHybridShard;
    if (ends_unit_[i] && frees && !(unit == final_unit_ && x.requires_grad())) {
      unit->release();
      // Gathered again when this unit's backward starts: the gradient of its output arrives.
      if (x.requires_grad()) {
        FlatUnit* prev = backward_prefetch_ ? prev_unit_[i] : nullptr;
        x.register_hook([unit, prev](torch::Tensor g) {
          unit->gather();
          if (prev) prev->prefetch();  // its backward comes next: gathered while this one's runs
          return g;
        });
      }
    }
    ++i;
  }
  return x;
}

void ShardedModel::backward(const torch::Tensor& loss, bool sync) {
  GradState& state = *grads_;
  state.syncing = sync && reduce_in_backward_;
  state.remaining = state.expected;
  state.reduced.assign(units_.size(), false);
  try {
    loss.backward();
    state.drain();
  } catch (...) {
    state.syncing = false;
    try {
      state.drain();  // as the reductions before it: this backward's gradients are partial anyway
    } catch (...) {  // the first error is the one to report
    }
    throw;
  }
  state.syncing = false;
  // The units whose gradients backward did not reduce (reduce_in_backward off, or a parameter
  // that got no gradient): after it, in one bucket.
  std::vector<FlatUnit*> units;
  for (std::size_t u = 0; u < units_.size(); ++u) {
    if (units_[u] && !state.reduced[u]) units.push_back(units_[u].get());
  }
  if (!sync) {
    release();
    return;
  }
  bool one_dtype = true;
  for (FlatUnit* u : units) one_dtype = one_dtype && u->shard().scalar_type() == units.front()->shard().scalar_type();
  if (units.size() > 1 && one_dtype) {
    torch::NoGradGuard no_grad;
    const std::int64_t world = strategy_ == ShardingStrategy::kNoShard ? 1 : shard_group_.size();
    std::int64_t slice_total = 0;
    for (FlatUnit* u : units) slice_total += u->shard().numel();
    // Rank r's part of the bucket holds every unit's slice r, in unit order; reduce-scattered, each
    // rank receives exactly its slices.
    const c10::ScalarType dtype = mixed_.reduce_dtype.value_or(units.front()->shard().scalar_type());
    torch::Tensor bucket = torch::empty({world * slice_total}, units.front()->shard().options().dtype(dtype).requires_grad(false));
    std::int64_t at = 0;
    for (FlatUnit* u : units) {
      const torch::Tensor g = u->take_gradients();
      const std::int64_t n = u->shard().numel();
      for (std::int64_t r = 0; r < world; ++r) bucket.narrow(0, r * slice_total + at, n).copy_(g.narrow(0, r * n, n));
      at += n;
    }
    torch::Tensor mine;
    if (strategy_ == ShardingStrategy::kNoShard || world == 1) {
      // Every rank's bucket is whole: averaged over the world (under HYBRID_SHARD with shards of
      // one rank, the replicas; a world of one, nothing).
      group_.all_reduce(bucket, ReduceOp::kAvg);
      mine = bucket;
    } else {
      mine = torch::empty({slice_total}, bucket.options());
      shard_group_.reduce_scatter(mine, bucket, ReduceOp::kAvg);
      if (replicate_) replicate_->all_reduce(mine, ReduceOp::kAvg);
    }
    at = 0;
    for (FlatUnit* u : units) {
      const std::int64_t n = u->shard().numel();
      u->add_grad(mine.narrow(0, at, n));
      at += n;
    }
  } else {
    for (FlatUnit* u : units) u->reduce_gradients(mixed_.reduce_dtype);
  }
  release();  // every unit, reduced in backward or here: the next forward gathers what the optimizer steps
}

void ShardedModel::set_prefetch(bool forward, bool backward) {
  forward_prefetch_ = forward;
  backward_prefetch_ = backward;
}

void FullyShardedSequential::set_activation_checkpointing(std::function<bool(const std::string& path)> which) {
  checkpointed_.clear();
  for (const Leaf& leaf : leaves_) checkpointed_.push_back(which && which(leaf.path));
}

void FullyShardedSequential::set_activation_checkpointing(const WrapPolicy& which) {
  checkpointed_.clear();
  for (const Leaf& leaf : leaves_) {
    const torch::nn::Module& m = *leaf.module().ptr();
    checkpointed_.push_back(which.min_num_params > 0 ? numel_of(m) >= which.min_num_params : wraps_whole(which, leaf.path, m));
  }
}

ShardedModel::Bytes ShardedModel::bytes() const {
  Bytes b;
  for (const auto& unit : units_) {
    if (!unit) continue;
    const torch::Tensor& s = unit->shard();
    b.parameters += s.numel() * static_cast<std::int64_t>(s.element_size());
    if (s.grad().defined()) b.gradients += s.grad().numel() * static_cast<std::int64_t>(s.grad().element_size());
    for (const auto& p : unit->params()) {
      if (p.alias_of < 0) b.unsharded_parameters += p.numel * static_cast<std::int64_t>(s.element_size());
    }
  }
  return b;
}

void ShardedModel::release() {
  for (auto& unit : units_) {
    if (unit) unit->release();
  }
}

std::vector<torch::Tensor> ShardedModel::parameters() {
  std::vector<torch::Tensor> out;
  for (auto& unit : units_) {
    if (unit) out.push_back(unit->shard());
  }
  return out;
}

void ShardedModel::offload_shards() {
  for (auto& unit : units_) {
    if (unit) unit->offload_shard();
  }
}

void ShardedModel::visit_full_state(const std::function<void(const std::string&, const torch::Tensor&)>& fn) {
  torch::NoGradGuard no_grad;
  for (auto& unit : units_) {
    if (!unit) continue;
    // In the shards' own precision (not a param_dtype's), as FSDP's state dict is.
    const std::vector<torch::Tensor> values = unit->unflatten(unit->shard().detach());
    for (std::size_t i = 0; i < values.size(); ++i) fn(unit->params()[i].fqn, values[i]);
  }
}

namespace {

// torch's state_dict order below `m`: its parameters, its buffers, then each child's, recursively.
void state_order(const torch::nn::Module& m, const std::string& prefix, std::map<std::string, std::size_t>& order) {
  auto name = [&](const std::string& key) { return prefix.empty() ? key : prefix + "." + key; };
  for (const auto& item : m.named_parameters(false)) order.emplace(name(item.key()), order.size());
  for (const auto& item : m.named_buffers(false)) order.emplace(name(item.key()), order.size());
  for (const auto& child : m.named_children()) state_order(*child.value(), name(child.key()), order);
}

}  // namespace

std::vector<std::pair<std::string, torch::Tensor>> ShardedModel::buffers() const {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& [prefix, m] : state_roots()) {
    for (const auto& item : m->named_buffers(true)) out.emplace_back(prefix.empty() ? item.key() : prefix + "." + item.key(), item.value());
  }
  return out;
}

std::vector<std::pair<std::string, const torch::nn::Module*>> FullyShardedSequential::state_roots() const {
  std::vector<std::pair<std::string, const torch::nn::Module*>> out;
  for (const Leaf& leaf : leaves_) {
    const torch::nn::Module& m = *leaf.module().ptr();
    out.emplace_back(fqn_prefix(leaf.path, m), &m);
  }
  return out;
}

std::vector<std::string> ShardedModel::in_model_order(std::vector<std::string> fqns) const {
  std::map<std::string, std::size_t> order;
  for (const auto& [prefix, m] : state_roots()) state_order(*m, prefix, order);
  std::stable_sort(fqns.begin(), fqns.end(), [&](const std::string& a, const std::string& b) { return order[a] < order[b]; });
  return fqns;
}

std::vector<std::pair<std::string, torch::Tensor>> ShardedModel::full_state_dict() {
  std::map<std::string, torch::Tensor> values;
  std::vector<std::string> names;
  visit_full_state([&](const std::string& fqn, const torch::Tensor& value) {
    values.emplace(fqn, value);
    names.push_back(fqn);
  });
  for (auto& [fqn, b] : buffers()) {
    values.emplace(fqn, b.detach());
    names.push_back(fqn);
  }
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const std::string& fqn : in_model_order(std::move(names))) out.emplace_back(fqn, values.at(fqn));
  return out;
}

}  // namespace fsdp
