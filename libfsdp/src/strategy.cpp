// SPDX-License-Identifier: Apache-2.0
#include "fsdp/strategy.hpp"

#include <dlfcn.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <iostream>
#include <set>
#include <span>

#include "ckpt/error.hpp"
#include "ckpt/io.hpp"

namespace fsdp {
namespace pk = ckpt::pickle;
namespace fs = std::filesystem;

StrategyOptions registered_strategy(std::string_view name) {
  StrategyOptions o;
  if (name == "fsdp") return o;
  if (name == "fsdp_cpu_offload") {
    o.cpu_offload = true;
    return o;
  }
  throw Error(ErrorKind::kInvalidArgument, "unknown strategy '" + std::string(name) + "' (registered: fsdp, fsdp_cpu_offload)");
}

std::vector<std::string> registered_strategies() { return {"fsdp", "fsdp_cpu_offload"}; }

bool set_num_threads(int threads) {
  torch::set_num_threads(threads);
  // OpenBLAS's setter, where the OpenBLAS LibTorch loaded exports it (another BLAS has none).
  using SetThreads = void (*)(int);
  auto* openblas = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  if (openblas) openblas(threads);
  return openblas != nullptr;
}

Strategy::Strategy(StrategyOptions options) : options_(std::move(options)) {
  const std::string& a = options_.accelerator;
  if (a == "cuda" || a == "gpu") {
    if (!torch::cuda::is_available()) {
      throw Error(ErrorKind::kUnsupported, "accelerator '" + a + "': " +
                  (nccl_available() ? std::string("no GPU is visible") : std::string("this build's LibTorch has no CUDA")) + " (use cpu)");
    }
    device_type_ = c10::DeviceType::CUDA;
  } else if (a == "auto") {
    if (torch::cuda::is_available()) device_type_ = c10::DeviceType::CUDA;
  } else if (a != "cpu") {
    throw Error(ErrorKind::kInvalidArgument, "unknown accelerator '" + a + "' (cpu, cuda, gpu or auto)");
  }
  const bool cuda = device_type_ == c10::DeviceType::CUDA;
  if (options_.process_group_backend == Backend::kNccl && !cuda) throw Error(ErrorKind::kInvalidArgument, "backend nccl moves GPU memory only; it needs accelerator cuda");
  // The seed's constructor errors, with their meaning.
  if (options_.activation_checkpointing && options_.activation_checkpointing_policy) {
    throw Error(ErrorKind::kInvalidArgument, "you cannot set both activation_checkpointing and activation_checkpointing_policy; use the latter");
  }
  if (options_.process_group && options_.device_mesh) {
    throw Error(ErrorKind::kInvalidArgument, "the options process_group and device_mesh are mutually exclusive; pass only one of them");
  }
  sharding_ = sharding_strategy_from_string(options_.sharding_strategy);
  if (sharding_ == ShardingStrategy::kHybridShard && !options_.auto_wrap_policy && !options_.process_group && !options_.device_mesh) {
    throw Error(ErrorKind::kInvalidArgument, "the hybrid sharding strategy requires at least one of the options auto_wrap_policy, process_group or device_mesh");
  }
  if (options_.device_mesh && sharding_ != ShardingStrategy::kHybridShard) {
    throw Error(ErrorKind::kInvalidArgument, "device_mesh is only valid with the HYBRID_SHARD sharding strategy, not " + options_.sharding_strategy);
  }
  if (options_.state_dict_type != "sharded" && options_.state_dict_type != "full") {
    throw Error(ErrorKind::kInvalidArgument, "unknown state_dict_type: '" + options_.state_dict_type + "' (full or sharded)");
  }
  precision_ = parse_precision(options_.precision);
  if (precision_ == Precision::k16Mixed && !cuda) {
    throw Error(ErrorKind::kInvalidArgument, "precision 16-mixed (float16 autocast with a gradient scaler) needs CUDA: accelerator cuda (use bf16-mixed)");
  }
  if (precision_ == Precision::k16True && !cuda) {
    throw Error(ErrorKind::kInvalidArgument, "precision 16-true (a float16 model) needs CUDA: accelerator cuda (LibTorch's CPU kernels have no float16 matmul; use bf16-true)");
  }
}

Strategy::~Strategy() {
  scalers_.clear();
  optimizers_.clear();
  modules_.clear();
  mesh_.reset();
  owned_group_.reset();
  if (!store_.empty()) {
    std::error_code ec;
    fs::remove(store_, ec);
  }
}

void Strategy::warn(const std::string& message) {
  if (group_ && group_->rank() != 0) return;
  if (options_.warn) options_.warn(message);
  else std::cerr << "warning: " << message << "\n";
}

void Strategy::setup_environment(const std::map<std::string, std::string>& env) {
  if (group_) throw Error("setup_environment was called twice");
  int local_rank = 0;
  if (options_.process_group) {
    group_ = options_.process_group;
    local_rank = group_->rank();
  } else {
    std::optional<Rendezvous> where = Rendezvous::from_environment(env);
    if (!where) {
      where.emplace();
      static std::atomic<int> made{0};
      store_ = fs::temp_directory_path() / ("fsdp-strategy-" + std::to_string(::getpid()) + "-" + std::to_string(made++) + ".store");
      where->file_store = store_.string();
    }
    const Backend fallback = device_type_ == c10::DeviceType::CUDA ? Backend::kNccl : Backend::kGloo;
    owned_group_ = std::make_unique<ProcessGroup>(*where, options_.process_group_backend.value_or(fallback), options_.timeout);
    group_ = owned_group_.get();
    local_rank = where->local_rank;
  }
  if (device_type_ == c10::DeviceType::CUDA) {
    // nccl chose this rank's GPU when it met the others; otherwise LOCAL_RANK's, as nccl would.
    root_device_ = group_->device().is_cuda()
                       ? group_->device()
                       : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % std::max<int>(1, static_cast<int>(torch::cuda::device_count()))));
  } else {
    root_device_ = c10::Device(c10::kCPU);
  }
  if (sharding_ == ShardingStrategy::kHybridShard) {
    // Without a mesh, PyTorch's default: shard within a machine, replicate across machines.
    std::pair<int, int> rs;
    if (options_.device_mesh) {
      rs = *options_.device_mesh;
    } else {
      int local = group_->size();
      if (auto it = env.find("LOCAL_WORLD_SIZE"); it != env.end()) local = std::max(1, std::atoi(it->second.c_str()));
      if (group_->size() % local != 0) throw Error("HYBRID_SHARD: " + std::to_string(local) + " ranks per machine do not divide the world; give device_mesh");
      rs = {group_->size() / local, local};
    }
    mesh_ = std::make_unique<DeviceMesh>(*group_, rs.first, rs.second);
  }
  if (options_.activation_checkpointing) {
    warn("activation_checkpointing is deprecated, use activation_checkpointing_policy instead (the same policy)");
  }
  if (options_.cpu_offload.offload_params && !root_device_->is_cuda()) {
    warn("cpu_offload has no effect on the CPU: parameters, gradients and optimizer state are in host memory already");
  }
}

