// SPDX-License-Identifier: Apache-2.0
#include "fsdp/optim.hpp"

#include <torch/torch.h>

#include <cmath>

namespace fsdp {

std::string_view to_string(OptimizerKind kind) noexcept { return kind == OptimizerKind::kSgd ? "sgd" : "adamw"; }

OptimizerKind optimizer_from_string(std::string_view name) {
  if (name == "adamw") return OptimizerKind::kAdamW;
  if (name == "sgd") return OptimizerKind::kSgd;
  throw Error("unknown optimizer '" + std::string(name) + "' (adamw or sgd)");
}

namespace {

// The model's parameters by FQN, each once (a tied weight under its first name), in the model's order.
std::vector<const FlatUnit::Param*> model_params(const ShardedModel& model) {
  std::map<std::string, const FlatUnit::Param*> by_name;
  std::vector<std::string> names;
  for (const auto& unit : model.units()) {
    if (!unit) continue;
    for (const auto& p : unit->params()) {
      if (p.alias_of >= 0) continue;
      by_name.emplace(p.fqn, &p);
      names.push_back(p.fqn);
    }
  }
  std::vector<const FlatUnit::Param*> out;
  for (const std::string& n : model.in_model_order(std::move(names))) out.push_back(by_name.at(n));
  return out;
}

bool trainable(const FlatUnit::Param& p) { return p.tensor.requires_grad(); }

// The sum of |g|^p over a flat gradient (p infinite: the largest |g|, exact in any dtype), as a
// float64 tensor of one element. In float64, so that the clip coefficient does not depend on how
// the model is split into units (a float32 sum differs with the order of its terms, and a
// coefficient one rounding apart changes the step): a block at a time through one float64 buffer
// that stays in cache, where a float64 copy of the whole gradient would cost a pass over twice its
// bytes.
torch::Tensor power_sum(const torch::Tensor& g, double p) {
  if (std::isinf(p)) return at::linalg_vector_norm(g, p).to(torch::kFloat64).reshape({1});
  constexpr std::int64_t kBlock = std::int64_t{1} << 16;
  const std::int64_t n = g.numel();
  torch::Tensor sum = torch::zeros({1}, g.options().dtype(torch::kFloat64));
  torch::Tensor buffer = torch::empty({std::min(kBlock, n)}, sum.options());
  for (std::int64_t at = 0; at < n; at += kBlock) {
    torch::Tensor b = buffer.narrow(0, 0, std::min(kBlock, n - at)).copy_(g.narrow(0, at, std::min(kBlock, n - at)));
    sum += p == 2.0 ? at::dot(b, b) : b.abs_().pow_(p).sum();
  }
  return sum;
}

}  // namespace

std::vector<ParamGroup> decay_groups(const ShardedModel& model, double weight_decay,
                                     const std::function<bool(const std::string& fqn)>& no_decay) {
  ParamGroup decay, rest;
  decay.weight_decay = weight_decay;
  rest.weight_decay = 0.0;
  for (const FlatUnit::Param* p : model_params(model)) {
    if (!trainable(*p)) continue;
    const bool decays = p->shape.size() >= 2 && !(no_decay && no_decay(p->fqn));
    (decays ? decay : rest).params.push_back(p->fqn);
  }
  return {decay, rest};
}

ShardedOptimizer::ShardedOptimizer(ShardedModel& model, OptimizerOptions options)
    : model_(model), options_(std::move(options)), buffers_(model.units().size()) {
  const std::vector<const FlatUnit::Param*> params = model_params(model_);
  std::map<std::string, const FlatUnit::Param*> known;
  for (const FlatUnit::Param* p : params) known.emplace(p->fqn, p);
  std::vector<ParamGroup> given = options_.groups;
  if (given.empty()) {
    given.emplace_back();
    for (const FlatUnit::Param* p : params) {
      if (trainable(*p)) given.front().params.push_back(p->fqn);
    }
  }
  std::map<std::string, std::size_t> listed;
  for (std::size_t i = 0; i < given.size(); ++i) {
    const ParamGroup& g = given[i];
    const OptimizerOptions& o = options_;
    groups_.push_back({g.params, g.lr.value_or(o.lr), g.lr.value_or(o.lr), g.weight_decay.value_or(o.weight_decay),
                       g.beta1.value_or(o.beta1), g.beta2.value_or(o.beta2), g.eps.value_or(o.eps), g.momentum.value_or(o.momentum)});
    for (const std::string& fqn : g.params) {
      const auto it = known.find(fqn);
      if (it == known.end()) throw Error("optimizer: parameter group " + std::to_string(i) + " names '" + fqn + "', which is not a parameter of the model");
      if (const auto [at, fresh] = listed.emplace(fqn, i); !fresh) {
        throw Error("optimizer: '" + fqn + "' is in parameter groups " + std::to_string(at->second) + " and " + std::to_string(i) +
                    " (a parameter may be in one group only)");
      }
      if (trainable(*it->second)) group_of_.emplace(fqn, i);
    }
  }
  // Each unit's slice as runs of one group; a frozen or unlisted parameter's elements are in none.
  segments_.resize(model_.units().size());
  for (std::size_t u = 0; u < model_.units().size(); ++u) {
    const auto& unit = model_.units()[u];
    if (!unit) continue;
    const std::vector<FlatUnit::Range> ranges = unit->slice_ranges();
    for (std::size_t i = 0; i < unit->params().size(); ++i) {
      const FlatUnit::Param& p = unit->params()[i];
      const auto g = group_of(p.fqn);
      if (p.alias_of >= 0 || !g || ranges[i].begin == ranges[i].end) continue;
      const Segment s{*g, p.offset + ranges[i].begin - unit->slice_begin(), ranges[i].end - ranges[i].begin};
      std::vector<Segment>& runs = segments_[u];
      if (!runs.empty() && runs.back().group == s.group && runs.back().begin + runs.back().length == s.begin) {
        runs.back().length += s.length;
      } else {
        runs.push_back(s);
      }
    }
  }
}

std::optional<std::size_t> ShardedOptimizer::group_of(const std::string& fqn) const {
  const auto it = group_of_.find(fqn);
  if (it == group_of_.end()) return std::nullopt;
  return it->second;
}

void ShardedOptimizer::set_lr(double lr) noexcept {
  for (Group& g : groups_) g.lr = scaled(g, lr);
  scheduled_ = true;
}

void ShardedOptimizer::set_lrs(const std::vector<double>& lrs) {
  if (lrs.size() != groups_.size()) {
    throw Error("optimizer: " + std::to_string(lrs.size()) + " learning rates for " + std::to_string(groups_.size()) + " param groups");
  }
  for (std::size_t i = 0; i < lrs.size(); ++i) groups_[i].lr = lrs[i];
  scheduled_ = true;
}

void ShardedOptimizer::set_group(std::size_t i, const Group& g) {
  Group& mine = groups_.at(i);
  if (g.params != mine.params) throw Error("optimizer: group " + std::to_string(i) + " would change its parameters");
  mine = g;
}

void ShardedOptimizer::zero_grad() {
  for (const auto& unit : model_.units()) {
    if (unit) unit->shard().mutable_grad() = torch::Tensor();
  }
}

std::vector<std::string> ShardedOptimizer::buffer_names() const {
  if (options_.kind == OptimizerKind::kAdamW) return {"exp_avg", "exp_avg_sq"};
  for (const Group& g : groups_) {
    if (g.momentum != 0.0) return {"momentum_buffer"};
  }
  return {};
}

torch::Tensor& ShardedOptimizer::buffer(std::size_t unit, const std::string& name) {
  const auto& u = model_.units().at(unit);
  if (!u) throw Error("optimizer: unit " + std::to_string(unit) + " has no parameters");
  auto& slot = buffers_[unit][name];
  if (!slot.defined()) slot = torch::zeros_like(u->shard().detach());
  return slot;
}

double ShardedOptimizer::clip_grad_norm(double max_norm, double norm_type, bool error_if_nonfinite) {
  if (!(norm_type > 0)) throw Error("clip_grad_norm: norm_type " + std::to_string(norm_type) + " (a p > 0, or infinity)");
  torch::NoGradGuard no_grad;
  const bool inf = std::isinf(norm_type);
  // Each rank's part: the sum of |g|^p of its slices (the largest |g| for infinity), in float64,
  // on the shards' device: one copy to the host, for the norm itself.
  torch::Tensor part;
  for (const auto& unit : model_.units()) {
    if (!unit || !unit->shard().grad().defined()) continue;
    const torch::Tensor s = power_sum(unit->shard().grad(), norm_type);
    part = !part.defined() ? s : inf ? torch::maximum(part, s) : part + s;
  }
  if (!part.defined()) part = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat64));
  // With NO_SHARD every rank holds every gradient already; otherwise each holds its slice.
  if (model_.strategy() != ShardingStrategy::kNoShard) {
    model_.shard_group().all_reduce(part, inf ? ReduceOp::kMax : ReduceOp::kSum);  // replicas hold the same slices
  }
  const double total = part.item<double>();
  const double norm = inf ? total : norm_type == 2.0 ? std::sqrt(total) : std::pow(total, 1.0 / norm_type);
  if (error_if_nonfinite && !std::isfinite(norm)) {
    throw Error("the total norm of the gradients is " + std::to_string(norm) +
                ", so they cannot be clipped (pass error_if_nonfinite = false to scale them anyway)");
  }
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (const auto& unit : model_.units()) {
      if (unit && unit->shard().grad().defined()) unit->shard().mutable_grad().mul_(coef);
    }
  }
  return norm;
}

