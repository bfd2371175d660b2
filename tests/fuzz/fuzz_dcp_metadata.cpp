// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: a DCP .metadata through both readers (NOTE [The direct .metadata reader]).
// The tree reader (the restricted unpickler and the metadata interpreter) must never fail
// internally; the direct reader must decline whatever the tree reader refuses, and read whatever
// it accepts into the very index the tree reader builds.
#include <cstddef>
#include <cstdint>

#include "ckpt/error.hpp"
#include "formats/dcp_metadata.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  ckpt::Checkpoint direct;
  direct.root = "/nonexistent-fuzz-root";
  ckpt::Checkpoint tree = direct;
  const bool accepted = ckpt::detail::read_dcp_metadata_direct(bytes, ".metadata", direct);
  try {
    ckpt::detail::read_dcp_metadata_tree(bytes, ".metadata", tree);
  } catch (const ckpt::Error& e) {
    if (e.kind() == ckpt::ErrorKind::kInternal || accepted) __builtin_trap();
    return 0;
  }
  if (accepted && !ckpt::detail::index_difference(direct, tree).empty()) __builtin_trap();
  return 0;
}
