// SPDX-License-Identifier: Apache-2.0
// fsdp::Strategy, the counterpart of Lightning Fabric's FSDPStrategy: every error of the seed's
// table raised in the same situation (a world of one), and save_checkpoint/load_checkpoint with a
// state of named objects (model, optimizer, other values) in both state-dict types, a filter,
// strict and non-strict loading, at 2 ranks. Like the other fsdp tests, the binary runs itself as
// the ranks of the multi-rank case.
#include <torch/torch.h>

#include <dlfcn.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <string>

#include <catch2/catch.hpp>

#include "expect.hpp"
#include "fsdp/strategy.hpp"
#include "launch.hpp"

namespace {

using fsdp_test::expect_error;
using fsdp_test::failures;

namespace fs = std::filesystem;
namespace pk = ckpt::pickle;

torch::nn::Sequential model(std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(5, 7), torch::nn::Tanh(), torch::nn::Linear(7, 3));
}

std::map<std::string, std::string> environment() {
  std::map<std::string, std::string> env;
  for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) {
    if (const char* v = std::getenv(k)) env[k] = v;
  }
  return env;
}

// A couple of AdamW steps, so that the optimizer has state worth saving.
void train(fsdp::FullyShardedSequential& m, fsdp::ShardedOptimizer& opt, int rank, int world) {
  for (int s = 0; s < 2; ++s) {
    torch::manual_seed(static_cast<std::uint64_t>(50 + s));
    torch::Tensor x = torch::randn({4, 5}), y = torch::randn({4, 3});
    const int per = 4 / world;
    opt.zero_grad();
    m.backward(torch::mse_loss(m.forward(x.narrow(0, rank * per, per)), y.narrow(0, rank * per, per)));
    opt.step(1e-2);
  }
}

bool same_parameters(fsdp::FullyShardedSequential& a, fsdp::FullyShardedSequential& b) {
  const auto x = a.full_state_dict(), y = b.full_state_dict();
  if (x.size() != y.size()) return false;
  for (std::size_t i = 0; i < x.size(); ++i) {
    if (x[i].first != y[i].first || !x[i].second.equal(y[i].second)) return false;
  }
  return true;
}

