// SPDX-License-Identifier: Apache-2.0
// Optimizers over an FSDP model's shards (DESIGN.md "libfsdp"): each unit's flat slice is one
// parameter, and each optimizer buffer is a flat slice laid out as it is, so a rank holds only its
// part of the optimizer state (what FSDP's sharded optimizer state is). The update rules are
// PyTorch's own single-tensor ones (torch.optim.AdamW and SGD), element for element: on a slice,
// each element is updated exactly as the same element of the whole parameter would be.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/fully_sharded.hpp"

namespace fsdp {

enum class OptimizerKind { kAdamW, kSgd };
std::string_view to_string(OptimizerKind kind) noexcept;
/// "adamw" or "sgd"; throws fsdp::Error for anything else.
OptimizerKind optimizer_from_string(std::string_view name);

struct OptimizerOptions {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  ///< AdamW
  double momentum = 0.0;                          ///< SGD (no buffer when 0)
  double weight_decay = 0.01;                     ///< AdamW: decoupled; SGD: added to the gradient
};

class ShardedOptimizer {
 public:
  ShardedOptimizer(FullyShardedSequential& model, OptimizerOptions options);

  /// Clears every shard's gradient.
  void zero_grad();
  /// Scales the gradients so that their global 2-norm is at most `max_norm` (as
  /// torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6), never above 1);
  /// returns the norm before clipping. A collective (each rank holds part of the gradients).
  /// error_if_nonfinite: a NaN or infinite norm throws fsdp::Error, the gradients unchanged.
  double clip_grad_norm(double max_norm, bool error_if_nonfinite = false);
  /// One update at learning rate `lr`, every unit.
  void step(double lr);

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

 private:
  FullyShardedSequential& model_;
  OptimizerOptions options_;
  std::int64_t steps_ = 0;
  std::vector<std::map<std::string, torch::Tensor>> buffers_;  ///< per unit (empty for units without parameters)
};

}  // namespace fsdp
