// SPDX-License-Identifier: Apache-2.0
// FullyShardedSequential against single-process training: the same MLP, seed and global batch,
// trained for a few SGD steps at world size 2 and 3 under FULL_SHARD, SHARD_GRAD_OP and NO_SHARD
// (each rank takes its contiguous part of the global batch), must end with the parameters that
// one process training on the whole batch ends with, within float tolerance. Like
// test_process_group, the binary runs itself as the ranks of each case.
#include <torch/torch.h>

#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <functional>
#include <cstring>
#include <iostream>
#include <map>
#include <string>

#include "ckpt/formats/dcp.hpp"
#include "ckpt/formats/torch_save.hpp"
#include "ckpt/io.hpp"
#include "fsdp/checkpoint.hpp"
#include "fsdp/fully_sharded.hpp"
#include "launch.hpp"

namespace {

constexpr int kBatch = 12, kSteps = 5;

// Its children made one after the other (a constructor's arguments are made in an unspecified
// order), as deferred initialization makes them.
torch::nn::Sequential model() {
  torch::manual_seed(7);
  torch::nn::Sequential seq;
  seq->push_back(torch::nn::Linear(6, 10));
  seq->push_back(torch::nn::Tanh());
  seq->push_back(torch::nn::Linear(10, 10));
  seq->push_back(torch::nn::ReLU());
  seq->push_back(torch::nn::Linear(10, 3));
  return seq;
}

// Set: the model whose backward Mix watches (below).
const fsdp::FullyShardedSequential* g_watched = nullptr;
int g_overlapped = 0;  // backwards in which a unit's reduce-scatter was still in flight when Mix's was done

// Linear(10, 10) then ReLU as one module of its own type, counting its forwards. Watching, it
// notes whether, once backward is through it (and its unit's gradients are all there), the
// reduction of the unit after it is still in flight: backward went on beside it.
struct MixImpl : torch::nn::Module {
  MixImpl() : lin(register_module("lin", torch::nn::Linear(10, 10))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    ++calls;
    if (g_watched && x.requires_grad()) {
      x.register_hook([](const torch::Tensor& g) {
        for (const auto& u : g_watched->units()) {
          if (u->reducing()) {
            ++g_overlapped;
            break;
          }
        }
        return g;
      });
    }
    return torch::relu(lin(x));
  }
  torch::nn::Linear lin;
  int calls = 0;
};
TORCH_MODULE(Mix);

// model()'s arithmetic and values (its parameters made in the same order) with the middle in a
// nested Sequential, an fsdp::Chain: in, body (Tanh, Mix), out. A policy that wraps Mix reaches
// it only by opening body.
torch::nn::Sequential nested_model(Mix& mix) {
  torch::manual_seed(7);
  torch::nn::Sequential seq;
  seq->push_back("in", torch::nn::Linear(6, 10));
  fsdp::Chain body;
  body->push_back(torch::nn::Tanh());
  mix = Mix();
  body->push_back(mix);
  seq->push_back("body", body);
  seq->push_back("out", torch::nn::Linear(10, 3));
  return seq;
}

std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(static_cast<std::uint64_t>(100 + step));
  return {torch::randn({kBatch, 6}), torch::randn({kBatch, 3})};
}

// Single process, whole batch; step `skip` not taken (a grad scaler's skipped step).
std::vector<std::pair<std::string, torch::Tensor>> reference(int skip = -1) {
  auto m = model();
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < kSteps; ++s) {
    if (s == skip) continue;
    auto [x, y] = batch(s);
    opt.zero_grad();
    torch::mse_loss(m->forward(x), y).backward();
    opt.step();
  }
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& p : m->named_parameters()) out.emplace_back(p.key(), p.value().detach().clone());
  return out;
}

