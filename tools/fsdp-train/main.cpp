// SPDX-License-Identifier: Apache-2.0
// fsdp-train: options -> either the local launcher (--nproc, when no launcher started us) or one
// rank's training.
#include <cstdlib>
#include <map>
#include <string>

#include "common/cli_common.hpp"
#include "common/run_tool.hpp"
#include "fsdp-train/config.hpp"
#include "fsdp-train/launcher.hpp"
#include "fsdp-train/train.hpp"

extern char** environ;

int main(int argc, char** argv) {
  fsdp_train::TrainConfig config;
  auto app = fsdp_train::make_train_app(config);
  if (auto code = fsdp_tools::parse(*app, argc, argv)) return *code;
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string kv(*e);
    const auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  const bool launch_here = config.nproc > 0 && !env.contains("FSDP_TRAIN_LAUNCHED");
  return fsdp_tools::run_tool("fsdp-train", [&] {
    // Options that contradict each other, or that the strategy refuses: usage errors (exit 2),
    // found before any rank starts.
    if (auto code = fsdp_tools::usage_errors("fsdp-train", [&] {
          fsdp_train::validate(config);
          fsdp_train::check_strategy(config);
          if (launch_here) {
            if (env.contains("RANK") || env.contains("SLURM_PROCID")) {
              throw fsdp_tools::UsageError("--nproc starts ranks itself; it cannot be used under a launcher that set RANK or SLURM_PROCID");
            }
            fsdp_train::explicit_mesh(config, config.nproc);
          }
        })) {
      return *code;
    }
    if (launch_here) return fsdp_train::launch_local(config.nproc, argc, argv);
    fsdp_tools::test_hooks_from_environment();  // tests only: FSDP_TEST_CRASH_AT kills a rank mid-save
    // An option that does not fit the model is found once the ranks have built it, every rank
    // alike: exit 2 still, said once (by rank 0).
    try {
      return fsdp_train::run_rank(config, env);
    } catch (const fsdp_tools::UsageError& e) {
      const auto rank = env.find("RANK");
      if (rank != env.end() && rank->second != "0") return 2;
      return *fsdp_tools::usage_errors("fsdp-train", [&] { throw e; });
    }
  });
}
