// SPDX-License-Identifier: Apache-2.0
// libfsdp's process group across real processes. Without arguments this binary runs every case:
// it re-executes itself as the ranks of each case (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set
// as torchrun sets them) and checks their exit statuses. `test_process_group rank CASE` is one
// rank of CASE. Prints "N passed, N failed".
#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "fsdp/process_group.hpp"
#include <catch2/catch.hpp>

#include "expect.hpp"
#include "launch.hpp"

namespace {

using fsdp_test::expect_error;
using fsdp_test::failures;

std::map<std::string, std::string> environment() {
  std::map<std::string, std::string> env;
  for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) {
    if (const char* v = std::getenv(k)) env[k] = v;
  }
  return env;
}

fsdp::ProcessGroup group(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  return fsdp::ProcessGroup(*fsdp::Rendezvous::from_environment(environment()), fsdp::Backend::kGloo, timeout);
}

// Every collective at once, checked against its closed form.
int collectives() {
  auto pg = group();
  const int r = pg.rank(), w = pg.size();
  pg.barrier();
  at::Tensor t = at::full({4}, static_cast<double>(r + 1), at::kFloat);
  pg.all_reduce(t);
  EXPECT(t.equal(at::full({4}, w * (w + 1) / 2.0, at::kFloat)));
  t = at::full({3}, static_cast<double>(r + 1), at::kFloat);
  pg.all_reduce(t, fsdp::ReduceOp::kAvg);
  EXPECT(t.allclose(at::full({3}, (w + 1) / 2.0, at::kFloat)));
  t = at::full({2}, static_cast<double>(r), at::kDouble);
  pg.all_reduce(t, fsdp::ReduceOp::kMax);
  EXPECT(t.equal(at::full({2}, w - 1.0, at::kDouble)));
  at::Tensor b = r == 1 ? at::arange(5, at::kLong) : at::zeros({5}, at::kLong);
  pg.broadcast(b, 1);
  EXPECT(b.equal(at::arange(5, at::kLong)));
  // all_gather: bf16 pieces of 3 in rank order
  at::Tensor piece = at::full({3}, static_cast<double>(r), at::kBFloat16);
  at::Tensor all = at::empty({3 * w}, at::kBFloat16);
  pg.all_gather(all, piece);
  for (int k = 0; k < w; ++k) EXPECT(all.narrow(0, 3 * k, 3).equal(at::full({3}, static_cast<double>(k), at::kBFloat16)));
  // reduce_scatter: input i*w + j from rank r is r + 10 * (i*w + j); this rank keeps slice r
  at::Tensor in = at::arange(2 * w, at::kFloat) * 10 + r;
  at::Tensor out = at::empty({2}, at::kFloat);
  pg.reduce_scatter(out, in);
  at::Tensor want = (at::arange(2 * w, at::kFloat) * 10 * w + w * (w - 1) / 2.0).narrow(0, 2 * r, 2);
  EXPECT(out.equal(want));
  // bfloat16, which Gloo lacks: broadcast and reductions too (sums exact in bf16 here)
  at::Tensor h = at::full({4}, static_cast<double>(r + 1), at::kBFloat16);
  pg.all_reduce(h);
  EXPECT(h.equal(at::full({4}, w * (w + 1) / 2.0, at::kBFloat16)));
  at::Tensor hb = r == 0 ? at::arange(4, at::kFloat).to(at::kBFloat16) : at::zeros({4}, at::kBFloat16);
  pg.broadcast(hb, 0);
  EXPECT(hb.equal(at::arange(4, at::kFloat).to(at::kBFloat16)));
  at::Tensor hs = at::empty({2}, at::kBFloat16);
  pg.reduce_scatter(hs, (at::arange(2 * w, at::kFloat) + r).to(at::kBFloat16));
  EXPECT(hs.equal((at::arange(2 * w, at::kFloat) * w + w * (w - 1) / 2.0).narrow(0, 2 * r, 2).to(at::kBFloat16)));
  pg.barrier();
  return failures ? 1 : 0;
}

