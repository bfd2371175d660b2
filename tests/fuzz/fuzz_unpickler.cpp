// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: the restricted unpickler, then the pickler and repr on whatever it accepted.
#include <cstddef>
#include <cstdint>

#include "ckpt/error.hpp"
#include "ckpt/pickle.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    auto v = ckpt::pickle::parse(bytes, "fuzz");
    (void)ckpt::pickle::repr(*v, 1000);
    auto out = ckpt::pickle::write(*v, 4);
    auto again = ckpt::pickle::parse(out, "fuzz-rewritten");  // what we write, we must read
    (void)again;
  } catch (const ckpt::Error& e) {
    if (e.kind() == ckpt::ErrorKind::kInternal) __builtin_trap();
  }
  return 0;
}
