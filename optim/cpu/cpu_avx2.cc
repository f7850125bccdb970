// The AVX2 kernels: 8 fp32 lanes. Compiled with -mavx2 -mfma -mf16c, like
// the whole layer with -ffp-contract=off (see CMakeLists.txt), and called
// only where the CPU has all three.
#include <immintrin.h>

#include "optim/cpu/cpu_kernels.h"
#include "optim/state_codec.h"

namespace strata::optim::avx2 {
namespace {

struct Vec {
  using F = __m256;
  static constexpr size_t kLanes = 8;

  static F Set(float x) { return _mm256_set1_ps(x); }
  static F Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static F LoadBf16(const uint16_t* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static F LoadFp16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // Round to nearest even on the bits; NaN -> 0xFFFF (src/base/half.h).
  static void StoreBf16(uint16_t* p, F x) {
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i kept_lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(kept_lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0xFFFF), nan);
    // Every lane is <= 0xFFFF, so the unsigned saturating pack only narrows.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1)));
  }
  // F16C rounds to nearest even with subnormals; a NaN is first made the
  // quiet NaN with no payload so that it converts to sign | 0x7E00.
  static void StoreFp16(uint16_t* p, F x) {
    const __m256i sign = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(static_cast<int>(0x80000000u)));
    const F quiet_nan = _mm256_castsi256_ps(_mm256_or_si256(sign, _mm256_set1_epi32(0x7FC00000)));
    x = _mm256_blendv_ps(x, quiet_nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
  }
  static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm256_div_ps(a, b); }
  static F Sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F MulAdd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F NegMulAdd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }

  // 8-bit states (the impl's Adam8bitUpdate).
  using I = __m256i;
  static I LoadCodes(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static void StoreCodes(uint8_t* p, I codes) {
    // Each lane's low byte to the front of its 128-bit half, then the two halves' first 4 bytes together.
    const I in_halves = _mm256_shuffle_epi8(codes, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                    -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1,
                                                                    -1, -1, -1, -1, -1));
    const I together = _mm256_permutevar8x32_epi32(in_halves, _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(together));
  }
  // A code map's values at a block's codes, a gather of 8 at a time.
  static void MapBlock(const StateTables& tables, const uint8_t* codes, float* values) {
    for (size_t j = 0; j < kStateBlockElems; j += kLanes) {
      Store(values + j, _mm256_i32gather_ps(tables.map, LoadCodes(codes + j), 4));
    }
  }
  // None: AVX2 lacks the two-register permutes of the runs' tables; an 8-lane gather is the lookup here.
  static bool CodesByRuns(F, const StateTables&, I&) { return false; }
  static I GatherInts(const uint32_t* table, I index) {
    return _mm256_i32gather_epi32(reinterpret_cast<const int*>(table), index, 4);
  }
  // ThresholdEncoder::Bucket of each lane's bits.
  static I Bucket(F x, uint32_t low_bits, uint32_t lowest, uint32_t per_sign) {
    const I bits = _mm256_castps_si256(x);
    const I magnitude = _mm256_srl_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                         _mm_cvtsi32_si128(static_cast<int>(low_bits)));
    I in_sign = _mm256_sub_epi32(magnitude, _mm256_set1_epi32(static_cast<int>(lowest)));
    in_sign = _mm256_min_epi32(_mm256_max_epi32(in_sign, _mm256_setzero_si256()),
                               _mm256_set1_epi32(static_cast<int>(per_sign - 1)));
    const I negative = _mm256_and_si256(_mm256_srai_epi32(bits, 31), _mm256_set1_epi32(static_cast<int>(per_sign)));
    return _mm256_add_epi32(in_sign, negative);
  }
  // The code of each lane from its bucket's entry (EncodeByThresholds): the
  // entry's code, one further from it where x's low bits reach its boundary
  // (both under 2^31, so a signed compare orders them).
  static I CodeOfEntry(I entry, F x, uint32_t low_mask) {
    const I bits = _mm256_castps_si256(x);
    const I code = _mm256_and_si256(entry, _mm256_set1_epi32(0xff));
    const I short_of = _mm256_cmpgt_epi32(_mm256_srli_epi32(entry, 8),
                                          _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(low_mask))));
    const I step = _mm256_or_si256(_mm256_srai_epi32(bits, 31), _mm256_set1_epi32(1));  // -1 or +1
    return _mm256_add_epi32(code, _mm256_andnot_si256(short_of, step));
  }
  static I ZeroIfNan(I code, F x) {
    return _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)), code);
  }
  // The largest magnitude of the lanes added, NaN if any was NaN (BlockScale).
  struct Largest {
    F largest = _mm256_setzero_ps();
    F nan = _mm256_setzero_ps();
    void Add(F x) {
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      largest = _mm256_max_ps(largest, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x));
    }
    float Total() const {
      if (_mm256_movemask_ps(nan) != 0) return __builtin_nanf("");
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(largest), _mm256_extractf128_ps(largest, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
      return _mm_cvtss_f32(m);
    }
  };

  struct Squares {
    __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
    void Add(F x) {
      const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
      const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
      low = _mm256_fmadd_pd(lo, lo, low);
      high = _mm256_fmadd_pd(hi, hi, high);
    }
    double Total() const {
      const __m256d sum = _mm256_add_pd(low, high);
      const __m128d pair = _mm_add_pd(_mm256_castpd256_pd128(sum), _mm256_extractf128_pd(sum, 1));
      return _mm_cvtsd_f64(_mm_add_sd(pair, _mm_unpackhi_pd(pair, pair)));
    }
  };
};

}  // namespace

#include "optim/cpu/cpu_kernels_impl.h"

}  // namespace strata::optim::avx2
