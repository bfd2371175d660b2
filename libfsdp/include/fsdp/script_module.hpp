// SPDX-License-Identifier: Apache-2.0
// A TorchScript module (torch.jit.script or torch.jit.trace, saved with torch.jit.save) as a
// torch::nn::Module that FullyShardedSequential can shard. Its parameters are registered, under
// their own FQNs ("transformer.h.0.attn.c_attn.weight"), in a tree of plain modules that mirrors
// the script's submodules. They are the script's very tensors, so pointing them at gathered values
// (what a unit does before forward) is what the script computes with, and their gradients are the
// script's. forward(x) calls the script's forward.
//
// A script's forward is opaque: FSDP cannot run its children one by one, so the whole module is
// one unit, as FSDP wraps a model given no auto-wrap policy. As the only child of a Sequential it
// adds no name of its own to the FQNs (FullyShardedSequential knows it), so a checkpoint's keys
// are the script's state_dict keys.
#pragma once

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <c10/core/ScalarType.h>

#include <memory>
#include <string>

namespace torch::jit {
struct Module;
}

namespace fsdp {

class ScriptModuleImpl : public torch::nn::Module {
 public:
  /// Takes `script` (moved onto the CPU, in training mode). Throws fsdp::Error when it has no
  /// parameters or no forward method.
  explicit ScriptModuleImpl(const torch::jit::Module& script);
  ~ScriptModuleImpl() override;

  /// The script's forward(x); its result must be one tensor (throws fsdp::Error otherwise).
  torch::Tensor forward(const torch::Tensor& x);
  /// Casts the floating-point parameters and buffers (the script's, and so the mirror's) to
  /// `dtype`; integer and boolean buffers (masks, indices) keep theirs. torch::nn::Module::to
  /// would cast those too.
  void cast_floating(c10::ScalarType dtype);
  /// How many buffers the script has: they are used as it holds them and, like the mirror's,
  /// not part of FullyShardedSequential's state dict.
  std::size_t buffer_count() const;
  /// Training or evaluation mode, for the script as for the mirror.
  void train(bool on = true) override;
  /// Moves the script, buffers included, to `device`; the mirror's parameters, being the script's
  /// tensors, move with it.
  void to(torch::Device device, bool non_blocking = false) override;

 private:
  std::unique_ptr<torch::jit::Module> script_;
};
TORCH_MODULE(ScriptModule);

/// Loads a torch.jit.save file onto the CPU. Throws fsdp::Error naming the file and what
/// TorchScript's loader said when it is not one.
ScriptModule load_script_module(const std::string& path);

}  // namespace fsdp
