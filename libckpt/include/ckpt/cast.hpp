// SPDX-License-Identifier: Apache-2.0
// Element casts between the floating dtypes --dtype offers (float64, float32, float16, bfloat16),
// bit for bit as torch's CPU `Tensor.to(dtype)` does them: round to nearest even; float64 to a
// 16-bit type goes through float32 (c10::Half and c10::BFloat16 are built from a float); a NaN
// becomes 0x7FC0 in bfloat16 (sign dropped) and sign|0x7E00 in float16.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <string_view>

#include "ckpt/dtype.hpp"
#include "ckpt/progress.hpp"

namespace ckpt {

/// float16, bfloat16, float32, float64: the dtypes cast() converts between.
bool is_castable_float(DType dtype) noexcept;

/// Whether a cast that overflows to inf or flushes non-zeros to zero is reported, or an error.
enum class CastCheck { kReport, kStrict };

/// What a narrowing cast did to values it could not keep.
struct CastDamage {
  std::uint64_t overflowed = 0;  ///< finite values that became infinite
  std::uint64_t flushed = 0;     ///< non-zero values that became zero
  bool any() const noexcept { return overflowed || flushed; }
};

/// Converts `in` (elements of `from`) into `out` (the same number of elements of `to`), and counts
/// the damage. Both dtypes must be castable floats and the sizes must agree (internal error
/// otherwise).
CastDamage cast(std::span<const std::byte> in, DType from, std::span<std::byte> out, DType to);

/// The damage of a copy's casts, per tensor, from any number of threads.
class CastLedger {
 public:
  void record(std::string_view tensor, CastDamage damage);
  /// Every tensor whose cast did damage, by name.
  std::map<std::string, CastDamage> damaged() const;
  /// After a copy into `to`: notes each damaged tensor on `progress` (may be null) with its counts;
  /// with CastCheck::kStrict (--strict-cast) throws kMismatch naming them instead, before the
  /// output is committed. `where`: the output, for the error.
  void conclude(DType to, CastCheck check, Progress* progress, const std::string& where) const;

 private:
  mutable std::mutex mutex_;
  std::map<std::string, CastDamage, std::less<>> damaged_;
};

}  // namespace ckpt