// Rank 1 never comes: rank 0 must fail within its timeout, saying who it waited for.
int missing_rank() {
  if (std::atoi(std::getenv("RANK")) == 1) return 0;
  const auto start = std::chrono::steady_clock::now();
  try {
    auto pg = group(std::chrono::seconds(2));
    std::cerr << "rank 0: the group formed without rank 1\n";
    return 1;
  } catch (const fsdp::Error& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cerr << "rank 0 (expected): " << e.what() << "\n";
    EXPECT(std::string(e.what()).find("did not all meet") != std::string::npos);
    EXPECT(s < 15);
  }
  return failures ? 1 : 0;
}

// Rank 1 dies after the group formed: rank 0's next collective fails within the timeout.
int rank_dies() {
  auto pg = group(std::chrono::seconds(3));
  pg.barrier();
  if (pg.rank() == 1) std::_Exit(0);
  const auto start = std::chrono::steady_clock::now();
  try {
    at::Tensor t = at::ones({1024});
    pg.all_reduce(t);
    std::cerr << "rank 0: all_reduce succeeded without rank 1\n";
    return 1;
  } catch (const fsdp::Error& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::cerr << "rank 0 (expected): " << e.what() << "\n";
    EXPECT(std::string(e.what()).find("rank 0 of 2: all_reduce failed") != std::string::npos);
    EXPECT(s < 15);
  }
  return failures ? 1 : 0;
}

int environment_parsing() {
  using fsdp::Rendezvous;
  EXPECT(!Rendezvous::from_environment({}).has_value());
  auto t = Rendezvous::from_environment({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"MASTER_ADDR", "n1"}, {"MASTER_PORT", "1234"}});
  EXPECT(t && t->rank == 3 && t->world_size == 8 && t->local_rank == 1 && t->master_addr == "n1" && t->master_port == 1234);
  EXPECT(t->agent_store_prefix.empty());
  // torchrun's agent serves the store: every rank a client, under torch's prefix.
  auto e = Rendezvous::from_environment({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"TORCHELASTIC_RESTART_COUNT", "3"}});
  EXPECT(e && e->agent_store_prefix == "/worker/attempt_3");
  auto s = Rendezvous::from_environment({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "6"}, {"SLURM_LOCALID", "1"}, {"SLURM_JOB_NODELIST", "gpu[007-009,12],cpu1"}});
  EXPECT(s && s->rank == 5 && s->world_size == 6 && s->local_rank == 1 && s->master_addr == "gpu007" && s->master_port == 29500);
  EXPECT(fsdp::first_slurm_host("node1,node2") == "node1");
  EXPECT(fsdp::first_slurm_host("a[1-4]") == "a1");
  bool threw = false;
  try {
    Rendezvous::from_environment({{"RANK", "2"}, {"WORLD_SIZE", "2"}});
  } catch (const fsdp::Error&) {
    threw = true;
  }
  EXPECT(threw);
  threw = false;
  try {
    fsdp::backend_from_string("mpi");
  } catch (const fsdp::Error&) {
    threw = true;
  }
  EXPECT(threw);
  return failures ? 1 : 0;
}


}  // namespace

const fsdp_test::Mode kRank{"rank", [](const std::string& name) {
  const std::map<std::string, std::function<int()>> cases{
      {"collectives", collectives}, {"missing_rank", missing_rank}, {"rank_dies", rank_dies}, {"environment", environment_parsing}};
  return cases.at(name)();
}};

TEST_CASE("fsdp process group: the rendezvous environment (1 rank)", "[fsdp][process_group]") { CHECK(fsdp_test::launch_ranks("environment", 1)); }

TEST_CASE("fsdp process group: collectives at 2 and 3 ranks", "[fsdp][process_group]") {
  for (int world : {2, 3}) {
    SECTION(std::to_string(world) + " ranks") { CHECK(fsdp_test::launch_ranks("collectives", world)); }
  }
}

TEST_CASE("fsdp process group: a rank that never joins is a timeout, not a hang", "[fsdp][process_group]") {
  CHECK(fsdp_test::launch_ranks("missing_rank", 2));
}

TEST_CASE("fsdp process group: a rank that dies mid-collective fails the others", "[fsdp][process_group]") {
  CHECK(fsdp_test::launch_ranks("rank_dies", 2));
}