// The same with FSDP's param_dtype bfloat16 at world size `world`: float32 master parameters,
// each rank's part of the batch run on a bfloat16 copy of them, the gradients averaged in
// bfloat16 (the reduce dtype follows the parameter dtype), then cast back for SGD.
std::vector<std::pair<std::string, torch::Tensor>> reference_param_dtype(int world) {
  auto m = model();
  const int per = kBatch / world;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    std::vector<torch::Tensor> sum;
    for (int r = 0; r < world; ++r) {
      auto low = model();
      {
        torch::NoGradGuard no_grad;
        for (std::size_t i = 0; i < low->parameters().size(); ++i) {
          low->parameters()[i].set_data(m->parameters()[i].detach().to(torch::kBFloat16));
        }
      }
      torch::mse_loss(low->forward(x.narrow(0, r * per, per).to(torch::kBFloat16)).to(torch::kFloat), y.narrow(0, r * per, per)).backward();
      for (std::size_t i = 0; i < low->parameters().size(); ++i) {
        const torch::Tensor g = low->parameters()[i].grad().to(torch::kFloat);
        if (sum.size() <= i) sum.push_back(g);
        else sum[i] = sum[i] + g;
      }
    }
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < sum.size(); ++i) {
      m->parameters()[i].sub_(sum[i].to(torch::kBFloat16).div(world).to(torch::kFloat), 0.1);
    }
  }
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& p : m->named_parameters()) out.emplace_back(p.key(), p.value().detach().clone());
  return out;
}

// An identity that counts its forwards: under activation checkpointing it runs twice a step.
struct CounterImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    ++calls;
    return x;
  }
  int calls = 0;
};
TORCH_MODULE(Counter);

// ShardedGradScaler at 2 ranks, scale 1024 growing every 2 clean steps: at step 2 rank 1's slice
// holds an inf, so both ranks skip that step and halve the scale. The result is single-process SGD
// without step 2 (scaling by a power of two is exact), and after each update the scale is 1024,
// 2048 (two clean steps), 1024 (the inf), 1024, 2048.
int scaler_rank_main() {
  std::map<std::string, std::string> env;
  for (const char* k : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) env[k] = std::getenv(k);
  fsdp::ProcessGroup pg(*fsdp::Rendezvous::from_environment(env), fsdp::Backend::kGloo, std::chrono::seconds(60));
  fsdp::FullyShardedSequential m(model(), pg, fsdp::ShardingStrategy::kFullShard);
  fsdp::ShardedOptimizer opt(m, {fsdp::OptimizerKind::kSgd, 0.1, 0.9, 0.999, 1e-8, 0.0, 0.0});
  fsdp::ShardedGradScaler scaler(opt, {1024.0, 2.0, 0.5, 2});
  const int per = kBatch / pg.size();
  const std::vector<double> want_scale{1024, 2048, 1024, 1024, 2048};  // after each update
  const std::vector<std::int64_t> want_tracker{1, 0, 0, 1, 0};
  int bad = 0;
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    opt.zero_grad();
    m.backward(scaler.scale(torch::mse_loss(m.forward(x.narrow(0, pg.rank() * per, per)), y.narrow(0, pg.rank() * per, per))));
    if (s == 2 && pg.rank() == 1) {
      torch::NoGradGuard no_grad;
      m.units().front()->shard().mutable_grad()[0] = INFINITY;
    }
    const bool stepped = scaler.step(0.1);
    scaler.update();
    if (stepped != (s != 2) || scaler.get_scale() != want_scale[static_cast<std::size_t>(s)] ||
        scaler.growth_tracker() != want_tracker[static_cast<std::size_t>(s)]) {
      std::cerr << "rank " << pg.rank() << " step " << s << ": stepped " << stepped << ", scale " << scaler.get_scale() << ", tracker "
                << scaler.growth_tracker() << "\n";
      bad = 1;
    }
  }
  const auto got = m.full_state_dict();
  const auto want = reference(/*skip=*/2);
  for (std::size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    if (!got[i].second.allclose(want[i].second, 1e-5, 1e-6)) {
      std::cerr << "rank " << pg.rank() << " scaler: " << got[i].first << " differs from single-process SGD without step 2 by "
                << (got[i].second - want[i].second).abs().max().item<double>() << "\n";
      bad = 1;
    }
  }
  return bad || got.size() != want.size();
}

// The values chunks_checkpoint() writes: model()'s, changed so that a load is seen.
std::vector<std::pair<std::string, torch::Tensor>> chunked_values() {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : model()->named_parameters()) out.emplace_back(item.key(), item.value().detach() * 2 + 1);
  return out;
}

