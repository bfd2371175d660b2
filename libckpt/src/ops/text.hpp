// SPDX-License-Identifier: Apache-2.0
// Small text helpers shared by the inspect operations: shapes, padded columns, glob matching.
#pragma once

#include <fnmatch.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace ckpt::detail {

inline std::string shape_text(std::span<const std::int64_t> shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

/// Display width in code points, so that non-ASCII names line up.
inline std::size_t text_width(const std::string& t) {
  return static_cast<std::size_t>(
      std::count_if(t.begin(), t.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xc0) != 0x80; }));
}

inline std::string pad(const std::string& t, std::size_t n) {
  const std::size_t w = text_width(t);
  return w >= n ? t + " " : t + std::string(n - w + 1, ' ');
}

/// Shell-style glob ('*', '?', '[...]'); an empty pattern matches everything.
inline bool glob_match(const std::string& pattern, const std::string& name) {
  return pattern.empty() || ::fnmatch(pattern.c_str(), name.c_str(), 0) == 0;
}

}  // namespace ckpt::detail
