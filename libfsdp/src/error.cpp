// SPDX-License-Identifier: Apache-2.0
#include "fsdp/error.hpp"

namespace fsdp {

std::string_view to_string(ErrorKind kind) noexcept {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return "invalid argument";
    case ErrorKind::kUnsupported: return "unsupported";
    case ErrorKind::kCheckpoint: return "checkpoint";
    case ErrorKind::kCommunication: return "communication";
    case ErrorKind::kRuntime: return "runtime";
  }
  return "runtime";
}

}  // namespace fsdp
