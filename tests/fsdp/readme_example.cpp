// SPDX-License-Identifier: Apache-2.0
// The README's libfsdp example, built and run by the tests (a world of one, or the ranks torchrun
// or SLURM describe). The README shows the parts between the markers, one after the other; a test
// checks that it does.
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <string>

#include "fsdp/strategy.hpp"

extern char** environ;

// README begin
// A module of your own, with any forward signature; the submodules declared fsdp::Sharded are
// units of their own, the root unit holds the rest.
struct BlockImpl : torch::nn::Module {
  BlockImpl() : fc(register_module("fc", torch::nn::Linear(64, 64))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask) { return x + torch::gelu(fc(x)) * mask; }
  torch::nn::Linear fc;
};

struct NetImpl : torch::nn::Module {
  NetImpl()
      : in(register_module("in", torch::nn::Linear(16, 64))),
        block(register_module("block", std::make_shared<fsdp::Sharded<BlockImpl>>())),
        out(register_module("out", torch::nn::Linear(64, 1))) {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask) { return out(block->forward(in(x), mask)); }
  torch::nn::Linear in;
  std::shared_ptr<fsdp::Sharded<BlockImpl>> block;
  torch::nn::Linear out;
};
// README end

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "ckpt";
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string kv(*e);
    if (const auto eq = kv.find('='); eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  // README begin
  fsdp::StrategyOptions options = fsdp::registered_strategy("fsdp");
  options.sharding_strategy = "FULL_SHARD";
  options.precision = "bf16-mixed";  // float32 weights, bfloat16 compute and gradient reduction
  fsdp::Strategy strategy(options);
  strategy.setup_environment(env);  // torchrun's or SLURM's variables; none: a world of one

  torch::manual_seed(0);
  auto& model = strategy.setup_module(std::make_shared<NetImpl>());  // FQNs: in.weight, block.fc.weight, ...
  auto& optimizer = strategy.setup_optimizer({fsdp::OptimizerKind::kAdamW, 1e-2});
  fsdp::LambdaLR schedule(optimizer, [](std::int64_t epoch) { return 1.0 - static_cast<double>(epoch) / 20; });  // torch's LambdaLR

  for (int step = 1; step <= 20; ++step) {
    torch::Tensor x = torch::randn({8, 16}), y = x.sum(1, /*keepdim=*/true);  // this rank's batch
    torch::Tensor mask = (torch::rand({8, 64}) > 0.1).to(torch::kFloat);
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      const fsdp::Autocast context = strategy.forward_context();  // the precision's autocast
      loss = torch::mse_loss(model.forward(x, mask).to(torch::kFloat), y);
    }
    model.backward(loss);  // gradients reduce-scattered into each rank's shard
    strategy.clip_gradients_norm(optimizer, 1.0);
    optimizer.step();  // at the schedule's lr
    schedule.step();
    if (strategy.global_rank() == 0 && step % 10 == 0) std::cout << "step " << step << " loss " << loss.item<double>() << "\n";
  }
  fsdp::State state{{"model", &model}, {"optimizer", &optimizer}, {"scheduler", &schedule}, {"step", ckpt::pickle::make_int(20)}};
  strategy.save_checkpoint(dir, state);  // a DCP directory PyTorch's dcp.load reads; meta.pt holds "scheduler" and "step"
  // README end
  return 0;
}
