// SPDX-License-Identifier: Apache-2.0
#include "fsdp/precision.hpp"

#include <ATen/autocast_mode.h>
#include <torch/nn/module.h>

#include <string>

#include "c10d_compat.hpp"
#include "fsdp/error.hpp"
#include "fsdp/script_module.hpp"

namespace fsdp {

Precision parse_precision(std::string_view name) {
  if (name == "32-true") return Precision::k32True;
  if (name == "bf16-mixed") return Precision::kBf16Mixed;
  if (name == "bf16-true") return Precision::kBf16True;
  if (name == "16-mixed") return Precision::k16Mixed;
  if (name == "16-true") return Precision::k16True;
  throw Error(ErrorKind::kInvalidArgument, "precision '" + std::string(name) + "' is not supported (32-true, bf16-mixed, bf16-true, 16-mixed, 16-true)");
}

std::string_view to_string(Precision precision) noexcept {
  switch (precision) {
    case Precision::k32True: return "32-true";
    case Precision::kBf16Mixed: return "bf16-mixed";
    case Precision::kBf16True: return "bf16-true";
    case Precision::k16Mixed: return "16-mixed";
    case Precision::k16True: return "16-true";
  }
  return "32-true";
}

MixedPrecision mixed_precision_of(Precision precision) {
  MixedPrecision mp;
  if (precision == Precision::k16Mixed || precision == Precision::k16True) mp.reduce_dtype = c10::ScalarType::Half;
  else if (precision != Precision::k32True) mp.reduce_dtype = c10::ScalarType::BFloat16;
  return mp;
}

std::optional<c10::ScalarType> autocast_dtype_of(Precision precision) {
  if (precision == Precision::kBf16Mixed) return c10::ScalarType::BFloat16;
  if (precision == Precision::k16Mixed) return c10::ScalarType::Half;
  return std::nullopt;
}

std::optional<c10::ScalarType> model_dtype_of(Precision precision) {
  if (precision == Precision::kBf16True) return c10::ScalarType::BFloat16;
  if (precision == Precision::k16True) return c10::ScalarType::Half;
  return std::nullopt;
}

void convert_module(torch::nn::Module& module, Precision precision) {
  const auto dtype = model_dtype_of(precision);
  if (!dtype) return;
  // A TorchScript module's integer tensors (masks, indices) must keep their dtypes, which
  // torch::nn::Module::to would convert too: a script casts its floating ones itself.
  bool script = false;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    if (auto* s = dynamic_cast<ScriptModuleImpl*>(m.get())) {
      s->cast_floating(*dtype);
      script = true;
    }
  }
  if (!script) module.to(*dtype);
}

Autocast::Autocast(bool on, c10::DeviceType device, c10::ScalarType dtype) : on_(on), device_(device) {
  if (!on_) return;
  const detail::AutocastState was = detail::autocast_state(device_);
  was_enabled_ = was.enabled;
  was_dtype_ = was.dtype;
  detail::set_autocast_state(device_, {true, dtype});
}

Autocast::~Autocast() {
  if (!on_) return;
  detail::set_autocast_state(device_, {was_enabled_, was_dtype_});
  at::autocast::clear_cache();
}

}  // namespace fsdp
