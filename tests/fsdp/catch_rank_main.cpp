// SPDX-License-Identifier: Apache-2.0
// The main of the libfsdp test binaries: a registered mode (`rank CASE`, which launch_ranks starts
// for each rank of a multi-process case), else Catch2's session, whose TEST_CASEs are one CTest
// entry each.
#define CATCH_CONFIG_RUNNER
#include <ATen/Parallel.h>

#include <catch2/catch.hpp>
#include <cstdlib>
#include <iostream>
#include <string>

#include "launch.hpp"

int main(int argc, char** argv) {
  at::set_num_threads(1);
  if (argc == 3) {
    if (const auto it = fsdp_test::modes().find(argv[1]); it != fsdp_test::modes().end()) {
      try {
        return it->second(argv[2]);
      } catch (const std::exception& e) {
        const char* rank = std::getenv("RANK");
        std::cerr << (rank ? "rank " + std::string(rank) : std::string(argv[1])) << ": " << e.what() << "\n";
        return 1;
      }
    }
  }
  return Catch::Session().run(argc, argv);
}
