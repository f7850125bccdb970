// The 8-bit states' decode with AVX-512 VBMI's byte permutes: 64 codes at
// a time, where the AVX-512F kernel decodes 16 by eight float permutes. Built
// with -mavx512vbmi -mavx512bw and called only where the CPU has both
// (CpuHasVbmi in cpu_kernels.cc).
//
// GCC 12 warns inside its own _mm512_permutexvar_epi8 (built from
// _mm512_undefined_epi32): a false positive in the compiler's header.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <array>

#include "optim/cpu/cpu_kernels.h"

namespace strata::optim::avx512_vbmi {

// Note [Decoding by byte planes]
// A map of 256 floats is four planes of 256 bytes (byte k of every value:
// StateTables::planes); a plane is four registers. For 64 codes, each plane's
// bytes come from two two-register permutes (the codes' low 7 bits), one of
// them kept where a code's top bit is set; then byte and word unpacks
// interleave the planes into 64 floats. The unpacks work within 16-byte lanes,
// so the codes are first put in the order that makes the floats come out in
// theirs: output register r, lane l, element j is code 16r + 4l + j, and the
// unpacks take it from byte 16l + 4r + j.
void MapCodes(const uint8_t* planes, const uint8_t* codes, float* values, size_t n) {
  alignas(64) static constexpr auto kOrder = [] {
    std::array<uint8_t, 64> order{};
    for (int r = 0; r < 4; ++r) {
      for (int l = 0; l < 4; ++l) {
        for (int j = 0; j < 4; ++j) order[16 * l + 4 * r + j] = static_cast<uint8_t>(16 * r + 4 * l + j);
      }
    }
    return order;
  }();
  const __m512i order = _mm512_load_si512(kOrder.data());
  __m512i low[4][2], high[4][2];  // each plane's codes 0-127 and 128-255
  for (int k = 0; k < 4; ++k) {
    for (int half = 0; half < 2; ++half) {
      low[k][half] = _mm512_loadu_si512(planes + 256 * k + 64 * half);
      high[k][half] = _mm512_loadu_si512(planes + 256 * k + 128 + 64 * half);
    }
  }
  for (size_t at = 0; at < n; at += 64) {
    const __m512i c = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(codes + at));
    const __mmask64 top = _mm512_movepi8_mask(c);
    __m512i bytes[4];
    for (int k = 0; k < 4; ++k) {
      const __m512i below = _mm512_permutex2var_epi8(low[k][0], c, low[k][1]);
      bytes[k] = _mm512_mask_blend_epi8(top, below, _mm512_permutex2var_epi8(high[k][0], c, high[k][1]));
    }
    const __m512i low01 = _mm512_unpacklo_epi8(bytes[0], bytes[1]), high01 = _mm512_unpackhi_epi8(bytes[0], bytes[1]);
    const __m512i low23 = _mm512_unpacklo_epi8(bytes[2], bytes[3]), high23 = _mm512_unpackhi_epi8(bytes[2], bytes[3]);
    _mm512_storeu_si512(values + at, _mm512_unpacklo_epi16(low01, low23));
    _mm512_storeu_si512(values + at + 16, _mm512_unpackhi_epi16(low01, low23));
    _mm512_storeu_si512(values + at + 32, _mm512_unpacklo_epi16(high01, high23));
    _mm512_storeu_si512(values + at + 48, _mm512_unpackhi_epi16(high01, high23));
  }
}

}  // namespace strata::optim::avx512_vbmi
