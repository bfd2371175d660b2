// SPDX-License-Identifier: Apache-2.0
// FullyShardedModule against the same arithmetic in one process: a module of the user's own whose
// forward takes two tensors, whose Sharded blocks return two tensors and hold a buffer, with
// dropout, trained for a few SGD steps at world size 2 and 3 under each sharding strategy, units
// chosen by hand (every Sharded submodule), by type and by size, with and without activation
// checkpointing. Each rank seeds its generator per step, and the reference runs each rank's part
// of the batch in turn with that rank's seed, so dropout draws the same masks; under activation
// checkpointing the recompute must draw them again (the RNG state restored), or the gradients
// differ. Like the other libfsdp tests, the binary runs itself as the ranks of each case.
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <string>
#include <tuple>

#include "fsdp/checkpoint.hpp"
#include "fsdp/optim.hpp"
#include "fsdp/sharded_module.hpp"
#include "fsdp/strategy.hpp"
#include "launch.hpp"

namespace {

constexpr int kBatch = 12, kSteps = 4, kDim = 8;

// Deferred initialization: the blocks made so far, and how many of their parameters still held
// their full values when a later block was made (none should, once sharded).
bool check_deferred = false;
std::vector<torch::nn::Module*> blocks_made;
int held_whole = 0;

// Two inputs, two outputs, a buffer, dropout.
struct BlockImpl : torch::nn::Module {
  BlockImpl()
      : lin(register_module("lin", torch::nn::Linear(kDim, kDim))),
        gate(register_module("gate", torch::nn::Linear(kDim, kDim))),
        drop(register_module("drop", torch::nn::Dropout(0.25))) {
    scale = register_buffer("scale", torch::rand({kDim}) + 0.5);
    if (check_deferred) {
      for (torch::nn::Module* before : blocks_made) {
        for (const auto& p : before->parameters()) held_whole += p.numel() > 0 ? 1 : 0;
      }
      blocks_made.push_back(this);
    }
  }
  std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& context) {
    ++calls;
    const torch::Tensor h = torch::tanh(lin(x)) * scale + context;
    const torch::Tensor g = torch::sigmoid(gate(drop(h)));
    return {h * g, g.mean(1)};
  }
  torch::nn::Linear lin, gate;
  torch::nn::Dropout drop;
  torch::Tensor scale;
  int calls = 0;
};

// Sharded<B> where Sharded, else B itself: the reference is the same module, not sharded.
template <bool kSharded, class Impl>
using Maybe = std::conditional_t<kSharded, fsdp::Sharded<Impl>, Impl>;

template <bool kSharded>
struct NetImpl : torch::nn::Module {
  NetImpl()
      : in(register_module("in", torch::nn::Linear(6, kDim))),
        b0(register_module("b0", std::make_shared<Maybe<kSharded, BlockImpl>>())),
        b1(register_module("b1", std::make_shared<Maybe<kSharded, BlockImpl>>())),
        out(register_module("out", std::make_shared<Maybe<kSharded, torch::nn::LinearImpl>>(kDim, 3))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context) {
    const torch::Tensor h = in(x);
    auto [h1, s1] = b0->forward(h, context);
    auto [h2, s2] = b1->forward(h1, context);
    return out->forward(h2) + (s1 + s2).unsqueeze(1);
  }
  torch::nn::Linear in;
  std::shared_ptr<Maybe<kSharded, BlockImpl>> b0, b1;
  std::shared_ptr<Maybe<kSharded, torch::nn::LinearImpl>> out;
};

template <bool kSharded>
std::shared_ptr<NetImpl<kSharded>> make_net() {
  torch::manual_seed(7);
  auto net = std::make_shared<NetImpl<kSharded>>();
  net->train();
  return net;
}

