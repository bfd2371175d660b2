// SPDX-License-Identifier: Apache-2.0
// Optimizers over an FSDP model's shards (DESIGN.md "libfsdp"): each unit's flat slice is one
// parameter, and each optimizer buffer is a flat slice laid out as it is, so a rank holds only its
// part of the optimizer state (what FSDP's sharded optimizer state is). The update rules are
// PyTorch's own single-tensor ones (torch.optim.AdamW and SGD), element for element: on a slice,
// each element is updated exactly as the same element of the whole parameter would be.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/fully_sharded.hpp"

namespace fsdp {

enum class OptimizerKind { kAdamW, kSgd };
std::string_view to_string(OptimizerKind kind) noexcept;
/// "adamw" or "sgd"; throws fsdp::Error for anything else.
OptimizerKind optimizer_from_string(std::string_view name);

/// One of torch.optim's param_groups: parameters by FQN (a tied weight under its first name), with
/// hyperparameters of their own; an unset one is the optimizer's (OptimizerOptions).
struct ParamGroup {
  std::vector<std::string> params;
  std::optional<double> lr, weight_decay, beta1, beta2, eps, momentum;
};

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  ///< AdamW
  double momentum = 0.0;                          ///< SGD (no buffer when 0)
  double weight_decay = 0.01;                     ///< AdamW: decoupled; SGD: added to the gradient
  /// torch.optim's param_groups, in order. Empty: one group of every parameter that requires grad,
  /// in the model's order. A parameter in no group is not stepped; one that requires no grad (a
  /// frozen one) may be listed but is never stepped and has no state, as torch.optim skips a
  /// parameter without a gradient.
  std::vector<ParamGroup> groups = {};
};

/// nanoGPT's and Hugging Face's grouping: the parameters of two or more dimensions that
/// `no_decay` does not name decay at `weight_decay`, the others (biases, norm weights, and what
/// `no_decay` names) at 0; in that order, each in the model's order. Frozen parameters are in
/// neither.
std::vector<ParamGroup> decay_groups(const ShardedModel& model, double weight_decay,
                                     const std::function<bool(const std::string& fqn)>& no_decay);

class ShardedOptimizer {
 public:
  /// A group's hyperparameters as they are now (torch.optim's param_groups entry).
  struct Group {
    std::vector<std::string> params;
    double initial_lr = 0;  ///< the lr a schedule scales (LambdaLR's initial_lr)
    double lr = 0;          ///< the last step's, or what a schedule set for the next one
    double weight_decay = 0, beta1 = 0, beta2 = 0, eps = 0, momentum = 0;
  };

  /// Throws fsdp::Error for a group naming a parameter the model lacks, or one already in an
  /// earlier group.
  ShardedOptimizer(ShardedModel& model, OptimizerOptions options);

  /// Clears every shard's gradient.
  void zero_grad();
  /// Scales the gradients so that their global `norm_type`-norm (p > 0, or infinity: the largest
  /// magnitude) is at most `max_norm` (as torch.nn.utils.clip_grad_norm_ and FSDP's
  /// clip_grad_norm_: coefficient max_norm / (norm + 1e-6), never above 1); returns the norm
  /// before clipping. A collective (each rank holds part of the gradients). error_if_nonfinite: a
  /// NaN or infinite norm throws fsdp::Error, the gradients unchanged.
  double clip_grad_norm(double max_norm, double norm_type = 2.0, bool error_if_nonfinite = false);
  /// Clamps every gradient element into [-clip_value, clip_value] (torch.nn.utils.clip_grad_value_:
  /// elementwise, so each rank clamps its slice; no collective).
  void clip_grad_value(double clip_value);
  /// One update. With a schedule's learning rate `lr`, every group steps at lr scaled by its
  /// initial_lr / options().lr, as one LambdaLR scales each group's initial_lr by one factor (a
  /// group without an lr of its own steps at `lr`); without, at each group's lr as it stands
  /// (torch's optimizer.step(): the groups' own, or what a LambdaLR set).
  void step(std::optional<double> lr = std::nullopt);
  /// A schedule's learning rate for the next step, scaled into each group as step(lr) does: what
  /// torch's LRScheduler.step() leaves in group["lr"]. From then on param_groups also records each
  /// group's "initial_lr", as LambdaLR adds it.
  void set_lr(double lr) noexcept;
  /// Each group's lr for the next step, in groups() order, as an LRScheduler's step() writes
  /// group["lr"] (LambdaLR's); param_groups then records "initial_lr" as after set_lr. Throws
  /// fsdp::Error unless there is one lr per group.
  void set_lrs(const std::vector<double>& lrs);
  bool scheduled() const noexcept { return scheduled_; }
  /// The first group's lr (the schedule's learning rate when it has no lr of its own).
  double lr() const noexcept { return groups_.empty() ? options_.lr : groups_.front().lr; }
  const std::vector<Group>& groups() const noexcept { return groups_; }
  /// A loaded checkpoint's hyperparameters for group `i` (its params must stay as they are).
  void set_group(std::size_t i, const Group& g);
  /// The group `fqn` is stepped in: none for a parameter in no group or frozen, which has no state.
  std::optional<std::size_t> group_of(const std::string& fqn) const;

