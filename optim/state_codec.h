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

#include <array>
#include <cstddef>
#include <cstdint>

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

// One block's scale: the largest magnitude of its values, at least 1e-12
// (NaN where a value is NaN).
float BlockScale(const float* values, size_t n);

// Quantizes `n` values (a multiple of kStateBlockElems) block by block into
// `codes` (n) and `scales` (n / kStateBlockElems).
void QuantizeBlocks(const float* values, size_t n, bool is_signed, uint8_t* codes, float* scales);
// The values `codes` and `scales` stand for: map[code] * scale.
void DequantizeBlocks(const uint8_t* codes, const float* scales, size_t n, bool is_signed, float* values);

}  // namespace strata::optim
