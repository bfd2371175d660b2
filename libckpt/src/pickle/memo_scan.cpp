// SPDX-License-Identifier: Apache-2.0
#include "pickle/memo_scan.hpp"

#include <algorithm>

#include "pickle/opcodes.hpp"

namespace ckpt::pickle {

bool valid_utf8(std::string_view s) {
  // CPython decodes with "surrogatepass", so encoded surrogates (ED A0..BF xx) are accepted.
  std::size_t i = 0;
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  while (i < s.size()) {
    unsigned char c = p[i];
    std::size_t n = 0;
    std::uint32_t cp = 0;
    if (c < 0x80) {
      ++i;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      n = 1;
      cp = c & 0x1fu;
    } else if ((c & 0xf0) == 0xe0) {
      n = 2;
      cp = c & 0x0fu;
    } else if ((c & 0xf8) == 0xf0) {
      n = 3;
      cp = c & 0x07u;
    } else {
      return false;
    }
    for (std::size_t k = 1; k <= n; ++k) {
      if (i + k >= s.size() || (p[i + k] & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3fu);
    }
    if ((n == 1 && cp < 0x80) || (n == 2 && cp < 0x800) || (n == 3 && (cp < 0x10000 || cp > 0x10ffff))) return false;
    i += n + 1;
  }
  return true;
}

Int decode_long(std::span<const std::byte> raw) {
  std::vector<std::uint8_t> b(raw.size());
  for (std::size_t i = 0; i < raw.size(); ++i) b[i] = static_cast<std::uint8_t>(raw[i]);
  // Minimal two's complement: drop redundant sign bytes.
  while (b.size() > 1) {
    const std::uint8_t last = b.back();
    const bool next_neg = (b[b.size() - 2] & 0x80) != 0;
    if ((last == 0x00 && !next_neg) || (last == 0xff && next_neg)) {
      b.pop_back();
    } else {
      break;
    }
  }
  if (b.size() == 1 && b[0] == 0) b.clear();
  Int out;
  if (b.size() <= 8) {
    std::uint64_t v = 0;
    for (std::size_t i = 0; i < b.size(); ++i) v |= std::uint64_t{b[i]} << (8 * i);
    if (!b.empty() && (b.back() & 0x80) && b.size() < 8) v |= ~std::uint64_t{0} << (8 * b.size());
    out.value = static_cast<std::int64_t>(v);
  } else {
    out.big = std::move(b);
  }
  return out;
}

IndexSet referenced_memo(std::span<const std::byte> bytes, const ParseOptions& options) {
  IndexSet out;
  std::uint64_t next_scanned = options.progress_every;
  const auto* p = reinterpret_cast<const std::uint8_t*>(bytes.data());
  const std::size_t n = bytes.size();
  std::size_t i = 0;
  auto le = [&](std::size_t at, int width) {
    std::uint64_t v = 0;
    for (int k = width - 1; k >= 0; --k) v = (v << 8) | p[at + static_cast<std::size_t>(k)];
    return v;
  };
  while (i < n) {
    if (options.on_scanned && i >= next_scanned) {
      options.on_scanned(i);
      next_scanned = i + options.progress_every;
    }
    const std::uint8_t code = p[i++];
    std::uint64_t skip = 0;  // operand bytes after the opcode
    switch (code) {
      case op::kStop: return out;
      case op::kMark: case op::kEmptyTuple: case op::kTuple1: case op::kTuple2: case op::kTuple3: case op::kTuple:
      case op::kEmptyList: case op::kAppend: case op::kAppends: case op::kEmptyDict: case op::kSetItem:
      case op::kSetItems: case op::kEmptySet: case op::kAddItems: case op::kFrozenSet: case op::kNone:
      case op::kNewTrue: case op::kNewFalse: case op::kStackGlobal: case op::kReduce: case op::kNewObj:
      case op::kNewObjEx: case op::kBuild: case op::kBinPersId: case op::kMemoize:
        break;
      case op::kProto: case op::kBinInt1: case op::kBinPut: skip = 1; break;
      case op::kBinInt2: skip = 2; break;
      case op::kBinInt: case op::kLongBinPut: skip = 4; break;
      case op::kFrame: case op::kBinFloat: skip = 8; break;
      case op::kBinGet:
      case op::kLongBinGet: {
        const int width = code == op::kBinGet ? 1 : 4;
        if (n - i < static_cast<std::size_t>(width)) return out;
        out.insert(le(i, width));
        skip = static_cast<std::uint64_t>(width);
        break;
      }
      case op::kLong1: case op::kShortBinUnicode: case op::kShortBinString: case op::kShortBinBytes:
      case op::kLong4: case op::kBinUnicode: case op::kBinBytes: case op::kBinUnicode8: case op::kBinBytes8: {
        const int width = code == op::kBinUnicode8 || code == op::kBinBytes8 ? 8
                          : code == op::kLong4 || code == op::kBinUnicode || code == op::kBinBytes ? 4 : 1;
        if (n - i < static_cast<std::size_t>(width)) return out;
        const std::uint64_t len = le(i, width);
        i += static_cast<std::size_t>(width);
        if (len > n - i) return out;
        skip = len;
        break;
      }
      case op::kGlobal:
        for (int line = 0; line < 2; ++line) {
          while (i < n && p[i] != '\n') ++i;
          if (i == n) return out;
          ++i;
        }
        break;
      default: return out;
    }
    if (skip > n - i) return out;
    i += static_cast<std::size_t>(skip);
  }
  return out;
}

}  // namespace ckpt::pickle