void errors_table() {
  auto opts = [] { return fsdp::registered_strategy("fsdp"); };
  expect_error("unknown registered name", [] { fsdp::registered_strategy("ddp"); }, "unknown strategy 'ddp'");
  expect_error("both activation-checkpointing arguments", [&] {
    auto o = opts();
    o.activation_checkpointing = fsdp::WrapPolicy{};
    o.activation_checkpointing_policy = fsdp::WrapPolicy{};
    fsdp::Strategy s(o);
  }, "both activation_checkpointing and activation_checkpointing_policy");
  expect_error("hybrid without policy, group or mesh", [&] {
    auto o = opts();
    o.sharding_strategy = "HYBRID_SHARD";
    fsdp::Strategy s(o);
  }, "requires at least one of the options auto_wrap_policy, process_group or device_mesh");
  expect_error("unknown state_dict_type", [&] {
    auto o = opts();
    o.state_dict_type = "local";
    fsdp::Strategy s(o);
  }, "unknown state_dict_type: 'local'");
  expect_error("device_mesh without HYBRID_SHARD", [&] {
    auto o = opts();
    o.device_mesh = std::pair{1, 1};
    fsdp::Strategy s(o);
  }, "only valid with the HYBRID_SHARD");
  expect_error("16-mixed on the CPU", [&] {
    auto o = opts();
    o.precision = "16-mixed";
    fsdp::Strategy s(o);
  }, "needs CUDA");
  expect_error("unknown accelerator", [&] {
    auto o = opts();
    o.accelerator = "tpu";
    fsdp::Strategy s(o);
  }, "unknown accelerator 'tpu'");
  expect_error("nccl on the CPU", [&] {
    auto o = opts();
    o.process_group_backend = fsdp::Backend::kNccl;
    fsdp::Strategy s(o);
  }, "needs accelerator cuda");
  if (!torch::cuda::is_available()) {
    expect_error("cuda without a GPU", [&] {
      auto o = opts();
      o.accelerator = "cuda";
      fsdp::Strategy s(o);
    }, fsdp::nccl_available() ? "no GPU is visible" : "this build's LibTorch has no CUDA");
    auto o = opts();
    o.accelerator = "auto";  // no GPU: the CPU
    fsdp::Strategy s(o);
    expect_error("root_device before setup_environment", [&] { s.root_device(); }, "call setup_environment first");
    s.setup_environment({});
    EXPECT(s.root_device() == c10::Device(c10::kCPU) && s.group().device() == c10::Device(c10::kCPU));
  }

  // A world of one, from an empty environment.
  std::vector<std::string> warnings;
  auto o = fsdp::registered_strategy("fsdp_cpu_offload");
  o.warn = [&](const std::string& w) { warnings.push_back(w); };
  {
    auto g = fsdp::registered_strategy("fsdp");
    fsdp::Strategy probe(g);
    probe.setup_environment({});
    g.process_group = &probe.group();
    g.sharding_strategy = "HYBRID_SHARD";
    g.device_mesh = std::pair{1, 1};
    expect_error("process_group with device_mesh", [&] { fsdp::Strategy s(g); }, "mutually exclusive");
  }
  {
    // The deprecated spelling works, and says so; 16-true needs CUDA, as 16-mixed does.
    auto d = fsdp::registered_strategy("fsdp");
    std::vector<std::string> said;
    d.warn = [&](const std::string& w) { said.push_back(w); };
    d.activation_checkpointing = fsdp::WrapPolicy{{}, {"Linear"}, 0};
    fsdp::Strategy deprecated(d);
    deprecated.setup_environment({});
    EXPECT(said.size() == 1 && said[0].find("activation_checkpointing is deprecated, use activation_checkpointing_policy") != std::string::npos);
    auto h = fsdp::registered_strategy("fsdp");
    h.precision = "16-true";
    expect_error("16-true on the CPU", [&] { fsdp::Strategy s(h); }, "16-true (a float16 model) needs CUDA");
    EXPECT(fsdp::parse_precision("16-true") == fsdp::Precision::k16True && fsdp::model_dtype_of(fsdp::Precision::k16True) == torch::kHalf);
    fsdp::CpuOffload offload;
    offload.offload_params = true;
    h.cpu_offload = offload;
    EXPECT(h.cpu_offload.offload_params);
  }
  fsdp::Strategy s(o);
  s.setup_environment({});
  EXPECT(warnings.size() == 1 && warnings[0].find("cpu_offload has no effect") != std::string::npos);
  EXPECT(s.world_size() == 1 && s.global_rank() == 0);
  auto raw = model(1);
  torch::optim::SGD early(raw->parameters(), torch::optim::SGDOptions(0.1));
  auto& m = s.setup_module(raw);
  expect_error("an optimizer made before setup_module", [&] { s.setup_optimizer(early); }, "create the optimizer after setting up the model");
  torch::optim::SGD late(m.parameters(), torch::optim::SGDOptions(0.1));
  s.setup_optimizer(late);  // accepted
  {
    // module_init_context(empty_init=True)'s counterpart: the model as its children's makers, made
    // and sharded one by one, holds the values the whole model made from the same seed holds.
    const std::vector<std::pair<std::string, fsdp::ChildMaker>> makers{
        {"0", [] { return torch::nn::AnyModule(torch::nn::Linear(5, 7)); }},
        {"1", [] { return torch::nn::AnyModule(torch::nn::Tanh()); }},
        {"2", [] { return torch::nn::AnyModule(torch::nn::Linear(7, 3)); }}};
    fsdp::Strategy whole(fsdp::registered_strategy("fsdp")), deferred(fsdp::registered_strategy("fsdp"));
    whole.setup_environment({});
    deferred.setup_environment({});
    torch::manual_seed(3);
    torch::nn::Sequential seq;
    for (const auto& [name, make] : makers) seq->push_back(name, make());
    auto& a = whole.setup_module(seq);
    torch::manual_seed(3);
    auto& b = deferred.setup_module(makers);
    EXPECT(b.units().size() == 2 && same_parameters(a, b));
    auto h = fsdp::registered_strategy("fsdp");
    h.sharding_strategy = "HYBRID_SHARD";
    h.device_mesh = std::pair{1, 1};
    fsdp::Strategy hybrid(h);
    hybrid.setup_environment({});
    expect_error("deferred initialization under HYBRID_SHARD", [&] { hybrid.setup_module(makers); }, "not available under HYBRID_SHARD");
  }
  {
    // A model the user wrapped already is left as it is: the policy is ignored, with the seed's
    // warning, and the same model (same units) comes back.
    std::vector<std::string> said;
    auto w = fsdp::registered_strategy("fsdp");
    w.auto_wrap_policy = fsdp::WrapPolicy{};
    w.auto_wrap_policy->min_num_params = 1 << 20;  // would make one unit of everything
    w.warn = [&](const std::string& x) { said.push_back(x); };
    fsdp::Strategy ws(w);
    ws.setup_environment({});
    auto mine = std::make_unique<fsdp::FullyShardedSequential>(model(1), ws.group(), fsdp::ShardingStrategy::kFullShard);
    const fsdp::FullyShardedSequential* before = mine.get();
    fsdp::FullyShardedSequential& adopted = ws.setup_module(std::move(mine));
    EXPECT(&adopted == before && adopted.units().size() == 2);  // its own units: each Linear
    EXPECT(said.size() == 1 && said[0] == "A FSDP auto_wrap_policy is set, but the model is already wrapped. The policy will be ignored.");
    EXPECT(!ws.options().auto_wrap_policy);
  }
  auto& opt = s.setup_optimizer(fsdp::OptimizerOptions{});
  train(m, opt, 0, 1);

  char tmpl[] = "/tmp/fsdp-strategy-XXXXXX";
  const fs::path dir = ::mkdtemp(tmpl);
  fs::create_directories(dir / "plain");
  expect_error("no model in the state", [&] { s.save_checkpoint(dir / "a", {{"step", pk::make_int(1)}}); }, "could not find an FSDP model");
  auto& m2 = s.setup_module(model(2));
  expect_error("two models", [&] { s.save_checkpoint(dir / "a", {{"a", &m}, {"b", &m2}}); }, "found several FSDP models");
  expect_error("a filter with a sharded save", [&] {
    s.save_checkpoint(dir / "a", {{"model", &m}}, {{"model", [](const std::string&) { return true; }}});
  }, "filtering is not supported for sharded checkpoints");
  expect_error("load with an empty state", [&] {
    fsdp::State none;
    s.load_checkpoint(dir / "a", none);
  }, "needs a state with at least the model");
  expect_error("load from a path that is no checkpoint", [&] {
    fsdp::State st{{"model", &m}};
    s.load_checkpoint(dir / "plain", st);
  }, "does not point to a valid checkpoint");

  // A sharded save (meta.pt holds the other values) and its load into a fresh model and optimizer.
  const pk::ValuePtr config = pk::make_dict({{pk::make_str("lr"), pk::make_float(0.01)}});
  s.save_checkpoint(dir / "a", {{"model", &m}, {"optimizer", &opt}, {"step", pk::make_int(7)}, {"config", config}});
  EXPECT(fs::is_regular_file(dir / "a" / ".metadata") && fs::is_regular_file(dir / "a" / "meta.pt"));
  auto& m3 = s.setup_module(model(3));
  auto& opt3 = s.setup_optimizer(fsdp::OptimizerOptions{});
  fsdp::State st{{"model", &m3}, {"optimizer", &opt3}, {"step", pk::make_none()}};
  const pk::ValuePtr rest = s.load_checkpoint(dir / "a", st);
  EXPECT(same_parameters(m, m3));
  EXPECT(opt3.steps() == 2 && opt3.buffer(0, "exp_avg").equal(opt.buffer(0, "exp_avg")));
  EXPECT(std::get<pk::ValuePtr>(st["step"])->int64() == 7);
  EXPECT(rest->dict_items() && rest->dict_items()->size() == 1 && *rest->dict_items()->front().first->str() == "config");
  fsdp::State missing{{"model", &m3}, {"epoch", pk::make_none()}};
  expect_error("a requested key the checkpoint lacks", [&] { s.load_checkpoint(dir / "a", missing); }, "a key 'epoch' that does not exist");
  s.load_checkpoint(dir / "a", missing, /*strict=*/false);
  EXPECT(std::get<pk::ValuePtr>(missing["epoch"])->is<pk::None>());

  // Full: a filter keeps only the first layer; strict loading then misses the rest, non-strict
  // keeps the model's own values for them.
  auto full_opts = fsdp::registered_strategy("fsdp");
  full_opts.state_dict_type = "full";
  full_opts.process_group = &s.group();
  fsdp::Strategy f(full_opts);
  f.setup_environment({});
  expect_error("a full save onto a directory", [&] { f.save_checkpoint(dir / "plain", {{"model", &m}}); }, "exists and is a directory");
  f.save_checkpoint(dir / "a", {{"model", &m}, {"step", pk::make_int(8)}},
                    {{"model", [](const std::string& fqn) { return fqn.rfind("0.", 0) == 0; }}});
  EXPECT(fs::is_regular_file(dir / "a"));  // the sharded checkpoint there was replaced
  auto& m4 = f.setup_module(model(4));
  fsdp::State st4{{"model", &m4}};
  expect_error("strict: a parameter the checkpoint lacks", [&] { f.load_checkpoint(dir / "a", st4); }, "missing (2): model.2.weight, model.2.bias");
  auto& m5 = f.setup_module(model(4));
  fsdp::State st5{{"model", &m5}};
  const pk::ValuePtr rest5 = f.load_checkpoint(dir / "a", st5, /*strict=*/false);
  const auto got = m5.full_state_dict(), mine = m.full_state_dict();
  const auto init = model(4)->named_parameters();
  EXPECT(got[0].second.equal(mine[0].second) && got[1].second.equal(mine[1].second));     // 0.weight, 0.bias: loaded
  EXPECT(got[2].second.equal(init["2.weight"]) && got[3].second.equal(init["2.bias"]));  // kept
  EXPECT(rest5->dict_items() && rest5->dict_items()->size() == 1);                         // step
  // A sharded save over the file replaces it; strict loading refuses entries the model lacks.
  s.save_checkpoint(dir / "a", {{"model", &m}});
  EXPECT(fs::is_regular_file(dir / "a" / ".metadata"));
  auto small = torch::nn::Sequential(torch::nn::Linear(5, 7));
  auto& m6 = s.setup_module(small);
  fsdp::State st6{{"model", &m6}};
  expect_error("strict: entries the model lacks", [&] { s.load_checkpoint(dir / "a", st6); }, "unexpected (2): model.2.bias, model.2.weight");
  s.load_checkpoint(dir / "a", st6, false);

  // error_if_nonfinite: the gradients stay as they were.
  opt.zero_grad();
  m.backward(m.forward(torch::full({1, 5}, std::nan(""))).sum());
  const torch::Tensor before = m.parameters()[0].grad().clone();
  expect_error("a non-finite gradient norm", [&] { s.clip_gradients_norm(opt, 1.0); }, "cannot be clipped");
  EXPECT(m.parameters()[0].grad().equal(before) || (before.isnan().all().item<bool>() && m.parameters()[0].grad().isnan().all().item<bool>()));
  fs::remove_all(dir);
}

