// SPDX-License-Identifier: Apache-2.0
// Checkpoints of FSDP models through libckpt (the bridge is src/ckpt_bridge.cpp, the one file that
// sees both at::Tensor and ckpt:: types).
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "ckpt/pickle.hpp"
#include "fsdp/fully_sharded.hpp"
#include "fsdp/optim.hpp"

namespace fsdp {

/// An optimizer of the model and the key its state is saved under.
struct NamedOptimizer {
  std::string key = "optimizer";
  ShardedOptimizer* optimizer = nullptr;
};

struct SaveOptions {
  std::string model_key = "model";
  /// Also saves these optimizers' state, each as FSDP's sharded optimizer state dict flattened by
  /// DCP: `<key>.state.<parameter>.<buffer>` chunked as the parameter is,
  /// `<key>.state.<parameter>.step` (a 0-d float32 tensor, written once), for each parameter it
  /// steps, and `<key>.param_groups` (a bytes item: its groups, "params" listing FQNs).
  std::vector<NamedOptimizer> optimizers;
  /// Non-null: rank 0 writes it as `meta.pt` (a torch.save file), as Lightning keeps a sharded
  /// checkpoint's other state, before `.metadata`.
  ckpt::pickle::ValuePtr meta;
  /// save_sharded: consecutive units' chunks share one of a rank's data files until they reach
  /// this many bytes (DCP's several files per rank); a file's chunks are views of the shards
  /// (copies to the host, where the shards are on a GPU) made just before it is written.
  std::int64_t file_bytes = std::int64_t{16} << 20;
  /// Set: only the parameters (by FQN) it accepts are saved, with their optimizer state (save_full
  /// only: a sharded checkpoint with a filter could not be loaded, so save_sharded refuses one).
  std::function<bool(const std::string& fqn)> model_filter;
};

/// Saves `model`'s sharded state dict as a DCP directory as dcp.save lays it out: each rank writes
/// what its slice of each unit's flat buffer holds, where it lies, with no gather: a parameter's
/// elements in the slice as at most 2 * ndim - 1 boxes (NOTE [A sharded save, as the shards lie]
/// in ckpt_bridge.cpp; docs/formats/sharding.md#a-flat-slice-as-boxes), in the rank's files
/// __r_N.distcp (a file holds consecutive units' chunks, see SaveOptions::file_bytes); optimizer
/// moments as their parameters; buffers and steps whole by rank 0; FQNs `<key>.<parameter>` with
/// planner_data (key, parameter). Any DCP reader, PyTorch's included, loads it at any world size.
/// A checkpoint already at `dir` stays whole until the new one is; every rank writes its files,
/// and after a barrier rank 0 writes .metadata last, so that the directory is a checkpoint only
/// once it is whole. A collective: every rank calls it. Throws fsdp::Error.
void save_sharded(const std::filesystem::path& dir, ShardedModel& model, ProcessGroup& group, const SaveOptions& options = {});

/// Saves `model`'s full state dict (FSDP's FULL_STATE_DICT) as one torch.save file, written by
/// rank 0 alone (atomically: a temporary file renamed into place), laid out as Lightning's full
/// checkpoint: the entries of `options.meta` (a dict) at the top level, `model` (FQN -> tensor)
/// and, with an optimizer, `optimizer` (FSDP's full optim state dict: `state` keyed by FQN with
/// `step`, the buffers; `param_groups`). Every rank gathers (a collective), one unit at a time
/// as rank 0's file needs it: rank 0 holds about one unit's full values at a time, never the whole
/// state. Throws fsdp::Error.
void save_full(const std::filesystem::path& file, ShardedModel& model, ProcessGroup& group, const SaveOptions& options = {});

struct LoadOptions {
  /// The key the model's entries sit under: `<model_key>.<parameter>`. Empty: the checkpoint is
  /// the module's own state dict (`<parameter>`), as torch.save(model.state_dict()), a
  /// safetensors file or a Hugging Face folder holds it.
  std::string model_key = "model";
  /// s<d>REGEX<d>REPLACEMENT<d>[g] (ckpt::EntryRenames), applied in order to each checkpoint name
  /// below `model_key` before it is matched with the model's.
  std::vector<std::string> renames;
  /// Also loads these optimizers' state (saved as SaveOptions describes, or as torch.optim keys
  /// it, by integer ids): the checkpoint's param_groups must hold the same parameters, group by
  /// group, and give each group its hyperparameters; then each stepped parameter's buffers and
  /// the step count.
  std::vector<NamedOptimizer> optimizers;
  /// true: every parameter of the model must be in the checkpoint, and the checkpoint may hold no
  /// other tensor under `<model_key>.` (as torch's load_state_dict(strict=True); the error lists
  /// both kinds); false: missing parameters keep their values and other entries are ignored (the
  /// optimizer state asked for must be whole either way).
  bool strict = true;
};

/// Loads `model`'s parameters from a DCP directory (ours or PyTorch's) written at any world size,
/// from a torch.save file (save_full's, Lightning's full or consolidated checkpoint, whose
/// top-level object is then what is returned), or from any weights libckpt reads (safetensors, a
/// Hugging Face folder, HDF5):
/// of each parameter `<key>.<parameter>` this rank reads only the rows that hold its slice of the
/// unit, from whatever chunks hold them (all ranks together read about the checkpoint's size;
/// bench/fsdp_load measures it). Every parameter must be there with its shape; a dtype that differs
/// is cast as copy_ casts. Returns the object `meta.pt` holds (null when there is none). Throws
/// fsdp::Error naming the file and what is wrong. Collective-free (each rank reads for itself),
/// but every rank must call it before the next forward.
ckpt::pickle::ValuePtr load_sharded(const std::filesystem::path& dir, ShardedModel& model, ProcessGroup& group,
                                    const LoadOptions& options = {});

}  // namespace fsdp
