// SPDX-License-Identifier: Apache-2.0
// Element access for the operations that look at values (stats, diff): decoding one element of
// any numeric dtype to double, and visiting a chunk's elements in C order through its strides.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ckpt/checkpoint.hpp"
#include "ckpt/error.hpp"

namespace ckpt::detail {

inline double half_to_double(std::uint16_t h) {
  const int sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  double v;
  if (exp == 0) v = std::ldexp(man, -24);
  else if (exp == 31) v = man ? std::nan("") : INFINITY;
  else v = std::ldexp(man + 1024, exp - 25);
  return sign ? -v : v;
}

inline double e4m3fn_to_double(std::uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 0xf, man = b & 7;
  if (exp == 15 && man == 7) return std::nan("");
  const double v = exp == 0 ? std::ldexp(man, -9) : std::ldexp(man + 8, exp - 10);
  return sign ? -v : v;
}

/// Whether to_double() understands `dtype` (complex, quantized and bit types are not).
inline bool is_numeric(DType d) {
  switch (d) {
    case DType::kBool: case DType::kUInt8: case DType::kInt8: case DType::kInt16: case DType::kInt32:
    case DType::kInt64: case DType::kUInt16: case DType::kUInt32: case DType::kUInt64: case DType::kFloat16:
    case DType::kBFloat16: case DType::kFloat32: case DType::kFloat64: case DType::kFloat8E5M2:
    case DType::kFloat8E4M3FN:
      return true;
    default:
      return false;
  }
}

inline double to_double(DType d, const std::byte* p) {
  auto load = [p](auto v) {
    std::memcpy(&v, p, sizeof v);
    return v;
  };
  switch (d) {
    case DType::kBool: return load(std::uint8_t{}) ? 1.0 : 0.0;
    case DType::kUInt8: return load(std::uint8_t{});
    case DType::kInt8: return load(std::int8_t{});
    case DType::kInt16: return load(std::int16_t{});
    case DType::kInt32: return load(std::int32_t{});
    case DType::kInt64: return static_cast<double>(load(std::int64_t{}));
    case DType::kUInt16: return load(std::uint16_t{});
    case DType::kUInt32: return load(std::uint32_t{});
    case DType::kUInt64: return static_cast<double>(load(std::uint64_t{}));
    case DType::kFloat16: return half_to_double(load(std::uint16_t{}));
    case DType::kBFloat16: return std::bit_cast<float>(static_cast<std::uint32_t>(load(std::uint16_t{})) << 16);
    case DType::kFloat32: return load(float{});
    case DType::kFloat64: return load(double{});
    case DType::kFloat8E5M2: return half_to_double(static_cast<std::uint16_t>(load(std::uint8_t{}) << 8));
    case DType::kFloat8E4M3FN: return e4m3fn_to_double(load(std::uint8_t{}));
    default: internal_error("to_double on a non-numeric dtype");
  }
}

inline bool is_integral(DType d) {
  switch (d) {
    case DType::kBool: case DType::kUInt8: case DType::kInt8: case DType::kInt16: case DType::kInt32:
    case DType::kInt64: case DType::kUInt16: case DType::kUInt32: case DType::kUInt64:
      return true;
    default:
      return false;
  }
}

static_assert(std::numeric_limits<long double>::digits >= 64, "integer_value needs a long double that holds every int64 and uint64");

/// An integer dtype's element, exactly (to_double rounds int64 and uint64 past 2^53).
inline long double integer_value(DType d, const std::byte* p) {
  auto load = [p](auto v) {
    std::memcpy(&v, p, sizeof v);
    return v;
  };
  switch (d) {
    case DType::kInt64: return static_cast<long double>(load(std::int64_t{}));
    case DType::kUInt64: return static_cast<long double>(load(std::uint64_t{}));
    default: return to_double(d, p);  // the rest are exact in a double
  }
}

/// An integer_value as text, every digit.
inline std::string integer_text(long double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0Lf", v);
  return buf;
}

/// An integer_value as a JSON integer of type Json (nlohmann's): int64 when negative, uint64
/// otherwise, so that every value of both keeps its digits.
template <typename Json>
Json integer_json(long double v) {
  return v < 0 ? Json(static_cast<std::int64_t>(v)) : Json(static_cast<std::uint64_t>(v));
}

/// Calls fn(index, element) for every element of the chunk, `index` counting in C order within
/// the chunk. The storage is read through a view (mmap, memory) or, failing that, into a buffer
/// covering exactly the span the view touches.
template <typename Fn>
void for_each_element(const ChunkData& d, Fn&& fn) {
  const std::size_t es = element_size(d.dtype);
  std::uint64_t numel = 1;
  for (auto s : d.shape) numel *= static_cast<std::uint64_t>(s);
  if (numel == 0) return;
  std::uint64_t last = static_cast<std::uint64_t>(d.storage_offset);
  for (std::size_t i = 0; i < d.shape.size(); ++i) last += static_cast<std::uint64_t>((d.shape[i] - 1) * d.strides[i]);
  const std::uint64_t begin = static_cast<std::uint64_t>(d.storage_offset) * es, end = (last + 1) * es;
  std::vector<std::byte> owned;
  const std::byte* base;
  if (auto v = d.storage->view(begin, end - begin)) {
    base = v->data();
  } else {
    owned = d.storage->read_vector(begin, end - begin);
    base = owned.data();
  }
  const bool contiguous = d.strides == contiguous_strides(d.shape);
  if (contiguous) {
    for (std::uint64_t i = 0; i < numel; ++i) fn(i, base + i * es);
    return;
  }
  std::vector<std::int64_t> idx(d.shape.size(), 0);
  for (std::uint64_t i = 0; i < numel; ++i) {
    std::int64_t e = 0;
    for (std::size_t k = 0; k < idx.size(); ++k) e += idx[k] * d.strides[k];
    fn(i, base + static_cast<std::uint64_t>(e) * es);
    for (std::size_t k = idx.size(); k-- > 0;) {
      if (++idx[k] < d.shape[k]) break;
      idx[k] = 0;
    }
  }
}

}  // namespace ckpt::detail