void ShardedOptimizer::clip_grad_value(double clip_value) {
  torch::NoGradGuard no_grad;
  for (const auto& unit : model_.units()) {
    if (unit && unit->shard().grad().defined()) unit->shard().mutable_grad().clamp_(-clip_value, clip_value);
  }
}

std::int64_t ShardedOptimizer::state_bytes() const {
  std::int64_t n = 0;
  for (const auto& per_unit : buffers_) {
    for (const auto& [name, t] : per_unit) n += t.defined() ? t.numel() * static_cast<std::int64_t>(t.element_size()) : 0;
  }
  return n;
}

void ShardedOptimizer::step(std::optional<double> schedule_lr) {
  if (schedule_lr) {
    for (Group& g : groups_) g.lr = scaled(g, *schedule_lr);
  }
  torch::NoGradGuard no_grad;
  ++steps_;
  const bool adamw = options_.kind == OptimizerKind::kAdamW;
  for (std::size_t u = 0; u < model_.units().size(); ++u) {
    const auto& unit = model_.units()[u];
    if (!unit || !unit->shard().grad().defined() || segments_[u].empty()) continue;
    // The update is elementwise, so each run of a group's elements is stepped on its own.
    const torch::Tensor whole_param = unit->shard().detach(), whole_grad = unit->shard().grad();
    const bool fresh_momentum = !adamw && !buffers_[u].count("momentum_buffer");
    for (const Segment& s : segments_[u]) {
      const Group& g = groups_[s.group];
      const double lr = g.lr;
      torch::Tensor param = whole_param.narrow(0, s.begin, s.length), grad = whole_grad.narrow(0, s.begin, s.length);
      if (adamw) {
        // torch.optim.AdamW, _single_tensor_adamw (amsgrad off, maximize off).
        param.mul_(1.0 - lr * g.weight_decay);
        torch::Tensor exp_avg = buffer(u, "exp_avg").narrow(0, s.begin, s.length);
        torch::Tensor exp_avg_sq = buffer(u, "exp_avg_sq").narrow(0, s.begin, s.length);
        exp_avg.lerp_(grad, 1.0 - g.beta1);
        exp_avg_sq.mul_(g.beta2).addcmul_(grad, grad, 1.0 - g.beta2);
        const double step = static_cast<double>(steps_);
        const double bias_correction1 = 1.0 - std::pow(g.beta1, step);
        const double bias_correction2 = 1.0 - std::pow(g.beta2, step);
        const double step_size = lr / bias_correction1;
        const double bias_correction2_sqrt = std::sqrt(bias_correction2);
        torch::Tensor denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(g.eps);
        param.addcdiv_(exp_avg, denom, -step_size);
      } else {
        // torch.optim.SGD, _single_tensor_sgd (dampening 0, nesterov off).
        torch::Tensor d = grad;
        if (g.weight_decay != 0.0) d = d.add(param, g.weight_decay);
        if (g.momentum != 0.0) {
          torch::Tensor buf = buffer(u, "momentum_buffer").narrow(0, s.begin, s.length);
          if (fresh_momentum) buf.copy_(d);  // the first step's buffer is the gradient itself
          else buf.mul_(g.momentum).add_(d);
          d = buf;
        }
        param.add_(d, -lr);
      }
    }
  }
}