// A DCP checkpoint of chunked_values() under "model." whose chunks no FSDP save makes: a weight
// split along dim 1 in columns of 3, a bias along dim 0 in pieces of 4, over 3 ranks' files.
void chunks_checkpoint(const std::filesystem::path& dir) {
  std::vector<ckpt::DcpWriteTensor> tensors;
  for (const auto& [name, value] : chunked_values()) {
    ckpt::DcpWriteTensor t{"model." + name, ckpt::DType::kFloat32, value.sizes().vec(), {}, true};
    const std::int64_t dim = value.dim() - 1, step = dim == 1 ? 3 : 4;
    for (std::int64_t at = 0, k = 0; at < value.size(dim); at += step, ++k) {
      const std::int64_t n = std::min(step, value.size(dim) - at);
      const torch::Tensor piece = value.narrow(dim, at, n).contiguous();
      std::vector<std::byte> bytes(static_cast<std::size_t>(piece.numel()) * 4);
      std::memcpy(bytes.data(), piece.data_ptr(), bytes.size());
      std::vector<std::int64_t> offsets(static_cast<std::size_t>(value.dim()), 0), sizes = value.sizes().vec();
      offsets[static_cast<std::size_t>(dim)] = at;
      sizes[static_cast<std::size_t>(dim)] = n;
      t.chunks.push_back({static_cast<int>(k % 3), offsets, sizes, ckpt::memory_source(std::move(bytes))});
    }
    tensors.push_back(std::move(t));
  }
  ckpt::DcpWriteOptions o;
  o.world_size = 3;
  ckpt::write_dcp(dir, tensors, {}, o);
}

// Each rank reads only its slice's rows of each chunk: what it holds, gathered, is the whole.
int chunks_rank_main() {
  std::map<std::string, std::string> env;
  for (const char* k : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) env[k] = std::getenv(k);
  fsdp::ProcessGroup pg(*fsdp::Rendezvous::from_environment(env), fsdp::Backend::kGloo, std::chrono::seconds(60));
  fsdp::FullyShardedSequential m(model(), pg, fsdp::ShardingStrategy::kFullShard);
  fsdp::load_sharded(std::getenv("FSDP_TEST_LOAD_DIR"), m, pg);
  const auto got = m.full_state_dict();
  const auto want = chunked_values();
  int bad = got.size() != want.size();
  for (std::size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    if (got[i].first != want[i].first || !got[i].second.equal(want[i].second)) {
      std::cerr << "rank " << pg.rank() << ": " << got[i].first << " is not what the checkpoint holds\n";
      bad = 1;
    }
  }
  return bad;
}