  const OptimizerOptions& options() const noexcept { return options_; }
  /// Updates taken (PyTorch's per-parameter "step"; the same for every parameter here).
  std::int64_t steps() const noexcept { return steps_; }
  void set_steps(std::int64_t steps) noexcept { steps_ = steps; }
  /// The names of the per-parameter buffers PyTorch keeps: exp_avg, exp_avg_sq (AdamW);
  /// momentum_buffer (SGD with momentum); none otherwise.
  std::vector<std::string> buffer_names() const;
  /// Unit `unit`'s buffer `name`: a tensor laid out as that unit's shard() (created as zeros when
  /// first asked for, so that a loaded state can be copied in).
  torch::Tensor& buffer(std::size_t unit, const std::string& name);
  /// Bytes of optimizer state this rank holds (its buffers, laid out as its shards).
  std::int64_t state_bytes() const;
  ShardedModel& model() noexcept { return model_; }

 private:
  /// A run of a unit's slice whose elements are all stepped in one group: [begin, begin + length)
  /// of shard(), of parameters next to each other in the flat buffer.
  struct Segment {
    std::size_t group = 0;
    std::int64_t begin = 0, length = 0;
  };
  /// A group's lr for a schedule's `lr`.
  double scaled(const Group& g, double lr) const noexcept { return options_.lr > 0 ? lr * g.initial_lr / options_.lr : g.initial_lr; }

  ShardedModel& model_;
  OptimizerOptions options_;
  std::int64_t steps_ = 0;
  bool scheduled_ = false;
  std::vector<Group> groups_;
  std::map<std::string, std::size_t> group_of_;              ///< stepped parameters only
  std::vector<std::vector<Segment>> segments_;                 ///< per unit
  std::vector<std::map<std::string, torch::Tensor>> buffers_;  ///< per unit (empty for units without parameters)
};

/// torch's GradScaler options (ShardedGradScaler's defaults).
struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0, backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
};

/// FSDP's ShardedGradScaler, what Lightning's 16-mixed steps through: the loss is multiplied by
/// a scale before backward so that float16 gradients do not underflow; before the step the
/// shards' gradients are divided by it, and a step whose gradients hold an inf or NaN on any rank
/// is skipped on every rank. update() then halves the scale (backoff_factor) after a skipped step
/// and doubles it (growth_factor) after growth_interval steps in a row without one, as
/// torch.amp's update does. Per step: scale(loss).backward (through the model), unscale() before
/// clipping if you clip, step(lr), update().
class ShardedGradScaler {
 public:
  /// Throws fsdp::Error for a scale or factors torch refuses.
  ShardedGradScaler(ShardedOptimizer& optimizer, GradScalerOptions options = {});

  /// `loss` times the scale.
  torch::Tensor scale(const torch::Tensor& loss) const;
  /// Divides the shards' gradients by the scale (once a step; step() does it if you did not) and
  /// finds whether any rank's hold an inf or NaN: a collective over the model's group. Returns that.
  bool unscale();
  /// The optimizer's step at `lr` (none: at each group's lr as it stands), unless an inf or NaN
  /// was found; returns whether it stepped.
  bool step(std::optional<double> lr = std::nullopt);
  /// The scale for the next step; clears this step's unscaling.
  void update();

  double get_scale() const noexcept { return scale_; }
  /// Steps in a row without an inf or NaN since the scale last changed (torch's _growth_tracker).
  std::int64_t growth_tracker() const noexcept { return growth_tracker_; }
  /// What torch's GradScaler.state_dict() holds besides the options: scale and _growth_tracker.
  void load(double scale, std::int64_t growth_tracker);
  const GradScalerOptions& options() const noexcept { return options_; }

 private:
  ShardedOptimizer& optimizer_;
  GradScalerOptions options_;
  double scale_;
  std::int64_t growth_tracker_ = 0;
  bool unscaled_ = false, found_inf_ = false;
};

}  // namespace fsdp