struct Batch {
  torch::Tensor x, context, y;
};
Batch batch(int step) {
  torch::manual_seed(static_cast<std::uint64_t>(100 + step));
  return {torch::randn({kBatch, 6}), torch::randn({kBatch, kDim}), torch::randn({kBatch, 3})};
}
Batch part(const Batch& b, int rank, int world) {
  const int per = kBatch / world;
  return {b.x.narrow(0, rank * per, per), b.context.narrow(0, rank * per, per), b.y.narrow(0, rank * per, per)};
}
void seed_for(int step, int rank) { torch::manual_seed(static_cast<std::uint64_t>(1000 + 10 * step + rank)); }

// One process: each step, every rank's part in turn under that rank's seed, the gradients of
// their losses averaged, then SGD; `world` ranks from step `from` on, `before` ranks before it.
std::vector<std::pair<std::string, torch::Tensor>> reference(int world, int steps, int from = 0, int before = 0) {
  auto net = make_net<false>();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < steps; ++s) {
    const Batch b = batch(s);
    opt.zero_grad();
    const int w = s < from ? before : world;
    for (int r = 0; r < w; ++r) {
      const Batch p = part(b, r, w);
      seed_for(s, r);
      (torch::mse_loss(net->forward(p.x, p.context), p.y) / w).backward();
    }
    opt.step();
  }
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : net->named_parameters()) out.emplace_back(item.key(), item.value().detach().clone());
  for (const auto& item : net->named_buffers()) out.emplace_back(item.key(), item.value().detach().clone());
  return out;
}

// The same under FSDP's MixedPrecision(param_dtype, reduce_dtype, buffer_dtype all bfloat16):
// float32 master values, each rank's part computed on a bfloat16 copy of them (inputs and buffers
// cast too), the gradients averaged in bfloat16, then cast back for SGD.
std::vector<std::pair<std::string, torch::Tensor>> reference_bf16(int world, int steps) {
  auto net = make_net<false>();
  const auto params = net->parameters();
  for (int s = 0; s < steps; ++s) {
    const Batch b = batch(s);
    std::vector<torch::Tensor> sum(params.size());
    for (int r = 0; r < world; ++r) {
      auto low = make_net<false>();
      {
        torch::NoGradGuard no_grad;
        for (std::size_t i = 0; i < params.size(); ++i) low->parameters()[i].set_data(params[i].detach().to(torch::kBFloat16));
        for (std::size_t i = 0; i < net->buffers().size(); ++i) low->buffers()[i].set_data(net->buffers()[i].to(torch::kBFloat16));
      }
      const Batch p = part(b, r, world);
      seed_for(s, r);
      torch::mse_loss(low->forward(p.x.to(torch::kBFloat16), p.context.to(torch::kBFloat16)).to(torch::kFloat), p.y).backward();
      for (std::size_t i = 0; i < params.size(); ++i) {
        const torch::Tensor g = low->parameters()[i].grad().to(torch::kFloat);
        sum[i] = sum[i].defined() ? sum[i] + g : g;
      }
    }
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < params.size(); ++i) params[i].sub_(sum[i].to(torch::kBFloat16).div(world).to(torch::kFloat), 0.1);
  }
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : net->named_parameters()) out.emplace_back(item.key(), item.value().detach().clone());
  for (const auto& item : net->named_buffers()) out.emplace_back(item.key(), item.value().detach().clone());
  return out;
}

std::map<std::string, std::string> env_of_rank() {
  std::map<std::string, std::string> env;
  for (const char* k : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) env[k] = std::getenv(k);
  return env;
}

// FSDP_TEST_POLICY: hand (every Sharded submodule a unit), type (Block only: out's weight joins
// the root's unit) or size (at least 100 parameters: the blocks, 144 each, not out's 27).
fsdp::WrapPolicy policy_of(const std::string& how) {
  fsdp::WrapPolicy p;
  if (how == "type") p.module_types = {"Block"};
  if (how == "size") p.min_num_params = 100;
  return p;
}