// This process's rank of the world the launcher started: the registry's "fsdp" strategy joined.
std::unique_ptr<fsdp::Strategy> joined_strategy() {
  auto o = fsdp::registered_strategy("fsdp");
  o.timeout = std::chrono::seconds(60);
  auto s = std::make_unique<fsdp::Strategy>(o);
  s->setup_environment(environment());
  return s;
}

// A strategy saving `state_dict_type` checkpoints over the ranks `joined` joined.
std::unique_ptr<fsdp::Strategy> saving_as(fsdp::Strategy& joined, const char* state_dict_type) {
  auto o = fsdp::registered_strategy("fsdp");
  o.state_dict_type = state_dict_type;
  o.process_group = &joined.group();
  auto s = std::make_unique<fsdp::Strategy>(o);
  s->setup_environment(environment());
  return s;
}

// One rank of the 2-rank case: save both kinds through the strategy, load into fresh models.
int rank_main() {
  const std::unique_ptr<fsdp::Strategy> world_of = joined_strategy();
  fsdp::Strategy& joined = *world_of;
  for (const char* type : {"sharded", "full"}) {
    const std::unique_ptr<fsdp::Strategy> saver = saving_as(joined, type);
    fsdp::Strategy& s = *saver;
    auto& m = s.setup_module(model(1));
    auto& opt = s.setup_optimizer(fsdp::OptimizerOptions{});
    train(m, opt, s.global_rank(), s.world_size());
    auto halving = [](std::int64_t epoch) { return std::pow(0.5, static_cast<double>(epoch)); };
    fsdp::LambdaLR schedule(opt, halving);
    schedule.step();
    schedule.step();
    EXPECT(schedule.last_epoch() == 2 && opt.lr() == opt.options().lr * 0.25);
    const fs::path path = fs::path(std::getenv("FSDP_TEST_DIR")) / type;
    s.save_checkpoint(path, {{"model", &m}, {"optimizer", &opt}, {"scheduler", &schedule}, {"step", pk::make_int(2)}});
    auto& m2 = s.setup_module(model(2));
    auto& opt2 = s.setup_optimizer(fsdp::OptimizerOptions{});
    fsdp::LambdaLR schedule2(opt2, halving);
    fsdp::State st{{"model", &m2}, {"optimizer", &opt2}, {"scheduler", &schedule2}, {"step", pk::make_none()}};
    s.load_checkpoint(path, st);
    // The schedule's state as saved, the lr from the optimizer's param_groups (torch's split).
    EXPECT(schedule2.last_epoch() == 2 && schedule2.get_last_lr() == schedule.get_last_lr() && opt2.lr() == opt.lr());
    schedule2.step();
    EXPECT(opt2.lr() == opt.options().lr * 0.125);
    // A schedule without saved state goes on from a step as if it had been followed.
    fsdp::LambdaLR schedule3(opt2, halving);
    schedule3.go_to(3);
    EXPECT(schedule3.last_epoch() == 3 && opt2.lr() == opt.options().lr * 0.125 && pk::repr(*schedule3.state_dict()) == pk::repr(*schedule2.state_dict()));
    EXPECT(same_parameters(m, m2));
    EXPECT(opt2.steps() == 2 && opt2.buffer(0, "exp_avg_sq").equal(opt.buffer(0, "exp_avg_sq")));
    EXPECT(std::get<pk::ValuePtr>(st["step"])->int64() == 2);
    // The same next step from both.
    train(m, opt, s.global_rank(), s.world_size());
    train(m2, opt2, s.global_rank(), s.world_size());
    EXPECT(same_parameters(m, m2));
  }
  return failures ? 1 : 0;
}

