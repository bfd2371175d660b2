// SPDX-License-Identifier: Apache-2.0
// Checkpoints of FSDP models through libckpt (the bridge is src/ckpt_bridge.cpp, the one file that
// sees both at::Tensor and ckpt:: types).
#pragma once

#include <filesystem>
#include <string>

#include "fsdp/fully_sharded.hpp"

namespace fsdp {

/// Saves `model`'s sharded state dict as a DCP directory laid out as PyTorch FSDP's
/// SHARDED_STATE_DICT and dcp.save lay it out (spec/FORMATS.md §5.2): every original parameter
/// chunked on dim 0 by torch.chunk's rule, rank r writing piece r into __r_0.distcp (ranks past
/// the last piece write nothing for it), FQNs `<key>.<parameter>` with planner_data
/// (key, parameter). An existing .metadata is removed first; every rank writes its file, and after
/// a barrier rank 0 writes .metadata last. A collective: every rank calls it. Throws fsdp::Error.
void save_sharded(const std::filesystem::path& dir, FullyShardedSequential& model, ProcessGroup& group, const std::string& key = "model");

/// Loads `model`'s parameters from a DCP directory (ours or PyTorch's) written at any world size:
/// each parameter `<key>.<parameter>` is assembled from whatever chunks hold it and this rank
/// keeps its slice of each unit. Every parameter must be there with its shape; a dtype that differs
/// is cast as copy_ casts. Throws fsdp::Error naming the file and what is wrong. Collective-free
/// (each rank reads for itself), but every rank must call it before the next forward.
void load_sharded(const std::filesystem::path& dir, FullyShardedSequential& model, ProcessGroup& group, const std::string& key = "model");

}  // namespace fsdp
