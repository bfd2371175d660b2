// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: the safetensors header reader (every tensor it accepts must be readable) and
// the DCP_SHARDING_INFO its __metadata__ may carry.
#include <cstddef>
#include <cstdint>

#include "ckpt/error.hpp"
#include "ckpt/formats/safetensors.hpp"
#include "formats/dcp/sharding_info.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    auto f = ckpt::read_safetensors(ckpt::borrowed_source(bytes, "fuzz.safetensors"));
    for (const auto& t : f.tensors) (void)f.data(t)->read_vector(0, t.end - t.begin);
    if (const auto saved = ckpt::detail::dcp_saved_offsets(f); saved && saved->size() != f.tensors.size()) __builtin_trap();
  } catch (const ckpt::Error& e) {
    if (e.kind() == ckpt::ErrorKind::kInternal) __builtin_trap();
  }
  return 0;
}