ProcessGroup& Strategy::group() {
  if (!group_) throw Error("call setup_environment first");
  return *group_;
}
int Strategy::global_rank() { return group().rank(); }
int Strategy::world_size() { return group().size(); }
c10::Device Strategy::root_device() {
  if (!root_device_) throw Error("call setup_environment first");
  return *root_device_;
}

MixedPrecision Strategy::mixed() const { return options_.mixed_precision.value_or(mixed_precision_of(precision_)); }
WrapPolicy Strategy::policy() const { return options_.auto_wrap_policy.value_or(WrapPolicy{}); }

void Strategy::prepare(torch::nn::Module& module) {
  convert_module(module, precision_);
  if (root_device().is_cuda()) module.to(root_device());
}

FullyShardedSequential& Strategy::setup_module(torch::nn::Sequential module) {
  prepare(*module);
  std::unique_ptr<FullyShardedSequential> m = mesh_ ? std::make_unique<FullyShardedSequential>(std::move(module), *mesh_, sharding_, mixed(), policy())
                                                    : std::make_unique<FullyShardedSequential>(std::move(module), group(), sharding_, mixed(), policy());
  return static_cast<FullyShardedSequential&>(adopt(std::move(m)));
}

FullyShardedSequential& Strategy::setup_module(const std::vector<std::pair<std::string, ChildMaker>>& children) {
  if (mesh_) throw Error("deferred initialization (a model given as its children's makers) is not available under HYBRID_SHARD; make the model whole");
  std::vector<std::pair<std::string, ChildMaker>> made_there = children;
  const c10::Device d = root_device();
  for (auto& [name, make] : made_there) {
    make = [make = std::move(make), d, p = precision_] {
      torch::nn::AnyModule m = make();
      convert_module(*m.ptr(), p);
      if (d.is_cuda()) m.ptr()->to(d);
      return m;
    };
  }
  return static_cast<FullyShardedSequential&>(adopt(std::make_unique<FullyShardedSequential>(made_there, group(), sharding_, mixed(), policy())));
}

