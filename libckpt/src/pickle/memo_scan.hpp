// SPDX-License-Identifier: Apache-2.0
// What the restricted unpickler (unpickler.cpp) and the direct .metadata reader
// (formats/dcp/metadata_direct.cpp) share: the first pass that finds the memo entries a GET uses, the
// UTF-8 check CPython's decoder makes, and LONG1/LONG4 decoding.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <unordered_set>
#include <vector>

#include "ckpt/pickle.hpp"
#include "pickle/opcodes.hpp"

namespace ckpt::pickle {

// Runs of opcodes without operands that CPython's pickler writes for every dataclass object and
// every torch.Size, most of a large .metadata (NOTE [A chunk at a glance], formats/dcp/metadata_direct.cpp):
// after the GET of a class, EMPTY_TUPLE NEWOBJ MEMOIZE EMPTY_DICT MEMOIZE MARK; after a
// TUPLE1/2/3 of ints, MEMOIZE TUPLE1 MEMOIZE REDUCE MEMOIZE; SETITEMS BUILD to end the object.
inline constexpr std::uint8_t kObjectHead[] = {op::kEmptyTuple, op::kNewObj, op::kMemoize, op::kEmptyDict, op::kMemoize, op::kMark};
inline constexpr std::uint8_t kSizeTail[] = {op::kMemoize, op::kTuple1, op::kMemoize, op::kReduce, op::kMemoize};
inline constexpr std::uint8_t kObjectEnd[] = {op::kSetItems, op::kBuild};

/// Whether the N bytes at p + i (of n; i <= n) are `run`: one word compared where 8 bytes are there.
template <std::size_t N>
bool run_at(const std::uint8_t* p, std::size_t i, std::size_t n, const std::uint8_t (&run)[N]) {
  static_assert(N <= 8);
  static_assert(std::endian::native == std::endian::little, "the mask keeps the first N bytes of a little-endian word");
  if (n - i >= 8) [[likely]] {
    std::uint64_t have = 0, want = 0;
    std::memcpy(&have, p + i, 8);
    std::memcpy(&want, run, N);
    constexpr std::uint64_t kMask = N == 8 ? ~std::uint64_t{0} : (std::uint64_t{1} << (8 * N)) - 1;
    return (have & kMask) == want;
  }
  return N <= n - i && std::memcmp(p + i, run, N) == 0;
}

/// Whether `s` is UTF-8 as CPython decodes it ("surrogatepass": encoded surrogates accepted).
bool valid_utf8(std::string_view s);

/// A LONG1/LONG4 operand (little-endian two's complement) as an Int.
Int decode_long(std::span<const std::byte> raw);

/// A set of memo indices: a bitmap below kDense, a hash set above (only hand-made pickles go there).
class IndexSet {
 public:
  static constexpr std::uint64_t kDense = std::uint64_t{1} << 26;
  /// Adds `i`; returns whether it was new.
  bool insert(std::uint64_t i) {
    if (i >= kDense) return sparse_.insert(i).second;
    const std::size_t w = static_cast<std::size_t>(i >> 6);
    if (w >= bits_.size()) bits_.resize(std::max(w + 1, bits_.size() * 2), 0);
    const std::uint64_t m = std::uint64_t{1} << (i & 63);
    const bool fresh = (bits_[w] & m) == 0;
    bits_[w] |= m;
    return fresh;
  }
  bool contains(std::uint64_t i) const {
    if (i >= kDense) return sparse_.count(i) != 0;
    const std::size_t w = static_cast<std::size_t>(i >> 6);
    return w < bits_.size() && (bits_[w] >> (i & 63) & 1) != 0;
  }

  /// The indices below kDense: bit b of word w is index 64w + b.
  const std::vector<std::uint64_t>& dense_words() const noexcept { return bits_; }
  /// Whether any index is kDense or above.
  bool has_sparse() const noexcept { return !sparse_.empty(); }

 private:
  std::vector<std::uint64_t> bits_;
  std::unordered_set<std::uint64_t> sparse_;
};

/// The memo indices a GET refers to, found by walking the opcodes without running them. The walk
/// stops where the pickle stops making sense (an unknown opcode, a length past the end); a real
/// pass fails at that same opcode, so no GET after it ever runs. Reports progress through
/// `options.on_scanned`.
IndexSet referenced_memo(std::span<const std::byte> bytes, const ParseOptions& options);

}  // namespace ckpt::pickle