int rank_main(const std::string& strategy) {
  if (strategy == "scaler") return scaler_rank_main();
  if (strategy == "chunks") return chunks_rank_main();
  std::map<std::string, std::string> env;
  for (const char* k : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) env[k] = std::getenv(k);
  fsdp::ProcessGroup pg(*fsdp::Rendezvous::from_environment(env), fsdp::Backend::kGloo, std::chrono::seconds(60));
  // FSDP_TEST_CHECKPOINT: every child under activation checkpointing, a counter last.
  const bool checkpointing = std::getenv("FSDP_TEST_CHECKPOINT") != nullptr;
  torch::nn::Sequential seq = model();
  Counter counter;
  if (checkpointing) seq->push_back("counter", counter);
  // FSDP_TEST_NESTED=types|path|size|none: nested_model() under a policy that opens body (by
  // Mix's type name, by its path, by size: min_num_params 100, body holding 110) or none (body one
  // unit), with Mix under activation checkpointing (by the same policy under types, else by path).
  const char* nested = std::getenv("FSDP_TEST_NESTED");
  Mix mix{nullptr};
  fsdp::WrapPolicy policy;
  std::vector<std::string> want_leaves{"in", "body.0", "body.1", "out"};
  std::size_t want_units = 2;
  if (nested) {
    seq = nested_model(mix);
    const std::string how = nested;
    if (how == "types") policy.module_types = {"Mix"};
    else if (how == "path") policy.own_unit = [](const std::string& path) { return path == "body.1"; };
    else if (how == "size") policy.min_num_params = 100;  // in + body.1 (180), then out
    else want_leaves = {"in", "body", "out"}, want_units = 3;
  }
  // FSDP_TEST_MESH=R,S: a device mesh of R replicas of S shards (HYBRID_SHARD).
  std::unique_ptr<fsdp::DeviceMesh> mesh;
  if (const char* m = std::getenv("FSDP_TEST_MESH")) mesh = std::make_unique<fsdp::DeviceMesh>(pg, std::atoi(m), std::atoi(std::strchr(m, ',') + 1));
  // FSDP_TEST_PARAM_DTYPE: MixedPrecision(param_dtype=bfloat16).
  const bool low = std::getenv("FSDP_TEST_PARAM_DTYPE") != nullptr;
  fsdp::MixedPrecision mixed;
  if (low) mixed.param_dtype = torch::kBFloat16;
  // FSDP_TEST_DEFERRED: the same model made child by child, each unit sharded before the next
  // child is made (deferred initialization); every maker checks that no child made before it
  // still holds its full values.
  const bool deferred = std::getenv("FSDP_TEST_DEFERRED") != nullptr;
  int held_whole = 0;
  std::vector<std::pair<std::string, fsdp::ChildMaker>> makers;
  auto made = std::make_shared<std::vector<std::shared_ptr<torch::nn::Module>>>();
  auto add = [&](const std::string& name, std::function<torch::nn::AnyModule()> make) {
    makers.emplace_back(name, [made, make, &held_whole] {
      for (const auto& before : *made) {
        for (const auto& p : before->parameters()) held_whole += p.numel() > 0 ? 1 : 0;
      }
      torch::nn::AnyModule any = make();
      made->push_back(any.ptr());
      return any;
    });
  };
  if (nested) {  // nested_model(), child by child; its Chain opened as the policy says
    add("in", [] { return torch::nn::AnyModule(torch::nn::Linear(6, 10)); });
    add("body", [&mix] {
      mix = Mix();
      return torch::nn::AnyModule(fsdp::Chain(torch::nn::Tanh(), mix));
    });
    add("out", [] { return torch::nn::AnyModule(torch::nn::Linear(10, 3)); });
  } else {
    add("0", [] { return torch::nn::AnyModule(torch::nn::Linear(6, 10)); });
    add("1", [] { return torch::nn::AnyModule(torch::nn::Tanh()); });
    add("2", [] { return torch::nn::AnyModule(torch::nn::Linear(10, 10)); });
    add("3", [] { return torch::nn::AnyModule(torch::nn::ReLU()); });
    add("4", [] { return torch::nn::AnyModule(torch::nn::Linear(10, 3)); });
  }
  if (deferred) torch::manual_seed(7);  // as model() seeds before making the whole model
  fsdp::FullyShardedSequential m =
      deferred ? fsdp::FullyShardedSequential(makers, pg, fsdp::sharding_strategy_from_string(strategy), mixed, policy)
      : mesh   ? fsdp::FullyShardedSequential(seq, *mesh, fsdp::sharding_strategy_from_string(strategy), mixed)
               : fsdp::FullyShardedSequential(seq, pg, fsdp::sharding_strategy_from_string(strategy), mixed, policy);
  if (nested) {
    std::vector<std::string> leaves;
    for (const auto& leaf : m.leaves()) leaves.push_back(leaf.path);
    if (leaves != want_leaves || m.units().size() != want_units) {
      std::cerr << "rank " << pg.rank() << " " << nested << ": " << leaves.size() << " leaves (" << leaves.front() << ", ...), "
                << m.units().size() << " units\n";
      return 1;
    }
    if (policy.module_types.empty()) m.set_activation_checkpointing([](const std::string& path) { return path == "body.1"; });
    else m.set_activation_checkpointing(policy);  // Mix, by its type name
    if (!policy.own_unit && policy.module_types.empty() && !policy.min_num_params) {  // none: Mix runs once, not checkpointed
      if (m.overlap_reduction()) throw std::runtime_error("Gloo's default is not to overlap the reduction");
      m.set_overlap_reduction(true);
      g_watched = &m;
    }
  }
  // (Under a policy with a root unit, its first child stays whole until its last is made.)
  if (held_whole > 0 && !nested) {
    std::cerr << "deferred initialization: " << held_whole << " parameters of earlier children were still whole when a child was made\n";
    return 1;
  }
  if (checkpointing) m.set_activation_checkpointing([](const std::string&) { return true; });
  // FSDP_TEST_PREFETCH=none|forward: no prefetch, or forward and backward prefetch (default: backward).
  if (const char* p = std::getenv("FSDP_TEST_PREFETCH")) m.set_prefetch(std::string(p) == "forward", std::string(p) == "forward");
  torch::optim::SGD opt(m.parameters(), torch::optim::SGDOptions(0.1));
  const int per = kBatch / pg.size();
  // A resumed run: steps [from, to) after loading what an earlier run saved (any world size).
  const char* from_env = std::getenv("FSDP_TEST_FROM_STEP");
  const char* to_env = std::getenv("FSDP_TEST_TO_STEP");
  const int from = from_env ? std::atoi(from_env) : 0, to = to_env ? std::atoi(to_env) : kSteps;
  if (const char* dir = std::getenv("FSDP_TEST_LOAD_DIR")) fsdp::load_sharded(dir, m, pg);
  for (int s = from; s < to; ++s) {
    auto [x, y] = batch(s);
    opt.zero_grad();
    auto out = m.forward(x.narrow(0, pg.rank() * per, per));
    if (low) {
      // Computed with bfloat16 parameters; the optimizer's shards stay float32.
      for (const auto& u : m.units()) {
        if (u && u->gathered() && u->params().front().tensor.scalar_type() != torch::kBFloat16) {
          std::cerr << "rank " << pg.rank() << ": a gathered unit is not in bfloat16\n";
          return 1;
        }
        if (u && u->shard().scalar_type() != torch::kFloat) {
          std::cerr << "rank " << pg.rank() << ": a shard is not float32\n";
          return 1;
        }
      }
      out = out.to(torch::kFloat);
    }
    // FULL_SHARD holds no full parameters between forward and backward but the last unit's (the
    // first backward needs, as FSDP keeps the root's); SHARD_GRAD_OP keeps them all
    const fsdp::FlatUnit* last = nullptr;  // the one holding the model's last parameter
    for (const auto& u : m.units()) {
      for (const auto& p : u->params()) {
        if (p.fqn == seq->named_parameters().keys().back()) last = u.get();
      }
    }
    for (const auto& u : m.units()) {
      const bool frees = strategy == "FULL_SHARD" || strategy == "HYBRID_SHARD";
      if (u && u->gathered() != (!frees || u.get() == last)) {
        std::cerr << "rank " << pg.rank() << " " << strategy << ": a unit is " << (u->gathered() ? "" : "not ") << "gathered after forward\n";
        return 1;
      }
    }
    m.backward(torch::mse_loss(out, y.narrow(0, pg.rank() * per, per)));
    opt.step();
  }
  // Every unit's gradients were reduced inside backward, by the hook on its parameters'
  // accumulators (NOTE [Gradients reduced in backward]), none after it.
  if (m.reductions_in_backward() != static_cast<std::int64_t>(to - from) * static_cast<std::int64_t>(m.units().size())) {
    std::cerr << "rank " << pg.rank() << ": " << m.reductions_in_backward() << " unit reductions in backward over " << (to - from)
              << " steps of " << m.units().size() << " units\n";
    return 1;
  }
  if (strategy != "NO_SHARD") {
    // the shards are shards: each rank holds 1/world of every unit (1/shards under HYBRID_SHARD), padded
    const int shards = mesh && strategy == "HYBRID_SHARD" ? mesh->shards() : pg.size();
    for (const auto& u : m.units()) {
      if (u && u->shard().numel() * shards != u->padded_numel()) {
        std::cerr << "rank " << pg.rank() << ": a shard of " << u->shard().numel() << " of " << u->padded_numel() << "\n";
        return 1;
      }
    }
  }
  if (nested && mix->calls != (std::string(nested) == "none" ? 1 : 2) * (to - from)) {
    std::cerr << "rank " << pg.rank() << ": the nested Mix ran " << mix->calls << " times in " << (to - from) << " steps\n";
    return 1;
  }
  // NOTE [Gradients reduced in backward], overlapped: out's reduce-scatter, started when its
  // gradients were there, is waited for only when body's starts, after Mix's backward.
  if (g_watched && g_overlapped != to - from) {
    std::cerr << "rank " << pg.rank() << ": a reduction was in flight after Mix's backward in " << g_overlapped << " of " << (to - from)
              << " steps\n";
    return 1;
  }
  if (checkpointing && counter->calls != 2 * (to - from)) {
    std::cerr << "rank " << pg.rank() << ": the checkpointed counter ran " << counter->calls << " times in " << (to - from)
              << " steps, not twice a step\n";
    return 1;
  }
  if (const char* dir = std::getenv("FSDP_TEST_SAVE_DIR")) {
    fsdp::SaveOptions so;
    // A file per unit: the save writes each rank's files one by one (NOTE [A sharded save, file by file]).
    if (const char* bytes = std::getenv("FSDP_TEST_SAVE_FILE_BYTES")) so.file_bytes = std::atoll(bytes);
    fsdp::save_sharded(dir, m, pg, so);
  }
  if (to != kSteps) return 0;  // the first half of a resumed run: nothing to compare yet
  const auto got = m.full_state_dict();
  auto want = low ? reference_param_dtype(pg.size()) : reference();
  // Under the model's own names (the nested model's differ, its values do not).
  const auto names = seq->named_parameters().keys();
  for (std::size_t i = 0; i < std::min(names.size(), want.size()); ++i) want[i].first = names[i];
  int bad = 0;
  if (got.size() != want.size()) bad = 1;
  for (std::size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    if (got[i].first != want[i].first || !got[i].second.allclose(want[i].second, 1e-5, 1e-6)) {
      std::cerr << "rank " << pg.rank() << " " << strategy << ": " << got[i].first << " differs from single-process training by "
                << (got[i].second - want[i].second).abs().max().item<double>() << "\n";
      bad = 1;
    }
  }
  return bad;
}


