// SPDX-License-Identifier: Apache-2.0
// The fsdp tests' checks: EXPECT(cond) counts a failure (naming the rank when RANK is set, and
// the line) and goes on; expect_error wants an fsdp::Error saying something. main returns
// failures != 0.
#pragma once

#include <cstdlib>
#include <functional>
#include <iostream>
#include <string>

#include "fsdp/process_group.hpp"

namespace fsdp_test {

inline int failures = 0;

inline std::ostream& failure_at(int line) {
  ++failures;
  if (const char* rank = std::getenv("RANK")) std::cerr << "rank " << rank << ": ";
  return std::cerr << line << ": ";
}

/// `f` must throw fsdp::Error whose message contains `what`.
inline void expect_error(const char* label, const std::function<void()>& f, const std::string& what) {
  try {
    f();
    std::cerr << label << ": no error (expected one containing '" << what << "')\n";
    ++failures;
  } catch (const fsdp::Error& e) {
    if (std::string(e.what()).find(what) == std::string::npos) {
      std::cerr << label << ": the error '" << e.what() << "' does not contain '" << what << "'\n";
      ++failures;
    }
  }
}

}  // namespace fsdp_test

#define EXPECT(cond)                                                    \
  do {                                                                  \
    if (!(cond)) fsdp_test::failure_at(__LINE__) << "expected " #cond "\n"; \
  } while (0)
