// SPDX-License-Identifier: Apache-2.0
// DCP_SHARDING_INFO: what DCP writes in a safetensors header's __metadata__ when it stores tensors
// as safetensors (docs/formats/dcp.md#hugging-face-storage): the JSON {fqn: {"saved_offsets":
// [...]}} giving where each of the file's tensors sits in the whole tensor.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "ckpt/formats/safetensors.hpp"

namespace ckpt::detail {

/// The saved offsets of each of `f`'s tensors, in f.tensors' order; std::nullopt when its
/// __metadata__ has no DCP_SHARDING_INFO. Throws kFormat at the header (offset 8 of `f`'s source)
/// for JSON that is not an object, a tensor without its entry, or offsets that are not
/// non-negative ints of the tensor's rank.
std::optional<std::vector<std::vector<std::int64_t>>> dcp_saved_offsets(const SafetensorsFile& f);

}  // namespace ckpt::detail