// A model with buffers: BatchNorm's running statistics and its batch count (a 0-d int64).
torch::nn::Sequential norm_model(std::uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(torch::nn::Linear(5, 8), torch::nn::BatchNorm1d(8), torch::nn::Tanh(), torch::nn::Linear(8, 3));
}

// Two optimizers over one model, each stepping its own parameters: AdamW the weights (two
// groups, one with an lr of its own), SGD with momentum the biases and the norm's parameters.
struct TwoOptimizers {
  fsdp::ShardedOptimizer *adam = nullptr, *sgd = nullptr;
};
TwoOptimizers two_optimizers(fsdp::Strategy& s) {
  fsdp::OptimizerOptions a;
  a.groups = {{{"0.weight"}, 5e-3, std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt},
              {{"3.weight"}, std::nullopt, 0.1, std::nullopt, std::nullopt, std::nullopt, std::nullopt}};
  fsdp::OptimizerOptions b;
  b.kind = fsdp::OptimizerKind::kSgd;
  b.momentum = 0.9;
  b.groups = {{{"0.bias", "1.weight", "1.bias", "3.bias"}, std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt, std::nullopt}};
  return {&s.setup_optimizer(a), &s.setup_optimizer(b)};
}

void train_two(fsdp::FullyShardedSequential& m, TwoOptimizers o, int rank, int world, int steps) {
  for (int s = 0; s < steps; ++s) {
    torch::manual_seed(static_cast<std::uint64_t>(60 + s));
    torch::Tensor x = torch::randn({4, 5}), y = torch::randn({4, 3});
    const int per = 4 / world;
    o.adam->zero_grad();
    o.sgd->zero_grad();
    m.backward(torch::mse_loss(m.forward(x.narrow(0, rank * per, per)), y.narrow(0, rank * per, per)));
    o.adam->step(1e-2);
    o.sgd->step(1e-2);
  }
}

