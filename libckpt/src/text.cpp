// SPDX-License-Identifier: Apache-2.0
#include "ckpt/text.hpp"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <iterator>

namespace ckpt {

std::string escape_name(std::string_view name) {
  std::string out;
  out.reserve(name.size());
  // The length of the valid UTF-8 sequence at `i` (0: none; its first byte is escaped).
  auto utf8_at = [&](std::size_t i) -> std::size_t {
    const auto b = [&](std::size_t k) { return static_cast<unsigned char>(name[k]); };
    const unsigned char c = b(i);
    const std::size_t n = c >= 0xf0 ? (c <= 0xf4 ? 4 : 0) : c >= 0xe0 ? 3 : c >= 0xc2 ? 2 : 0;
    if (n == 0 || i + n > name.size()) return 0;
    for (std::size_t k = 1; k < n; ++k) {
      if ((b(i + k) & 0xc0) != 0x80) return 0;
    }
    if (n == 3 && ((c == 0xe0 && b(i + 1) < 0xa0) || (c == 0xed && b(i + 1) >= 0xa0))) return 0;  // overlong, surrogate
    if (n == 4 && ((c == 0xf0 && b(i + 1) < 0x90) || (c == 0xf4 && b(i + 1) >= 0x90))) return 0;  // overlong, past U+10FFFF
    return n;
  };
  for (std::size_t i = 0; i < name.size(); ++i) {
    const char ch = name[i];
    const auto c = static_cast<unsigned char>(ch);
    std::size_t n = 0;
    if (c >= 0x80 && (n = utf8_at(i)) != 0) {
      out.append(name.substr(i, n));
      i += n - 1;
    } else if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else if (c < 0x20 || c >= 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += ch;
    }
  }
  return out;
}

namespace {

// Python's layout of the shortest round-trip digits that to_chars writes in scientific form.
template <typename F>
std::string python_layout(F value) {
  if (std::isnan(value)) return "nan";
  if (std::isinf(value)) return value > 0 ? "inf" : "-inf";
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, value, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<std::size_t>(end - buf));
  std::string out;
  if (sci.front() == '-') {
    out += '-';
    sci.remove_prefix(1);
  }
  const std::size_t e = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e)) {
    if (c != '.') digits += c;
  }
  const int exp = std::stoi(std::string(sci.substr(e + 1)));
  // Appended piece by piece (GCC 12 misreads a chain of operator+ on temporaries at -O3).
  if (exp >= -4 && exp < 16) {
    const auto n = static_cast<int>(digits.size());
    if (exp < 0) {
      out.append("0.").append(static_cast<std::size_t>(-exp - 1), '0').append(digits);
    } else if (n <= exp + 1) {
      out.append(digits).append(static_cast<std::size_t>(exp + 1 - n), '0').append(".0");
    } else {
      out.append(digits, 0, static_cast<std::size_t>(exp + 1)).append(".").append(digits, static_cast<std::size_t>(exp + 1));
    }
    return out;
  }
  out.append(digits, 0, 1);
  if (digits.size() > 1) out.append(".").append(digits, 1);
  char tail[16];
  std::snprintf(tail, sizeof tail, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
  return out.append(tail);
}

}  // namespace

std::string float_repr(double value) { return python_layout(value); }
std::string float_repr(float value) { return python_layout(value); }

std::string human_bytes(std::uint64_t bytes) {
  if (bytes < 1024) return std::to_string(bytes) + " B";
  static const char* const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes) / 1024;
  std::size_t u = 0;
  while (v >= 1024 && u + 1 < std::size(units)) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

}  // namespace ckpt
