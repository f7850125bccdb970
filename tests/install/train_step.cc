// A program built against an installed strata (find_package(strata), the
// target strata::strata): one AdamW step of a linear model through the
// Engine's chunks and strata's optimizer, checked against the update worked
// out here. It includes every public header and the layer headers the C++
// API names, so that a header the install leaves out fails to compile.
//
// Exit status 0 and one line on stdout on success; 1 and the reason on
// stderr otherwise.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <vector>

#include "offload/schedule/pipeline.h"
#include "offload/training/state_stream.h"
#include "offload/training/train_step.h"
#include "optim/optimizer.h"
#include "strata/access.h"
#include "strata/buffer.h"
#include "strata/checkpoint.h"
#include "strata/comm.h"
#include "strata/device.h"
#include "strata/engine.h"
#include "strata/file_system.h"
#include "strata/options.h"
#include "strata/safetensors.h"
#include "strata/stats.h"
#include "strata/status.h"
#include "strata/storage.h"
#include "strata/tensor.h"
#include "strata/types.h"
#include "strata/update_fence.h"

namespace {

using strata::ChunkKind;
using strata::Tier;

constexpr int kN = 1000;
constexpr double kLr = 1e-3;
constexpr double kWeightDecay = 0.1;

double Input(int i) { return std::sin(0.37 * i); }
double Target() { return 2.0; }

// 0.5 * (w . x - y)^2 over the weights `w`, and its gradient into `grad`.
double LossAndGrad(const float* w, float* grad) {
  double wx = 0;
  for (int i = 0; i < kN; ++i) wx += w[i] * Input(i);
  const double residual = wx - Target();
  if (grad != nullptr) {
    for (int i = 0; i < kN; ++i) grad[i] = static_cast<float>(residual * Input(i));
  }
  return 0.5 * residual * residual;
}

struct StepResult {
  double loss_before = 0;
  double loss_after = 0;
  double max_error = 0;  // the largest |w - expected| after the step
};

strata::Result<StepResult> RunStep() {
  strata::Options options;
  options.device.backend = strata::DeviceBackendKind::kEmulated;  // host memory: the bytes are readable here
  options.device.budget_bytes = 1 << 20;
  options.host.budget_bytes = 4 << 20;
  options.optimizer.lr = kLr;
  options.optimizer.weight_decay = kWeightDecay;
  options.log_level = strata::LogLevel::kWarning;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<strata::Engine> engine, strata::Engine::Create(options));
  STRATA_ASSIGN_OR_RETURN(strata::TensorId w,
                          engine->RegisterTensor({"linear.weight", {kN}, strata::DType::kFloat32, true, "linear"}));
  STRATA_RETURN_IF_ERROR(engine->Finalize());

  StepResult result;
  std::vector<float> before(kN);
  for (int i = 0; i < kN; ++i) before[i] = 0.1f * static_cast<float>(i % 7) - 0.3f;
  std::vector<float> grad(kN);
  result.loss_before = LossAndGrad(before.data(), grad.data());
  {
    // fp32: the parameter is its own master weight.
    STRATA_ASSIGN_OR_RETURN(strata::TensorAccess param, engine->Access(w, ChunkKind::kParam, Tier::kHost));
    STRATA_ASSIGN_OR_RETURN(strata::TensorAccess g, engine->Access(w, ChunkKind::kGrad, Tier::kHost));
    STRATA_ASSIGN_OR_RETURN(strata::TensorAccess m, engine->Access(w, ChunkKind::kExpAvg, Tier::kHost));
    STRATA_ASSIGN_OR_RETURN(strata::TensorAccess v, engine->Access(w, ChunkKind::kExpAvgSq, Tier::kHost));
    std::copy(before.begin(), before.end(), static_cast<float*>(param.data()));
    std::copy(grad.begin(), grad.end(), static_cast<float*>(g.data()));
    std::fill_n(static_cast<float*>(m.data()), kN, 0.0f);
    std::fill_n(static_cast<float*>(v.data()), kN, 0.0f);

    STRATA_ASSIGN_OR_RETURN(strata::optim::OptimizerConfig config, strata::optim::OptimizerConfigFromOptions(options));
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<strata::optim::Optimizer> optimizer,
                            strata::optim::Optimizer::Create(config));
    strata::optim::ChunkTensors chunk{.n = kN, .master = static_cast<float*>(param.data()), .grad = g.data()};
    chunk.state[0] = static_cast<float*>(m.data());
    chunk.state[1] = static_cast<float*>(v.data());
    STRATA_RETURN_IF_ERROR(optimizer->Step({&chunk, 1}).status());
  }
  // Read back from wherever the chunk is now.
  STRATA_ASSIGN_OR_RETURN(strata::TensorAccess param, engine->Access(w, ChunkKind::kParam, Tier::kDevice));
  const float* after = static_cast<const float*>(param.data());
  result.loss_after = LossAndGrad(after, nullptr);
  for (int i = 0; i < kN; ++i) {
    // AdamW's first step: the moments' bias corrections leave g / (|g| + eps).
    const double g = grad[i];
    const double expected = before[i] * (1 - kLr * kWeightDecay) - kLr * g / (std::fabs(g) + 1e-8);
    result.max_error = std::max(result.max_error, std::fabs(after[i] - expected));
  }
  return result;
}

}  // namespace

int main() {
  strata::Result<StepResult> result = RunStep();
  if (!result.ok()) {
    std::fprintf(stderr, "install check: %s\n", result.status().ToString().c_str());
    return 1;
  }
  if (result->max_error > 1e-6 || !(result->loss_after < result->loss_before)) {
    std::fprintf(stderr, "install check: the step is wrong: largest error %g, loss %g -> %g\n", result->max_error,
                 result->loss_before, result->loss_after);
    return 1;
  }
  std::printf("install check: one AdamW step, loss %.6f -> %.6f, largest error %.2g\n", result->loss_before,
              result->loss_after, result->max_error);
  return 0;
}