// Whether two state dicts hold the same names and values; `buffers` false: the buffers' values
// are not compared (each rank's running statistics are its own after a step).
bool same_state(const std::vector<std::pair<std::string, torch::Tensor>>& a, const std::vector<std::pair<std::string, torch::Tensor>>& b,
                bool buffers = true) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const bool buffer = a[i].first.starts_with("1.running_") || a[i].first == "1.num_batches_tracked";
    if (a[i].first != b[i].first || (!(buffer && !buffers) && !a[i].second.equal(b[i].second))) return false;
  }
  return true;
}

// The buffers case: at 2 ranks ("buffers-save"), buffers broadcast from rank 0 at setup, a state
// of two optimizers saved (both types) and loaded into fresh ones, which then step alike; rank 0
// keeps the full state dict it saved. At 3 ranks ("buffers-load"), both checkpoints load whole:
// parameters, buffers and both optimizers' groups and step counts.
int buffers_main(bool saving) {
  const int before = failures;
  const std::unique_ptr<fsdp::Strategy> world_of = joined_strategy();
  fsdp::Strategy& joined = *world_of;
  const int rank = joined.global_rank(), world = joined.world_size();
  const fs::path dir = std::getenv("FSDP_TEST_DIR");
  for (const char* type : {"sharded", "full"}) {
    const std::unique_ptr<fsdp::Strategy> saver = saving_as(joined, type);
    fsdp::Strategy& s = *saver;
    const fs::path path = dir / type, expected = dir / (std::string(type) + ".expected");
    if (saving) {
      torch::nn::Sequential raw = norm_model(1);
      raw[1]->named_buffers()["running_mean"].fill_(static_cast<float>(rank + 1));  // rank 0's wins
      auto& m = s.setup_module(raw);
      EXPECT(m.buffers().size() == 3 && m.buffers()[0].first == "1.running_mean" && m.buffers()[0].second.eq(1.0f).all().item<bool>());
      const TwoOptimizers opts = two_optimizers(s);
      train_two(m, opts, rank, world, 2);  // the running statistics now differ from rank to rank
      s.save_checkpoint(path, {{"model", &m}, {"adam", opts.adam}, {"sgd", opts.sgd}});
      const auto saved = m.full_state_dict();
      if (rank == 0) {
        std::vector<torch::Tensor> values;
        for (const auto& [name, t] : saved) values.push_back(t);
        torch::save(values, expected.string());
      }
      // The order of torch's state_dict: the norm's weight, bias, then its buffers.
      std::vector<std::string> names;
      for (const auto& [name, t] : saved) names.push_back(name);
      EXPECT((names == std::vector<std::string>{"0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
                                                "1.num_batches_tracked", "3.weight", "3.bias"}));
      auto& m2 = s.setup_module(norm_model(2));
      const TwoOptimizers opts2 = two_optimizers(s);
      fsdp::State st{{"model", &m2}, {"adam", opts2.adam}, {"sgd", opts2.sgd}};
      s.load_checkpoint(path, st);
      // Rank 0's buffers, on every rank: what rank 0 saved.
      EXPECT(same_state(saved, m2.full_state_dict(), /*buffers=*/rank == 0));
      for (const auto& [name, b] : m2.buffers()) {
        torch::Tensor r0 = b.clone();
        joined.group().broadcast(r0, 0);
        EXPECT(r0.equal(b));
      }
      train_two(m, opts, rank, world, 1);
      train_two(m2, opts2, rank, world, 1);
      EXPECT(same_state(m.full_state_dict(), m2.full_state_dict(), /*buffers=*/rank == 0));
      s.barrier();
    } else {
      auto& m = s.setup_module(norm_model(3));
      const TwoOptimizers opts = two_optimizers(s);
      fsdp::State st{{"model", &m}, {"adam", opts.adam}, {"sgd", opts.sgd}};
      s.load_checkpoint(path, st);
      std::vector<torch::Tensor> values;
      torch::load(values, expected.string());
      const auto loaded = m.full_state_dict();
      EXPECT(loaded.size() == values.size());
      for (std::size_t i = 0; i < loaded.size() && i < values.size(); ++i) EXPECT(loaded[i].second.equal(values[i]));
      EXPECT(opts.adam->steps() == 2);  // SGD keeps no step count (torch.optim.SGD's state has none)
      EXPECT(opts.adam->groups()[1].weight_decay == 0.1 && opts.sgd->groups()[0].momentum == 0.9);
      // Another grouping is refused, naming the parameters.
      fsdp::OptimizerOptions one;
      auto& other = s.setup_optimizer(one);
      fsdp::State wrong{{"model", &m}, {"adam", &other}};
      expect_error("another grouping", [&] { s.load_checkpoint(path, wrong, /*strict=*/false); }, "has 2 parameter groups, this optimizer 1");
    }
  }
  return failures == before ? 0 : 1;
}

