// SPDX-License-Identifier: Apache-2.0
// fsdp-train's configuration: the options struct (the single source of defaults) and its command
// line. No LibTorch here.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <vector>

namespace fsdp_train {

/// --auto-wrap auto: units of at least this many parameters, the default min_num_params of
/// PyTorch's size_based_auto_wrap_policy (1e8). A smaller model is one unit, as Lightning's
/// FSDPStrategy makes it without a policy: per step one all-gather and one reduce-scatter, where
/// a unit per block pays a gather, a re-gather and a reduction each (bench/train compares the two
/// at the default GPT).
inline constexpr std::int64_t kAutoWrapParams = 100'000'000;

struct TrainConfig {
  // model
  std::string model = "gpt";  ///< gpt, llama or mlp; "script" once validate() has seen --model-script
  std::string model_script;   ///< a torch.jit.save file: the model, its parameters under their own FQNs
  int n_layer = 2, n_head = 4, n_embd = 64, block_size = 64, vocab_size = 256;
  bool tie_weights = false;  ///< gpt, llama: the head's weight is the token embedding's
  // llama (ModelShape's)
  int n_kv_head = 0;             ///< 0: --n-head
  std::int64_t ffn_hidden = 0;   ///< 0: Llama's rule
  double rope_theta = 10000, norm_eps = 1e-5;
  // data
  std::string data = "synthetic";
  double val_fraction = 0.1;
  // training
  std::int64_t steps = 100;
  int batch_size = 8;  ///< per rank, per micro-batch
  int accumulate = 1;
  double lr = 1e-3, min_lr = -1;  ///< min_lr < 0: lr / 10
  std::int64_t warmup = 10;
  std::string optimizer = "adamw";
  double weight_decay = 0.01, momentum = 0.0, beta1 = 0.9, beta2 = 0.95;
  /// Parameters that do not decay besides those of fewer than two dimensions (nanoGPT's rule):
  /// biases and norm weights, by name (Hugging Face's rule), whatever their shape.
  std::vector<std::string> no_decay = {"*.bias", "*norm*", "*ln_*"};
  std::vector<std::string> freeze;  ///< globs: these parameters are not trained (no gradient, no optimizer state)
  double grad_clip = 1.0;  ///< 0: off
  std::uint64_t seed = 1337;
  std::int64_t eval_every = 0;
  int eval_batches = 4;
  // strategy
  std::string strategy = "fsdp";  ///< the registry's names: fsdp, fsdp_cpu_offload
  std::string sharding_strategy = "FULL_SHARD";
  std::string device_mesh;  ///< "R,S" (HYBRID_SHARD: R replicas of S shards); empty: one replica per node
  std::string precision = "32-true";  ///< 32-true, bf16-mixed (autocast, bf16 reduction), bf16-true (a bf16 model)
  /// FSDP's MixedPrecision given explicitly (empty: from --precision): float32, bfloat16, float16.
  std::string param_dtype, reduce_dtype, buffer_dtype;
  bool activation_checkpointing = false;  ///< gpt: every block
  std::string backward_prefetch = "BACKWARD_PRE";  ///< or NONE
  bool forward_prefetch = false;
  std::string overlap_reduction = "auto";  ///< on, off, or auto: on with nccl, off with gloo
  std::string auto_wrap = "auto";  ///< auto (units of kAutoWrapParams), children, block, or a parameter count
  std::string device = "cpu";  ///< cpu or cuda (each rank on the GPU its LOCAL_RANK names)
  std::string backend;  ///< gloo or nccl; empty: the device's (gloo on cpu, nccl on cuda)
  double timeout = 1800;
  int threads = 0;  ///< intra-op threads per rank; 0: the cores shared among the local ranks
  // launching
  int nproc = 0;  ///< > 0: start this many local ranks
  // output
  std::int64_t log_every = 10;
  std::string log_jsonl;
  bool quiet = false;
  // checkpoints
  std::string ckpt_dir;
  std::int64_t save_every = 0;
  int keep_last = 0;  ///< 0: keep all
  std::string resume;  ///< a step directory, or "latest" (in ckpt_dir)
  bool force = false;  ///< train from scratch over an earlier run's checkpoints in ckpt_dir, removing them
  std::int64_t stop_at_step = 0;  ///< > 0: save and stop after this step (the schedule still runs to --steps)
  std::string state_dict_type = "sharded";
  // starting from weights
  std::string init_from;                  ///< weights in any format libckpt reads: a new run (step 1, fresh optimizer) starts from them
  std::string init_key;                   ///< the key the model's weights sit under there; empty: the file is the state dict
  std::vector<std::string> init_renames;  ///< s/REGEX/REPLACEMENT/ on the file's names, in order
  bool init_non_strict = false;           ///< missing parameters keep their initial values, other names are ignored
};

std::unique_ptr<CLI::App> make_train_app(TrainConfig& c);

/// Checks the options that only make sense together, before any rank starts, and derives what
/// follows from them (--model-script makes the model "script"). Throws fsdp_tools::UsageError.
void validate(TrainConfig& c);

/// HYBRID_SHARD's mesh as --device-mesh gives it, (replicas, shards); std::nullopt without it
/// (the strategy then shards within a machine and replicates across machines, as PyTorch does).
/// Throws fsdp_tools::UsageError when --device-mesh is given to another strategy, or does not fit a
/// world of `world` ranks (0: not checked).
std::optional<std::pair<int, int>> explicit_mesh(const TrainConfig& c, int world = 0);

/// The learning rate at `step` (1-based): linear warmup over `warmup` steps, then cosine decay to
/// min_lr at `steps` (nanoGPT's schedule).
double learning_rate(const TrainConfig& c, std::int64_t step);

}  // namespace fsdp_train
