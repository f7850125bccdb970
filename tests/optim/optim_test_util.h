// Random model states for the optimizer tests: one chunk's arrays in the
// dtypes under test, owned by vectors, with a ChunkTensors view of them.
#pragma once

#include <bit>
#include <cmath>
#include <random>
#include <vector>

#include "src/base/half.h"
#include "optim/optimizer.h"
#include "test_util.h"

namespace strata::optim::testing {

inline constexpr DType kAllDTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};

struct ChunkArrays {
  std::vector<float> master, state0, state1, grad32;
  std::vector<uint16_t> grad16, param16;
  DType grad_dtype = DType::kFloat32;
  DType param_dtype = DType::kFloat32;

  ChunkTensors view() {
    ChunkTensors t;
    t.n = master.size();
    t.master = master.data();
    t.param = param_dtype == DType::kFloat32 ? nullptr : param16.data();
    t.param_dtype = param_dtype;
    t.grad = grad_dtype == DType::kFloat32 ? static_cast<const void*>(grad32.data()) : grad16.data();
    t.grad_dtype = grad_dtype;
    t.state[0] = state0.data();
    t.state[1] = state1.data();
    return t;
  }
  // The gradient as the kernels read it, in fp32.
  float grad(size_t i) const {
    return FloatAt(grad_dtype == DType::kFloat32 ? static_cast<const void*>(grad32.data()) : grad16.data(), grad_dtype, i);
  }
  void set_grad(size_t i, float g) {
    if (grad_dtype == DType::kFloat32) {
      grad32[i] = g;
    } else {
      grad16[i] = grad_dtype == DType::kBFloat16 ? Bf16FromFloat(g) : Fp16FromFloat(g);
    }
  }
};

// Weights ~N(0, 1), gradients ~N(0, 10), exp_avg ~N(0, 0.1), exp_avg_sq in
// [0, 0.1): fresh values, never zeros.
inline ChunkArrays RandomChunk(size_t n, DType grad_dtype, DType param_dtype, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> positive(0.0f, 0.1f);
  ChunkArrays a;
  a.grad_dtype = grad_dtype;
  a.param_dtype = param_dtype;
  a.master.resize(n);
  a.state0.resize(n);
  a.state1.resize(n);
  a.grad32.resize(grad_dtype == DType::kFloat32 ? n : 0);
  a.grad16.resize(grad_dtype == DType::kFloat32 ? 0 : n);
  a.param16.resize(param_dtype == DType::kFloat32 ? 0 : n);
  for (size_t i = 0; i < n; ++i) {
    a.master[i] = normal(rng);
    a.state0[i] = normal(rng) * 0.1f;
    a.state1[i] = positive(rng);
    a.set_grad(i, normal(rng) * 10.0f);
    if (param_dtype != DType::kFloat32) a.param16[i] = static_cast<uint16_t>(rng());
  }
  return a;
}

// A chunk's states as bf16 arrays (Note [bf16 states]), and the fp32
// states they stand for.
struct Bf16States {
  std::vector<uint16_t> state0, state1;
  explicit Bf16States(ChunkArrays& a) : state0(a.state0.size()), state1(a.state1.size()) {
    for (size_t i = 0; i < state0.size(); ++i) {
      state0[i] = Bf16FromFloat(a.state0[i]);
      state1[i] = Bf16FromFloat(a.state1[i]);
      a.state0[i] = FloatFromBf16(state0[i]);
      a.state1[i] = FloatFromBf16(state1[i]);
    }
  }
  ChunkTensors view(ChunkArrays& a) {
    ChunkTensors t = a.view();
    t.state[0] = reinterpret_cast<float*>(state0.data());
    t.state[1] = reinterpret_cast<float*>(state1.data());
    t.state_dtype = DType::kBFloat16;
    return t;
  }
};

// One optimizer configuration at one step: every kind and SGD variant.
struct Case {
  const char* name;
  OptimizerConfig config;
  int64_t step;
  float grad_multiplier;
};

inline std::vector<Case> Cases() {
  return {
      {"adamw", {.kind = OptimizerKind::kAdamW, .lr = 1e-3f, .weight_decay = 0.01f}, 5, 1.0f},
      {"adam-l2-scaled", {.kind = OptimizerKind::kAdam, .lr = 3e-4f, .weight_decay = 0.1f}, 1, 1.0f / 1024},
      {"sgd-momentum-first", {.kind = OptimizerKind::kSgd, .lr = 0.1f, .weight_decay = 1e-4f, .momentum = 0.9f}, 1,
       0.5f},
      {"sgd-momentum", {.kind = OptimizerKind::kSgd, .lr = 0.1f, .momentum = 0.9f, .dampening = 0.1f}, 7, 1.0f},
      {"sgd-nesterov", {.kind = OptimizerKind::kSgd, .lr = 0.05f, .momentum = 0.8f, .nesterov = true}, 3, 1.0f},
      {"sgd-plain", {.kind = OptimizerKind::kSgd, .lr = 0.01f, .weight_decay = 0.01f}, 2, 1.0f},
  };
}

// |x - ref| <= atol + rtol * |ref|; NaN where the reference has NaN; the
// same infinities.
inline void ExpectClose(const std::vector<float>& got, const std::vector<float>& ref, const char* what,
                        float atol = 1e-6f, float rtol = 1e-5f) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(ref[i])) {
      ASSERT_TRUE(std::isnan(got[i])) << what << "[" << i << "]: expected NaN, got " << got[i];
    } else if (std::isinf(ref[i])) {
      ASSERT_EQ(got[i], ref[i]) << what << "[" << i << "]";
    } else {
      ASSERT_LE(std::fabs(got[i] - ref[i]), atol + rtol * std::fabs(ref[i]))
          << what << "[" << i << "]: got " << got[i] << ", reference " << ref[i];
    }
  }
}

// The same bits, element for element; NaN where the reference has NaN (its
// payload aside).
inline void ExpectBitIdentical(const std::vector<float>& got, const std::vector<float>& ref, const char* what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(ref[i])) {
      ASSERT_TRUE(std::isnan(got[i])) << what << "[" << i << "]: expected NaN, got " << got[i];
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(got[i]), std::bit_cast<uint32_t>(ref[i]))
          << what << "[" << i << "]: got " << got[i] << ", reference " << ref[i];
    }
  }
}

// The 16-bit compute copy is exactly the rounding of the fp32 master.
inline void ExpectParamIsRoundedMaster(const ChunkArrays& a) {
  for (size_t i = 0; i < a.param16.size(); ++i) {
    const uint16_t want =
        a.param_dtype == DType::kBFloat16 ? Bf16FromFloat(a.master[i]) : Fp16FromFloat(a.master[i]);
    ASSERT_EQ(a.param16[i], want) << DTypeName(a.param_dtype) << " param[" << i << "] of master " << a.master[i];
  }
}

}  // namespace strata::optim::testing
