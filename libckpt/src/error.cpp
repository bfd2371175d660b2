// SPDX-License-Identifier: Apache-2.0
// ckpt::Error: composing the grep-friendly `source: offset N: message (while ...)` text once.
#include "ckpt/error.hpp"

namespace ckpt {

std::string_view to_string(ErrorKind kind) noexcept {
  switch (kind) {
    case ErrorKind::kIo: return "io";
    case ErrorKind::kFormat: return "format";
    case ErrorKind::kUnsupported: return "unsupported";
    case ErrorKind::kMismatch: return "mismatch";
    case ErrorKind::kInvalidArgument: return "invalid argument";
    case ErrorKind::kInternal: return "internal";
    case ErrorKind::kCancelled: return "cancelled";
  }
  return "unknown";
}

Error::Error(ErrorKind kind, std::string source, std::optional<std::uint64_t> offset, std::string message)
    : std::runtime_error(message),
      kind_(kind),
      source_(std::move(source)),
      offset_(offset),
      message_(std::move(message)) {
  compose();
}

Error& Error::add_context(std::string context) {
  context_.push_back(std::move(context));
  compose();
  return *this;
}

void Error::compose() {
  what_.clear();
  if (!source_.empty()) what_ += source_ + ": ";
  if (offset_) what_ += "offset " + std::to_string(*offset_) + ": ";
  what_ += message_;
  for (std::size_t i = 0; i < context_.size(); ++i) {
    what_ += i == 0 ? " (while " : "; while ";
    what_ += context_[i];
  }
  if (!context_.empty()) what_ += ")";
}

void internal_error(std::string_view what) {
  throw Error(ErrorKind::kInternal, "internal error: " + std::string(what) + " (please report)");
}

}  // namespace ckpt
