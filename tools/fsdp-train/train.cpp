// SPDX-License-Identifier: Apache-2.0
#include "fsdp-train/train.hpp"

#include <signal.h>
#include <time.h>
#include <sys/resource.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "ckpt/ops/filter.hpp"
#include "ckpt/ops/inspect.hpp"
#include "ckpt/pickle.hpp"
#include "common/usage_error.hpp"
#include "fsdp-train/data.hpp"
#include "fsdp-train/model.hpp"
#include "fsdp/checkpoint.hpp"
#include "fsdp/fully_sharded.hpp"
#include "fsdp/optim.hpp"
#include "fsdp/process_group.hpp"
#include "fsdp/scheduler.hpp"
#include "fsdp/script_module.hpp"
#include "fsdp/strategy.hpp"

namespace fsdp_train {
namespace {

namespace fs = std::filesystem;
namespace pk = ckpt::pickle;

std::atomic<int> g_stop_signal{0};
std::atomic<std::int64_t> g_first_stop_ns{0};

// NOTE [One interrupt, delivered several times]
// Ctrl-C in a terminal signals the whole foreground process group: the launcher and every rank,
// and the launcher forwards the interrupt to each rank once more; srun sends SIGTERM to every task,
// and torchrun forwards what it gets. So one interrupt reaches a rank once or twice within moments.
// The first asks the rank to finish its step, save and exit 0; another within kStopRepeat of it is
// the same interrupt; a later one is the user's second, which ends the process at once.
constexpr std::int64_t kStopRepeatNs = 1'000'000'000;

std::int64_t monotonic_ns() noexcept {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);  // async-signal-safe
  return static_cast<std::int64_t>(t.tv_sec) * 1'000'000'000 + t.tv_nsec;
}

void on_stop_signal(int sig) {
  const std::int64_t now = monotonic_ns();
  std::int64_t first = 0;
  if (g_first_stop_ns.compare_exchange_strong(first, now)) {
    g_stop_signal.store(sig);
    return;
  }
  if (now - first < kStopRepeatNs) return;  // the same interrupt, delivered again
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
}

double peak_rss_mib() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

std::string step_dir_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

/// The checkpoints in `dir`, by step: complete ones (a step-N directory with .metadata, or a
/// step-N.pt file, which appears only whole) and incomplete ones (a directory without .metadata).
struct StepDirs {
  std::vector<std::pair<std::int64_t, fs::path>> complete, incomplete;
};

StepDirs list_step_dirs(const fs::path& dir) {
  StepDirs out;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::string name = e.path().filename().string();
    const bool file = e.is_regular_file() && name.size() == 16 && name.ends_with(".pt");
    if (file) name.resize(13);
    if (!(file || e.is_directory()) || name.size() != 13 || name.rfind("step-", 0) != 0) continue;
    if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; })) continue;
    const std::int64_t step = std::stoll(name.substr(5));
    (file || fs::exists(e.path() / ".metadata") ? out.complete : out.incomplete).emplace_back(step, e.path());
  }
  std::sort(out.complete.begin(), out.complete.end());
  std::sort(out.incomplete.begin(), out.incomplete.end());
  return out;
}

std::string shape_text(const torch::Tensor& t) {
  std::ostringstream s;
  s << t.sizes();
  return s.str();
}

pk::ValuePtr config_dict(const TrainConfig& c, int world) {
  std::vector<std::pair<pk::ValuePtr, pk::ValuePtr>> d;
  auto put = [&](const char* k, pk::ValuePtr v) { d.emplace_back(pk::make_str(k), std::move(v)); };
  put("model", pk::make_str(c.model));
  if (!c.model_script.empty()) put("model_script", pk::make_str(fs::path(c.model_script).filename().string()));
  put("n_layer", pk::make_int(c.n_layer));
  put("n_head", pk::make_int(c.n_head));
  put("n_embd", pk::make_int(c.n_embd));
  put("block_size", pk::make_int(c.block_size));
  put("vocab_size", pk::make_int(c.vocab_size));
  put("tie_weights", pk::make_bool(c.tie_weights));
  if (c.model == "llama") {
    put("n_kv_head", pk::make_int(c.n_kv_head > 0 ? c.n_kv_head : c.n_head));
    put("ffn_hidden", pk::make_int(llama_ffn_hidden(c.n_embd, c.ffn_hidden)));
    put("rope_theta", pk::make_float(c.rope_theta));
    put("norm_eps", pk::make_float(c.norm_eps));
  }
  put("data", pk::make_str(c.data));
  put("val_fraction", pk::make_float(c.val_fraction));
  put("steps", pk::make_int(c.steps));
  put("batch_size", pk::make_int(c.batch_size));
  put("accumulate", pk::make_int(c.accumulate));
  put("world_size", pk::make_int(world));
  put("lr", pk::make_float(c.lr));
  put("min_lr", pk::make_float(c.min_lr));
  put("warmup", pk::make_int(c.warmup));
  put("optimizer", pk::make_str(c.optimizer));
  put("weight_decay", pk::make_float(c.weight_decay));
  auto strs = [](const std::vector<std::string>& v) {
    std::vector<pk::ValuePtr> out;
    for (const auto& x : v) out.push_back(pk::make_str(x));
    return pk::make_list(std::move(out));
  };
  put("no_decay", strs(c.no_decay));
  put("freeze", strs(c.freeze));
  put("grad_clip", pk::make_float(c.grad_clip));
  put("seed", pk::make_int(static_cast<std::int64_t>(c.seed)));
  put("sharding_strategy", pk::make_str(c.sharding_strategy));
  if (!c.device_mesh.empty()) put("device_mesh", pk::make_str(c.device_mesh));
  put("precision", pk::make_str(c.precision));
  for (const auto& [k, v] : {std::pair{"param_dtype", &c.param_dtype}, {"reduce_dtype", &c.reduce_dtype}, {"buffer_dtype", &c.buffer_dtype}}) {
    if (!v->empty()) put(k, pk::make_str(*v));
  }
  return pk::make_dict(std::move(d));
}