int rank_main(const std::string& strategy_name) {
  fsdp::ProcessGroup pg(*fsdp::Rendezvous::from_environment(env_of_rank()), fsdp::Backend::kGloo, std::chrono::seconds(60));
  const fsdp::ShardingStrategy strategy = fsdp::sharding_strategy_from_string(strategy_name);
  const std::string how = std::getenv("FSDP_TEST_POLICY") ? std::getenv("FSDP_TEST_POLICY") : "hand";
  const bool checkpointing = std::getenv("FSDP_TEST_CHECKPOINT") != nullptr;
  // FSDP_TEST_BF16: MixedPrecision with bfloat16 parameters, reductions and buffers.
  const bool bf16 = std::getenv("FSDP_TEST_BF16") != nullptr;
  const fsdp::MixedPrecision mixed = bf16 ? fsdp::MixedPrecision{torch::kBFloat16, torch::kBFloat16, torch::kBFloat16} : fsdp::MixedPrecision{};
  // FSDP_TEST_DEFERRED: the module made by a factory, each block sharded as it is made.
  const bool deferred = std::getenv("FSDP_TEST_DEFERRED") != nullptr;
  auto net = deferred ? nullptr : make_net<true>();
  const fsdp::OptimizerOptions sgd{fsdp::OptimizerKind::kSgd, 0.1, 0.9, 0.999, 1e-8, 0.0, 0.0};
  // Made directly, or (FSDP_TEST_STRATEGY) by fsdp::Strategy's setup_module from its options.
  std::unique_ptr<fsdp::DeviceMesh> mesh;
  std::unique_ptr<fsdp::FullyShardedModule<NetImpl<true>>> owned;
  std::unique_ptr<fsdp::ShardedOptimizer> owned_opt;
  std::unique_ptr<fsdp::Strategy> fabric;
  fsdp::FullyShardedModule<NetImpl<true>>* model = nullptr;
  fsdp::ShardedOptimizer* optimizer = nullptr;
  if (std::getenv("FSDP_TEST_STRATEGY")) {
    fsdp::StrategyOptions o = fsdp::registered_strategy("fsdp");
    o.sharding_strategy = strategy_name;
    o.process_group = &pg;
    o.auto_wrap_policy = policy_of(how);
    if (checkpointing) o.activation_checkpointing_policy = policy_of("type");
    fabric = std::make_unique<fsdp::Strategy>(o);
    fabric->setup_environment({});
    if (deferred) {
      check_deferred = strategy != fsdp::ShardingStrategy::kNoShard;
      model = &fabric->setup_module<NetImpl<true>>([] { return make_net<true>(); });
      net = model->ptr();
    } else {
      model = &fabric->setup_module(net);
    }
    optimizer = &fabric->setup_optimizer(sgd);
  } else {
    if (deferred) {
      check_deferred = strategy != fsdp::ShardingStrategy::kNoShard;  // NO_SHARD computes with the full values
      owned = std::make_unique<fsdp::FullyShardedModule<NetImpl<true>>>([] { return make_net<true>(); }, pg, strategy, mixed, policy_of(how));
      net = owned->ptr();
    } else if (strategy == fsdp::ShardingStrategy::kHybridShard) {
      mesh = std::make_unique<fsdp::DeviceMesh>(pg, 2, pg.size() / 2);
      owned = std::make_unique<fsdp::FullyShardedModule<NetImpl<true>>>(net, *mesh, strategy, mixed, policy_of(how));
    } else {
      owned = std::make_unique<fsdp::FullyShardedModule<NetImpl<true>>>(net, pg, strategy, mixed, policy_of(how));
    }
    if (checkpointing) owned->set_activation_checkpointing(policy_of("type"));
    model = owned.get();
    owned_opt = std::make_unique<fsdp::ShardedOptimizer>(*model, sgd);
    optimizer = owned_opt.get();
  }
  fsdp::ShardedOptimizer& opt = *optimizer;
  int bad = 0;
  if (held_whole > 0 || (check_deferred && blocks_made.size() != 2)) {
    std::cerr << "rank " << pg.rank() << ": " << held_whole << " parameters of blocks made before another still held their full values\n";
    bad = 1;
  }
  const std::size_t want_units = how == "hand" ? 4 : 3;  // the root's (in), b0, b1 and, by hand, out
  if (model->units().size() != want_units || !model->root_unit()) {
    std::cerr << "rank " << pg.rank() << ": " << model->units().size() << " units, want " << want_units << "\n";
    bad = 1;
  }
  const int steps = std::getenv("FSDP_TEST_STEPS") ? std::atoi(std::getenv("FSDP_TEST_STEPS")) : kSteps;
  if (const char* dir = std::getenv("FSDP_TEST_LOAD_DIR")) {
    if (fabric) {
      fsdp::State state{{"model", model}, {"optimizer", &opt}};
      fabric->load_checkpoint(dir, state);
    } else {
      fsdp::LoadOptions o;
      o.optimizers = {{"optimizer", &opt}};
      fsdp::load_sharded(dir, *model, pg, o);
    }
  }
  const int first = std::getenv("FSDP_TEST_FIRST_STEP") ? std::atoi(std::getenv("FSDP_TEST_FIRST_STEP")) : 0;
  const int world = pg.size();
  for (int s = first; s < steps; ++s) {
    const Batch p = part(batch(s), pg.rank(), world);
    seed_for(s, pg.rank());
    opt.zero_grad();
    model->backward(torch::mse_loss(model->forward(p.x, p.context).to(torch::kFloat), p.y));
    opt.step();
    // Between steps each rank holds its slices only (not with NO_SHARD).
    const auto bytes = model->bytes();
    if (strategy != fsdp::ShardingStrategy::kNoShard && strategy != fsdp::ShardingStrategy::kHybridShard &&
        bytes.parameters * pg.size() > bytes.unsharded_parameters + 4 * 4 * pg.size() * static_cast<std::int64_t>(model->units().size())) {
      std::cerr << "rank " << pg.rank() << ": holds " << bytes.parameters << " bytes of " << bytes.unsharded_parameters << "\n";
      bad = 1;
    }
  }
  if (checkpointing && net->b0->calls != 2 * (steps - first)) {
    std::cerr << "rank " << pg.rank() << ": b0 ran " << net->b0->calls << " times in " << steps - first << " checkpointed steps\n";
    bad = 1;
  }
  if (const char* dir = std::getenv("FSDP_TEST_SAVE_DIR")) {
    if (fabric) {
      fabric->save_checkpoint(dir, {{"model", model}, {"optimizer", &opt}});
    } else {
      fsdp::SaveOptions o;
      o.optimizers = {{"optimizer", &opt}};
      fsdp::save_sharded(dir, *model, pg, o);
    }
  }
  const auto got = model->full_state_dict();
  // Resumed (FSDP_TEST_SAVED_AT: the world size that took the first steps): those steps at that size.
  const int saved_at = std::getenv("FSDP_TEST_SAVED_AT") ? std::atoi(std::getenv("FSDP_TEST_SAVED_AT")) : world;
  const auto want = bf16 ? reference_bf16(world, steps) : reference(world, steps, first, saved_at);
  if (got.size() != want.size()) {
    std::cerr << "rank " << pg.rank() << ": " << got.size() << " state dict entries, want " << want.size() << "\n";
    return 1;
  }
  const std::map<std::string, torch::Tensor> by_name(want.begin(), want.end());
  for (const auto& [name, value] : got) {
    const auto it = by_name.find(name);
    if (it == by_name.end()) {
      std::cerr << "rank " << pg.rank() << ": " << name << " is not the module's\n";
      bad = 1;
    } else if (!value.allclose(it->second.to(value.scalar_type()), 1e-5, 1e-6)) {
      std::cerr << "rank " << pg.rank() << ": " << name << " differs by " << (value.to(torch::kFloat) - it->second).abs().max().item<double>() << "\n";
      bad = 1;
    }
  }
  return bad;
}

