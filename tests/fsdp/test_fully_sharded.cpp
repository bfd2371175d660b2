// SPDX-License-Identifier: Apache-2.0
// FullyShardedSequential against single-process training: the same MLP, seed and global batch,
// trained for a few SGD steps at world size 2 and 3 under FULL_SHARD, SHARD_GRAD_OP and NO_SHARD
// (each rank takes its contiguous part of the global batch), must end with the parameters that
// one process training on the whole batch ends with, within float tolerance. Like
// test_process_group, the binary runs itself as the ranks of each case.
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <string>

#include "fsdp/fully_sharded.hpp"

namespace {

constexpr int kBatch = 12, kSteps = 5;

torch::nn::Sequential model() {
  torch::manual_seed(7);
  return torch::nn::Sequential(torch::nn::Linear(6, 10), torch::nn::Tanh(), torch::nn::Linear(10, 10), torch::nn::ReLU(),
                               torch::nn::Linear(10, 3));
}

std::pair<torch::Tensor, torch::Tensor> batch(int step) {
  torch::manual_seed(static_cast<std::uint64_t>(100 + step));
  return {torch::randn({kBatch, 6}), torch::randn({kBatch, 3})};
}

// Single process, whole batch.
std::vector<std::pair<std::string, torch::Tensor>> reference() {
  auto m = model();
  torch::optim::SGD opt(m->parameters(), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    opt.zero_grad();
    torch::mse_loss(m->forward(x), y).backward();
    opt.step();
  }
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& p : m->named_parameters()) out.emplace_back(p.key(), p.value().detach().clone());
  return out;
}

int rank_main(const std::string& strategy) {
  std::map<std::string, std::string> env;
  for (const char* k : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) env[k] = std::getenv(k);
  fsdp::ProcessGroup pg(*fsdp::Rendezvous::from_environment(env), fsdp::Backend::kGloo, std::chrono::seconds(60));
  fsdp::FullyShardedSequential m(model(), pg, fsdp::sharding_strategy_from_string(strategy));
  torch::optim::SGD opt(m.parameters(), torch::optim::SGDOptions(0.1));
  const int per = kBatch / pg.size();
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = batch(s);
    opt.zero_grad();
    auto out = m.forward(x.narrow(0, pg.rank() * per, per));
    // FULL_SHARD holds no full parameters between forward and backward; SHARD_GRAD_OP keeps them
    for (const auto& u : m.units()) {
      if (u && u->gathered() != (strategy != "FULL_SHARD")) {
        std::cerr << "rank " << pg.rank() << " " << strategy << ": a unit is " << (u->gathered() ? "" : "not ") << "gathered after forward\n";
        return 1;
      }
    }
    m.backward(torch::mse_loss(out, y.narrow(0, pg.rank() * per, per)));
    opt.step();
  }
  if (strategy != "NO_SHARD") {
    // the shards are shards: each rank holds 1/world of every unit, padded
    for (const auto& u : m.units()) {
      if (u && u->shard().numel() * pg.size() != u->padded_numel()) {
        std::cerr << "rank " << pg.rank() << ": a shard of " << u->shard().numel() << " of " << u->padded_numel() << "\n";
        return 1;
      }
    }
  }
  const auto got = m.full_state_dict();
  const auto want = reference();
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

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t n = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n);
  ::close(fd);
  return ntohs(a.sin_port);
}

bool launch(const std::string& strategy, int world) {
  const std::string port = std::to_string(free_port());
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      ::execl("/proc/self/exe", "test_fully_sharded", "rank", strategy.c_str(), static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  torch::set_num_threads(1);
  if (argc == 3 && std::string(argv[1]) == "rank") {
    try {
      return rank_main(argv[2]);
    } catch (const std::exception& e) {
      std::cerr << "rank " << std::getenv("RANK") << ": " << e.what() << "\n";
      return 1;
    }
  }
  int passed = 0, failed = 0;
  for (const char* strategy : {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}) {
    for (int world : {2, 3}) {
      const bool ok = launch(strategy, world);
      std::cout << (ok ? "ok   " : "FAIL ") << strategy << " at world size " << world << " equals single-process training\n";
      (ok ? passed : failed)++;
    }
  }
  std::cout << passed << " passed, " << failed << " failed\n";
  return failed ? 1 : 0;
}
