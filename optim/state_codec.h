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

#include "strata/types.h"

namespace strata::optim {

// Elements that share one scale (a kInt8Block chunk's blocks).
inline constexpr size_t kStateBlockElems = 256;
static_assert(kStateBlockElems == kInt8BlockElems);

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

// The encoder as one lookup, for vector code (Note [Encoding by
// thresholds]): a value's bucket (its sign, exponent and top 7 mantissa
// bits: Bucket) holds at most one boundary between codes, so one entry a
// bucket says all: the code at the bucket's least magnitude (bits 0-7) and
// the low mantissa bits from which the code is one further from it (bits
// 8-24; kNoBoundary where the whole bucket has one code).
struct ThresholdEncoder {
  static constexpr uint32_t kMinExponent = 97;  // |value| under 2^-30 shares the lowest bucket (no boundary there)
  static constexpr uint32_t kBucketBits = 7;    // mantissa bits a bucket's values share
  static constexpr uint32_t kLowBits = 23 - kBucketBits;
  static constexpr uint32_t kNoBoundary = 1u << kLowBits;
  static constexpr uint32_t kBucketsPerSign = 31 << kBucketBits;  // exponents 97..127
  std::array<float, 255> threshold;  // threshold[c]: the least float EncodeScaled codes above c
  std::array<uint32_t, 2 * kBucketsPerSign> entry;  // negative values' buckets after the positive ones'

  static uint32_t Bucket(uint32_t bits) {
    const uint32_t magnitude = (bits & 0x7fffffffu) >> kLowBits;  // exponent and top mantissa bits
    const uint32_t lowest = kMinExponent << kBucketBits;
    const uint32_t in_sign = magnitude < lowest ? 0 : std::min(magnitude - lowest, kBucketsPerSign - 1);
    return (bits >> 31) * kBucketsPerSign + in_sign;
  }
};
const ThresholdEncoder& Encoder(bool is_signed);

// The encoder as arithmetic, for vector code where a lookup a value costs
// more than the rest of the update (Note [Encoding by runs]): the map's
// positive values in runs of evenly spaced ones (0 and 1 each a run of one);
// a magnitude's run from its octave's entry and the one run start that
// octave may hold, and its code in the run from a multiply-add, trusted
// unless within kMargin of a code's edge or kUlps of a run start (the lookup
// decides those).
struct RunEncoder {
  static constexpr uint32_t kLowestExponent = 104;  // magnitudes under 2^-23 share its octave's entry
  static constexpr float kMargin = 1.0f / 1024;      // of a code's width
  static constexpr int32_t kUlps = 64;               // floats from a run start (its mirror's lies within 8)
  // By exponent & 31 (104..127 at 8..31): the run of the octave's least
  // magnitude, and the least magnitude of the run after it if that starts
  // within the octave (else +inf).
  std::array<int32_t, 32> run_below;
  std::array<float, 32> next_run_from;
  // By run: a magnitude's code is base + min(int(|x| * slope + offset), last).
  std::array<float, 16> slope, offset;
  std::array<int32_t, 16> base, last;
};
const RunEncoder& Runs(bool is_signed);

// The map's and the encoders' arrays, for vector kernels (which call no
// inline function: optim/cpu/cpu_kernels_impl.h).
struct StateTables {
  const float* map;          // 256
  const uint32_t* entry;     // 2 * kBucketsPerSign
  const uint8_t* planes;     // 4 * 256: byte k of map[c] (little-endian) at 256 k + c
  const RunEncoder* runs;
  bool is_signed;            // negative magnitudes code as 254 - code (signed) or 0 (unsigned)
};
const StateTables& TablesOf(bool is_signed);

// EncodeScaled by the encoder's lookup: the same code for every float.
inline uint8_t EncodeByThresholds(float scaled, const ThresholdEncoder& encoder) {
  if (scaled != scaled) return 0;  // NaN, as EncodeScaled
  uint32_t bits;
  std::memcpy(&bits, &scaled, sizeof(bits));
  const uint32_t entry = encoder.entry[ThresholdEncoder::Bucket(bits)];
  uint32_t code = entry & 0xffu;
  if ((bits & (ThresholdEncoder::kNoBoundary - 1)) >= entry >> 8) code += bits >> 31 ? 0xffu : 1u;  // -1 or +1
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
