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

/// `bytes` for people: "512 B", "6.1 KiB", "2.2 MiB", "1.0 GiB" (powers of 1024, one decimal).
std::string human_bytes(std::uint64_t bytes);

}  // namespace ckpt