FullyShardedSequential& Strategy::setup_module(std::unique_ptr<FullyShardedSequential> wrapped) {
  if (!wrapped) throw Error("setup_module: no model");
  group();  // the environment first, as for a model the strategy wraps
  if (options_.auto_wrap_policy) {
    warn("A FSDP auto_wrap_policy is set, but the model is already wrapped. The policy will be ignored.");
    options_.auto_wrap_policy.reset();
  }
  return static_cast<FullyShardedSequential&>(adopt(std::move(wrapped)));
}

ShardedModel& Strategy::adopt(std::unique_ptr<ShardedModel> model) {
  modules_.push_back(std::move(model));
  ShardedModel& m = *modules_.back();
  if (options_.cpu_offload.offload_params && root_device().is_cuda()) m.offload_shards();  // on the CPU it has no effect (warned)
  m.set_prefetch(options_.forward_prefetch, options_.backward_prefetch);
  if (options_.overlap_reduction) m.set_overlap_reduction(*options_.overlap_reduction);
  if (const auto& which = options_.activation_checkpointing_policy ? options_.activation_checkpointing_policy : options_.activation_checkpointing) {
    m.set_activation_checkpointing(*which);
  }
  return m;
}

Autocast Strategy::forward_context() {
  const auto dtype = autocast_dtype_of(precision_);
  return Autocast(dtype.has_value(), root_device().type(), dtype.value_or(c10::ScalarType::BFloat16));
}

ShardedOptimizer& Strategy::setup_optimizer(const OptimizerOptions& options) {
  if (modules_.empty()) throw Error("set up the model (setup_module) before its optimizer");
  optimizers_.push_back(std::make_unique<ShardedOptimizer>(*modules_.back(), options));
  if (precision_ == Precision::k16Mixed) scalers_[optimizers_.back().get()] = std::make_unique<ShardedGradScaler>(*optimizers_.back());
  return *optimizers_.back();
}

void Strategy::setup_optimizer(const torch::optim::Optimizer& optimizer) {
  std::set<const void*> shards;
  for (const auto& m : modules_) {
    for (const auto& p : m->parameters()) shards.insert(p.unsafeGetTensorImpl());
  }
  for (const auto& g : optimizer.param_groups()) {
    for (const auto& p : g.params()) {
      if (shards.count(p.unsafeGetTensorImpl())) return;
    }
  }
  throw Error("the optimizer does not reference any FSDP parameters: create the optimizer after setting up the model");
}

double Strategy::clip_gradients_norm(ShardedOptimizer& optimizer, double max_norm, double norm_type, bool error_if_nonfinite) {
  // Under 16-mixed the norm is the true gradients' (Lightning unscales before clipping); a step
  // with an inf or NaN is skipped by the scaler, so its norm is no error.
  if (ShardedGradScaler* scaler = grad_scaler(optimizer); scaler && scaler->unscale()) return INFINITY;
  return optimizer.clip_grad_norm(max_norm, norm_type, error_if_nonfinite);
}

void Strategy::clip_gradients_value(ShardedOptimizer& optimizer, double clip_value) {
  if (ShardedGradScaler* scaler = grad_scaler(optimizer)) scaler->unscale();
  optimizer.clip_grad_value(clip_value);
}