ShardedGradScaler::ShardedGradScaler(ShardedOptimizer& optimizer, GradScalerOptions options)
    : optimizer_(optimizer), options_(options), scale_(options.init_scale) {
  if (!(options_.init_scale > 0) || !std::isfinite(options_.init_scale)) throw Error("grad scaler: init_scale must be a positive finite number");
  if (!(options_.growth_factor > 1.0)) throw Error("grad scaler: growth_factor must be above 1");
  if (!(options_.backoff_factor > 0.0 && options_.backoff_factor < 1.0)) throw Error("grad scaler: backoff_factor must be between 0 and 1");
  if (options_.growth_interval < 1) throw Error("grad scaler: growth_interval must be at least 1");
}

torch::Tensor ShardedGradScaler::scale(const torch::Tensor& loss) const { return loss * scale_; }

bool ShardedGradScaler::unscale() {
  if (unscaled_) return found_inf_;
  torch::NoGradGuard no_grad;
  const double inv = 1.0 / scale_;
  torch::Tensor bad;  // on the shards' device: one copy to the host, after the collective
  for (const auto& unit : optimizer_.model().units()) {
    if (!unit || !unit->shard().grad().defined()) continue;
    torch::Tensor& g = unit->shard().mutable_grad();
    torch::Tensor here = g.isfinite().logical_not().any().to(torch::kFloat).reshape({1});
    bad = bad.defined() ? torch::maximum(bad, here) : here;
    g.mul_(inv);  // as torch's _amp_foreach_non_finite_check_and_unscale_: unscaled either way
  }
  if (!bad.defined()) bad = torch::zeros({1}, torch::kFloat);
  // Every rank must agree: a rank whose slice is finite skips the step too (ShardedGradScaler).
  optimizer_.model().group().all_reduce(bad, ReduceOp::kMax);
  found_inf_ = bad.item<float>() != 0.0f;
  unscaled_ = true;
  return found_inf_;
}

bool ShardedGradScaler::step(std::optional<double> lr) {
  if (unscale()) return false;
  optimizer_.step(lr);
  return true;
}

void ShardedGradScaler::update() {
  if (!unscaled_) throw Error("grad scaler: update() before this step's unscale() or step()");
  if (found_inf_) {
    scale_ *= options_.backoff_factor;
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval) {
    const double grown = scale_ * options_.growth_factor;
    if (std::isfinite(grown)) scale_ = grown;  // torch keeps a scale that would overflow
    growth_tracker_ = 0;
  }
  unscaled_ = found_inf_ = false;
}

void ShardedGradScaler::load(double scale, std::int64_t growth_tracker) {
  if (!(scale > 0) || !std::isfinite(scale)) throw Error("grad scaler: a saved scale of " + std::to_string(scale));
  scale_ = scale;
  growth_tracker_ = growth_tracker;
  unscaled_ = found_inf_ = false;
}

}  // namespace fsdp
