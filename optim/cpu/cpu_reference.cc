// The scalar reference of every CPU kernel: the torch.optim formulas as
// written, one element at a time, in fp32, with no fused multiply-add (the
// build is ISO C++, so the compiler does not contract a * b + c either).
// The vector versions are checked against this file.
#include <cmath>

#include "optim/cpu/cpu_kernels.h"
#include "src/base/half.h"

namespace strata::optim::scalar {
namespace {

// The compute copy of the updated master weight, when there is one.
void StoreParam(const ChunkTensors& t, size_t i, float master) {
  if (t.param == nullptr) return;
  uint16_t* param = static_cast<uint16_t*>(t.param);
  param[i] = t.param_dtype == DType::kBFloat16 ? Bf16FromFloat(master) : Fp16FromFloat(master);
}

void AdamRange(const UpdateConstants& c, const ChunkTensors& t, size_t begin, size_t end) {
  float* exp_avg = t.state[0];
  float* exp_avg_sq = t.state[1];
  for (size_t i = begin; i < end; ++i) {
    // Unscale and clip; Adam (L2) adds the decay to the gradient ...
    float grad = FloatAt(t.grad, t.grad_dtype, i) * c.grad_multiplier + c.decay_l2 * t.master[i];
    const float weight = t.master[i];
    float m = c.beta1 * exp_avg[i] + c.one_minus_beta1 * grad;
    float v = c.beta2 * exp_avg_sq[i] + c.one_minus_beta2 * grad * grad;
    // Bias corrections: step_size holds lr / (1 - beta1^t).
    float denom = std::sqrt(v) * c.inv_sqrt_correction2 + c.eps;
    // AdamW's decay (lr * wd * w, 0 for Adam) joins the step before it is
    // taken from the weight: one rounding of the weight per step. Two (decay,
    // then step) would round a weight that barely moves the same way every
    // step, an error that adds up (1.5e-6 of the weight over 100 steps at
    // lr 1e-3 and weight decay 0.01, against 2.6e-7 this way).
    const float step = c.decay_rate * weight + c.step_size * (m / denom);
    const float updated = weight - step;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    t.master[i] = updated;
    StoreParam(t, i, updated);
  }
}

void SgdRange(const UpdateConstants& c, const ChunkTensors& t, size_t begin, size_t end) {
  float* buffer = t.state[0];  // null without momentum
  for (size_t i = begin; i < end; ++i) {
    float d = FloatAt(t.grad, t.grad_dtype, i) * c.grad_multiplier + c.decay_l2 * t.master[i];
    if (buffer != nullptr) {
      float b = c.first_step ? d : c.momentum * buffer[i] + c.one_minus_dampening * d;
      buffer[i] = b;
      d = c.nesterov ? d + c.momentum * b : b;
    }
    float weight = t.master[i] - c.lr * d;
    t.master[i] = weight;
    StoreParam(t, i, weight);
  }
}

}  // namespace

void UpdateRange(const UpdateConstants& c, const ChunkTensors& chunk, size_t begin, size_t end) {
  if (c.kind == OptimizerKind::kSgd) {
    SgdRange(c, chunk, begin, end);
  } else {
    AdamRange(c, chunk, begin, end);
  }
}

double SumSquaresRange(const void* grad, DType dtype, size_t begin, size_t end) {
  double sum = 0;
  for (size_t i = begin; i < end; ++i) {
    const double g = FloatAt(grad, dtype, i);
    sum += g * g;
  }
  return sum;
}

void ConvertToBf16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Bf16FromFloat(src[i]);
}

void ConvertToFp16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Fp16FromFloat(src[i]);
}

}  // namespace strata::optim::scalar
