// SPDX-License-Identifier: Apache-2.0
// The conversions are c10's: c10/util/BFloat16.h round_to_nearest_even and the FP16 library's
// fp16_ieee_from_fp32_value / fp16_ieee_to_fp32_value, which c10::Half uses on x86.
#include "ckpt/cast.hpp"

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "ckpt/error.hpp"

namespace ckpt {
namespace {

float half_to_float(std::uint16_t h) noexcept {
  const std::uint32_t w = static_cast<std::uint32_t>(h) << 16;
  const std::uint32_t sign = w & 0x80000000u;
  const std::uint32_t two_w = w + w;
  constexpr std::uint32_t exp_offset = 0xE0u << 23;
  constexpr float exp_scale = 0x1.0p-112f;
  const float normalized = std::bit_cast<float>((two_w >> 4) + exp_offset) * exp_scale;
  constexpr std::uint32_t magic_mask = 126u << 23;
  constexpr float magic_bias = 0.5f;
  const float denormalized = std::bit_cast<float>((two_w >> 17) | magic_mask) - magic_bias;
  constexpr std::uint32_t denormalized_cutoff = 1u << 27;
  const std::uint32_t result =
      sign | (two_w < denormalized_cutoff ? std::bit_cast<std::uint32_t>(denormalized) : std::bit_cast<std::uint32_t>(normalized));
  return std::bit_cast<float>(result);
}

std::uint16_t float_to_half(float f) noexcept {
  constexpr float scale_to_inf = 0x1.0p+112f;
  constexpr float scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const std::uint32_t w = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t shl1_w = w + w;
  const std::uint32_t sign = w & 0x80000000u;
  std::uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = std::bit_cast<float>((bias >> 1) + 0x07800000u) + base;
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(base);
  const std::uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const std::uint32_t mantissa_bits = bits & 0x00000FFFu;
  const std::uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<std::uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

float bf16_to_float(std::uint16_t b) noexcept { return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16); }

std::uint16_t float_to_bf16(float f) noexcept {
  if (std::isnan(f)) return 0x7FC0;
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounding_bias = ((u >> 16) & 1u) + 0x7FFFu;
  return static_cast<std::uint16_t>((u + rounding_bias) >> 16);
}

template <typename T>
T load(const std::byte* p) noexcept {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <typename T>
void store(std::byte* p, T v) noexcept {
  std::memcpy(p, &v, sizeof v);
}

// Element `i` of `p`, a castable float dtype, as a double (exactly).
double element(const std::byte* p, DType d, std::size_t i) noexcept {
  switch (d) {
    case DType::kFloat64: return load<double>(p + 8 * i);
    case DType::kFloat32: return load<float>(p + 4 * i);
    case DType::kFloat16: return half_to_float(load<std::uint16_t>(p + 2 * i));
    default: return bf16_to_float(load<std::uint16_t>(p + 2 * i));
  }
}

// Reads element i as the widest type the source holds exactly: double for float64, float otherwise.
template <typename Out>
void convert_all(std::span<const std::byte> in, DType from, std::size_t n, Out&& put) {
  const std::byte* p = in.data();
  switch (from) {
    case DType::kFloat64:
      for (std::size_t i = 0; i < n; ++i) put(i, load<double>(p + 8 * i));
      break;
    case DType::kFloat32:
      for (std::size_t i = 0; i < n; ++i) put(i, load<float>(p + 4 * i));
      break;
    case DType::kFloat16:
      for (std::size_t i = 0; i < n; ++i) put(i, half_to_float(load<std::uint16_t>(p + 2 * i)));
      break;
    case DType::kBFloat16:
      for (std::size_t i = 0; i < n; ++i) put(i, bf16_to_float(load<std::uint16_t>(p + 2 * i)));
      break;
    default: internal_error("cast from a dtype that is not a castable float");
  }
}

}  // namespace

bool is_castable_float(DType d) noexcept {
  return d == DType::kFloat64 || d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16;
}

CastDamage cast(std::span<const std::byte> in, DType from, std::span<std::byte> out, DType to) {
  if (!is_castable_float(from) || !is_castable_float(to)) internal_error("cast between dtypes that are not castable floats");
  const std::size_t n = in.size() / element_size(from);
  if (in.size() % element_size(from) != 0 || out.size() != n * element_size(to)) internal_error("cast: sizes disagree");
  if (from == to) {
    std::memcpy(out.data(), in.data(), in.size());
    return {};
  }
  std::byte* q = out.data();
  switch (to) {
    case DType::kFloat64:
      convert_all(in, from, n, [&](std::size_t i, auto v) { store<double>(q + 8 * i, static_cast<double>(v)); });
      break;
    case DType::kFloat32:
      convert_all(in, from, n, [&](std::size_t i, auto v) { store<float>(q + 4 * i, static_cast<float>(v)); });
      break;
    case DType::kFloat16:
      convert_all(in, from, n, [&](std::size_t i, auto v) { store<std::uint16_t>(q + 2 * i, float_to_half(static_cast<float>(v))); });
      break;
    case DType::kBFloat16:
      convert_all(in, from, n, [&](std::size_t i, auto v) { store<std::uint16_t>(q + 2 * i, float_to_bf16(static_cast<float>(v))); });
      break;
    default: internal_error("unreachable");
  }
  // Only a cast to fewer exponent or mantissa bits loses values: float64 to anything narrower,
  // float32 to a 16-bit type, float16 to bfloat16 (fewer mantissa bits: its subnormals flush) and
  // bfloat16 to float16 (a narrower exponent range).
  const bool narrows = element_size(to) < element_size(from) || (from == DType::kFloat16 && to == DType::kBFloat16) ||
                       (from == DType::kBFloat16 && to == DType::kFloat16);
  CastDamage damage;
  if (!narrows) return damage;
  convert_all(in, from, n, [&](std::size_t i, auto v) {
    const double x = static_cast<double>(v), y = element(q, to, i);
    damage.overflowed += std::isfinite(x) && std::isinf(y);
    damage.flushed += x != 0 && !std::isnan(x) && y == 0;
  });
  return damage;
}

void CastLedger::record(std::string_view tensor, CastDamage damage) {
  if (!damage.any()) return;
  std::lock_guard lock(mutex_);
  auto it = damaged_.find(tensor);
  if (it == damaged_.end()) it = damaged_.emplace(std::string(tensor), CastDamage{}).first;
  it->second.overflowed += damage.overflowed;
  it->second.flushed += damage.flushed;
}

std::map<std::string, CastDamage> CastLedger::damaged() const {
  std::lock_guard lock(mutex_);
  return {damaged_.begin(), damaged_.end()};
}

void CastLedger::conclude(DType to, CastCheck check, Progress* progress, const std::string& where) const {
  const std::map<std::string, CastDamage> damaged = this->damaged();
  if (damaged.empty()) return;
  auto text = [&](const std::string& tensor, const CastDamage& d) {
    std::string s = "'" + tensor + "' cast to " + std::string(name(to)) + ":";
    if (d.overflowed) s += " " + std::to_string(d.overflowed) + " finite value" + (d.overflowed == 1 ? "" : "s") + " became inf";
    if (d.overflowed && d.flushed) s += ",";
    if (d.flushed) s += " " + std::to_string(d.flushed) + " non-zero value" + (d.flushed == 1 ? "" : "s") + " became 0";
    return s;
  };
  if (check == CastCheck::kStrict) {
    std::string s;
    for (const auto& [tensor, d] : damaged) s += (s.empty() ? "" : "; ") + text(tensor, d);
    throw Error(ErrorKind::kMismatch, where, std::nullopt,
                "--strict-cast: " + std::to_string(damaged.size()) + " tensor" + (damaged.size() == 1 ? "" : "s") +
                    " would lose values: " + s + "; nothing was written");
  }
  if (!progress) return;
  for (const auto& [tensor, d] : damaged) progress->note(text(tensor, d) + " (--strict-cast refuses such a cast)");
}

}  // namespace ckpt