// The reference parameters as a torch.save file of {fqn: tensor} (libckpt's writer).
void save_reference(const std::string& path) {
  ckpt::TorchSaveBuilder b;
  std::vector<std::pair<ckpt::pickle::ValuePtr, ckpt::pickle::ValuePtr>> items;
  for (const auto& [name, t] : reference()) {
    std::vector<std::byte> bytes(static_cast<std::size_t>(t.numel()) * sizeof(float));
    std::memcpy(bytes.data(), t.contiguous().data_ptr<float>(), bytes.size());
    const std::size_t st = b.add_storage(ckpt::DType::kFloat32, ckpt::memory_source(std::move(bytes)));
    items.emplace_back(ckpt::pickle::make_str(name), b.tensor(st, t.sizes().vec()));
  }
  auto sink = ckpt::open_file_sink(path, ckpt::Overwrite::kYes);
  b.write(*sink, *ckpt::pickle::make_dict(std::move(items)));
  sink->commit();
}

// `first` for 3 steps at `first_world` ranks (on `first_mesh` when set), saved; `saved(dir)`
// checks the checkpoint; loaded by `then` at `then_world` ranks for the last 2 steps, which must
// end where single-process training does.
bool save_then_resume(const char* first, int first_world, const char* first_mesh, const char* then, int then_world,
                      const std::function<bool(const std::string&)>& saved = {}) {
  char tmpl[] = "/tmp/fsdp-resume-XXXXXX";
  const std::string dir = std::string(::mkdtemp(tmpl)) + "/ckpt";
  if (first_mesh) ::setenv("FSDP_TEST_MESH", first_mesh, 1);
  ::setenv("FSDP_TEST_TO_STEP", "3", 1);
  ::setenv("FSDP_TEST_SAVE_DIR", dir.c_str(), 1);
  bool ok = fsdp_test::launch_ranks(first, first_world);
  ::unsetenv("FSDP_TEST_MESH");
  ::unsetenv("FSDP_TEST_SAVE_DIR");
  ::unsetenv("FSDP_TEST_TO_STEP");
  ok = ok && (!saved || saved(dir));
  ::setenv("FSDP_TEST_FROM_STEP", "3", 1);
  ::setenv("FSDP_TEST_LOAD_DIR", dir.c_str(), 1);
  ok = ok && fsdp_test::launch_ranks(then, then_world);
  ::unsetenv("FSDP_TEST_FROM_STEP");
  ::unsetenv("FSDP_TEST_LOAD_DIR");
  std::filesystem::remove_all(std::filesystem::path(dir).parent_path());
  return ok;
}

}  // namespace