pk::ValuePtr Strategy::broadcast(const pk::ValuePtr& value, int src) {
  ProcessGroup& g = group();
  if (src < 0 || src >= g.size()) throw Error(ErrorKind::kInvalidArgument, "broadcast: src " + std::to_string(src) + " is not a rank");
  const bool mine = g.rank() == src;
  if (mine && !value) throw Error(ErrorKind::kInvalidArgument, "broadcast: no value on the source rank");
  const std::vector<std::byte> bytes = mine ? pk::write(*value, 4) : std::vector<std::byte>();
  // The length first, then the bytes (as uint8: Gloo moves no bytes dtype).
  torch::Tensor n = torch::tensor({static_cast<std::int64_t>(bytes.size())}, torch::kLong).to(root_device());
  g.broadcast(n, src);
  torch::Tensor data = torch::empty({n.item<std::int64_t>()}, torch::kUInt8);
  if (mine && !bytes.empty()) std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
  data = data.to(root_device());
  g.broadcast(data, src);
  if (mine) return value;
  data = data.to(torch::kCPU);
  const auto* p = static_cast<const std::byte*>(data.data_ptr());
  try {
    return pk::parse(std::span<const std::byte>(p, static_cast<std::size_t>(data.numel())), "broadcast from rank " + std::to_string(src));
  } catch (const ckpt::Error& e) {
    throw Error("broadcast", e);
  }
}

torch::Tensor Strategy::all_reduce(const torch::Tensor& tensor, ReduceOp op) {
  torch::Tensor out = tensor.detach().clone();
  group().all_reduce(out, op);
  return out;
}

ShardedGradScaler* Strategy::grad_scaler(const ShardedOptimizer& optimizer) {
  auto it = scalers_.find(&optimizer);
  return it == scalers_.end() ? nullptr : it->second.get();
}

torch::Tensor Strategy::scale_loss(const ShardedOptimizer& optimizer, const torch::Tensor& loss) {
  ShardedGradScaler* scaler = grad_scaler(optimizer);
  return scaler ? scaler->scale(loss) : loss;
}

bool Strategy::optimizer_step(ShardedOptimizer& optimizer, std::optional<double> lr) {
  ShardedGradScaler* scaler = grad_scaler(optimizer);
  if (!scaler) {
    optimizer.step(lr);
    return true;
  }
  const bool stepped = scaler->step(lr);
  scaler->update();
  return stepped;
}

void Strategy::barrier() { group().barrier(); }

namespace {

bool is_sharded_checkpoint(const fs::path& p) { return fs::is_directory(p) && fs::is_regular_file(p / ".metadata"); }

struct Split {
  std::string model_key;
  ShardedModel* model = nullptr;
  std::vector<NamedOptimizer> optimizers;  ///< in the state's order
  std::vector<std::string> other;  ///< the keys of every other value
};

Split split(const State& state, const char* verb) {
  Split s;
  int models = 0;
  for (const auto& [key, item] : state) {
    if (auto* m = std::get_if<ShardedModel*>(&item)) {
      ++models;
      s.model_key = key;
      s.model = *m;
    } else if (auto* o = std::get_if<ShardedOptimizer*>(&item)) {
      if (std::any_of(s.optimizers.begin(), s.optimizers.end(), [&](const NamedOptimizer& n) { return n.optimizer == *o; })) {
        throw Error(std::string("the same optimizer is in the state twice (as '") + key + "'): " + verb + " each once");
      }
      s.optimizers.push_back({key, *o});
    } else {
      s.other.push_back(key);
    }
  }
  if (models == 0 || !s.model) {
    throw Error(std::string("could not find an FSDP model in the state to ") + verb +
                ": pass it as part of the state, like {\"model\", &model}, after setting it up through the strategy");
  }
  if (models > 1) {
    throw Error(std::string("found several FSDP models in the state: ") + verb +
                " one model per checkpoint (call it for each model with a different path)");
  }
  return s;
}

/// `value` without the entries `keep` refuses, when it is a dict and a filter is given.
pk::ValuePtr filtered(const pk::ValuePtr& value, const std::function<bool(const std::string&)>& keep) {
  if (!keep || !value || !value->dict_items()) return value;
  std::vector<std::pair<pk::ValuePtr, pk::ValuePtr>> items;
  for (const auto& [k, v] : *value->dict_items()) {
    if (!k->str() || keep(*k->str())) items.emplace_back(k, v);
  }
  return pk::make_dict(std::move(items));
}

}  // namespace

