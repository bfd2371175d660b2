// SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <numbers>

#include "ckpt/error.hpp"
#include "ckpt/ops/filter.hpp"
#include "common/cli_common.hpp"
#include "fsdp-train/config.hpp"

namespace fsdp_train {

std::unique_ptr<CLI::App> make_train_app(TrainConfig& c) {
  auto app = std::make_unique<CLI::App>();
  app->name("fsdp-train");
  fsdp_tools::setup_app(*app, "fsdp-train",
                        "Train a model with fully sharded data parallelism (libfsdp) on one or more ranks, with sharded "
                        "checkpoints that PyTorch reads as its own, and resume them at any world size.");
  auto* m = "Model";
  auto* model = app->add_option("--model", c.model,
                                 "gpt (decoder-only transformer, nanoGPT's), llama (Hugging Face's LlamaForCausalLM, its parameter names) "
                                 "or mlp (embedding, one hidden layer)")
                     ->check(CLI::IsMember({"gpt", "llama", "mlp"}))->group(m);
  app->add_option("--model-script", c.model_script,
                  "a TorchScript module exported from Python (torch.jit.script or trace, saved with torch.jit.save) whose "
                  "forward(tokens) returns logits; trained as one FSDP unit, its parameters saved under their own FQNs. "
                  "TorchScript is code: load only files you trust")
      ->check(CLI::ExistingFile)->excludes(model)->group(m);
  app->add_option("--n-layer", c.n_layer, "transformer blocks")->check(CLI::Range(1, 1024))->group(m);
  app->add_option("--n-head", c.n_head, "attention heads (must divide --n-embd)")->check(CLI::Range(1, 1024))->group(m);
  app->add_option("--n-embd", c.n_embd, "embedding width")->check(CLI::Range(1, 1 << 16))->group(m);
  app->add_option("--block-size", c.block_size, "context length in tokens")->check(CLI::Range(1, 1 << 16))->group(m);
  app->add_option("--vocab-size", c.vocab_size, "vocabulary size (256 for a text file's bytes)")->check(CLI::Range(2, 65536))->group(m);
  app->add_flag("--tie-weights,--tie-embeddings", c.tie_weights,
                "gpt, llama: the output head uses the token embedding's weight (one parameter, saved under both names, as nanoGPT's "
                "and Hugging Face's tie_word_embeddings)")
      ->group(m);
  fsdp_tools::no_default(app->add_option("--n-kv-head", c.n_kv_head, "llama: key and value heads, grouped-query attention (must divide --n-head; default: --n-head)"))
      ->check(CLI::Range(1, 1024))->group(m);
  fsdp_tools::no_default(app->add_option("--ffn-hidden", c.ffn_hidden, "llama: the MLP's hidden size (default: Llama's rule, 2/3 of 4 x --n-embd rounded up to 256)"))
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20))->group(m);
  app->add_option("--rope-theta", c.rope_theta, "llama: the rotary embeddings' base")->check(CLI::PositiveNumber)->group(m);
  app->add_option("--norm-eps", c.norm_eps, "llama: RMSNorm's epsilon")->check(CLI::PositiveNumber)->group(m);
  auto* d = "Data";
  app->add_option("--data", c.data, "synthetic, FILE.bin (uint16 tokens, as nanoGPT writes) or any other file (its bytes are the tokens)")->group(d);
  app->add_option("--val-fraction", c.val_fraction, "the last part of the tokens kept for validation")->check(CLI::Range(0.0, 0.9))->group(d);
  auto* t = "Training";
  app->add_option("--steps", c.steps, "optimizer steps in all (a resumed run continues up to this step)")->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40))->group(t);
  app->add_option("-b,--batch-size", c.batch_size, "sequences per rank per micro-batch (the global batch is this x ranks x --accumulate)")->check(CLI::Range(1, 1 << 20))->group(t);
  app->add_option("--accumulate", c.accumulate, "micro-batches per optimizer step (gradients reduced once, after the last: no_sync)")->check(CLI::Range(1, 1 << 16))->group(t);
  app->add_option("--lr", c.lr, "peak learning rate")->check(CLI::PositiveNumber)->group(t);
  fsdp_tools::no_default(app->add_option("--min-lr", c.min_lr, "learning rate at the last step of the cosine decay (default: --lr / 10)"))->group(t);
  app->add_option("--warmup", c.warmup, "linear warmup steps")->check(CLI::NonNegativeNumber)->group(t);
  app->add_option("--optimizer", c.optimizer, "adamw or sgd (PyTorch's update rules)")->check(CLI::IsMember({"adamw", "sgd"}))->group(t);
  app->add_option("--weight-decay", c.weight_decay,
                  "AdamW: decoupled weight decay; SGD: L2 added to the gradient; applied to the parameters of two or more "
                  "dimensions that --no-decay does not name (a second parameter group, without decay, holds the others)")
      ->check(CLI::NonNegativeNumber)->group(t);
  app->add_option("--no-decay", c.no_decay, "GLOB (repeatable): parameters without weight decay besides those under two dimensions")
      ->allow_extra_args(false)->group(t);
  app->add_option("--freeze", c.freeze,
                  "GLOB (repeatable): parameters left as they are (no gradient, no optimizer state), e.g. 'embed.*'; a GLOB "
                  "that names no parameter is an error")
      ->allow_extra_args(false)->group(t);
  app->add_option("--momentum", c.momentum, "SGD momentum")->check(CLI::Range(0.0, 1.0))->group(t);
  app->add_option("--beta1", c.beta1, "AdamW beta1")->check(CLI::Range(0.0, 1.0))->group(t);
  app->add_option("--beta2", c.beta2, "AdamW beta2")->check(CLI::Range(0.0, 1.0))->group(t);
  app->add_option("--grad-clip", c.grad_clip, "clip the global gradient norm to this (0: off)")->check(CLI::NonNegativeNumber)->group(t);
  app->add_option("--seed", c.seed, "seeds the initial parameters, the synthetic data and the batches")->group(t);
  app->add_option("--eval-every", c.eval_every, "validation loss every K steps (0: never)")->check(CLI::NonNegativeNumber)->group(t);
  app->add_option("--eval-batches", c.eval_batches, "validation batches per evaluation")->check(CLI::Range(1, 1 << 20))->group(t);
  auto* s = "Strategy";
  app->add_option("--strategy", c.strategy,
                  "fsdp, or fsdp_cpu_offload (parameters, gradients and optimizer state in host memory: what a CPU run has "
                  "already, so here it changes nothing and says so)")
      ->check(CLI::IsMember({"fsdp", "fsdp_cpu_offload"}))->group(s);
  app->add_option("--sharding-strategy", c.sharding_strategy,
                  "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, or HYBRID_SHARD (FULL_SHARD within each replica of --device-mesh, "
                  "gradients averaged across replicas)")
      ->check(CLI::IsMember({"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"}))->group(s);
  app->add_option("--device-mesh", c.device_mesh,
                  "R,S: HYBRID_SHARD's mesh of R replicas of S shards, R x S = the world size (default: the ranks of a machine "
                  "shard, the machines replicate)")
      ->check([](const std::string& v) -> std::string {
        int replicas = 0, shards = 0;
        char tail = 0;
        if (std::sscanf(v.c_str(), "%d,%d%c", &replicas, &shards, &tail) != 2 || replicas < 1 || shards < 1) {
          return "expected R,S (two positive integers)";
        }
        return {};
      })
      ->group(s);
  app->add_option("--precision", c.precision,
                  "32-true; bf16-mixed (fp32 parameters and optimizer, bfloat16 autocast compute and gradient reduction, "
                  "as Lightning's); bf16-true (the model itself in bfloat16); 16-mixed (--device cuda: float16 autocast and "
                  "reduction, a sharded grad scaler skipping steps whose gradients overflow)")
      ->check(CLI::IsMember({"32-true", "bf16-mixed", "bf16-true", "16-mixed"}))->group(s);
  const auto dtypes = CLI::IsMember({"float32", "bfloat16", "float16"});
  app->add_option("--param-dtype", c.param_dtype,
                  "FSDP's MixedPrecision param_dtype: gather and compute with the parameters in this dtype while the shards "
                  "the optimizer steps keep theirs (float32, bfloat16, float16)")->check(dtypes)->group(s);
  app->add_option("--reduce-dtype", c.reduce_dtype, "reduce gradients in this dtype (default: --param-dtype's, else --precision's)")
      ->check(dtypes)->group(s);
  app->add_option("--buffer-dtype", c.buffer_dtype, "cast the model's buffers to this dtype")->check(dtypes)->group(s);
  app->add_option("--auto-wrap", c.auto_wrap,
                  "FSDP units: auto (the default: N = 100000000, size_based_auto_wrap_policy's default, so a model under 100M "
                  "parameters is one unit), children (each top-level module: embed, every block, head; llama: each decoder layer), "
                  "block (each block or decoder layer; the rest shares the root unit), or N (consecutive modules grouped until a "
                  "unit holds N parameters; llama: each decoder layer of at least N)")
      ->check(CLI::IsMember({"auto", "children", "block"}) | CLI::PositiveNumber)->group(s);
  app->add_option("--backward-prefetch", c.backward_prefetch,
                  "BACKWARD_PRE (FSDP's default): when a unit's backward starts, start gathering the next one's; NONE: gather "
                  "each when its backward starts")
      ->check(CLI::IsMember({"BACKWARD_PRE", "NONE"}))->group(s);
  app->add_flag("--forward-prefetch", c.forward_prefetch, "start gathering the next unit when a unit's forward starts (FSDP's forward_prefetch)")
      ->group(s);
  app->add_option("--overlap-reduction", c.overlap_reduction,
                  "run each unit's gradient reduce-scatter beside the rest of backward: on, off, or auto (on with nccl, off with gloo, "
                  "whose reduction takes the cores backward computes on)")
      ->check(CLI::IsMember({"auto", "on", "off"}))
      ->group(s);
  app->add_flag("--activation-checkpointing", c.activation_checkpointing,
                "recompute each transformer block's forward in backward instead of keeping its activations (gpt, llama)")->group(s);
  app->add_option("--device", c.device, "cpu, or cuda (each rank on the GPU its LOCAL_RANK names; a build against a LibTorch with CUDA)")
      ->check(CLI::IsMember({"cpu", "cuda"}))->group(s);
  app->add_option("--backend", c.backend, "gloo or nccl (default: gloo on cpu, nccl on cuda)")->check(CLI::IsMember({"gloo", "nccl"}))->group(s);
  app->add_option("--timeout", c.timeout, "seconds a collective may wait for the other ranks")->check(CLI::PositiveNumber)->group(s);
  app->add_option("--threads", c.threads, "intra-op threads per rank, LibTorch's and OpenBLAS's (0: the machine's cores shared among the local ranks)")->check(CLI::Range(0, 4096))->group(s);
  auto* l = "Launching";
  fsdp_tools::no_default(app->add_option("--nproc", c.nproc,
                                         "start N local ranks (without it, one rank of the world that RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, "
                                         "torchrun or SLURM describe, or a world of one)"))
      ->check(CLI::Range(1, 4096))->group(l);
  auto* o = "Output";
  app->add_option("--log-every", c.log_every, "print a line every K steps")->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40))->group(o);
  app->add_option("--log-jsonl", c.log_jsonl, "write one JSON object per step and per evaluation to FILE")->group(o);
  app->add_flag("-q,--quiet", c.quiet, "print errors only: no step lines, progress bar, warnings or summary")->group(o);
  auto* k = "Checkpoints";
  app->add_option("--ckpt-dir", c.ckpt_dir, "write checkpoints as DIR/step-NNNNNNNN/ (also at the last step and on SIGINT/SIGTERM)")->group(k);
  app->add_option("--save-every", c.save_every, "save every K steps (0: only at the end)")->check(CLI::NonNegativeNumber)->group(k);
  app->add_option("--keep-last", c.keep_last, "keep only the newest K complete checkpoints (0: all)")->check(CLI::NonNegativeNumber)->group(k);
  app->add_option("--resume", c.resume, "continue from a checkpoint directory, or 'latest' (the newest complete one in --ckpt-dir), at any world size")->group(k);
  app->add_flag("-f,--force", c.force,
                "without --resume: start from step 0 although --ckpt-dir holds an earlier run's checkpoints, removing them")
      ->group(k);
  fsdp_tools::no_default(app->add_option("--stop-at-step", c.stop_at_step,
                                         "save and exit 0 after this step, as on SIGTERM; the learning-rate schedule still ends at --steps "
                                         "(for runs split across time-limited jobs)"))
      ->check(CLI::NonNegativeNumber)->group(k);
  app->add_option("--state-dict-type", c.state_dict_type,
                  "sharded (a DCP directory, as FSDP's SHARDED_STATE_DICT and Lightning save it) or full (one torch.save file "
                  "step-N.pt written by rank 0, as Lightning's full checkpoint)")
      ->check(CLI::IsMember({"sharded", "full"}))->group(k);
  auto* w = "Starting from weights";
  auto* init = app->add_option("--init-from", c.init_from,
                               "start a new run (step 1, a fresh optimizer) from the weights in PATH: a torch.save state dict, "
                               "safetensors, a Hugging Face folder, a DCP directory, any format fsdp-ckpt-inspect reads")
                   ->excludes(app->get_option("--resume"))->group(w);
  app->add_option("--init-key", c.init_key, "the key the model's weights sit under in --init-from (e.g. model); default: the file is the state dict")
      ->needs(init)->group(w);
  app->add_option("--init-rename", c.init_renames, "s/REGEX/REPLACEMENT/[g] on --init-from's names before they are matched with the model's (repeatable, in order)")
      ->allow_extra_args(false)->needs(init)->group(w);
  app->add_flag("--init-non-strict", c.init_non_strict,
                "parameters --init-from lacks keep their initial values and names the model lacks are ignored (default: both are errors)")
      ->needs(init)->group(w);
  return app;
}