// For the PyTorch interop test (interop.fsdp_checkpoint): `BINARY save OUT` writes sharded
// checkpoints at world size 2, 3 and 4 (HYBRID_SHARD on a 2 x 2 mesh), and the reference.
const fsdp_test::Mode kSave{"save", [](const std::string& out) {
  save_reference(out + "/reference.pt");
  bool ok = true;
  struct Case {
    std::string strategy;
    int world;
    const char* mesh;
  };
  for (const auto& [strategy, world, mesh] : std::vector<Case>{{"FULL_SHARD", 2, nullptr}, {"SHARD_GRAD_OP", 3, nullptr}, {"HYBRID_SHARD", 4, "2,2"}}) {
    ::setenv("FSDP_TEST_SAVE_DIR", (out + "/" + strategy + "_w" + std::to_string(world)).c_str(), 1);
    if (mesh) ::setenv("FSDP_TEST_MESH", mesh, 1);
    if (world == 3) ::setenv("FSDP_TEST_SAVE_FILE_BYTES", "1", 1);  // PyTorch reads a rank's several files too
    ok = fsdp_test::launch_ranks(strategy, world) && ok;
    ::unsetenv("FSDP_TEST_MESH");
    ::unsetenv("FSDP_TEST_SAVE_FILE_BYTES");
  }
  return ok ? 0 : 1;
}};
const fsdp_test::Mode kRank{"rank", [](const std::string& strategy) { return rank_main(strategy); }};

