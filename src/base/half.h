// Scalar conversions between fp32 and the two 16-bit float formats, as
// PyTorch converts them on the CPU. These are the references the vector
// conversions in the optimizer kernels are checked against, bit for bit.
//
// fp32 -> bf16: round to nearest, ties to even, on the bit pattern (add
//   0x7FFF plus the lowest kept bit, keep the top 16 bits); every NaN becomes
//   0xFFFF, as a tensor conversion (`x.to(torch.bfloat16)`, PyTorch's
//   vectorized CPU path) writes it; the scalar c10::BFloat16 constructor
//   writes 0x7FC0 instead, a NaN as well. Subnormals are kept (no flush).
// Checked against torch 1.13's CPU tensor conversions on 33.6 million
// values (every upper half with the rounding-deciding lower halves, 20M
// random patterns, the fp16 subnormal and overflow edges): identical bits,
// NaNs included (docs/benchmarks.md).
// fp32 -> fp16: IEEE 754 round to nearest even, subnormal results kept,
//   overflow to infinity (65520 and above round to inf), NaN to the quiet NaN
//   0x7E00 with the input's sign.
// bf16/fp16 -> fp32: exact.
//
// Pure functions; thread-safe.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "strata/types.h"

namespace strata::optim {

inline uint16_t Bf16FromFloat(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFF;  // NaN
  const uint32_t kept_lsb = (bits >> 16) & 1u;
  return static_cast<uint16_t>((bits + 0x7FFFu + kept_lsb) >> 16);
}

inline float FloatFromBf16(uint16_t value) { return std::bit_cast<float>(static_cast<uint32_t>(value) << 16); }

inline uint16_t Fp16FromFloat(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) return sign | 0x7E00;  // NaN
  // 65520 (0x477FF000) is halfway between 65504, the largest fp16, and 65536;
  // the tie goes to the even side, which is infinity.
  if (magnitude >= 0x477FF000u) return sign | 0x7C00;
  if (magnitude >= 0x38800000u) {  // 2^-14 and up: a normal fp16
    // Re-bias the exponent (127 -> 15) and round 23 mantissa bits to 10; a
    // carry out of the mantissa correctly bumps the exponent.
    const uint32_t rebiased = magnitude - (112u << 23);
    const uint32_t kept_lsb = (rebiased >> 13) & 1u;
    return sign | static_cast<uint16_t>((rebiased + 0xFFFu + kept_lsb) >> 13);
  }
  // A subnormal fp16 counts units of 2^-24: the 24-bit significand times
  // 2^(exponent - 126) units, rounded to nearest even in integers (no
  // dependence on the floating-point rounding mode). Below 2^-25, half a
  // unit, everything rounds to zero; 1024 units is the smallest normal,
  // whose encoding is also 1024.
  const uint32_t exponent = magnitude >> 23;
  if (exponent < 102) return sign;
  const uint32_t shift = 126 - exponent;  // 14..24
  const uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;
  uint32_t units = significand >> shift;
  const uint32_t rest = significand & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (units & 1u) != 0)) ++units;
  return sign | static_cast<uint16_t>(units);
}

inline float FloatFromFp16(uint16_t value) {
  const uint32_t sign = static_cast<uint32_t>(value & 0x8000u) << 16;
  const uint32_t exponent = (value >> 10) & 0x1Fu;
  const uint32_t mantissa = value & 0x3FFu;
  uint32_t bits;
  if (exponent == 0x1F) {
    bits = 0x7F800000u | (mantissa << 13);  // inf or NaN, payload kept
  } else if (exponent == 0) {
    bits = std::bit_cast<uint32_t>(static_cast<float>(mantissa) * 5.9604644775390625e-8f);  // units of 2^-24
  } else {
    bits = ((exponent + 112u) << 23) | (mantissa << 13);
  }
  return std::bit_cast<float>(sign | bits);
}

// Element i of an fp32, bf16 or fp16 array, in fp32 (exact).
inline float FloatAt(const void* data, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(data)[i];
    case DType::kBFloat16: return FloatFromBf16(static_cast<const uint16_t*>(data)[i]);
    case DType::kFloat16: return FloatFromFp16(static_cast<const uint16_t*>(data)[i]);
    case DType::kInt8Block: break;  // codes, not values: no element reads as a float
  }
  return 0;
}

// Stores `value` as element i of an fp32, bf16 or fp16 array (rounded to nearest even).
inline void StoreFloat(void* data, DType dtype, size_t i, float value) {
  switch (dtype) {
    case DType::kFloat32: static_cast<float*>(data)[i] = value; return;
    case DType::kBFloat16: static_cast<uint16_t*>(data)[i] = Bf16FromFloat(value); return;
    case DType::kFloat16: static_cast<uint16_t*>(data)[i] = Fp16FromFloat(value); return;
    case DType::kInt8Block: return;  // codes, not values
  }
}

}  // namespace strata::optim
