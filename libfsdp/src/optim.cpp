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

ShardedOptimizer::ShardedOptimizer(FullyShardedSequential& model, OptimizerOptions options)
    : model_(model), options_(options), buffers_(model.units().size()) {}

void ShardedOptimizer::zero_grad() {
  for (const auto& unit : model_.units()) {
    if (unit) unit->shard().mutable_grad() = torch::Tensor();
  }
}

std::vector<std::string> ShardedOptimizer::buffer_names() const {
  if (options_.kind == OptimizerKind::kAdamW) return {"exp_avg", "exp_avg_sq"};
  if (options_.momentum != 0.0) return {"momentum_buffer"};
  return {};
}

torch::Tensor& ShardedOptimizer::buffer(std::size_t unit, const std::string& name) {
  const auto& u = model_.units().at(unit);
  if (!u) throw Error("optimizer: unit " + std::to_string(unit) + " has no parameters");
  auto& slot = buffers_[unit][name];
  if (!slot.defined()) slot = torch::zeros_like(u->shard().detach());
  return slot;
}

double ShardedOptimizer::clip_grad_norm(double max_norm, bool error_if_nonfinite) {
  torch::NoGradGuard no_grad;
  torch::Tensor sq;  // on the shards' device: one copy to the host, for the norm itself
  for (const auto& unit : model_.units()) {
    if (!unit || !unit->shard().grad().defined()) continue;
    // Squared in place in the float64 copy, where pow(2) would make a second one; the same
    // values either way.
    torch::Tensor s = unit->shard().grad().to(torch::kFloat64).square_().sum().reshape({1});
    sq = sq.defined() ? sq + s : s;
  }
  if (!sq.defined()) sq = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat64));
  // With NO_SHARD every rank holds every gradient already; otherwise each holds its slice.
  if (model_.strategy() != ShardingStrategy::kNoShard) model_.shard_group().all_reduce(sq, ReduceOp::kSum);  // replicas hold the same slices
  const double norm = std::sqrt(sq.item<double>());
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

std::int64_t ShardedOptimizer::state_bytes() const {
  std::int64_t n = 0;
  for (const auto& per_unit : buffers_) {
    for (const auto& [name, t] : per_unit) n += t.defined() ? t.numel() * static_cast<std::int64_t>(t.element_size()) : 0;
  }
  return n;
}

void ShardedOptimizer::step(double lr) {
  torch::NoGradGuard no_grad;
  ++steps_;
  lr_ = lr;
  const auto& o = options_;
  for (std::size_t i = 0; i < model_.units().size(); ++i) {
    const auto& unit = model_.units()[i];
    if (!unit || !unit->shard().grad().defined()) continue;
    torch::Tensor param = unit->shard().detach();
    torch::Tensor grad = unit->shard().grad();
    if (o.kind == OptimizerKind::kAdamW) {
      // torch.optim.AdamW, _single_tensor_adamw (amsgrad off, maximize off).
      param.mul_(1.0 - lr * o.weight_decay);
      torch::Tensor& exp_avg = buffer(i, "exp_avg");
      torch::Tensor& exp_avg_sq = buffer(i, "exp_avg_sq");
      exp_avg.lerp_(grad, 1.0 - o.beta1);
      exp_avg_sq.mul_(o.beta2).addcmul_(grad, grad, 1.0 - o.beta2);
      const double step = static_cast<double>(steps_);
      const double bias_correction1 = 1.0 - std::pow(o.beta1, step);
      const double bias_correction2 = 1.0 - std::pow(o.beta2, step);
      const double step_size = lr / bias_correction1;
      const double bias_correction2_sqrt = std::sqrt(bias_correction2);
      torch::Tensor denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(o.eps);
      param.addcdiv_(exp_avg, denom, -step_size);
    } else {
      // torch.optim.SGD, _single_tensor_sgd (dampening 0, nesterov off).
      torch::Tensor d = grad;
      if (o.weight_decay != 0.0) d = d.add(param, o.weight_decay);
      if (o.momentum != 0.0) {
        auto& slot = buffers_[i]["momentum_buffer"];
        if (!slot.defined()) slot = d.clone();
        else slot.mul_(o.momentum).add_(d);
        d = slot;
      }
      param.add_(d, -lr);
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

bool ShardedGradScaler::step(double lr) {
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