void Strategy::save_checkpoint(const fs::path& path, const State& state, const Filter& filter) {
  const bool sharded = options_.state_dict_type == "sharded";
  if (!filter.empty() && sharded) {
    throw Error("filtering is not supported for sharded checkpoints (FSDP cannot load a filtered sharded checkpoint), so saving one is refused");
  }
  if (fs::is_directory(path) && !sharded && !is_sharded_checkpoint(path)) {
    throw Error("the checkpoint path exists and is a directory: " + path.string());
  }
  // What the path holds may be replaced only as every tool replaces an output with --force (NOTE
  // [What --force replaces]): a sharded save a file or a DCP directory, a full save a file or
  // (as Lightning's) a sharded checkpoint. Every rank sees the same answer.
  try {
    ckpt::check_output(path, fs::is_directory(path) ? ckpt::OutputKind::kDcpDirectory : ckpt::OutputKind::kFile, ckpt::Overwrite::kYes);
  } catch (const ckpt::Error& e) {
    throw Error("cannot save the checkpoint", e);
  }
  const Split s = split(state, "save");
  SaveOptions o;
  o.model_key = s.model_key;
  o.optimizers = s.optimizers;
  std::vector<std::pair<pk::ValuePtr, pk::ValuePtr>> meta;
  for (const auto& key : s.other) {
    const auto f = filter.find(key);
    const StateItem& item = state.at(key);
    const pk::ValuePtr value = std::holds_alternative<Stateful*>(item) ? std::get<Stateful*>(item)->state_dict() : std::get<pk::ValuePtr>(item);
    meta.emplace_back(pk::make_str(key), filtered(value, f == filter.end() ? nullptr : f->second));
  }
  o.meta = pk::make_dict(std::move(meta));
  for (const NamedOptimizer& n : s.optimizers) {
    if (filter.count(n.key)) throw Error("a filter on the optimizer's state ('" + n.key + "') is not supported");
  }
  if (const auto f = filter.find(s.model_key); f != filter.end()) o.model_filter = f->second;
  ProcessGroup& g = group();
  if (sharded) {
    if (g.rank() == 0 && fs::is_regular_file(path)) fs::remove(path);
    g.barrier();
    save_sharded(path, *s.model, g, o);
  } else {
    save_full(path, *s.model, g, o);  // a sharded checkpoint there is replaced once the file is whole
  }
}

pk::ValuePtr Strategy::load_checkpoint(const fs::path& path, State& state, bool strict) {
  if (state.empty()) {
    throw Error("load_checkpoint needs a state with at least the model instance to reload, like {\"model\", &model}");
  }
  const Split s = split(state, "load");
  if (!is_sharded_checkpoint(path) && !fs::is_regular_file(path)) {
    throw Error("the path '" + path.string() +
                "' does not point to a valid checkpoint: give a directory with FSDP checkpoint shards (and .metadata), or a single "
                "file with a full checkpoint");
  }
  LoadOptions o;
  o.model_key = s.model_key;
  o.optimizers = s.optimizers;
  o.strict = strict;
  const pk::ValuePtr meta = load_sharded(path, *s.model, group(), o);
  // What was saved besides the model and the optimizer: meta.pt, or a full file's other entries.
  std::vector<std::pair<pk::ValuePtr, pk::ValuePtr>> rest;
  if (meta && meta->dict_items()) {
    for (const auto& [k, v] : *meta->dict_items()) {
      const auto is = [&](const NamedOptimizer& n) { return k->str() && *k->str() == n.key; };
      if ((k->str() && *k->str() == s.model_key) || std::any_of(s.optimizers.begin(), s.optimizers.end(), is)) continue;
      rest.emplace_back(k, v);
    }
  }
  for (const auto& key : s.other) {
    auto it = std::find_if(rest.begin(), rest.end(), [&](const auto& kv) { return kv.first->str() && *kv.first->str() == key; });
    if (it == rest.end()) {
      if (strict) {
        throw Error("the requested state contains a key '" + key + "' that does not exist in the loaded checkpoint " + path.string() +
                    " (to disable strict loading, pass strict = false)");
      }
      continue;
    }
    if (auto* stateful = std::get_if<Stateful*>(&state[key])) {
      (*stateful)->load_state_dict(it->second);
    } else {
      state[key] = it->second;
    }
    rest.erase(it);
  }
  return pk::make_dict(std::move(rest));
}

void Strategy::load_checkpoint(const fs::path& path, ShardedModel& module, bool strict) {
  load_weights(path, module, {}, {}, strict);
}

void Strategy::load_weights(const fs::path& path, ShardedModel& module, const std::string& key,
                            const std::vector<std::string>& renames, bool strict) {
  LoadOptions o;
  o.model_key = key;
  o.renames = renames;
  o.strict = strict;
  load_sharded(path, module, group(), o);
}

}  // namespace fsdp
