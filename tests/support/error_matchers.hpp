// SPDX-License-Identifier: Apache-2.0
// Catch2 matcher for ckpt::Error: kind, offset and a message substring, as the corruption tables
// need. The offset is always asserted: std::nullopt means the error names none (an argument
// check), kAnyOffset that it names one whose value the row cannot know.
#pragma once

#include <catch2/catch.hpp>
#include <cstddef>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "ckpt/error.hpp"

namespace fsdp_test {

inline constexpr std::uint64_t kAnyOffset = ~std::uint64_t{0};

class IsCkptError : public Catch::MatcherBase<ckpt::Error> {
 public:
  IsCkptError(ckpt::ErrorKind kind, std::optional<std::uint64_t> offset, std::string substring)
      : kind_(kind), offset_(offset), substring_(std::move(substring)) {}
  bool match(const ckpt::Error& e) const override {
    const bool offset_ok = offset_ == kAnyOffset ? e.offset().has_value() : e.offset() == offset_;
    return e.kind() == kind_ && offset_ok && std::string(e.what()).find(substring_) != std::string::npos;
  }
  std::string describe() const override {
    std::ostringstream os;
    os << "is a ckpt::Error of kind " << ckpt::to_string(kind_);
    if (offset_ == kAnyOffset) os << " at some offset";
    else if (offset_) os << " at offset " << *offset_;
    else os << " naming no offset";
    os << " containing \"" << substring_ << "\"";
    return os.str();
  }

 private:
  ckpt::ErrorKind kind_;
  std::optional<std::uint64_t> offset_;
  std::string substring_;
};

/// One row of a corruption table: a defect made by patching a copy of a good file, and the error
/// the reader must raise for it.
struct PatchRow {
  const char* defect;
  std::function<void(std::vector<std::byte>&)> patch;
  ckpt::ErrorKind kind;
  std::optional<std::uint64_t> offset;
  const char* message;
};

/// Runs each row as its own SECTION: patch a copy of `good`, then `read(bytes)` must throw the
/// row's error.
template <typename Read>
void run_patch_table(const std::vector<std::byte>& good, const std::vector<PatchRow>& rows, Read read) {
  for (const auto& row : rows) {
    SECTION(row.defect) {
      auto bad = good;
      row.patch(bad);
      REQUIRE_THROWS_MATCHES(read(bad), ckpt::Error, IsCkptError(row.kind, row.offset, row.message));
    }
  }
}

}  // namespace fsdp_test

// Catch2 prints the exception's what() on mismatch through this.
namespace Catch {
template <>
struct StringMaker<ckpt::Error> {
  static std::string convert(const ckpt::Error& e) { return std::string("ckpt::Error(") + std::string(ckpt::to_string(e.kind())) + "): " + e.what(); }
};
}  // namespace Catch
