// SPDX-License-Identifier: Apache-2.0
// Precision, decided in one place: Lightning's precision names parsed once into Precision, and
// what each means for the model (converted for *-true), for forward (autocast for *-mixed) and for
// the units (the MixedPrecision of their gathers and reductions). The Strategy applies them; a
// caller passes the name and runs forward inside Strategy::forward_context().
#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <string_view>

namespace torch::nn {
class Module;
}

namespace fsdp {

enum class Precision {
  k32True,    ///< float32 throughout
  kBf16Mixed, ///< float32 parameters and optimizer; bfloat16 autocast compute and gradient reduction
  kBf16True,  ///< the model itself in bfloat16
  k16Mixed,   ///< float16 autocast with a gradient scaler (CUDA only)
  k16True,    ///< the model itself in float16 (CUDA only: LibTorch's CPU kernels have no float16 matmul)
};

/// "32-true", "bf16-mixed", "bf16-true", "16-mixed" or "16-true"; throws fsdp::Error
/// kInvalidArgument, listing them, for anything else.
Precision parse_precision(std::string_view name);
std::string_view to_string(Precision precision) noexcept;

/// FSDP's MixedPrecision. param_dtype: parameters are gathered and computed with in it, the
/// shards (what the optimizer steps) keep theirs. reduce_dtype: gradients are cast to it for the
/// reduction (half the bytes on the wire for bfloat16) and back to the shard's dtype after; unset,
/// it is param_dtype's (as FSDP's). buffer_dtype: the model's buffers are cast to it.
struct MixedPrecision {
  std::optional<c10::ScalarType> param_dtype;
  std::optional<c10::ScalarType> reduce_dtype;
  std::optional<c10::ScalarType> buffer_dtype;
};

/// The MixedPrecision a precision implies for the units, as Lightning's FSDPPrecision: bfloat16
/// reduction for bf16-mixed and bf16-true, float16 for 16-mixed and 16-true, nothing for 32-true.
MixedPrecision mixed_precision_of(Precision precision);

/// The autocast dtype of a precision: bfloat16 for bf16-mixed, float16 for 16-mixed, nothing for
/// the others (no autocast).
std::optional<c10::ScalarType> autocast_dtype_of(Precision precision);

/// The dtype a *-true precision converts the model to (bfloat16, float16); nothing for the others.
std::optional<c10::ScalarType> model_dtype_of(Precision precision);

/// For a *-true precision, converts `module`'s floating parameters and buffers to its dtype (a
/// TorchScript module's masks and indices keep theirs); nothing for the others.
void convert_module(torch::nn::Module& module, Precision precision);

/// The forward context of Lightning's mixed precisions: while it lives (and `on`), forward runs
/// under autocast to `dtype` on `device` (CPU or CUDA); when it ends, autocast is as it was and
/// its cache is cleared. Strategy::forward_context() makes the one a precision implies.
class Autocast {
 public:
  explicit Autocast(bool on, c10::DeviceType device = c10::DeviceType::CPU, c10::ScalarType dtype = c10::ScalarType::BFloat16);
  ~Autocast();
  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  bool on_;
  c10::DeviceType device_;
  bool was_enabled_ = false;
  c10::ScalarType was_dtype_ = c10::ScalarType::BFloat16;
};

}  // namespace fsdp
