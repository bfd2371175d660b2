// SPDX-License-Identifier: Apache-2.0
#include "pickle/memo_scan.hpp"

#include <algorithm>
#include <array>
#include <cstring>

#include "pickle/opcodes.hpp"

namespace ckpt::pickle {

bool valid_utf8(std::string_view s) {
  // Nearly every str in a checkpoint is ASCII: eight bytes at a time first.
  std::uint64_t high = 0;
  std::size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    std::uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    high |= w & 0x8080808080808080u;
  }
  for (std::size_t k = i; k < s.size(); ++k) high |= static_cast<unsigned char>(s[k]) & 0x80u;
  if (high == 0) return true;
  // CPython decodes with "surrogatepass", so encoded surrogates (ED A0..BF xx) are accepted.
  i = 0;
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

namespace {

// What the first pass does with each opcode byte: one dense switch on this class is a jump table,
// where a switch on the opcode itself compiles to a chain of compares (twice as slow at -O3).
enum OpClass : std::uint8_t { kEnd, kNoOperand, kTupleN, kSkip1, kSkip2, kSkip4, kSkip8, kGet1, kGet4, kLen1, kLen4, kLen8, kGlobalLines };

constexpr std::array<std::uint8_t, 256> op_classes() {
  std::array<std::uint8_t, 256> t{};  // kEnd: STOP, and every opcode the unpickler refuses
  for (std::uint8_t c : {op::kMark, op::kEmptyTuple, op::kTuple1, op::kTuple2, op::kTuple3, op::kTuple, op::kEmptyList, op::kAppend,
                         op::kAppends, op::kEmptyDict, op::kSetItem, op::kSetItems, op::kEmptySet, op::kAddItems, op::kFrozenSet,
                         op::kNone, op::kNewTrue, op::kNewFalse, op::kStackGlobal, op::kReduce, op::kNewObj, op::kNewObjEx,
                         op::kBuild, op::kBinPersId, op::kMemoize}) {
    t[c] = kNoOperand;
  }
  t[op::kTuple1] = t[op::kTuple2] = t[op::kTuple3] = kTupleN;
  for (std::uint8_t c : {op::kProto, op::kBinInt1, op::kBinPut}) t[c] = kSkip1;
  t[op::kBinInt2] = kSkip2;
  t[op::kBinInt] = t[op::kLongBinPut] = kSkip4;
  t[op::kFrame] = t[op::kBinFloat] = kSkip8;
  t[op::kBinGet] = kGet1;
  t[op::kLongBinGet] = kGet4;
  for (std::uint8_t c : {op::kLong1, op::kShortBinUnicode, op::kShortBinString, op::kShortBinBytes}) t[c] = kLen1;
  for (std::uint8_t c : {op::kLong4, op::kBinUnicode, op::kBinBytes}) t[c] = kLen4;
  t[op::kBinUnicode8] = t[op::kBinBytes8] = kLen8;
  t[op::kGlobal] = kGlobalLines;
  return t;
}
constexpr auto kOpClasses = op_classes();

template <int kWidth>
std::uint64_t load_le(const std::uint8_t* p) {
  std::uint64_t v = 0;
  for (int k = kWidth - 1; k >= 0; --k) v = (v << 8) | p[k];
  return v;
}

}  // namespace

IndexSet referenced_memo(std::span<const std::byte> bytes, const ParseOptions& options) {
  IndexSet out;
  const auto* p = reinterpret_cast<const std::uint8_t*>(bytes.data());
  const std::size_t n = bytes.size();
  std::size_t i = 0;
  // A pickle that stops making sense ends the walk there: a real pass fails at that opcode.
  // Operands that run past the end end it too (i passes n).
  auto walk = [&](std::size_t limit) -> bool {  // false: the walk is over
    while (i < limit) {
      switch (kOpClasses[p[i++]]) {
        case kNoOperand: continue;
        case kTupleN:  // a run found whole is stepped over: none of its opcodes has an operand
          i += run_at(p, i, n, kSizeTail) * sizeof kSizeTail;  // no branch: the runs come and go
          continue;
        case kSkip1: i += 1; continue;
        case kSkip2: i += 2; continue;
        case kSkip4: i += 4; continue;
        case kSkip8: i += 8; continue;
        case kGet1:
          if (i >= n) return false;
          out.insert(p[i]);
          i += 1;
          i += run_at(p, i, n, kObjectHead) * sizeof kObjectHead;
          continue;
        case kGet4:
          if (n - i < 4) return false;
          out.insert(load_le<4>(p + i));
          i += 4;
          i += run_at(p, i, n, kObjectHead) * sizeof kObjectHead;
          continue;
        case kLen1:
        case kLen4:
        case kLen8: {
          const std::uint8_t cls = kOpClasses[p[i - 1]];
          const std::size_t width = cls == kLen1 ? 1 : cls == kLen4 ? 4 : 8;
          if (n - i < width) return false;
          const std::uint64_t len = width == 1 ? p[i] : width == 4 ? load_le<4>(p + i) : load_le<8>(p + i);
          i += width;
          if (len > n - i) return false;
          i += static_cast<std::size_t>(len);
          continue;
        }
        case kGlobalLines:
          for (int line = 0; line < 2; ++line) {
            while (i < n && p[i] != '\n') ++i;
            if (i == n) return false;
            ++i;
          }
          continue;
        default: return false;  // STOP, or an opcode the unpickler refuses
      }
    }
    return i < n;
  };
  if (!options.on_scanned) {
    walk(n);
    return out;
  }
  while (walk(std::min<std::uint64_t>(n, i + options.progress_every))) options.on_scanned(i);
  return out;
}

}  // namespace ckpt::pickle
