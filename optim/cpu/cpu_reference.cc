// The scalar reference of every CPU kernel: torch.optim's arithmetic (Note
// [torch.optim's arithmetic] in cpu_kernels.cc), one element at a time, in
// fp32, with a fused multiply-add (std::fma) exactly where torch has one
// (the layer is built with -ffp-contract=off: the compiler contracts no other
// a * b + c).
// The vector versions are checked against this file.
#include <cmath>

#include "optim/cpu/cpu_kernels.h"
#include "optim/state_codec.h"
#include "src/base/half.h"

namespace strata::optim::scalar {
namespace {

// The compute copy of the updated master weight, when there is one.
void StoreParam(const ChunkTensors& t, size_t i, float master) {
  if (t.param == nullptr) return;
  uint16_t* param = static_cast<uint16_t*>(t.param);
  param[i] = t.param_dtype == DType::kBFloat16 ? Bf16FromFloat(master) : Fp16FromFloat(master);
}

// State `k`'s element i in fp32, and stored (bf16 states: rounded to
// nearest even once, after the update computed it in fp32).
float State(const ChunkTensors& t, int k, size_t i) { return FloatAt(t.state[k], t.state_dtype, i); }
void SetState(const ChunkTensors& t, int k, size_t i, float value) { StoreFloat(t.state[k], t.state_dtype, i, value); }

void AdamRange(const UpdateConstants& c, const ChunkTensors& t, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    // Unscale and clip; Adam (L2) adds the decay to the gradient.
    const float grad = std::fma(t.master[i], c.decay_l2, FloatAt(t.grad, t.grad_dtype, i) * c.grad_multiplier);
    const float weight = t.master[i] * c.decay_factor;  // AdamW's decay (1 for Adam)
    const float m_in = State(t, 0, i);
    const float m = std::fma(c.one_minus_beta1, grad - m_in, m_in);
    const float v = std::fma(c.one_minus_beta2 * grad, grad, State(t, 1, i) * c.beta2);
    const float denom = std::sqrt(v) / c.sqrt_correction2 + c.eps;
    const float updated = weight + (c.neg_step_size * m) / denom;
    SetState(t, 0, i, m);
    SetState(t, 1, i, v);
    t.master[i] = updated;
    StoreParam(t, i, updated);
  }
}

void SgdRange(const UpdateConstants& c, const ChunkTensors& t, size_t begin, size_t end) {
  const bool with_momentum = t.state[0] != nullptr;
  for (size_t i = begin; i < end; ++i) {
    float d = std::fma(t.master[i], c.decay_l2, FloatAt(t.grad, t.grad_dtype, i) * c.grad_multiplier);
    if (with_momentum) {
      const float b = c.first_step ? d : std::fma(d, c.one_minus_dampening, State(t, 0, i) * c.momentum);
      SetState(t, 0, i, b);
      d = c.nesterov ? std::fma(b, c.momentum, d) : b;
    }
    const float weight = std::fma(d, -c.lr, t.master[i]);
    t.master[i] = weight;
    StoreParam(t, i, weight);
  }
}

// torch's lerp for a weight under one half, as torchao's compiled step has it.
float Lerp(float from, float to, float weight) { return weight * (to - from) + from; }

// torchao's 8-bit Adam on one element whose moments are `m` and `v` in
// fp32 (as stored, or decoded): updates them and gives the weight.
float Adam8bitElement(const Adam8bitConstants& c, float weight, float g, float& m, float& v) {
  if (c.decoupled) {
    weight = weight - c.lr_decay * weight;
  } else {
    g = g + c.weight_decay * weight;
  }
  m = Lerp(m, g, c.one_minus_beta1);
  v = Lerp(v, g * g, c.one_minus_beta2);
  const float denom = std::sqrt(v) / c.sqrt_correction2 + c.eps;
  return weight - c.lr * (m / c.correction1) / denom;
}

}  // namespace

void Adam8bitUpdate(const Adam8bitConstants& c, float* master, const float* grad, uint8_t* const codes[2],
                    float* const scales[2], size_t n) {
  const StateCodeMap& signed_map = CodeMap(true);
  const StateCodeMap& unsigned_map = CodeMap(false);
  float m[kStateBlockElems], v[kStateBlockElems];
  for (size_t at = 0; at < n; at += kStateBlockElems) {
    const size_t block = at / kStateBlockElems;
    for (size_t j = 0; j < kStateBlockElems; ++j) {
      const size_t i = at + j;
      // The moments as stored, updated in fp32; the update reads these, not their codes.
      m[j] = signed_map[codes[0][i]] * scales[0][block];
      v[j] = unsigned_map[codes[1][i]] * scales[1][block];
      master[i] = Adam8bitElement(c, master[i], grad[i], m[j], v[j]);
    }
    QuantizeBlocks(m, kStateBlockElems, true, codes[0] + at, scales[0] + block);
    QuantizeBlocks(v, kStateBlockElems, false, codes[1] + at, scales[1] + block);
  }
}

void Adam8bitFp32States(const Adam8bitConstants& c, float* master, const float* grad, float* const states[2],
                        size_t n) {
  for (size_t i = 0; i < n; ++i) master[i] = Adam8bitElement(c, master[i], grad[i], states[0][i], states[1][i]);
}

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

void WidenGrad(const void* grad, DType dtype, float multiplier, float* out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = FloatAt(grad, dtype, i) * multiplier;
}

void ConvertToBf16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Bf16FromFloat(src[i]);
}

void ConvertToFp16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] = Fp16FromFloat(src[i]);
}

}  // namespace strata::optim::scalar
