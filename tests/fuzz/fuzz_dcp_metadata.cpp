// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: a DCP .metadata through the restricted unpickler and the metadata interpreter.
#include <cstddef>
#include <cstdint>

#include "ckpt/error.hpp"
#include "formats/dcp_metadata.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    ckpt::Checkpoint c;
    c.root = "/nonexistent-fuzz-root";
    ckpt::detail::read_dcp_metadata(bytes, ".metadata", c);
  } catch (const ckpt::Error& e) {
    if (e.kind() == ckpt::ErrorKind::kInternal) __builtin_trap();
  }
  return 0;
}
