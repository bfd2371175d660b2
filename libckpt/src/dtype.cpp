// SPDX-License-Identifier: Apache-2.0
// The dtype table. Storage classes from torch/storage.py (_dtype_to_storage_type_map); dtypes
// without one pickle as UntypedStorage + _rebuild_tensor_v3 (docs/formats/torch_save.md#tensors-and-storages). The
// sub-byte shell dtypes (uint1..7, int1..7) have torch itemsize 1.
#include "ckpt/dtype.hpp"

#include <array>

namespace ckpt {
namespace {

constexpr std::array<DTypeInfo, 46> kTable{{
    {DType::kBool, "bool", "BoolStorage", "BOOL", 1},
    {DType::kUInt8, "uint8", "ByteStorage", "U8", 1},
    {DType::kInt8, "int8", "CharStorage", "I8", 1},
    {DType::kInt16, "int16", "ShortStorage", "I16", 2},
    {DType::kInt32, "int32", "IntStorage", "I32", 4},
    {DType::kInt64, "int64", "LongStorage", "I64", 8},
    {DType::kUInt16, "uint16", "", "U16", 2},
    {DType::kUInt32, "uint32", "", "U32", 4},
    {DType::kUInt64, "uint64", "", "U64", 8},
    {DType::kFloat16, "float16", "HalfStorage", "F16", 2},
    {DType::kBFloat16, "bfloat16", "BFloat16Storage", "BF16", 2},
    {DType::kFloat32, "float32", "FloatStorage", "F32", 4},
    {DType::kFloat64, "float64", "DoubleStorage", "F64", 8},
    {DType::kComplex32, "complex32", "", "", 4},
    {DType::kComplex64, "complex64", "ComplexFloatStorage", "C64", 8},
    {DType::kComplex128, "complex128", "ComplexDoubleStorage", "", 16},
    {DType::kFloat8E5M2, "float8_e5m2", "", "F8_E5M2", 1},
    {DType::kFloat8E4M3FN, "float8_e4m3fn", "", "F8_E4M3", 1},
    {DType::kFloat8E5M2FNUZ, "float8_e5m2fnuz", "", "F8_E5M2FNUZ", 1},
    {DType::kFloat8E4M3FNUZ, "float8_e4m3fnuz", "", "F8_E4M3FNUZ", 1},
    {DType::kFloat8E8M0FNU, "float8_e8m0fnu", "", "F8_E8M0", 1},
    {DType::kFloat4E2M1FNx2, "float4_e2m1fn_x2", "", "", 1},
    {DType::kQInt8, "qint8", "QInt8Storage", "", 1},
    {DType::kQUInt8, "quint8", "QUInt8Storage", "", 1},
    {DType::kQInt32, "qint32", "QInt32Storage", "", 4},
    {DType::kQUInt4x2, "quint4x2", "QUInt4x2Storage", "", 1},
    {DType::kQUInt2x4, "quint2x4", "QUInt2x4Storage", "", 1},
    {DType::kBits8, "bits8", "", "", 1},
    {DType::kBits16, "bits16", "", "", 2},
    {DType::kBits1x8, "bits1x8", "", "", 1},
    {DType::kBits2x4, "bits2x4", "", "", 1},
    {DType::kBits4x2, "bits4x2", "", "", 1},
    {DType::kUInt1, "uint1", "", "", 1},
    {DType::kUInt2, "uint2", "", "", 1},
    {DType::kUInt3, "uint3", "", "", 1},
    {DType::kUInt4, "uint4", "", "", 1},
    {DType::kUInt5, "uint5", "", "", 1},
    {DType::kUInt6, "uint6", "", "", 1},
    {DType::kUInt7, "uint7", "", "", 1},
    {DType::kInt1, "int1", "", "", 1},
    {DType::kInt2, "int2", "", "", 1},
    {DType::kInt3, "int3", "", "", 1},
    {DType::kInt4, "int4", "", "", 1},
    {DType::kInt5, "int5", "", "", 1},
    {DType::kInt6, "int6", "", "", 1},
    {DType::kInt7, "int7", "", "", 1},
}};

struct Alias {
  std::string_view alias;
  DType dtype;
};
// torch's Python-level aliases; they pickle under the canonical name, but users type them.
constexpr std::array<Alias, 9> kAliases{{
    {"float", DType::kFloat32}, {"double", DType::kFloat64}, {"half", DType::kFloat16},
    {"long", DType::kInt64}, {"int", DType::kInt32}, {"short", DType::kInt16},
    {"cfloat", DType::kComplex64}, {"cdouble", DType::kComplex128}, {"chalf", DType::kComplex32},
}};

}  // namespace

std::span<const DTypeInfo> all_dtypes() noexcept { return kTable; }

const DTypeInfo& info(DType dtype) noexcept { return kTable[static_cast<std::size_t>(dtype)]; }

std::optional<DType> dtype_from_torch_name(std::string_view name) noexcept {
  if (name.starts_with("torch.")) name.remove_prefix(6);
  for (const auto& row : kTable) {
    if (row.name == name) return row.dtype;
  }
  for (const auto& a : kAliases) {
    if (a.alias == name) return a.dtype;
  }
  return std::nullopt;
}

std::optional<DType> dtype_from_storage_class(std::string_view storage_class) noexcept {
  if (storage_class.empty()) return std::nullopt;
  for (const auto& row : kTable) {
    if (row.storage_class == storage_class) return row.dtype;
  }
  return std::nullopt;
}

std::optional<DType> dtype_from_safetensors(std::string_view code) noexcept {
  if (code.empty()) return std::nullopt;
  for (const auto& row : kTable) {
    if (row.safetensors == code) return row.dtype;
  }
  return std::nullopt;
}

}  // namespace ckpt
