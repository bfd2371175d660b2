// SPDX-License-Identifier: Apache-2.0
// fsdp::Error, the one exception type of libfsdp. Its kind says whose mistake it is: a caller's
// options (kInvalidArgument, which a tool reports as a usage error), what this build or device
// cannot do (kUnsupported), a checkpoint file (kCheckpoint, keeping the file and byte offset of
// the libckpt error it came from), the other ranks (kCommunication), or anything else at run time.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace ckpt {
class Error;
}

namespace fsdp {

enum class ErrorKind {
  kInvalidArgument,  ///< options that conflict or name nothing: the caller's mistake
  kUnsupported,      ///< valid, but not on this build or device (16-mixed without CUDA)
  kCheckpoint,       ///< a checkpoint file is missing, malformed or does not fit the model
  kCommunication,    ///< a collective failed or timed out; another rank stopped
  kRuntime,          ///< anything else while running
};

/// "invalid argument", "unsupported", ...
std::string_view to_string(ErrorKind kind) noexcept;

/// What libfsdp throws: a message meant for the user, naming the rank and the operation.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, ErrorKind kind = ErrorKind::kRuntime) : std::runtime_error(message), kind_(kind) {}
  Error(ErrorKind kind, const std::string& message) : Error(message, kind) {}
  /// A libckpt error crossing into libfsdp: kCheckpoint (kInvalidArgument when it was one), the
  /// message "<context>: <cause>", and the cause's file and offset kept.
  Error(std::string_view context, const ckpt::Error& cause);

  ErrorKind kind() const noexcept { return kind_; }
  /// The file and byte offset a libckpt error named, when this error came from one.
  const std::optional<std::string>& file() const noexcept { return file_; }
  const std::optional<std::uint64_t>& offset() const noexcept { return offset_; }

 private:
  ErrorKind kind_;
  std::optional<std::string> file_;
  std::optional<std::uint64_t> offset_;
};

}  // namespace fsdp