/// The run being resumed must be the same model: these must agree with the checkpoint's config.
void check_same_model(const TrainConfig& c, const pk::ValuePtr& meta, const fs::path& where) {
  const pk::Value* cfg = pk::dict_value(meta.get(), "config").get();
  if (!cfg) return;  // not ours (PyTorch's or Lightning's): the parameter shapes were checked on load
  auto want_int = [&](const char* key, std::int64_t v) {
    const pk::Value* x = pk::dict_value(cfg, key).get();
    if (x && x->int64() && *x->int64() != v) {
      throw std::runtime_error(where.string() + ": the checkpoint's " + key + " is " + std::to_string(*x->int64()) + ", this run's " + std::to_string(v));
    }
  };
  const pk::Value* model = pk::dict_value(cfg, "model").get();
  if (model && model->str() && *model->str() != c.model) throw std::runtime_error(where.string() + ": the checkpoint is of a '" + *model->str() + "' model, this run's is '" + c.model + "'");
  want_int("n_layer", c.n_layer);
  want_int("n_head", c.n_head);
  want_int("n_embd", c.n_embd);
  want_int("block_size", c.block_size);
  want_int("vocab_size", c.vocab_size);
  const pk::Value* opt = pk::dict_value(cfg, "optimizer").get();
  if (opt && opt->str() && *opt->str() != c.optimizer) throw std::runtime_error(where.string() + ": the checkpoint's optimizer is " + *opt->str() + ", this run's " + c.optimizer);
}

class Trainer {
 public:
  /// Sets the model and its optimizer up through `strategy` (whose environment is set up).
  Trainer(const TrainConfig& c, fsdp::Strategy& strategy)
      : c_(c), strategy_(strategy), pg_(strategy.group()), rank_(pg_.rank()), world_(pg_.size()), device_(strategy.root_device()),
        data_(load_tokens(c.data, c.vocab_size, c.block_size, c.val_fraction, c.seed)),
        model_(build_model(c)),
        fsdp_(model_.setup(strategy)),
        opt_(strategy.setup_optimizer(optimizer_options(c, fsdp_))),
        // Epoch e is step e + 1: torch's LambdaLR over the groups' initial lr (--lr).
        schedule_(opt_, [&c](std::int64_t epoch) { return learning_rate(c, epoch + 1) / c.lr; }) {}

  /// fsdp-train's options as the strategy's (Fabric's FSDPStrategy arguments): the registry's
  /// --strategy, with every other option set explicitly.
  static fsdp::StrategyOptions strategy_options(const TrainConfig& c) {
    fsdp::StrategyOptions o = fsdp::registered_strategy(c.strategy);
    o.accelerator = c.device;
    if (!c.backend.empty()) o.process_group_backend = fsdp::backend_from_string(c.backend);
    o.timeout = std::chrono::milliseconds(static_cast<std::int64_t>(c.timeout * 1000));
    o.precision = c.precision;
    o.mixed_precision = mixed_precision(c);
    o.auto_wrap_policy = wrap_policy(c);
    if (c.activation_checkpointing) o.activation_checkpointing_policy = fsdp::WrapPolicy{{}, {"Block", "LlamaDecoderLayer"}, 0};  // Lightning's {Block}
    o.backward_prefetch = c.backward_prefetch == "BACKWARD_PRE";
    o.forward_prefetch = c.forward_prefetch;
    if (c.overlap_reduction != "auto") o.overlap_reduction = c.overlap_reduction == "on";
    o.sharding_strategy = c.sharding_strategy;
    o.state_dict_type = c.state_dict_type;
    o.device_mesh = explicit_mesh(c);  // none: the strategy's default, one replica per machine
    o.warn = [](const std::string& m) { std::cerr << "fsdp-train: warning: " << m << std::endl; };  // the strategy warns on rank 0 only
    return o;
  }

