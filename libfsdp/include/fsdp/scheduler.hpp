// SPDX-License-Identifier: Apache-2.0
// Learning-rate schedules over a ShardedOptimizer's param groups, kept as torch.optim.lr_scheduler
// keeps them, and the Stateful interface a checkpoint's state saves them through.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "ckpt/pickle.hpp"

namespace fsdp {

class ShardedOptimizer;

/// An object of a checkpoint's state that saves itself as a value and loads itself from one, as
/// Lightning saves any object with state_dict() and load_state_dict() (its _Stateful).
class Stateful {
 public:
  virtual ~Stateful() = default;
  virtual ckpt::pickle::ValuePtr state_dict() const = 0;
  /// Throws fsdp::Error for a value it cannot take.
  virtual void load_state_dict(const ckpt::pickle::ValuePtr& state) = 0;
};

/// torch.optim.lr_scheduler.LambdaLR with one factor for every group: in epoch e each group's lr
/// is its base lr (its initial_lr) times factor(e). Made, it takes torch's initial step (epoch 0,
/// each group's lr set); step() after each optimizer step begins the next epoch. Keep it alive
/// as long as the optimizer steps by it.
class LambdaLR final : public Stateful {
 public:
  LambdaLR(ShardedOptimizer& optimizer, std::function<double(std::int64_t epoch)> factor);

  void step();
  /// Epoch `epoch`, as if step() had been called until then: the schedule of a run resumed from a
  /// checkpoint that saved none (torch's LambdaLR made with last_epoch = epoch - 1). Sets each
  /// group's lr to its base lr times factor(epoch).
  void go_to(std::int64_t epoch);
  std::int64_t last_epoch() const noexcept { return last_epoch_; }
  /// Each group's lr as this schedule last set it (get_last_lr()).
  const std::vector<double>& get_last_lr() const noexcept { return last_lr_; }

  /// LambdaLR.state_dict(), key for key and in its order: base_lrs, last_epoch, verbose,
  /// _step_count, _get_lr_called_within_step, _last_lr, lr_lambdas (None for each group: torch
  /// saves no function).
  ckpt::pickle::ValuePtr state_dict() const override;
  /// LambdaLR.load_state_dict: last_epoch (required), and base_lrs, _step_count and _last_lr where
  /// the value holds them (one lr per group). The groups' lr are not changed: as in torch, the
  /// optimizer's own state (its param_groups) restores them.
  void load_state_dict(const ckpt::pickle::ValuePtr& state) override;

 private:
  ShardedOptimizer& optimizer_;
  std::function<double(std::int64_t)> factor_;
  std::vector<double> base_lrs_, last_lr_;
  std::int64_t last_epoch_ = -1, step_count_ = 0;
};

}  // namespace fsdp