void validate(TrainConfig& c) {
  try {
    ckpt::EntryRenames(std::nullopt, c.init_renames);
  } catch (const ckpt::Error& e) {
    throw fsdp_tools::UsageError(std::string("--init-rename: ") + e.what());
  }
  const TrainConfig defaults;
  if (c.model != "llama" && (c.n_kv_head != defaults.n_kv_head || c.ffn_hidden != defaults.ffn_hidden || c.rope_theta != defaults.rope_theta ||
                             c.norm_eps != defaults.norm_eps)) {
    throw fsdp_tools::UsageError("--n-kv-head, --ffn-hidden, --rope-theta and --norm-eps are for --model llama");
  }
  if (c.model_script.empty()) {
    if ((c.model == "gpt" || c.model == "llama") && c.n_head > 0 && c.n_embd % c.n_head != 0) {
      throw fsdp_tools::UsageError("--n-embd " + std::to_string(c.n_embd) + " is not a multiple of --n-head " + std::to_string(c.n_head));
    }
    if (c.model == "llama" && (c.n_embd / c.n_head) % 2 != 0) {
      throw fsdp_tools::UsageError("--n-embd " + std::to_string(c.n_embd) + " / --n-head " + std::to_string(c.n_head) +
                                   " is an odd head size; rotary embeddings pair a head's halves");
    }
    if (c.model == "llama" && c.n_kv_head > 0 && c.n_head % c.n_kv_head != 0) {
      throw fsdp_tools::UsageError("--n-head " + std::to_string(c.n_head) + " is not a multiple of --n-kv-head " + std::to_string(c.n_kv_head));
    }
    return;
  }
  c.model = "script";
  // A script's forward is opaque: FSDP cannot run, wrap or recompute its parts one by one.
  if (c.activation_checkpointing) throw fsdp_tools::UsageError("--activation-checkpointing needs the model's blocks; a --model-script is one opaque module");
  if (c.auto_wrap != "auto" && c.auto_wrap != "children") throw fsdp_tools::UsageError("--auto-wrap " + c.auto_wrap + ": a --model-script is one FSDP unit (its forward is opaque)");
  if (c.tie_weights) throw fsdp_tools::UsageError("--tie-weights is for --model gpt and llama; a --model-script ties what it ties");
}