// The seed's clipping, broadcast and all_reduce at this world size: clip_gradients_norm of each
// norm_type and clip_gradients_value against LibTorch's own clip_grad_norm_ and clip_grad_value_
// on the whole model with the whole batch (the sharded step then lands where a plain SGD step on
// those clipped gradients does); a pickle value from the last rank; the mean of every rank's tensor.
int clip_main() {
  const int before = failures;
  const std::unique_ptr<fsdp::Strategy> world_of = joined_strategy();
  fsdp::Strategy& s = *world_of;
  const int rank = s.global_rank(), world = s.world_size();
  torch::manual_seed(70);
  const torch::Tensor x = torch::randn({6, 5}), y = torch::randn({6, 3});
  const int per = 6 / world;
  for (const double p : {2.0, 1.0, 3.5, static_cast<double>(INFINITY), -1.0}) {  // -1: by value
    auto& m = s.setup_module(model(1));
    fsdp::OptimizerOptions sgd;
    sgd.kind = fsdp::OptimizerKind::kSgd;
    sgd.weight_decay = 0.0;
    auto& opt = s.setup_optimizer(sgd);
    m.backward(torch::mse_loss(m.forward(x.narrow(0, rank * per, per)), y.narrow(0, rank * per, per)));
    torch::nn::Sequential ref = model(1);
    torch::mse_loss(ref->forward(x), y).backward();
    if (p > 0) {
      const double ours = s.clip_gradients_norm(opt, 0.05, p);
      const double theirs = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.05, p);
      EXPECT(std::abs(ours - theirs) <= 1e-5 * std::abs(theirs));
    } else {
      s.clip_gradients_value(opt, 0.01);
      torch::nn::utils::clip_grad_value_(ref->parameters(), 0.01);
    }
    opt.step(1.0);
    torch::NoGradGuard no_grad;
    for (auto& q : ref->parameters()) q.sub_(q.grad());
    const auto ours = m.full_state_dict();
    const auto theirs = ref->named_parameters();
    for (const auto& [name, t] : ours) EXPECT(torch::allclose(t, theirs[name], 1e-5, 1e-6));
  }
  // broadcast: any pickle value, from the last rank.
  const pk::ValuePtr sent = pk::make_dict({{pk::make_str("epoch"), pk::make_int(3)},
                                           {pk::make_str("lrs"), pk::make_list({pk::make_float(0.5), pk::make_none()})}});
  const pk::ValuePtr got = s.broadcast(rank == world - 1 ? sent : pk::make_none(), world - 1);
  EXPECT(got && pk::write(*got, 4) == pk::write(*sent, 4));
  // all_reduce: the mean by default; the input as it was.
  const torch::Tensor mine = torch::full({2}, static_cast<float>(rank + 1));
  EXPECT(s.all_reduce(mine).equal(torch::full({2}, static_cast<float>(world + 1) / 2.0f)));
  EXPECT(s.all_reduce(mine, fsdp::ReduceOp::kMax).equal(torch::full({2}, static_cast<float>(world))));
  EXPECT(mine.equal(torch::full({2}, static_cast<float>(rank + 1))));
  return failures == before ? 0 : 1;
}

