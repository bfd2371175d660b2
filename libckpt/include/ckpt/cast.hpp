// SPDX-License-Identifier: Apache-2.0
// Element casts between the floating dtypes --dtype offers (float64, float32, float16, bfloat16),
// bit for bit as torch's CPU `Tensor.to(dtype)` does them: round to nearest even; float64 to a
// 16-bit type goes through float32 (c10::Half and c10::BFloat16 are built from a float); a NaN
// becomes 0x7FC0 in bfloat16 (sign dropped) and sign|0x7E00 in float16.
#pragma once

#include <cstddef>
#include <span>

#include "ckpt/dtype.hpp"

namespace ckpt {

/// float16, bfloat16, float32, float64: the dtypes cast() converts between.
bool is_castable_float(DType dtype) noexcept;

/// Converts `in` (elements of `from`) into `out` (the same number of elements of `to`).
/// Both dtypes must be castable floats and the sizes must agree (internal error otherwise).
void cast(std::span<const std::byte> in, DType from, std::span<std::byte> out, DType to);

}  // namespace ckpt