std::optional<std::pair<int, int>> explicit_mesh(const TrainConfig& c, int world) {
  if (c.device_mesh.empty()) return std::nullopt;
  if (c.sharding_strategy != "HYBRID_SHARD") throw fsdp_tools::UsageError("--device-mesh is HYBRID_SHARD's; this run's --sharding-strategy is " + c.sharding_strategy);
  int r = 0, s = 0;
  if (std::sscanf(c.device_mesh.c_str(), "%d,%d", &r, &s) != 2 || r < 1 || s < 1 || (world > 0 && r * s != world)) {
    throw fsdp_tools::UsageError("--device-mesh " + c.device_mesh + " does not fit " + std::to_string(world) +
                             " ranks (replicas x shards must equal the world size)");
  }
  return std::pair{r, s};
}

double learning_rate(const TrainConfig& c, std::int64_t step) {
  const double min_lr = c.min_lr < 0 ? c.lr / 10 : c.min_lr;
  if (step <= c.warmup) return c.lr * static_cast<double>(step) / static_cast<double>(c.warmup + 1);
  if (step >= c.steps) return min_lr;
  const double progress = static_cast<double>(step - c.warmup) / static_cast<double>(c.steps - c.warmup);
  return min_lr + 0.5 * (1.0 + std::cos(std::numbers::pi * progress)) * (c.lr - min_lr);
}

}  // namespace fsdp_train
