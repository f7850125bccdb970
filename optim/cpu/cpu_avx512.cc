// The AVX-512 kernels: 16 fp32 lanes. Compiled with -mavx512f -mfma -mf16c,
// like the whole layer with -ffp-contract=off (see CMakeLists.txt), and
// called only where the CPU has AVX-512F.
//
// GCC 12 warns inside its own _mm512_sqrt_ps, _mm512_cvtps_pd, _mm512_srli_epi32
// and _mm512_max_epi32 (built from _mm512_undefined_*): a false positive in the
// compiler's header.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include "optim/cpu/cpu_kernels.h"
#include "optim/state_codec.h"

namespace strata::optim::avx512 {
namespace {

struct Vec {
  using F = __m512;
  static constexpr size_t kLanes = 16;

  static F Set(float x) { return _mm512_set1_ps(x); }
  static F Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static F LoadBf16(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static F LoadFp16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // Round to nearest even on the bits; NaN -> 0xFFFF (src/base/half.h).
  static void StoreBf16(uint16_t* p, F x) {
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i kept_lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded =
        _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(kept_lsb, _mm512_set1_epi32(0x7FFF))), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0xFFFF));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  }
  // F16C rounds to nearest even with subnormals; a NaN is first made the
  // quiet NaN with no payload so that it converts to sign | 0x7E00.
  static void StoreFp16(uint16_t* p, F x) {
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
    const F quiet_nan = _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_set1_epi32(0x7FC00000)));
    x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), quiet_nan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F Div(F a, F b) { return _mm512_div_ps(a, b); }
  static F Sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F MulAdd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F NegMulAdd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }

  // 8-bit states (the impl's Adam8bitUpdate).
  using I = __m512i;
  static I LoadCodes(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void StoreCodes(uint8_t* p, I codes) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(codes));
  }
  // A code map's values at a block's codes: by byte permutes where the CPU
  // has VBMI (avx512_vbmi::MapCodes), else 16 at a time by eight float
  // permutes of 32 values, chosen by the code's top 3 bits (cheaper here
  // than a gather of 16 loads).
  static void MapBlock(const StateTables& tables, const uint8_t* codes, float* values) {
    if (CpuHasVbmi()) return avx512_vbmi::MapCodes(tables.planes, codes, values, kStateBlockElems);
    MapCodesByPermutes(tables.map, codes, values, kStateBlockElems);
  }
  // Two gathers of 8: on the development VM's cores a gather of 16 takes
  // longer than two of 8 (4.8 against 3.7 ns).
  static I GatherInts(const uint32_t* table, I index) {
    const auto* base = reinterpret_cast<const int*>(table);
    const __m256i low = _mm256_i32gather_epi32(base, _mm512_castsi512_si256(index), 4);
    const __m256i high = _mm256_i32gather_epi32(base, _mm512_extracti64x4_epi64(index, 1), 4);
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
  }
  // ThresholdEncoder::Bucket of each lane's bits.
  static I Bucket(F x, uint32_t low_bits, uint32_t lowest, uint32_t per_sign) {
    const I bits = _mm512_castps_si512(x);
    const I magnitude = _mm512_srl_epi32(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                         _mm_cvtsi32_si128(static_cast<int>(low_bits)));
    I in_sign = _mm512_sub_epi32(magnitude, _mm512_set1_epi32(static_cast<int>(lowest)));
    in_sign = _mm512_min_epi32(_mm512_max_epi32(in_sign, _mm512_setzero_si512()),
                               _mm512_set1_epi32(static_cast<int>(per_sign - 1)));
    const I negative = _mm512_and_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32(static_cast<int>(per_sign)));
    return _mm512_add_epi32(in_sign, negative);
  }
  // The code of each lane from its bucket's entry (EncodeByThresholds): the
  // entry's code, one further from it where x's low bits reach its boundary.
  static I CodeOfEntry(I entry, F x, uint32_t low_mask) {
    const I bits = _mm512_castps_si512(x);
    const I code = _mm512_and_si512(entry, _mm512_set1_epi32(0xff));
    const __mmask16 past = _mm512_cmpge_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int>(low_mask))),
                                                   _mm512_srli_epi32(entry, 8));
    const I step = _mm512_or_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32(1));  // -1 or +1
    return _mm512_mask_add_epi32(code, past, code, step);
  }
  // RunEncoder's code of each lane (Note [Encoding by runs]), into `code`;
  // false, leaving it, where a lane lies too near a boundary to trust it.
  static bool CodesByRuns(F x, const StateTables& tables, I& code) {
    const RunEncoder& r = *tables.runs;
    const F magnitude = _mm512_abs_ps(x);
    const I bits = _mm512_castps_si512(magnitude);
    // Exponents clamped to 104..127: below, the run of 0; above (|x| >= 2: never a scaled value), the run of 1.
    const I octave = _mm512_min_epi32(
        _mm512_max_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(RunEncoder::kLowestExponent)),
        _mm512_set1_epi32(127));
    const F next_from = _mm512_permutex2var_ps(Load(r.next_run_from.data()), octave, Load(r.next_run_from.data() + 16));
    I run = _mm512_permutex2var_epi32(LoadInts(r.run_below.data()), octave, LoadInts(r.run_below.data() + 16));
    run = _mm512_mask_add_epi32(run, _mm512_cmp_ps_mask(magnitude, next_from, _CMP_GE_OQ), run, _mm512_set1_epi32(1));
    const F t = _mm512_fmadd_ps(magnitude, _mm512_permutexvar_ps(run, Load(r.slope.data())),
                                _mm512_permutexvar_ps(run, Load(r.offset.data())));
    const F off = _mm512_abs_ps(_mm512_sub_ps(t, _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT)));
    const I ulps = _mm512_abs_epi32(_mm512_sub_epi32(bits, _mm512_castps_si512(next_from)));
    const __mmask16 doubtful = _mm512_cmp_ps_mask(off, Set(RunEncoder::kMargin), _CMP_NGE_UQ) |  // or NaN
                               _mm512_cmplt_epi32_mask(ulps, _mm512_set1_epi32(RunEncoder::kUlps));
    if (doubtful != 0) return false;
    const I in_run = _mm512_min_epi32(_mm512_cvttps_epi32(t), _mm512_permutexvar_epi32(run, LoadInts(r.last.data())));
    const I positive = _mm512_add_epi32(_mm512_permutexvar_epi32(run, LoadInts(r.base.data())), in_run);
    const __mmask16 negative = _mm512_cmplt_epi32_mask(_mm512_castps_si512(x), _mm512_setzero_si512());
    code = tables.is_signed
               ? _mm512_max_epi32(_mm512_mask_sub_epi32(positive, negative, _mm512_set1_epi32(254), positive),
                                  _mm512_setzero_si512())
               : _mm512_mask_mov_epi32(positive, negative, _mm512_setzero_si512());
    return true;
  }
  static I LoadInts(const int32_t* p) { return _mm512_loadu_si512(p); }
  static I ZeroIfNan(I code, F x) {
    return _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_setzero_si512());
  }
  // The largest magnitude of the lanes added, NaN if any was NaN (BlockScale).
  struct Largest {
    F largest = _mm512_setzero_ps();
    __mmask16 nan = 0;
    void Add(F x) {
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      largest = _mm512_max_ps(largest, _mm512_abs_ps(x));
    }
    float Total() const {
      return nan != 0 ? __builtin_nanf("") : _mm512_reduce_max_ps(largest);
    }
  };

  struct Squares {
    __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
    void Add(F x) {
      const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
      const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
      low = _mm512_fmadd_pd(lo, lo, low);
      high = _mm512_fmadd_pd(hi, hi, high);
    }
    double Total() const { return _mm512_reduce_add_pd(_mm512_add_pd(low, high)); }
  };
};

}  // namespace

#include "optim/cpu/cpu_kernels_impl.h"

void MapCodesByPermutes(const float* map, const uint8_t* codes, float* values, size_t n) {
  for (size_t j = 0; j < n; j += kLanes) {
    const Vec::I code = Vec::LoadCodes(codes + j);
    const Vec::I group = _mm512_srli_epi32(code, 5);
    F mapped = _mm512_permutex2var_ps(_mm512_loadu_ps(map), code, _mm512_loadu_ps(map + 16));
#pragma GCC unroll 8
    for (int k = 1; k < 8; ++k) {
      const __mmask16 in_group = _mm512_cmpeq_epi32_mask(group, _mm512_set1_epi32(k));
      mapped = _mm512_mask_mov_ps(mapped, in_group,
                                  _mm512_permutex2var_ps(_mm512_loadu_ps(map + 32 * k), code,
                                                         _mm512_loadu_ps(map + 32 * k + 16)));
    }
    Vec::Store(values + j, mapped);
  }
}

}  // namespace strata::optim::avx512