// fsdp::set_num_threads reaches OpenBLAS's own pool (which torch::set_num_threads does not) where
// LibTorch computes through OpenBLAS, as Debian's does with libopenblas0-pthread installed.
using GetThreads = int (*)();
GetThreads openblas_get_num_threads() { return reinterpret_cast<GetThreads>(::dlsym(RTLD_DEFAULT, "openblas_get_num_threads")); }

// libfsdp owns precision and says whose mistake an error is: an option the strategy refuses is
// kInvalidArgument (a tool's usage error), a libckpt error keeps its file when it crosses,
// bf16-true converts the model in setup_module, and forward_context() autocasts bf16-mixed.
bool precision_and_error_kinds() {
  const int before = failures;
  auto kind_of = [](const std::function<void()>& f) -> std::optional<fsdp::ErrorKind> {
    try {
      f();
    } catch (const fsdp::Error& e) {
      return e.kind();
    }
    return std::nullopt;
  };
  auto opts = [] {
    fsdp::StrategyOptions o;
    o.warn = [](const std::string&) {};
    return o;
  };
  EXPECT(kind_of([&] { auto o = opts(); o.precision = "bf16-fast"; fsdp::Strategy s(o); }) == fsdp::ErrorKind::kInvalidArgument);
  EXPECT(kind_of([&] { auto o = opts(); o.precision = "16-mixed"; fsdp::Strategy s(o); }) == fsdp::ErrorKind::kInvalidArgument);
  EXPECT(kind_of([&] { auto o = opts(); o.sharding_strategy = "ZERO3"; fsdp::Strategy s(o); }) == fsdp::ErrorKind::kInvalidArgument);
  EXPECT(fsdp::parse_precision("bf16-true") == fsdp::Precision::kBf16True);
  EXPECT(fsdp::to_string(fsdp::Precision::kBf16Mixed) == "bf16-mixed");

  char tmpl[] = "/tmp/fsdp-precision-XXXXXX";
  const fs::path dir = ::mkdtemp(tmpl);
  {
    auto o = opts();
    o.precision = "bf16-true";
    fsdp::Strategy s(o);
    s.setup_environment({});
    fsdp::FullyShardedSequential& m = s.setup_module(model(3));
    for (const auto& [name, t] : m.full_state_dict()) EXPECT(t.scalar_type() == torch::kBFloat16);
    {
      const fsdp::Autocast context = s.forward_context();  // bf16-true: no autocast
      EXPECT(torch::mm(torch::ones({2, 2}), torch::ones({2, 2})).scalar_type() == torch::kFloat32);
    }
    // A libckpt error crossing: a save under a path whose parent is a file.
    std::ofstream(dir / "file") << "x";
    std::optional<fsdp::Error> crossed;
    try {
      fsdp::State state{{"model", &m}};
      s.save_checkpoint(dir / "file" / "ckpt", state);
    } catch (const fsdp::Error& e) {
      crossed = e;
    }
    EXPECT(crossed && crossed->kind() == fsdp::ErrorKind::kCheckpoint && crossed->file().has_value());
  }
  {
    auto o = opts();
    o.precision = "bf16-mixed";
    fsdp::Strategy s(o);
    s.setup_environment({});
    fsdp::FullyShardedSequential& m = s.setup_module(model(3));
    for (const auto& [name, t] : m.full_state_dict()) EXPECT(t.scalar_type() == torch::kFloat32);
    {
      const fsdp::Autocast context = s.forward_context();
      EXPECT(torch::mm(torch::ones({2, 2}), torch::ones({2, 2})).scalar_type() == torch::kBFloat16);
    }
    EXPECT(torch::mm(torch::ones({2, 2}), torch::ones({2, 2})).scalar_type() == torch::kFloat32);
  }
  fs::remove_all(dir);
  return failures == before;
}

}  // namespace

