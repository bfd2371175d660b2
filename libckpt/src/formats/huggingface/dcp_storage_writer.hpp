// SPDX-License-Identifier: Apache-2.0
// Writing DCP's Hugging Face storage (docs/formats/dcp.md#hugging-face-storage) from a DCP write
// plan: what HuggingFaceStorageWriter(save_sharded=True) writes for the plan's ranks, so that
// HuggingFaceStorageReader loads it. Each rank that holds chunks writes one safetensors file,
// `shard-{rank + 1}-model-00001-of-00001.safetensors` (5 digits each), of its chunks under their
// tensors' names, with DCP_SHARDING_INFO giving each chunk's offsets; no index, no .metadata.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ckpt/copy.hpp"
#include "ckpt/formats/safetensors.hpp"
#include "ckpt/output.hpp"
#include "formats/dcp/write_plan.hpp"

namespace ckpt::detail {

struct HfStorageFile {
  int rank = 0;
  std::string name;
  SafetensorsLayout layout;
  /// (tensor, chunk) of the plan for each of the layout's entries, in layout order.
  std::vector<std::pair<std::uint32_t, std::uint32_t>> chunks;
};

/// The files of `plan`'s tensor chunks, rank by rank. Throws kInvalidArgument for a dtype
/// HuggingFaceStorageReader does not read as itself (it knows F16, F32, F64, BF16, I8, U8, I16,
/// I32, I64 and reads any other as float32), naming the tensor; and for a rank holding two chunks
/// of one tensor (a file holds one tensor of a name).
std::vector<HfStorageFile> plan_hf_storage_files(const DcpPlan& plan, const std::string& target);

/// Writes `files` into `out`, their chunks made by plan.add_tasks, in one copy. The files are
/// committed; a failure leaves the ones not yet committed absent.
void write_hf_storage_files(OutputFiles& out, const DcpPlan& plan, std::span<const HfStorageFile> files,
                            const CopyOptions& options);

}  // namespace ckpt::detail
