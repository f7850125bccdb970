// Block-wise 8-bit optimizer states: the codes, the per-block scales and
// the two code maps (Note [8-bit states] in state_codec.cc).
//
//   std::vector<uint8_t> codes(n);
//   std::vector<float> scales(n / kStateBlockElems);
//   QuantizeBlocks(exp_avg, n, /*is_signed=*/true, codes.data(), scales.data());
//   DequantizeBlocks(codes.data(), scales.data(), n, /*is_signed=*/true, exp_avg);
//
// Scalar code, the reference of any vector or GPU one. Thread-safety: pure
// functions; the code maps are built once, on first use.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace strata::optim {

// Elements that share one scale.
inline constexpr size_t kStateBlockElems = 256;
// Tensors smaller than this keep fp32 states (as bitsandbytes and torchao do:
// their scales would be a large share of their bytes).
inline constexpr size_t kMinQuantizedElems = 4096;

// Whether a tensor of `numel` elements gets 8-bit states: at least
// kMinQuantizedElems, in whole blocks; else its states stay fp32.
constexpr bool QuantizesStates(size_t numel) {
  return numel >= kMinQuantizedElems && numel % kStateBlockElems == 0;
}

using StateCodeMap = std::array<float, 256>;

// The values the 256 codes stand for, ascending, within [-1, 1]: the
// signed map (the first moment) or the unsigned one (the second moment).
const StateCodeMap& CodeMap(bool is_signed);

// The code of `scaled` (a value divided by its block's scale, so within
// [-1, 1]): the nearest of the map's values, the upper one on a tie. NaN
// gives code 0.
inline uint8_t EncodeScaled(float scaled, const StateCodeMap& map) {
  unsigned code = scaled >= map[128] ? 128 : 0;
  for (unsigned half = 64; half > 0; half /= 2) {
    if (scaled >= map[code + half]) code += half;
  }
  const unsigned up = code < 255 ? code + 1 : 255;
  if (scaled - map[code] >= (map[up] - map[code]) * 0.5f) code = up;
  return static_cast<uint8_t>(code);
}

// The encoder as lookups, for vector code (Note [Encoding by thresholds]):
// threshold[c] (c < 255) is the least float EncodeScaled codes above c
// (+inf from 255 on), and first[bucket] the code of the least value of a
// bucket of floats (by sign, exponent and top 6 mantissa bits: Bucket), so
// that a value's code is first[its bucket] plus the thresholds it reaches,
// at most 2 further in any bucket.
struct ThresholdEncoder {
  static constexpr uint32_t kMinExponent = 97;  // |value| under 2^-30 shares the lowest bucket (no threshold there)
  static constexpr uint32_t kBucketsPerSign = 31 * 64;  // exponents 97..127, 64 buckets each
  std::array<float, 257> threshold;
  std::array<uint8_t, 2 * kBucketsPerSign + 3> first;  // negative values' buckets after the positive ones' (3 bytes
                                                     // of padding: vector code reads 4 bytes from each)

  static uint32_t Bucket(uint32_t bits) {
    const uint32_t magnitude = (bits & 0x7fffffffu) >> 17;  // exponent and top 6 mantissa bits
    const uint32_t lowest = kMinExponent << 6;
    const uint32_t in_sign = magnitude < lowest ? 0 : std::min(magnitude - lowest, kBucketsPerSign - 1);
    return (bits >> 31) * kBucketsPerSign + in_sign;
  }
};
const ThresholdEncoder& Encoder(bool is_signed);

// The map's and the encoder's arrays, for vector kernels (which call no
// inline function: optim/cpu/cpu_kernels_impl.h).
struct StateTables {
  const float* map;        // 256
  const float* threshold;  // 257
  const uint8_t* first;    // 2 * kBucketsPerSign, then 3 bytes of padding
};
StateTables TablesOf(bool is_signed);

// EncodeScaled by the encoder's lookups: the same code for every float.
inline uint8_t EncodeByThresholds(float scaled, const ThresholdEncoder& encoder) {
  if (scaled != scaled) return 0;  // NaN, as EncodeScaled
  uint32_t bits;
  std::memcpy(&bits, &scaled, sizeof(bits));
  uint32_t code = encoder.first[ThresholdEncoder::Bucket(bits)];
  code += scaled >= encoder.threshold[code] ? 1 : 0;
  code += scaled >= encoder.threshold[code] ? 1 : 0;
  return static_cast<uint8_t>(code);
}

// One block's scale: the largest magnitude of its values, at least 1e-12
// (NaN where a value is NaN).
float BlockScale(const float* values, size_t n);

// Quantizes `n` values (a multiple of kStateBlockElems) block by block into
// `codes` (n) and `scales` (n / kStateBlockElems).
void QuantizeBlocks(const float* values, size_t n, bool is_signed, uint8_t* codes, float* scales);
// The values `codes` and `scales` stand for: map[code] * scale.
void DequantizeBlocks(const uint8_t* codes, const float* scales, size_t n, bool is_signed, float* values);

}  // namespace strata::optim
