// SPDX-License-Identifier: Apache-2.0
// ckpt::Error, the one exception type of libckpt. Every failure caused by input data names the
// source it was reading, the absolute byte offset in that source, what was found and what was
// allowed; context is added at a few layer boundaries only (per file, per tensor, per operation).
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace ckpt {

/// What went wrong, coarsely; tools map every kind to exit status 1.
enum class ErrorKind {
  kIo,               ///< the operating system refused a read, write, open or rename
  kFormat,           ///< the bytes are malformed
  kUnsupported,      ///< valid, but not handled (a deflated zip member, a legacy torch.save file)
  kMismatch,         ///< shapes, dtypes or sizes that must agree do not
  kInvalidArgument,  ///< a caller or user mistake
  kInternal,         ///< a broken invariant: our bug ("please report")
  kCancelled,        ///< stopped on request (SIGINT, SIGTERM): nothing was written
};

/// The name of `kind` as used in messages and tests ("format", "io", ...).
std::string_view to_string(ErrorKind kind) noexcept;

/// The one exception libckpt throws.
///
/// `what()` reads `<source>: offset <N>: <message> (while <ctx>; while <ctx>)`, with the parts
/// that are unknown left out. `source` is the name of the ByteSource being read: a path,
/// `model.pt[archive/data.pkl]`, `ckpt/__1_0.distcp[item 7]`.
class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string source, std::optional<std::uint64_t> offset, std::string message);

  /// Shorthand for errors that have no source (argument checks).
  Error(ErrorKind kind, std::string message) : Error(kind, {}, std::nullopt, std::move(message)) {}

  ErrorKind kind() const noexcept { return kind_; }
  const std::string& source() const noexcept { return source_; }
  const std::optional<std::uint64_t>& offset() const noexcept { return offset_; }
  const std::string& message() const noexcept { return message_; }
  /// Context lines, innermost first.
  const std::vector<std::string>& context() const noexcept { return context_; }

  const char* what() const noexcept override { return what_.c_str(); }

  /// Appends an outer context line ("reading 'model.0.weight'"); used on catch-and-rethrow at
  /// layer boundaries: `catch (ckpt::Error& e) { e.add_context("..."); throw; }`.
  Error& add_context(std::string context);

 private:
  void compose();

  ErrorKind kind_;
  std::string source_;
  std::optional<std::uint64_t> offset_;
  std::string message_;
  std::vector<std::string> context_;
  std::string what_;
};

/// Throws kInternal with "internal error: <what> (please report)". For broken invariants only,
/// never for bad input.
[[noreturn]] void internal_error(std::string_view what);

}  // namespace ckpt