const fsdp_test::Mode kRank{"rank", [](const std::string& which) {
                              if (which.starts_with("buffers-")) return buffers_main(which == "buffers-save");
                              if (which == "clip") return clip_main();
                              return rank_main();
                            }};

TEST_CASE("fsdp strategy: the seed's errors, a sharded and a full save with a filter, strict and non-strict loads (world of one)", "[fsdp][strategy]") {
  const int before = failures;
  errors_table();
  CHECK(failures == before);
}

TEST_CASE("fsdp strategy: set_num_threads sets torch's intra-op threads", "[fsdp][strategy]") {
  fsdp::set_num_threads(3);
  CHECK(torch::get_num_threads() == 3);
  fsdp::set_num_threads(1);
  CHECK(torch::get_num_threads() == 1);
}

TEST_CASE("fsdp strategy: set_num_threads sets OpenBLAS's own pool where LibTorch computes through it", "[fsdp][strategy]") {
  const GetThreads get = openblas_get_num_threads();
  if (!get) fsdp_test::skip("LibTorch computes through another BLAS here: no OpenBLAS pool to set");
  const int before = get();
  CHECK(fsdp::set_num_threads(1));
  CHECK(get() == 1);
  fsdp::set_num_threads(3);
  CHECK(get() == 3);
  fsdp::set_num_threads(before);
  torch::set_num_threads(1);
}

TEST_CASE("fsdp strategy: precision parsed once: bf16-true converts the model, bf16-mixed autocasts in forward_context, and errors say their kind", "[fsdp][strategy]") {
  CHECK(precision_and_error_kinds());
}

TEST_CASE("fsdp strategy: save_checkpoint then load_checkpoint at 2 ranks, sharded and full: the same parameters, optimizer, schedule and next step", "[fsdp][strategy]") {
  char tmpl[] = "/tmp/fsdp-strategy2-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  ::setenv("FSDP_TEST_DIR", dir.c_str(), 1);
  const bool ok = fsdp_test::launch_ranks("save-load", 2);
  ::unsetenv("FSDP_TEST_DIR");
  fs::remove_all(dir);
  CHECK(ok);
}

TEST_CASE("fsdp strategy: buffers broadcast at setup, saved as rank 0's and loaded at 2 and 3 ranks, with two optimizers of their own groups in one state", "[fsdp][strategy]") {
  char tmpl[] = "/tmp/fsdp-buffers-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  ::setenv("FSDP_TEST_DIR", dir.c_str(), 1);
  const bool saved = fsdp_test::launch_ranks("buffers-save", 2);
  CHECK(saved);
  if (saved) CHECK(fsdp_test::launch_ranks("buffers-load", 3));
  ::unsetenv("FSDP_TEST_DIR");
  fs::remove_all(dir);
}

TEST_CASE("fsdp strategy: clip_gradients_norm of norm_type 2, 1, 3.5 and inf and clip_gradients_value equal LibTorch's at 1, 2 and 3 ranks, with broadcast and all_reduce", "[fsdp][strategy]") {
  for (int world : {1, 2, 3}) CHECK(fsdp_test::launch_ranks("clip", world));
}
