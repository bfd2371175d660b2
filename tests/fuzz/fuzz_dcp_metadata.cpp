// SPDX-License-Identifier: Apache-2.0
// libFuzzer target: a DCP .metadata through both readers (NOTE [The direct .metadata reader]).
// The tree reader (the restricted unpickler and the metadata interpreter) must never fail
// internally; the direct reader must decline whatever the tree reader refuses, and read whatever
// it accepts into the very index the tree reader builds, whether it has the first pass's answer
// from the start or guesses until the middle of the input or to its end (NOTE [The first pass
// beside the reader]; settled at fixed offsets here, so that a run repeats), and once more with
// the first pass and the index builder on their own thread, as inspect reads (NOTE [The builder
// beside the reader]): whenever that thread settles, the answer must be the same. And an index that
// the one validation (ckpt/ops/validate.hpp) passes has every element and byte count within 63 bits
// and chunks that cover each tensor exactly, counted here again in 128 bits.
#include <cstddef>
#include <cstdint>

#include "ckpt/error.hpp"
#include "ckpt/ops/validate.hpp"
#include "formats/dcp/metadata.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  ckpt::Checkpoint direct;
  direct.root = "/nonexistent-fuzz-root";
  ckpt::Checkpoint tree = direct;
  using Options = ckpt::detail::DirectReadOptions;
  const bool accepted = ckpt::detail::read_dcp_metadata_direct(bytes, ".metadata", direct, {}, nullptr, Options{Options::FirstPass::kFirst});
  for (const std::uint64_t at : {std::uint64_t{size / 2}, std::uint64_t{size + 1}}) {
    ckpt::Checkpoint guessed;
    guessed.root = direct.root;
    if (ckpt::detail::read_dcp_metadata_direct(bytes, ".metadata", guessed, {}, nullptr, Options{Options::FirstPass::kAt, at}) != accepted) {
      __builtin_trap();
    }
    if (accepted && !ckpt::detail::index_difference(direct, guessed).empty()) __builtin_trap();
  }
  {
    ckpt::Checkpoint beside;
    beside.root = direct.root;
    if (ckpt::detail::read_dcp_metadata_direct(bytes, ".metadata", beside, {}, nullptr, Options{Options::FirstPass::kAuto}) != accepted) {
      __builtin_trap();
    }
    if (accepted && !ckpt::detail::index_difference(direct, beside).empty()) __builtin_trap();
  }
  try {
    ckpt::detail::read_dcp_metadata_tree(bytes, ".metadata", tree);
  } catch (const ckpt::Error& e) {
    if (e.kind() == ckpt::ErrorKind::kInternal || accepted) __builtin_trap();
    return 0;
  }
  if (accepted && !ckpt::detail::index_difference(direct, tree).empty()) __builtin_trap();
  for (auto& f : tree.files) f.size = ~std::uint64_t{0};  // the data files are not here: every range fits
  try {
    ckpt::require_valid_index(tree);
  } catch (const ckpt::Error& e) {
    if (e.kind() != ckpt::ErrorKind::kFormat) __builtin_trap();
    return 0;
  }
  constexpr unsigned __int128 kLimit = static_cast<unsigned __int128>(1) << 63;
  auto count = [&](const auto& sizes) {
    unsigned __int128 n = 1;
    for (const std::int64_t s : sizes) {
      if (s < 0) __builtin_trap();
      n *= static_cast<unsigned __int128>(s);
      if (n >= kLimit) __builtin_trap();
    }
    return n;
  };
  for (const auto& t : tree.tensors) {
    const unsigned __int128 n = count(t.shape);
    if (n * ckpt::element_size(t.dtype) >= kLimit) __builtin_trap();
    unsigned __int128 covered = 0;
    for (const auto& ch : t.chunks) covered += count(ch.sizes);
    if (!t.shape.empty() && covered != n) __builtin_trap();
  }
  return 0;
}