  int run() {
    std::int64_t start = 0;
    if (!c_.resume.empty()) {
      start = resume();
    } else {
      if (!c_.ckpt_dir.empty()) start_over();
      if (!c_.init_from.empty()) init_from();
    }
    if (rank_ == 0 && !c_.log_jsonl.empty()) {
      log_.open(c_.log_jsonl, start > 0 ? std::ios::app : std::ios::trunc);
      if (!log_) throw std::runtime_error(c_.log_jsonl + ": cannot open the log for writing");
    }
    say(describe(start));
    double last_loss = 0, last_val = -1;
    std::int64_t step = start;
    const auto t_run = std::chrono::steady_clock::now();
    while (step < c_.steps) {
      ++step;
      const auto t0 = std::chrono::steady_clock::now();
      const auto comm0 = pg_.stats().time;
      const double lr = opt_.lr();  // this step's, the schedule's
      opt_.zero_grad();
      double local = 0;
      for (int m = 0; m < c_.accumulate; ++m) {
        auto [x, y] = batch(step, m, false);
        torch::Tensor loss = forward_loss(x, y) / c_.accumulate;
        // no_backward_sync until the last micro-batch; 16-mixed: backward of the scaled loss
        fsdp_.backward(strategy_.scale_loss(opt_, loss), /*sync=*/m + 1 == c_.accumulate);
        local += loss.item<double>();
      }
      const double norm = c_.grad_clip > 0 ? strategy_.clip_gradients_norm(opt_, c_.grad_clip, 2.0, /*error_if_nonfinite=*/false) : -1;
      const bool stepped = strategy_.optimizer_step(opt_);
      schedule_.step();  // as torch's loop, whether the optimizer stepped or not
      if (!stepped) {
        const fsdp::ShardedGradScaler* scaler = strategy_.grad_scaler(opt_);
        say("step " + std::to_string(step) + ": the gradients hold an inf or NaN; step skipped, grad scale now " +
            std::to_string(scaler ? scaler->get_scale() : 0.0));
      }
      // One collective per step: every rank's loss (their mean is the global batch's), whether it
      // was asked to stop, and its peak memory.
      const Stats stats = gather_stats(local);
      last_loss = stats.loss;
      if (!std::isfinite(last_loss)) {
        // Every rank sees the same mean: all stop here, and nothing poisoned is saved.
        throw std::runtime_error("the loss is " + std::to_string(last_loss) + " at step " + std::to_string(step) +
                                 " (diverged: lower --lr, or --grad-clip); nothing saved for this step" +
                                 (c_.ckpt_dir.empty() ? std::string() : ", earlier checkpoints in " + c_.ckpt_dir + " are intact"));
      }
      const std::vector<double>& rss = stats.rss;
      const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const double comm = std::chrono::duration<double>(pg_.stats().time - comm0).count();  // rank 0's
      const double tokens = static_cast<double>(c_.batch_size) * world_ * c_.accumulate * c_.block_size;
      const bool log_line = step % c_.log_every == 0 || step == c_.steps || step == start + 1;
      if (rank_ == 0) {
        if (log_line && !c_.quiet) {
          clear_bar();
          char buf[256];
          std::snprintf(buf, sizeof buf, "step %lld/%lld  loss %.4f  lr %.3e  %.0f tok/s  %.1f ms/step  peak rss", static_cast<long long>(step),
                        static_cast<long long>(c_.steps), last_loss, lr, tokens / dt, dt * 1e3);
          // "peak rss 178 MiB"; several ranks: "peak rss 178/181 MiB (rank 0/1)".
          std::string line = buf, ranks;
          for (std::size_t r = 0; r < rss.size(); ++r) {
            line += (r ? "/" : " ") + std::to_string(static_cast<long long>(rss[r]));
            ranks += (r ? "/" : "") + std::to_string(r);
          }
          std::cout << line << " MiB" << (rss.size() > 1 ? " (rank " + ranks + ")" : std::string()) << std::endl;
        }
        if (log_.is_open()) {
          nlohmann::ordered_json j{{"step", step}, {"loss", last_loss}, {"lr", lr}, {"tokens_per_s", tokens / dt}, {"step_time_s", dt},
                                   {"comm_time_s", comm}};
          if (norm >= 0) j["grad_norm"] = norm;
          j["peak_rss_mib"] = rss;
          log_ << j.dump() << "\n" << std::flush;
        }
      }
      if (rank_ == 0) draw_bar(step, start, last_loss, std::chrono::steady_clock::now() - t_run);
      if (c_.eval_every > 0 && step % c_.eval_every == 0) last_val = evaluate(step);
      const int signal = stats.signal;
      const bool stopping = signal != 0 || step == c_.stop_at_step;
      const bool save_now = !c_.ckpt_dir.empty() && ((c_.save_every > 0 && step % c_.save_every == 0) || step == c_.steps || stopping);
      if (save_now) save(step);
      if (stopping) {
        say("stopped at step " + std::to_string(step) + (signal ? std::string(" by ") + ::strsignal(signal) : std::string(" (--stop-at-step)")) +
            (c_.ckpt_dir.empty() ? " (no --ckpt-dir: nothing saved)" : ", after saving"));
        return 0;
      }
    }
    const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_run).count();
    if (step > start) {
      char buf[200];
      std::snprintf(buf, sizeof buf, "done: steps %lld-%lld in %.1f s, final loss %.4f", static_cast<long long>(start + 1),
                    static_cast<long long>(step), total, last_loss);
      std::string s = buf;
      if (last_val >= 0) {
        std::snprintf(buf, sizeof buf, ", validation loss %.4f", last_val);
        s += buf;
      }
      if (rank_ == 0 && !c_.quiet) {
        clear_bar();
        std::cout << s << std::endl;
        // Sharding is real: what this rank holds against what one unsharded copy would.
        const fsdp::ShardedModel::Bytes b = fsdp_.bytes();
        const std::int64_t state = opt_.state_bytes(), buffers = static_cast<std::int64_t>(opt_.buffer_names().size());
        std::snprintf(buf, sizeof buf,
                      "rank 0 holds parameters %lld B, gradients %lld B, optimizer state %lld B; unsharded %lld / %lld / %lld B",
                      static_cast<long long>(b.parameters), static_cast<long long>(b.gradients), static_cast<long long>(state),
                      static_cast<long long>(b.unsharded_parameters), static_cast<long long>(b.unsharded_parameters),
                      static_cast<long long>(b.unsharded_parameters * buffers));
        std::cout << buf << std::endl;
      }
    } else {
      say("nothing to do: the checkpoint is at step " + std::to_string(start) + " and --steps is " + std::to_string(c_.steps));
    }
    return 0;
  }

 private:
  static Model build_model(const TrainConfig& c) {
    torch::manual_seed(c.seed);
    Model model(c.model, {.n_layer = c.n_layer, .n_head = c.n_head, .n_embd = c.n_embd, .block_size = c.block_size, .vocab_size = c.vocab_size,
                             .tie_weights = c.tie_weights, .n_kv_head = c.n_kv_head, .ffn_hidden = c.ffn_hidden, .rope_theta = c.rope_theta,
                             .norm_eps = c.norm_eps, .script = c.model_script});
    // --freeze: frozen before wrapping, as FSDP wraps a module whose parameters require no grad.
    for (const std::string& glob : c.freeze) {
      bool any = false;
      for (auto& p : model.module().named_parameters()) {
        if (!ckpt::filters_select({{true, glob}}, p.key())) continue;
        p.value().set_requires_grad(false);
        any = true;
      }
      if (!any) throw fsdp_tools::UsageError("--freeze '" + glob + "' names no parameter of the model (its names are as fsdp-ckpt-inspect lists them below 'model.')");
    }
    return model;
  }

  static fsdp::WrapPolicy wrap_policy(const TrainConfig& c) {
    fsdp::WrapPolicy w;
    if (c.auto_wrap == "block") {
      w.module_types = {"Block", "LlamaDecoderLayer"};  // Lightning's auto_wrap_policy={Block}
    } else if (c.auto_wrap == "auto") {
      w.min_num_params = kAutoWrapParams;
    } else if (c.auto_wrap != "children") {
      w.min_num_params = std::stoll(c.auto_wrap);
    }
    return w;
  }

  static fsdp::MixedPrecision mixed_precision(const TrainConfig& c) {
    fsdp::MixedPrecision mp = fsdp::mixed_precision_of(fsdp::parse_precision(c.precision));
    // Explicit dtypes win over the precision's, as an explicit MixedPrecision does in Lightning.
    auto dtype = [](const std::string& name) -> std::optional<c10::ScalarType> {
      if (name.empty()) return std::nullopt;
      return name == "bfloat16" ? torch::kBFloat16 : name == "float16" ? torch::kHalf : torch::kFloat;
    };
    const auto param = dtype(c.param_dtype), reduce = dtype(c.reduce_dtype), buffer = dtype(c.buffer_dtype);
    if (param) return {param, reduce, buffer ? buffer : mp.buffer_dtype};  // no reduce dtype: the parameter dtype's, as FSDP's default
    return {mp.param_dtype, reduce ? reduce : mp.reduce_dtype, buffer ? buffer : mp.buffer_dtype};
  }

  torch::Tensor forward_loss(const torch::Tensor& x, const torch::Tensor& y) {
    const fsdp::Autocast context = strategy_.forward_context();  // bf16-mixed, 16-mixed: autocast
    const torch::Tensor logits = model_.forward(x);
    // A script's vocabulary is its own; the data's tokens were checked against --vocab-size.
    if (logits.dim() != 3 || logits.size(0) != x.size(0) || logits.size(1) != x.size(1) || logits.size(2) != c_.vocab_size) {
      throw std::runtime_error("the model's output has shape " + shape_text(logits) + " for tokens of shape " + shape_text(x) +
                               ", expected logits [batch, tokens, --vocab-size " + std::to_string(c_.vocab_size) + "]");
    }
    return loss_of(logits, y).to(torch::kFloat32);
  }

  static fsdp::OptimizerOptions optimizer_options(const TrainConfig& c, const fsdp::ShardedModel& model) {
    fsdp::OptimizerOptions o;
    o.kind = fsdp::optimizer_from_string(c.optimizer);
    o.lr = c.lr;
    o.beta1 = c.beta1;
    o.beta2 = c.beta2;
    o.momentum = c.momentum;
    o.weight_decay = c.weight_decay;
    std::vector<ckpt::EntryFilter> no_decay;
    for (const std::string& glob : c.no_decay) no_decay.push_back({true, glob});
    o.groups = fsdp::decay_groups(model, c.weight_decay, [&](const std::string& fqn) { return ckpt::filters_select(no_decay, fqn); });
    return o;
  }

  // Rank 0's warnings, on stderr even with -q.
  void warn(const std::string& s) const {
    if (rank_ != 0 || c_.quiet) return;
    clear_bar();
    std::cerr << "fsdp-train: warning: " << s << std::endl;
  }

  void say(const std::string& s) const {
    if (rank_ == 0 && !c_.quiet) {
      clear_bar();
      std::cout << s << std::endl;
    }
  }

  /// Rank 0's progress bar on a terminal (stderr): steps done, the last loss, time left.
  void draw_bar(std::int64_t step, std::int64_t start, double loss, std::chrono::steady_clock::duration elapsed) const {
    if (!bar_) return;
    const double frac = static_cast<double>(step) / static_cast<double>(c_.steps);
    const int width = 30, filled = static_cast<int>(frac * width);
    const double secs = std::chrono::duration<double>(elapsed).count();
    const double left = step > start ? secs / static_cast<double>(step - start) * static_cast<double>(c_.steps - step) : 0;
    std::fprintf(stderr, "\r\033[Kstep %lld/%lld [%.*s%*s] loss %.4f, %.0f s left", static_cast<long long>(step),
                 static_cast<long long>(c_.steps), filled, "##############################", width - filled, "", loss, left);
    std::fflush(stderr);
  }

  void clear_bar() const {
    if (!bar_) return;
    std::fputs("\r\033[K", stderr);
    std::fflush(stderr);
  }

  std::string mesh_text() const {
    if (fsdp_.strategy() != fsdp::ShardingStrategy::kHybridShard) return {};
    const int shards = fsdp_.shard_group().size();
    return " on " + std::to_string(world_ / shards) + " x " + std::to_string(shards) + " (replicas x shards)";
  }

  std::string describe(std::int64_t start) const {
    std::int64_t params = 0, frozen = 0;  // every parameter is in a unit (each child with parameters is one)
    for (const auto& u : fsdp_.units()) {
      if (!u) continue;
      for (const auto& p : u->params()) {
        if (p.alias_of >= 0) continue;  // a tied weight once
        params += p.numel;
        frozen += p.tensor.requires_grad() ? 0 : p.numel;
      }
    }
    return "fsdp-train: " + c_.model + " (" + std::to_string(params) + " parameters" +
           (frozen ? ", " + std::to_string(frozen) + " of them frozen" : std::string()) + "), " + std::to_string(world_) + (world_ == 1 ? " rank, " : " ranks, ") +
           c_.sharding_strategy + mesh_text() + " (" + std::to_string(fsdp_.units().size()) + (fsdp_.units().size() == 1 ? " unit), " : " units), ") + c_.precision + ", " + c_.optimizer + ", global batch " + std::to_string(c_.batch_size * world_ * c_.accumulate) + " x " +
           std::to_string(c_.block_size) + " tokens, data " + data_.source + " (" + std::to_string(data_.tokens.size()) + " tokens)" +
           (start > 0 ? ", resuming after step " + std::to_string(start) : "");
  }

  std::pair<torch::Tensor, torch::Tensor> batch(std::int64_t step, int micro, bool validation) const {
    const std::size_t b = static_cast<std::size_t>(c_.batch_size), T = static_cast<std::size_t>(c_.block_size);
    const std::size_t first = (static_cast<std::size_t>(micro) * static_cast<std::size_t>(world_) + static_cast<std::size_t>(rank_)) * b;
    const auto starts = validation ? sample_starts(c_.seed, step, first, b, data_.train_end, data_.tokens.size(), c_.block_size)
                                   : sample_starts(c_.seed, step, first, b, 0, data_.train_end, c_.block_size);
    torch::Tensor x = torch::empty({static_cast<std::int64_t>(b), static_cast<std::int64_t>(T)}, torch::kLong);
    torch::Tensor y = torch::empty_like(x);
    auto xa = x.accessor<std::int64_t, 2>();
    auto ya = y.accessor<std::int64_t, 2>();
    for (std::size_t i = 0; i < b; ++i) {
      for (std::size_t t = 0; t < T; ++t) {
        xa[static_cast<std::int64_t>(i)][static_cast<std::int64_t>(t)] = data_.tokens[starts[i] + t];
        ya[static_cast<std::int64_t>(i)][static_cast<std::int64_t>(t)] = data_.tokens[starts[i] + t + 1];
      }
    }
    return {x.to(device_), y.to(device_)};
  }

  torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& targets) const {
    return torch::nn::functional::cross_entropy(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}));
  }

  struct Stats {
    double loss = 0;           ///< the mean of every rank's loss
    int signal = 0;            ///< a stop signal one of the ranks received, or 0
    std::vector<double> rss;   ///< each rank's peak RSS, MiB
  };

  Stats gather_stats(double local_loss) {
    torch::Tensor mine = torch::tensor({local_loss, static_cast<double>(g_stop_signal.load()), peak_rss_mib()}, torch::kFloat64);
    torch::Tensor all = torch::empty({3 * world_}, torch::kFloat64);
    pg_.all_gather(all, mine);
    const double* v = all.data_ptr<double>();
    Stats s;
    for (int r = 0; r < world_; ++r) {
      s.loss += v[3 * r];
      if (v[3 * r + 1] != 0 && s.signal == 0) s.signal = static_cast<int>(v[3 * r + 1]);
      s.rss.push_back(v[3 * r + 2]);
    }
    s.loss /= world_;
    return s;
  }

  double evaluate(std::int64_t step) {
    torch::NoGradGuard no_grad;
    double sum = 0;
    for (int k = 0; k < c_.eval_batches; ++k) {
      auto [x, y] = batch(-1 - k, 0, true);
      sum += forward_loss(x, y).item<double>();
    }
    fsdp_.release();
    torch::Tensor v = torch::tensor({sum / c_.eval_batches}, torch::kFloat64);
    pg_.all_reduce(v, fsdp::ReduceOp::kAvg);
    const double val = v.item<double>();
    if (rank_ == 0) {
      if (!c_.quiet) {
        clear_bar();
        std::printf("step %lld  validation loss %.4f\n", static_cast<long long>(step), val);
        std::fflush(stdout);
      }
      if (log_.is_open()) log_ << nlohmann::ordered_json{{"step", step}, {"val_loss", val}}.dump() << "\n" << std::flush;
    }
    return val;
  }

  void save(std::int64_t step) {
    const bool full = c_.state_dict_type == "full";
    const fs::path dir = fs::path(c_.ckpt_dir) / (step_dir_name(step) + (full ? ".pt" : ""));
    // Fabric's save: the model, its optimizer, and the values that go to meta.pt (a full file's
    // top level).
    fsdp::State state{{"model", &fsdp_}, {"optimizer", &opt_}};
    state["format"] = pk::make_str("fsdp-train");
    state["format_version"] = pk::make_int(1);
    state["step"] = pk::make_int(step);
    state["world_size"] = pk::make_int(world_);
    state["config"] = config_dict(c_, world_);
    state["scheduler"] = &schedule_;  // LambdaLR.state_dict()
    state["data"] = pk::make_dict({{pk::make_str("seed"), pk::make_int(static_cast<std::int64_t>(c_.seed))},
                                   {pk::make_str("next_step"), pk::make_int(step + 1)}});
    if (const fsdp::ShardedGradScaler* scaler = strategy_.grad_scaler(opt_)) {  // 16-mixed: GradScaler.state_dict()'s
      state["grad_scaler"] = pk::make_dict({{pk::make_str("scale"), pk::make_float(scaler->get_scale())},
                                            {pk::make_str("growth_factor"), pk::make_float(scaler->options().growth_factor)},
                                            {pk::make_str("backoff_factor"), pk::make_float(scaler->options().backoff_factor)},
                                            {pk::make_str("growth_interval"), pk::make_int(scaler->options().growth_interval)},
                                            {pk::make_str("_growth_tracker"), pk::make_int(scaler->growth_tracker())}});
    }
    const auto t0 = std::chrono::steady_clock::now();
    if (rank_ == 0) fs::create_directories(full ? dir.parent_path() : dir);
    strategy_.save_checkpoint(dir, state);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rank_ == 0) {
      char buf[64];
      std::snprintf(buf, sizeof buf, " (%.2f s)", dt);
      say("saved " + dir.string() + buf);
      if (c_.keep_last > 0) {
        const StepDirs dirs = list_step_dirs(c_.ckpt_dir);
        const std::size_t n = dirs.complete.size(), keep = static_cast<std::size_t>(c_.keep_last);
        for (std::size_t i = 0; n > keep && i < n - keep; ++i) {
          if (dirs.complete[i].first >= step) continue;
          // Not a checkpoint any more before anything else goes.
          if (fs::is_directory(dirs.complete[i].second)) fs::remove(dirs.complete[i].second / ".metadata");
          fs::remove_all(dirs.complete[i].second);
        }
      }
    }
    pg_.barrier();
  }

  // A run from step 0 into a --ckpt-dir that holds an earlier run's checkpoints would overwrite some
  // and leave the newer ones for a later --resume latest to pick up: refused unless --force, which
  // removes them first (rank 0; the others meet it at the first collective, before any save).
  void start_over() {
    const StepDirs dirs = list_step_dirs(c_.ckpt_dir);
    if (dirs.complete.empty() && dirs.incomplete.empty()) return;
    const std::int64_t latest = dirs.complete.empty() ? dirs.incomplete.back().first : dirs.complete.back().first;
    if (!c_.force) {
      throw std::runtime_error("--ckpt-dir " + c_.ckpt_dir + " holds the checkpoints of an earlier run, up to step " + std::to_string(latest) +
                               ": --resume latest continues it, --force starts over and removes them");
    }
    if (rank_ != 0) return;
    for (const auto* list : {&dirs.complete, &dirs.incomplete}) {
      for (const auto& [step, path] : *list) fs::remove_all(path);
    }
    say("--force: removed the " + std::to_string(dirs.complete.size() + dirs.incomplete.size()) + " checkpoints of an earlier run in " +
        c_.ckpt_dir + " (up to step " + std::to_string(latest) + ")");
  }

  // A resumed run may change --steps, the batch or the world size; the run goes on, but the
  // learning-rate schedule or the global batch it trains with then differs from the saved run's.
  void warn_if_schedule_changed(const pk::ValuePtr& meta) const {
    const pk::Value* cfg = pk::dict_value(meta.get(), "config").get();
    auto saved = [&](const char* key) -> std::optional<std::int64_t> {
      const pk::Value* v = pk::dict_value(cfg, key).get();
      return v && v->int64() ? std::optional(*v->int64()) : std::nullopt;
    };
    if (!cfg) return;
    if (const auto s = saved("steps"); s && *s != c_.steps) {
      warn("--steps is " + std::to_string(c_.steps) + ", the checkpoint's run had " + std::to_string(*s) +
          ": the learning-rate schedule (warmup and cosine decay to --steps) is not the one it was following");
    }
    const auto b = saved("batch_size"), a = saved("accumulate"), w = saved("world_size");
    if (b && a && w) {
      const std::int64_t before = *b * *a * *w, now = static_cast<std::int64_t>(c_.batch_size) * c_.accumulate * world_;
      if (before != now) {
        warn("the global batch is " + std::to_string(now) + " sequences a step (batch " + std::to_string(c_.batch_size) + " x accumulate " +
            std::to_string(c_.accumulate) + " x " + std::to_string(world_) + " ranks), the checkpoint's run had " + std::to_string(before) +
            ": the same learning rate now applies to another batch size");
      }
    }
  }

  // A new run from weights: the model's parameters only; the optimizer and the step start afresh.
  void init_from() {
    const std::uint64_t read = bytes_read_by_all([&] {
      try {
        strategy_.load_weights(c_.init_from, fsdp_, c_.init_key, c_.init_renames, !c_.init_non_strict);
      } catch (const fsdp::Error& e) {
        throw std::runtime_error(std::string(e.what()) + "; with fsdp-train: --init-key, --init-rename, --init-non-strict");
      }
    });
    say("starting from the weights in " + c_.init_from + " (the ranks read " + std::to_string(read) + " B of it together)");
  }

  // What all ranks read together while `load` runs (each one's /proc/self/io rchar, every byte its
  // read calls returned): a load reads each rank's part, so about the checkpoint's size in all.
  // 0 where /proc is not there. A collective.
  template <class Load>
  std::uint64_t bytes_read_by_all(Load&& load) {
    auto rchar = [] {
      std::ifstream io("/proc/self/io");
      std::string key;
      std::uint64_t value = 0;
      while (io >> key >> value) {
        if (key == "rchar:") return value;
      }
      return std::uint64_t{0};
    };
    const std::uint64_t before = rchar();
    load();
    torch::Tensor n = torch::tensor({static_cast<double>(rchar() - before)}, torch::kFloat64);
    pg_.all_reduce(n, fsdp::ReduceOp::kSum);
    return static_cast<std::uint64_t>(n.item<double>());
  }

  std::int64_t resume() {
    fs::path path = c_.resume;
    if (c_.resume == "latest") {
      if (c_.ckpt_dir.empty()) throw std::runtime_error("--resume latest needs --ckpt-dir");
      const StepDirs dirs = list_step_dirs(c_.ckpt_dir);
      for (const auto& [s, p] : dirs.incomplete) {
        if (dirs.complete.empty() || s > dirs.complete.back().first) {
          warn(p.string() + " is incomplete (no .metadata: a save that did not finish); skipping it");
        }
      }
      if (dirs.complete.empty()) {
        say("no complete checkpoint in " + c_.ckpt_dir + " yet: starting from step 0");
        return 0;
      }
      // The newest that passes a structural verify (every file there, every item inside its file,
      // the chunks tiling each tensor); a damaged one is skipped with a warning, never deleted.
      path.clear();
      for (auto it = dirs.complete.rbegin(); it != dirs.complete.rend() && path.empty(); ++it) {
        const ckpt::VerifyReport report = ckpt::check_checkpoint({it->second, ckpt::VerifyDepth::kStructure, ckpt::OutputFormat::kText});
        if (report.ok()) {
          path = it->second;
          continue;
        }
        warn(it->second.string() + " is damaged (" + ckpt::to_string(report.problems.front()) +
            (report.problems.size() > 1 ? "; and " + std::to_string(report.problems.size() - 1) + " more" : std::string()) +
            "); skipping it");
      }
      if (path.empty()) {
        throw std::runtime_error("every checkpoint in " + c_.ckpt_dir + " is damaged (see the warnings); not starting over: pass --resume PATH or move them away");
      }
    }
    if (!fs::exists(path)) {
      // Name the checkpoints that are there: most often a step mistyped.
      const fs::path where = c_.ckpt_dir.empty() ? path.parent_path() : fs::path(c_.ckpt_dir);
      std::string there;
      for (const auto& [s, p] : list_step_dirs(where.empty() ? fs::path(".") : where).complete) there += (there.empty() ? "" : ", ") + p.filename().string();
      throw std::runtime_error(path.string() + ": no such checkpoint" +
                               (there.empty() ? std::string() : "; complete ones in " + where.string() + ": " + there));
    }
    if (!fs::is_regular_file(path) && !fs::exists(path / ".metadata")) {
      throw std::runtime_error(path.string() + ": not a complete checkpoint (no .metadata)");
    }
    // Strict for the model (every parameter, nothing else under model.*); the rest (step, config)
    // comes back as what was saved besides: a PyTorch or Lightning checkpoint may lack it.
    fsdp::State state{{"model", &fsdp_}, {"optimizer", &opt_}};
    pk::ValuePtr meta;
    const std::uint64_t read = bytes_read_by_all([&] { meta = strategy_.load_checkpoint(path, state, /*strict=*/true); });
    check_same_model(c_, meta, path);
    warn_if_schedule_changed(meta);
    std::int64_t step = opt_.steps();
    if (const pk::Value* s = pk::dict_value(meta.get(), "step").get(); s && s->int64()) step = *s->int64();
    // The schedule's state as saved; a checkpoint without one (PyTorch's, Lightning's) goes on
    // from its step as if the schedule had been followed.
    if (const pk::ValuePtr saved = pk::dict_value(meta.get(), "scheduler")) {
      schedule_.load_state_dict(saved);
    } else {
      schedule_.go_to(step);
    }
    if (fsdp::ShardedGradScaler* scaler = strategy_.grad_scaler(opt_)) {
      const pk::Value* saved = pk::dict_value(meta.get(), "grad_scaler").get();
      const pk::Value* scale = pk::dict_value(saved, "scale").get();
      const pk::Value* tracker = pk::dict_value(saved, "_growth_tracker").get();
      const double* value = scale ? scale->get_if<double>() : nullptr;
      if (value && tracker && tracker->int64()) scaler->load(*value, *tracker->int64());
    }
    say("resumed from " + path.string() + " at step " + std::to_string(step) + " (the ranks read " + std::to_string(read) + " B of it together)");
    return step;
  }

  const TrainConfig& c_;
  fsdp::Strategy& strategy_;
  fsdp::ProcessGroup& pg_;
  int rank_, world_;
  c10::Device device_;  ///< where the model computes and the batches go
  TokenData data_;
  Model model_;
  fsdp::ShardedModel& fsdp_;
  fsdp::ShardedOptimizer& opt_;
  fsdp::LambdaLR schedule_;
  std::ofstream log_;
  bool bar_ = rank_ == 0 && !c_.quiet && ::isatty(STDERR_FILENO);
};

}  // namespace