const fsdp_test::Mode kRank{"rank", [](const std::string& strategy) { return rank_main(strategy); }};

bool ranks_with(const std::string& strategy, int world, const std::vector<std::pair<const char*, std::string>>& env) {
  for (const auto& [k, v] : env) ::setenv(k, v.c_str(), 1);
  const bool ok = fsdp_test::launch_ranks(strategy, world);
  for (const auto& [k, v] : env) ::unsetenv(k);
  return ok;
}

}  // namespace

TEST_CASE("fsdp module: each sharding strategy at world size 2 and 3 with units by hand equals the same arithmetic in one process", "[fsdp]") {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) {
    for (int world : {2, 3}) {
      SECTION(std::string(strategy) + " at " + std::to_string(world)) { CHECK(ranks_with(strategy, world, {})); }
    }
  }
  SECTION("HYBRID_SHARD on a 2,2 mesh") { CHECK(ranks_with("HYBRID_SHARD", 4, {})); }
}

TEST_CASE("fsdp module: units by type and by size with activation checkpointing and dropout at world size 2 and 3 equal the reference", "[fsdp]") {
  for (const char* how : {"type", "size"}) {
    for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) {
      for (int world : {2, 3}) {
        SECTION(std::string(how) + ", " + strategy + " at " + std::to_string(world)) {
          CHECK(ranks_with(strategy, world, {{"FSDP_TEST_POLICY", how}, {"FSDP_TEST_CHECKPOINT", "1"}}));
        }
      }
    }
  }
}

