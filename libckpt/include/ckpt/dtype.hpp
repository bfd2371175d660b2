// SPDX-License-Identifier: Apache-2.0
// The one dtype table: torch dtype names, legacy storage class names, safetensors strings and
// element sizes, for every dtype torch 2.x defines (docs/formats/torch_save.md#tensors-and-storages, docs/formats/safetensors.md#dtypes).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>

namespace ckpt {

enum class DType : std::uint8_t {
  kBool, kUInt8, kInt8, kInt16, kInt32, kInt64,
  kUInt16, kUInt32, kUInt64,
  kFloat16, kBFloat16, kFloat32, kFloat64,
  kComplex32, kComplex64, kComplex128,
  kFloat8E5M2, kFloat8E4M3FN, kFloat8E5M2FNUZ, kFloat8E4M3FNUZ, kFloat8E8M0FNU, kFloat4E2M1FNx2,
  kQInt8, kQUInt8, kQInt32, kQUInt4x2, kQUInt2x4,
  kBits8, kBits16, kBits1x8, kBits2x4, kBits4x2,
  kUInt1, kUInt2, kUInt3, kUInt4, kUInt5, kUInt6, kUInt7,
  kInt1, kInt2, kInt3, kInt4, kInt5, kInt6, kInt7,
};

/// One row of the table.
struct DTypeInfo {
  DType dtype;
  std::string_view name;           ///< torch name without the `torch.` prefix: "float32"
  std::string_view storage_class;  ///< legacy typed storage in module `torch` ("FloatStorage"); empty: saved
                                   ///< as `torch.storage.UntypedStorage` with `_rebuild_tensor_v3`
  std::string_view safetensors;    ///< safetensors dtype string ("F32"); empty when safetensors has none
  std::uint8_t element_size;       ///< bytes per element (torch's itemsize)
};

/// Every row, in enum order.
std::span<const DTypeInfo> all_dtypes() noexcept;
const DTypeInfo& info(DType dtype) noexcept;
inline std::size_t element_size(DType dtype) noexcept { return info(dtype).element_size; }
inline std::string_view name(DType dtype) noexcept { return info(dtype).name; }

/// "float32" or "torch.float32"; torch's aliases ("float", "half", "long", "cfloat", ...) too.
std::optional<DType> dtype_from_torch_name(std::string_view name) noexcept;
/// "FloatStorage" (the class name in module `torch`).
std::optional<DType> dtype_from_storage_class(std::string_view storage_class) noexcept;
/// "F32", "BF16", ...
std::optional<DType> dtype_from_safetensors(std::string_view code) noexcept;

}  // namespace ckpt
