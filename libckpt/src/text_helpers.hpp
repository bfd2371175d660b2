// SPDX-License-Identifier: Apache-2.0
// Small text helpers shared by the operations: shapes, padded columns, dotted names, glob matching.
#pragma once

#include <fnmatch.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ckpt::detail {

inline std::string shape_text(std::span<const std::int64_t> shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

/// Display width in code points, so that non-ASCII names line up.
inline std::size_t text_width(std::string_view t) {
  return static_cast<std::size_t>(
      std::count_if(t.begin(), t.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xc0) != 0x80; }));
}

/// Appends `t` and the spaces that make it a column `n` wide, and one more between columns.
inline void append_padded(std::string& out, std::string_view t, std::size_t n) {
  const std::size_t w = text_width(t);
  out.append(t);
  out.append(w >= n ? 1 : n - w + 1, ' ');
}

/// The parts of a dotted name ("a.b.c": a, b, c; an empty part where two dots meet).
inline std::vector<std::string> split_dots(std::string_view name) {
  std::vector<std::string> out(1);
  for (const char ch : name) {
    if (ch == '.') {
      out.emplace_back();
    } else {
      out.back() += ch;
    }
  }
  return out;
}

/// `b` as two lowercase hex digits.
inline std::string hex_byte(unsigned char b) {
  constexpr char kDigits[] = "0123456789abcdef";
  return {kDigits[b >> 4], kDigits[b & 15]};
}

inline std::string pad(const std::string& t, std::size_t n) {
  std::string out;
  append_padded(out, t, n);
  return out;
}

/// Shell-style glob ('*', '?', '[...]'); an empty pattern matches everything.
inline bool glob_match(const std::string& pattern, const std::string& name) {
  return pattern.empty() || ::fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

}  // namespace ckpt::detail
