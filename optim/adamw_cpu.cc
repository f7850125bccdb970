#include "optim/adamw_cpu.h"

// GCC 12 warns inside its own _mm512_sqrt_ps (it builds the result from
// _mm512_undefined_ps): a false positive in the compiler's header.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <cmath>

namespace strata::optim {
namespace {

// The per-step constants every version uses.
struct Constants {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float step_size;            // lr / (1 - beta1^t)
  float inv_sqrt_correction2;  // 1 / sqrt(1 - beta2^t)
  float eps, grad_scale;
  float decay_l2;      // weight_decay when it goes into the gradient, else 0
  float decay_factor;  // 1 - lr * weight_decay when decoupled, else 1
};

Constants MakeConstants(const AdamHyper& h) {
  const double t = static_cast<double>(h.step);
  const double correction1 = 1.0 - std::pow(static_cast<double>(h.beta1), t);
  const double correction2 = 1.0 - std::pow(static_cast<double>(h.beta2), t);
  Constants c;
  c.beta1 = h.beta1;
  c.one_minus_beta1 = 1.0f - h.beta1;
  c.beta2 = h.beta2;
  c.one_minus_beta2 = 1.0f - h.beta2;
  c.step_size = static_cast<float>(h.lr / correction1);
  c.inv_sqrt_correction2 = static_cast<float>(1.0 / std::sqrt(correction2));
  c.eps = h.eps;
  c.grad_scale = h.grad_scale;
  c.decay_l2 = h.decoupled_weight_decay ? 0.0f : h.weight_decay;
  c.decay_factor = h.decoupled_weight_decay ? 1.0f - h.lr * h.weight_decay : 1.0f;
  return c;
}

// The reference: one element at a time, the formula as written.
void StepScalar(const Constants& c, float* p, const float* g, float* m, float* v, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    float grad = g[i] * c.grad_scale + c.decay_l2 * p[i];
    float param = p[i] * c.decay_factor;
    float mi = c.beta1 * m[i] + c.one_minus_beta1 * grad;
    float vi = c.beta2 * v[i] + c.one_minus_beta2 * grad * grad;
    float denom = std::sqrt(vi) * c.inv_sqrt_correction2 + c.eps;
    p[i] = param - c.step_size * mi / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

__attribute__((target("avx2,fma"))) void StepAvx2(const Constants& c, float* p, const float* g, float* m, float* v,
                                                  size_t n) {
  const __m256 beta1 = _mm256_set1_ps(c.beta1), one_minus_beta1 = _mm256_set1_ps(c.one_minus_beta1);
  const __m256 beta2 = _mm256_set1_ps(c.beta2), one_minus_beta2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 step_size = _mm256_set1_ps(c.step_size), inv_c2 = _mm256_set1_ps(c.inv_sqrt_correction2);
  const __m256 eps = _mm256_set1_ps(c.eps), grad_scale = _mm256_set1_ps(c.grad_scale);
  const __m256 decay_l2 = _mm256_set1_ps(c.decay_l2), decay_factor = _mm256_set1_ps(c.decay_factor);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 param = _mm256_loadu_ps(p + i);
    __m256 grad = _mm256_fmadd_ps(_mm256_loadu_ps(g + i), grad_scale, _mm256_mul_ps(decay_l2, param));
    param = _mm256_mul_ps(param, decay_factor);
    __m256 mi = _mm256_fmadd_ps(beta1, _mm256_loadu_ps(m + i), _mm256_mul_ps(one_minus_beta1, grad));
    __m256 vi = _mm256_fmadd_ps(beta2, _mm256_loadu_ps(v + i), _mm256_mul_ps(_mm256_mul_ps(one_minus_beta2, grad), grad));
    __m256 denom = _mm256_fmadd_ps(_mm256_sqrt_ps(vi), inv_c2, eps);
    _mm256_storeu_ps(p + i, _mm256_fnmadd_ps(step_size, _mm256_div_ps(mi, denom), param));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
  }
  StepScalar(c, p, g, m, v, i, n);  // the tail
}

__attribute__((target("avx512f"))) void StepAvx512(const Constants& c, float* p, const float* g, float* m, float* v,
                                                   size_t n) {
  const __m512 beta1 = _mm512_set1_ps(c.beta1), one_minus_beta1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 beta2 = _mm512_set1_ps(c.beta2), one_minus_beta2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 step_size = _mm512_set1_ps(c.step_size), inv_c2 = _mm512_set1_ps(c.inv_sqrt_correction2);
  const __m512 eps = _mm512_set1_ps(c.eps), grad_scale = _mm512_set1_ps(c.grad_scale);
  const __m512 decay_l2 = _mm512_set1_ps(c.decay_l2), decay_factor = _mm512_set1_ps(c.decay_factor);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 param = _mm512_loadu_ps(p + i);
    __m512 grad = _mm512_fmadd_ps(_mm512_loadu_ps(g + i), grad_scale, _mm512_mul_ps(decay_l2, param));
    param = _mm512_mul_ps(param, decay_factor);
    __m512 mi = _mm512_fmadd_ps(beta1, _mm512_loadu_ps(m + i), _mm512_mul_ps(one_minus_beta1, grad));
    __m512 vi = _mm512_fmadd_ps(beta2, _mm512_loadu_ps(v + i), _mm512_mul_ps(_mm512_mul_ps(one_minus_beta2, grad), grad));
    __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(vi), inv_c2, eps);
    _mm512_storeu_ps(p + i, _mm512_fnmadd_ps(step_size, _mm512_div_ps(mi, denom), param));
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
  }
  StepScalar(c, p, g, m, v, i, n);  // the tail
}

}  // namespace

std::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "?";
}

bool CpuSupports(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return true;
    case CpuIsa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CpuIsa::kAvx512: return __builtin_cpu_supports("avx512f");
  }
  return false;
}

CpuIsa BestCpuIsa() {
  static const CpuIsa best = CpuSupports(CpuIsa::kAvx512) ? CpuIsa::kAvx512
                             : CpuSupports(CpuIsa::kAvx2) ? CpuIsa::kAvx2
                                                          : CpuIsa::kScalar;
  return best;
}

void AdamStep(CpuIsa isa, const AdamHyper& hyper, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
              size_t n) {
  const Constants c = MakeConstants(hyper);
  switch (isa) {
    case CpuIsa::kAvx512: return StepAvx512(c, param, grad, exp_avg, exp_avg_sq, n);
    case CpuIsa::kAvx2: return StepAvx2(c, param, grad, exp_avg, exp_avg_sq, n);
    case CpuIsa::kScalar: return StepScalar(c, param, grad, exp_avg, exp_avg_sq, 0, n);
  }
}

void AdamStepParallel(const AdamHyper& hyper, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                      size_t n) {
  // Blocks of 64 Ki elements (1 MiB of the four arrays): enough work to hide
  // the scheduling, small enough to balance over the cores. Block starts are
  // multiples of every vector width, so each element takes the same path
  // (vector or tail) as in one call over everything: results are identical.
  constexpr size_t kBlockElems = size_t{1} << 16;
  const CpuIsa isa = BestCpuIsa();
  const size_t blocks = (n + kBlockElems - 1) / kBlockElems;
  tbb::parallel_for(size_t{0}, blocks, [&](size_t block) {
    const size_t begin = block * kBlockElems;
    AdamStep(isa, hyper, param + begin, grad + begin, exp_avg + begin, exp_avg_sq + begin,
             std::min(kBlockElems, n - begin));
  });
}

}  // namespace strata::optim