void check_strategy(const TrainConfig& config) {
  try {
    fsdp::Strategy check(Trainer::strategy_options(config));
  } catch (const fsdp::Error& e) {
    if (e.kind() == fsdp::ErrorKind::kInvalidArgument) throw fsdp_tools::UsageError(e.what());
    throw;
  }
}

int run_rank(const TrainConfig& config, const std::map<std::string, std::string>& env) {
  install_stop_handlers();
  const std::optional<fsdp::Rendezvous> where = fsdp::Rendezvous::from_environment(env);
  const int rank = where ? where->rank : 0, world = where ? where->world_size : 1;
  explicit_mesh(config, world);  // a mesh that does not fit, in the command line's words
  int local_world = world;
  if (auto it = env.find("LOCAL_WORLD_SIZE"); it != env.end()) local_world = std::max(1, std::atoi(it->second.c_str()));
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  fsdp::set_num_threads(config.threads > 0 ? config.threads : static_cast<int>(std::max(1u, cores / static_cast<unsigned>(local_world))));
  // The strategy joins the ranks (a world of one through a FileStore it removes), makes
  // HYBRID_SHARD's mesh, and sets the model and optimizer up as Fabric's FSDPStrategy does.
  fsdp::Strategy strategy(Trainer::strategy_options(config));
  try {
    strategy.setup_environment(env);
    Trainer trainer(config, strategy);
    return trainer.run();
  } catch (const fsdp_tools::UsageError&) {
    throw;  // an option that does not fit the model: exit 2, as the command line's own
  } catch (const std::exception& e) {
    // Several ranks: each error names its rank, once (libfsdp's may name it already); one rank:
    // none.
    const std::string who = "rank " + std::to_string(rank) + ": ", what = e.what();
    if (world == 1) throw std::runtime_error(what.starts_with(who) ? what.substr(who.size()) : what);
    throw std::runtime_error(what.starts_with(who) ? what : who + what);
  }
}

}  // namespace fsdp_train