// At world size 2 only: the sum of two bfloat16 gradients rounds once, as the reference's does;
// of three, a reduction rounds after each addition in an order of its own.
TEST_CASE("fsdp module: bfloat16 parameters, reductions and buffers at world size 2 equal the same arithmetic in one process", "[fsdp]") {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP"}) {
    SECTION(strategy) { CHECK(ranks_with(strategy, 2, {{"FSDP_TEST_BF16", "1"}, {"FSDP_TEST_POLICY", "type"}, {"FSDP_TEST_CHECKPOINT", "1"}})); }
  }
}

TEST_CASE("fsdp module: 2 steps at world size 3 with units by hand then saved and resumed at world size 2 with units by type equal the reference", "[fsdp]") {
  const auto dir = std::filesystem::temp_directory_path() / ("fsdp-module-resume-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  CHECK(ranks_with("FULL_SHARD", 3, {{"FSDP_TEST_STEPS", "2"}, {"FSDP_TEST_SAVE_DIR", dir.string()}}));
  CHECK(ranks_with("SHARD_GRAD_OP", 2, {{"FSDP_TEST_STEPS", "4"}, {"FSDP_TEST_FIRST_STEP", "2"}, {"FSDP_TEST_LOAD_DIR", dir.string()},
                                       {"FSDP_TEST_POLICY", "type"}, {"FSDP_TEST_SAVED_AT", "3"}}));
  std::filesystem::remove_all(dir);
}

TEST_CASE("fsdp module: fsdp::Strategy sets up a module of its own by type with activation checkpointing then saves and resumes it at another world size", "[fsdp]") {
  const auto dir = std::filesystem::temp_directory_path() / ("fsdp-module-strategy-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  CHECK(ranks_with("FULL_SHARD", 2, {{"FSDP_TEST_STRATEGY", "1"}, {"FSDP_TEST_POLICY", "type"}, {"FSDP_TEST_CHECKPOINT", "1"},
                                    {"FSDP_TEST_STEPS", "2"}, {"FSDP_TEST_SAVE_DIR", dir.string()}}));
  CHECK(ranks_with("SHARD_GRAD_OP", 3, {{"FSDP_TEST_STRATEGY", "1"}, {"FSDP_TEST_POLICY", "size"}, {"FSDP_TEST_STEPS", "4"},
                                       {"FSDP_TEST_FIRST_STEP", "2"}, {"FSDP_TEST_LOAD_DIR", dir.string()}, {"FSDP_TEST_SAVED_AT", "2"}}));
  std::filesystem::remove_all(dir);
}