// Runs `strategy` at `world` ranks with the environment variables `env` set for the ranks.
bool ranks_with(const std::string& strategy, int world, const std::vector<std::pair<const char*, const char*>>& env) {
  for (const auto& [k, v] : env) ::setenv(k, v, 1);
  const bool ok = fsdp_test::launch_ranks(strategy, world);
  for (const auto& [k, v] : env) ::unsetenv(k);
  return ok;
}

TEST_CASE("fsdp: 3 steps at world size 2, saved, resumed at world size 3 for 2 more equals 5 single-process steps", "[fsdp]") {
  CHECK(save_then_resume("FULL_SHARD", 2, nullptr, "SHARD_GRAD_OP", 3));
}

TEST_CASE("fsdp: a save written file by file (a data file per unit and rank) resumes at world size 3 as 5 single-process steps", "[fsdp]") {
  ::setenv("FSDP_TEST_SAVE_FILE_BYTES", "1", 1);
  CHECK(save_then_resume("FULL_SHARD", 2, nullptr, "FULL_SHARD", 3, [](const std::string& dir) {
    // Each rank wrote one file per unit, each holding that unit's chunks.
    int files = 0;
    for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.path().extension() == ".distcp";
    return files > 2 && std::filesystem::file_size(dir + "/__0_1.distcp") > 0 && std::filesystem::file_size(dir + "/__1_1.distcp") > 0;
  }));
  ::unsetenv("FSDP_TEST_SAVE_FILE_BYTES");
}

TEST_CASE("fsdp: a checkpoint chunked along dim 1 loads at world size 2 and 3, each rank reading its rows", "[fsdp]") {
  char tmpl[] = "/tmp/fsdp-chunks-XXXXXX";
  const std::filesystem::path dir = std::filesystem::path(::mkdtemp(tmpl)) / "ckpt";
  chunks_checkpoint(dir);
  for (int world : {2, 3}) {
    SECTION(std::to_string(world) + " ranks") { CHECK(ranks_with("chunks", world, {{"FSDP_TEST_LOAD_DIR", dir.c_str()}})); }
  }
  std::filesystem::remove_all(dir.parent_path());
}

