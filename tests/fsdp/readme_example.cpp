// SPDX-License-Identifier: Apache-2.0
// The README's libfsdp example, built and run by the tests (a world of one, or the ranks torchrun
// or SLURM describe). The README shows the part between the markers; a test checks that it does.
#include <torch/torch.h>

#include <cstdlib>
#include <iostream>
#include <map>
#include <string>

#include "fsdp/strategy.hpp"

extern char** environ;

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
  auto& model = strategy.setup_module(torch::nn::Sequential(  // each child with parameters: one unit
      torch::nn::Linear(16, 64), torch::nn::GELU(), torch::nn::Linear(64, 1)));
  auto& optimizer = strategy.setup_optimizer({fsdp::OptimizerKind::kAdamW, 1e-2});
  fsdp::LambdaLR schedule(optimizer, [](std::int64_t epoch) { return 1.0 - static_cast<double>(epoch) / 20; });  // torch's LambdaLR

  for (int step = 1; step <= 20; ++step) {
    torch::Tensor x = torch::randn({8, 16}), y = x.sum(1, /*keepdim=*/true);  // this rank's batch
    optimizer.zero_grad();
    torch::Tensor loss;
    {
      const fsdp::Autocast context = strategy.forward_context();  // the precision's autocast
      loss = torch::mse_loss(model.forward(x).to(torch::kFloat), y);
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
