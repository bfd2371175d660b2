// SPDX-License-Identifier: Apache-2.0
// detail::Cursor: the only way format code turns bytes into values. Bounds-checked little-endian
// decoding over bytes in memory; every error names the source and the absolute offset, so call
// sites rarely pass either. Lengths read from a file go through expect_available() before
// anything is allocated.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "ckpt/error.hpp"

namespace ckpt::detail {

// The formats are little-endian and so is every machine we build for; decoding copies bytes as is.
static_assert(std::endian::native == std::endian::little, "libckpt assumes a little-endian host");

class Cursor {
 public:
  /// `data` are the bytes of `source` starting at absolute offset `base`.
  Cursor(std::span<const std::byte> data, std::string source, std::uint64_t base = 0)
      : data_(data), source_(std::move(source)), base_(base) {}

  /// Absolute offset (in the source) of the next byte.
  std::uint64_t offset() const noexcept { return base_ + pos_; }
  std::size_t position() const noexcept { return pos_; }
  std::size_t remaining() const noexcept { return data_.size() - pos_; }
  bool at_end() const noexcept { return pos_ == data_.size(); }
  const std::string& source() const noexcept { return source_; }

  /// Throws kFormat "<what> needs N bytes, only M remain" unless `n` bytes remain.
  void expect_available(std::uint64_t n, std::string_view what) const {
    if (n > remaining()) {
      fail(std::string(what) + " needs " + std::to_string(n) + " bytes, only " + std::to_string(remaining()) +
           " remain");
    }
  }

  std::uint8_t u8(std::string_view what = "byte") {
    expect_available(1, what);
    return static_cast<std::uint8_t>(data_[pos_++]);
  }
  std::uint16_t u16le(std::string_view what = "u16") { return le<std::uint16_t>(what); }
  std::uint32_t u32le(std::string_view what = "u32") { return le<std::uint32_t>(what); }
  std::uint64_t u64le(std::string_view what = "u64") { return le<std::uint64_t>(what); }
  std::int32_t i32le(std::string_view what = "i32") { return static_cast<std::int32_t>(le<std::uint32_t>(what)); }
  double f64be(std::string_view what = "f64") {
    std::uint64_t v = 0;
    auto b = bytes(8, what);
    for (std::byte x : b) v = (v << 8) | static_cast<std::uint64_t>(x);
    return std::bit_cast<double>(v);
  }

  std::span<const std::byte> bytes(std::uint64_t n, std::string_view what = "bytes") {
    expect_available(n, what);
    auto out = data_.subspan(pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return out;
  }
  std::string_view string(std::uint64_t n, std::string_view what = "string") {
    auto b = bytes(n, what);
    return {reinterpret_cast<const char*>(b.data()), b.size()};
  }
  /// Bytes up to (not including) the next '\n', which is consumed.
  std::string_view line(std::string_view what = "line") {
    const std::size_t start = pos_;
    for (std::size_t i = pos_; i < data_.size(); ++i) {
      if (data_[i] == std::byte{'\n'}) {
        pos_ = i + 1;
        return {reinterpret_cast<const char*>(data_.data() + start), i - start};
      }
    }
    fail(std::string(what) + " has no terminating newline");
  }
  void skip(std::uint64_t n, std::string_view what = "bytes") { bytes(n, what); }
  void seek(std::size_t position) {
    if (position > data_.size()) internal_error("Cursor::seek past end");
    pos_ = position;
  }

  /// Throws kFormat at the current offset.
  [[noreturn]] void fail(std::string message) const { fail_at(offset(), std::move(message)); }
  /// Throws kFormat at absolute offset `at`.
  [[noreturn]] void fail_at(std::uint64_t at, std::string message, ErrorKind kind = ErrorKind::kFormat) const {
    throw Error(kind, source_, at, std::move(message));
  }

 private:
  template <typename T>
  T le(std::string_view what) {
    expect_available(sizeof(T), what);
    T v{};
    std::memcpy(&v, data_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::span<const std::byte> data_;
  std::string source_;
  std::uint64_t base_ = 0;
  std::size_t pos_ = 0;
};

/// a * b, or kFormat "<what> overflows" at `at` in `source`.
inline std::uint64_t checked_mul(std::uint64_t a, std::uint64_t b, const std::string& source, std::uint64_t at,
                                 std::string_view what) {
  std::uint64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) {
    throw Error(ErrorKind::kFormat, source, at, std::string(what) + " overflows 64 bits");
  }
  return r;
}
inline std::uint64_t checked_add(std::uint64_t a, std::uint64_t b, const std::string& source, std::uint64_t at,
                                 std::string_view what) {
  std::uint64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) {
    throw Error(ErrorKind::kFormat, source, at, std::string(what) + " overflows 64 bits");
  }
  return r;
}

}  // namespace ckpt::detail