TEST_CASE("fsdp: ShardedGradScaler at world size 2 skips a step with an inf on one rank, halves and doubles the scale", "[fsdp]") {
  // An inf in one rank's slice skips the step on both ranks and halves the scale, 2 clean steps
  // double it; equals single-process SGD without the skipped step.
  CHECK(fsdp_test::launch_ranks("scaler", 2));
}

TEST_CASE("fsdp: FULL_SHARD at world size 3 with each prefetch equals single-process training", "[fsdp]") {
  for (const char* prefetch : {"none", "forward"}) {  // the default, backward, is in the plain cases
    SECTION(std::string("prefetch ") + prefetch) { CHECK(ranks_with("FULL_SHARD", 3, {{"FSDP_TEST_PREFETCH", prefetch}})); }
  }
}

TEST_CASE("fsdp: param_dtype bfloat16 (float32 shards) at world size 2 equals the same arithmetic in one process", "[fsdp]") {
  for (const char* strategy : {"FULL_SHARD", "NO_SHARD"}) {
    SECTION(strategy) { CHECK(ranks_with(strategy, 2, {{"FSDP_TEST_PARAM_DTYPE", "1"}})); }
  }
}

TEST_CASE("fsdp: FULL_SHARD at world size 2 with activation checkpointing equals single-process training", "[fsdp]") {
  CHECK(ranks_with("FULL_SHARD", 2, {{"FSDP_TEST_CHECKPOINT", "1"}}));  // each child run again in backward
}

TEST_CASE("fsdp: deferred initialization of a nested model, its Chain opened by type, equals single-process training", "[fsdp]") {
  CHECK(ranks_with("FULL_SHARD", 2, {{"FSDP_TEST_DEFERRED", "1"}, {"FSDP_TEST_NESTED", "types"}}));
}

TEST_CASE("fsdp: deferred initialization (each child made after the units before it are sharded) equals single-process training", "[fsdp]") {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP"}) {
    SECTION(strategy) { CHECK(ranks_with(strategy, 2, {{"FSDP_TEST_DEFERRED", "1"}})); }
  }
}

TEST_CASE("fsdp: HYBRID_SHARD (sharded within a replica, averaged across replicas) equals single-process training", "[fsdp]") {
  for (const char* mesh : {"2,2", "2,1", "1,3"}) {  // 2,1: replication alone
    SECTION(std::string("mesh ") + mesh) {
      const int world = std::atoi(mesh) * std::atoi(std::strchr(mesh, ',') + 1);
      CHECK(ranks_with("HYBRID_SHARD", world, {{"FSDP_TEST_MESH", mesh}}));
    }
  }
}

TEST_CASE("fsdp: a HYBRID_SHARD save on a 2,2 mesh resumed by FULL_SHARD at world size 3 equals 5 single-process steps", "[fsdp]") {
  // Written by the first replica: the second replica's ranks write empty files, as a DCP rank
  // with no item does.
  CHECK(save_then_resume("HYBRID_SHARD", 4, "2,2", "FULL_SHARD", 3, [](const std::string& dir) {
    return std::filesystem::file_size(dir + "/__2_0.distcp") == 0 && std::filesystem::file_size(dir + "/__3_0.distcp") == 0 &&
           std::filesystem::file_size(dir + "/__1_0.distcp") > 0;
  }));
}

TEST_CASE("fsdp: a nested Sequential, opened by a policy or left whole, equals single-process training under the model's FQNs", "[fsdp]") {
  // types, path, size: opened by that policy (its Mix checkpointed); none: left whole by the
  // default policy, with the reduction overlapped (out's reduce-scatter still in flight after
  // Mix's backward).
  for (const char* how : {"types", "path", "size", "none"}) {
    SECTION(how) { CHECK(ranks_with("FULL_SHARD", 2, {{"FSDP_TEST_NESTED", how}})); }
  }
}

TEST_CASE("fsdp: each sharding strategy at world size 2 and 3 equals single-process training", "[fsdp]") {
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) {
    for (int world : {2, 3}) {
      SECTION(std::string(strategy) + " at " + std::to_string(world)) { CHECK(fsdp_test::launch_ranks(strategy, world)); }
    }
  }
}
