// AdamW and Adam (L2) on the CPU for fp32 parameters: a scalar reference, and
// AVX2+FMA and AVX-512 versions chosen at run time from what the CPU has,
// spread over oneTBB's threads.
//
// The update, per element, as PyTorch's torch.optim.AdamW/Adam compute it:
//   g  = grad * grad_scale                      (unscale and clip, fused)
//   g += weight_decay * p                       (Adam: L2 in the gradient)
//   p *= 1 - lr * weight_decay                  (AdamW: decoupled decay)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// The vector versions use fused multiply-adds, so they differ from the scalar
// reference by rounding: tests hold them to |x - ref| <= 1e-6 + 1e-5 |ref|.
// Checked against the reference on random data with tails, NaN and Inf in
// tests/optim/adamw_cpu_test.cc.
//
// Pure functions over caller-owned arrays; thread-safe for disjoint arrays.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace strata::optim {

struct AdamHyper {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool decoupled_weight_decay = true;  // AdamW; false: Adam with L2
  int64_t step = 1;                    // 1 for the first update (bias correction)
  float grad_scale = 1.0f;             // 1 / loss scale, times the clip coefficient
};

enum class CpuIsa : uint8_t { kScalar, kAvx2, kAvx512 };
std::string_view CpuIsaName(CpuIsa isa);
// The widest version this CPU runs.
CpuIsa BestCpuIsa();
bool CpuSupports(CpuIsa isa);

// One update of `n` elements with the given version (which the CPU must
// support), on the calling thread.
void AdamStep(CpuIsa isa, const AdamHyper& hyper, float* param, const float* grad, float* exp_avg,
              float* exp_avg_sq, size_t n);
// The same with BestCpuIsa(), split over oneTBB's threads.
void AdamStepParallel(const AdamHyper& hyper, float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                      size_t n);

}  // namespace strata::optim