TEST_CASE("fsdp module: deferred initialization (each block sharded as it is made) by hand and by type and by size equals the reference", "[fsdp]") {
  SECTION("by hand, FULL_SHARD at 2") { CHECK(ranks_with("FULL_SHARD", 2, {{"FSDP_TEST_DEFERRED", "1"}})); }
  SECTION("by type, SHARD_GRAD_OP at 3, checkpointed") {
    CHECK(ranks_with("SHARD_GRAD_OP", 3, {{"FSDP_TEST_DEFERRED", "1"}, {"FSDP_TEST_POLICY", "type"}, {"FSDP_TEST_CHECKPOINT", "1"}}));
  }
  SECTION("by size, FULL_SHARD at 3") { CHECK(ranks_with("FULL_SHARD", 3, {{"FSDP_TEST_DEFERRED", "1"}, {"FSDP_TEST_POLICY", "size"}})); }
  SECTION("by size, NO_SHARD at 2") { CHECK(ranks_with("NO_SHARD", 2, {{"FSDP_TEST_DEFERRED", "1"}, {"FSDP_TEST_POLICY", "size"}})); }
  SECTION("through fsdp::Strategy by type, FULL_SHARD at 2, checkpointed") {
    CHECK(ranks_with("FULL_SHARD", 2, {{"FSDP_TEST_DEFERRED", "1"}, {"FSDP_TEST_STRATEGY", "1"}, {"FSDP_TEST_POLICY", "type"}, {"FSDP_TEST_CHECKPOINT", "1"}}));
  }
}

namespace {
// A module whose two Sharded blocks share one Linear: the tie crosses units.
struct TiedImpl : torch::nn::Module {
  TiedImpl() {
    shared = torch::nn::Linear(kDim, kDim);
    a = register_module("a", std::make_shared<fsdp::Sharded<torch::nn::SequentialImpl>>(shared));
    b = register_module("b", std::make_shared<fsdp::Sharded<torch::nn::SequentialImpl>>(shared));
  }
  torch::nn::Linear shared{nullptr};
  std::shared_ptr<fsdp::Sharded<torch::nn::SequentialImpl>> a, b;
};
}  // namespace

TEST_CASE("fsdp module: deferred initialization refuses a policy by path and a weight tied across units", "[fsdp]") {
  fsdp::ProcessGroup pg(*fsdp::Rendezvous::from_environment({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(fsdp_test::free_port())}}),
                        fsdp::Backend::kGloo, std::chrono::seconds(10));
  fsdp::WrapPolicy by_path;
  by_path.own_unit = [](const std::string& path) { return path == "b0"; };
  CHECK_THROWS_WITH(fsdp::FullyShardedModule<NetImpl<true>>([] { return make_net<true>(); }, pg, fsdp::ShardingStrategy::kFullShard, {}, by_path),
                    Catch::Contains("a policy by path needs the whole module"));
  CHECK_THROWS_WITH(fsdp::FullyShardedModule<TiedImpl>([] { return std::make_shared<TiedImpl>(); }, pg, fsdp::ShardingStrategy::kFullShard),
                    Catch::Contains("'a' shares a Parameter with another module"));
  // Made whole, the same module shards: the tied weight joins the root's unit.
  fsdp::FullyShardedModule<TiedImpl> whole(std::make_shared<TiedImpl>(), pg, fsdp::ShardingStrategy::kFullShard);
  CHECK(whole.root_unit() != nullptr);
}
