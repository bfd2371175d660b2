// SPDX-License-Identifier: Apache-2.0
// Text that quotes what files hold, made safe to print: every tool's messages and listings.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace ckpt {

/// `name` with control characters, backslashes and bytes that are not UTF-8 escaped (\n, \x1b,
/// \\, \xa9), so that a hostile name cannot move the cursor, forge lines or garble the output.
std::string escape_name(std::string_view name);

/// Python's repr() of a float: the shortest digits that read back as `value` in its own
/// precision, fixed for a decimal exponent in [-4, 16) (with ".0" on an integral value), else
/// d[.ddd]e±XX ("0.003", "1e-05", "100.0", "1.2345678901234568e+17", "nan", "-inf"). The float
/// overload is numpy's repr of a float32 ("0.1", not 0.1's double "0.10000000149011612").
std::string float_repr(double value);
std::string float_repr(float value);

/// `bytes` for people: "512 B", "6.1 KiB", "2.2 MiB", "1.0 GiB" (powers of 1024, one decimal).
std::string human_bytes(std::uint64_t bytes);

}  // namespace ckpt
