// SPDX-License-Identifier: Apache-2.0
#pragma once

#include <stdexcept>

namespace fsdp_tools {

/// Options that contradict each other, or that a library refuses as the caller's mistake, found
/// after parsing: a usage error, exit status 2 (fsdp_tools::usage_errors prints it).
class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

}  // namespace fsdp_tools
