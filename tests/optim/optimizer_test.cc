#include "optim/optimizer.h"

#include <cmath>
#include <limits>
#include <vector>

#include "optim/loss_scaler.h"
#include "tests/optim/optim_test_util.h"

namespace strata::optim {
namespace {

using testing::ChunkArrays;
using testing::ExpectClose;
using testing::RandomChunk;

// Three chunks of different sizes and a bf16 model with bf16 gradients.
std::vector<ChunkArrays> RandomModel(std::mt19937_64& rng, DType dtype = DType::kBFloat16) {
  std::vector<ChunkArrays> chunks;
  for (size_t n : {size_t{1000}, size_t{65536 + 17}, size_t{5}}) chunks.push_back(RandomChunk(n, dtype, dtype, rng));
  return chunks;
}

std::vector<ChunkTensors> Views(std::vector<ChunkArrays>& chunks) {
  std::vector<ChunkTensors> views;
  for (ChunkArrays& c : chunks) views.push_back(c.view());
  return views;
}

bool SameBits(const std::vector<ChunkArrays>& a, const std::vector<ChunkArrays>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].master != b[i].master || a[i].state0 != b[i].state0 || a[i].state1 != b[i].state1 ||
        a[i].param16 != b[i].param16) {
      return false;
    }
  }
  return true;
}

TEST(OptimizerTest, InfOrNanGradientSkipsTheStepAndChangesNothing) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<ChunkArrays> model = RandomModel(rng, DType::kFloat16);
    model[1].set_grad(40000, bad);  // one element of one chunk
    const std::vector<ChunkArrays> before = model;
    ASSERT_OK_AND_ASSIGN(auto optimizer, Optimizer::Create({}, LossScalerConfig{.init_scale = 1024}));
    std::vector<ChunkTensors> views = Views(model);
    ASSERT_OK_AND_ASSIGN(StepPlan plan, optimizer->Step(views));
    EXPECT_TRUE(plan.skip);
    EXPECT_FALSE(std::isfinite(plan.grad_norm));
    EXPECT_TRUE(SameBits(model, before)) << "a skipped step changed a state";
    EXPECT_EQ(optimizer->steps_taken(), 0);
    EXPECT_EQ(optimizer->loss_scale(), 512.0f);  // backed off
  }
}

TEST(OptimizerTest, UnscalingByAPowerOfTwoGivesTheUnscaledResultBitForBit) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  std::vector<ChunkArrays> plain = RandomModel(rng, DType::kFloat32);
  std::vector<ChunkArrays> scaled = plain;
  constexpr float kScale = 4096.0f;
  for (ChunkArrays& c : scaled) {
    for (float& g : c.grad32) g *= kScale;  // exact: a power of two
  }
  const OptimizerConfig config{.lr = 1e-3f, .weight_decay = 0.01f};
  ASSERT_OK_AND_ASSIGN(auto reference, Optimizer::Create(config));
  ASSERT_OK_AND_ASSIGN(auto with_scaler, Optimizer::Create(config, LossScalerConfig{.init_scale = kScale}));
  std::vector<ChunkTensors> plain_views = Views(plain), scaled_views = Views(scaled);
  ASSERT_OK_AND_ASSIGN(StepPlan plain_plan, reference->Step(plain_views));
  ASSERT_OK_AND_ASSIGN(StepPlan scaled_plan, with_scaler->Step(scaled_views));
  EXPECT_FALSE(scaled_plan.skip);
  EXPECT_EQ(scaled_plan.loss_scale, kScale);
  EXPECT_NEAR(scaled_plan.grad_norm, plain_plan.grad_norm, 1e-12 * plain_plan.grad_norm);
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(scaled[i].master, plain[i].master);
    EXPECT_EQ(scaled[i].state1, plain[i].state1);
  }
}

TEST(OptimizerTest, ClipsToTheGlobalNormAcrossChunks) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  std::vector<ChunkArrays> model = RandomModel(rng, DType::kFloat32);
  double sum = 0;
  for (const ChunkArrays& c : model) {
    for (float g : c.grad32) sum += static_cast<double>(g) * g;
  }
  const double norm = std::sqrt(sum);
  // Clipping to a quarter of the norm equals pre-multiplying the gradients
  // by max_norm / (norm + 1e-6) without clipping (AdamW: the multiply is the
  // same single rounding in both).
  const float max_norm = static_cast<float>(norm / 4);
  std::vector<ChunkArrays> manual = model;
  const float coefficient = static_cast<float>(max_norm / (norm + 1e-6));
  for (ChunkArrays& c : manual) {
    for (float& g : c.grad32) g *= coefficient;
  }
  ASSERT_OK_AND_ASSIGN(auto clipping, Optimizer::Create({.weight_decay = 0.01f, .max_grad_norm = max_norm}));
  ASSERT_OK_AND_ASSIGN(auto plain, Optimizer::Create({.weight_decay = 0.01f}));
  std::vector<ChunkTensors> model_views = Views(model), manual_views = Views(manual);
  ASSERT_OK_AND_ASSIGN(StepPlan plan, clipping->Step(model_views));
  ASSERT_OK(plain->Step(manual_views).status());
  EXPECT_NEAR(plan.grad_norm, norm, 1e-9 * norm);
  EXPECT_EQ(plan.clip_coefficient, coefficient);
  for (size_t i = 0; i < model.size(); ++i) EXPECT_EQ(model[i].master, manual[i].master);
  // Under the limit nothing is clipped.
  ASSERT_OK_AND_ASSIGN(auto loose, Optimizer::Create({.max_grad_norm = static_cast<float>(norm * 2)}));
  ASSERT_OK_AND_ASSIGN(StepPlan loose_plan, loose->PlanStep(GradStats{.sum_squares = sum}));
  EXPECT_EQ(loose_plan.clip_coefficient, 1.0f);
}

TEST(OptimizerTest, AllReduceHookSumsAcrossRanksAndItsErrorChangesNothing) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  std::vector<ChunkArrays> model = RandomModel(rng);
  ASSERT_OK_AND_ASSIGN(auto optimizer, Optimizer::Create({}, LossScalerConfig{}));
  double seen = -1;
  // Two ranks with the same gradients: the sum doubles, the norm grows by sqrt(2).
  optimizer->SetAllReduceHook([&](GradStats& stats) {
    seen = stats.sum_squares;
    stats.sum_squares *= 2;
    return Status::Ok();
  });
  GradStats local;
  for (ChunkArrays& c : model) local.Add(c.view());
  ASSERT_OK_AND_ASSIGN(StepPlan plan, optimizer->PlanStep(local));
  EXPECT_EQ(seen, local.sum_squares);
  EXPECT_NEAR(plan.grad_norm, std::sqrt(2 * local.sum_squares) / 65536.0, 1e-9 * plan.grad_norm);
  ASSERT_OK(optimizer->FinishStep(plan));
  // A rank that fails: the step fails, nothing is counted or updated.
  optimizer->SetAllReduceHook([](GradStats&) { return CommError("rank 3 did not answer within 1000 ms"); });
  const std::vector<ChunkArrays> before = model;
  std::vector<ChunkTensors> views = Views(model);
  Result<StepPlan> failed = optimizer->Step(views);
  EXPECT_EQ(failed.status().code(), StatusCode::kCommError);
  EXPECT_TRUE(SameBits(model, before));
  EXPECT_EQ(optimizer->steps_taken(), 1);
  EXPECT_EQ(optimizer->scaler()->good_steps(), 1);
}

TEST(OptimizerTest, AChunkThatDoesNotFitIsRejectedBeforeAnythingChanges) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  std::vector<ChunkArrays> model = RandomModel(rng);
  const std::vector<ChunkArrays> before = model;
  std::vector<ChunkTensors> views = Views(model);
  views[2].state[1] = nullptr;  // the last chunk lacks exp_avg_sq
  ASSERT_OK_AND_ASSIGN(auto optimizer, Optimizer::Create({}));
  Result<StepPlan> result = optimizer->Step(views);
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("state[1] is missing"), std::string::npos) << result.status().ToString();
  EXPECT_TRUE(SameBits(model, before));
  views = Views(model);
  views[0].param = nullptr;  // bf16 parameters without their compute copy
  EXPECT_EQ(optimizer->Step(views).status().code(), StatusCode::kInvalidArgument);
  views = Views(model);
  views[1].state_dtype = DType::kFloat16;  // states are fp32 or bf16
  result = optimizer->Step(views);
  EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(result.status().message().find("fp32, bf16 or int8"), std::string::npos) << result.status().ToString();
  EXPECT_TRUE(SameBits(model, before));
  views = Views(model);
  views[1].state_dtype = DType::kInt8Block;  // int8 states update whole blocks of 256
  views[1].n = 300;
  result = optimizer->Step(views);
  EXPECT_NE(result.status().message().find("300 elements with int8 states: they update in whole blocks of 256"),
            std::string::npos)
      << result.status().ToString();
  EXPECT_TRUE(SameBits(model, before));
  // SGD without momentum needs no state.
  ASSERT_OK_AND_ASSIGN(auto sgd, Optimizer::Create({.kind = OptimizerKind::kSgd, .lr = 0.1f}));
  EXPECT_EQ(sgd->num_states(), 0);
  views = Views(model);
  for (ChunkTensors& v : views) v.state[0] = v.state[1] = nullptr;
  EXPECT_OK(sgd->Step(views).status());
  ASSERT_OK_AND_ASSIGN(auto momentum, Optimizer::Create({.kind = OptimizerKind::kSgd, .lr = 0.1f, .momentum = 0.9}));
  const std::vector<ChunkArrays> stepped = model;
  views = Views(model);
  views[0].state_dtype = DType::kInt8Block;  // 8-bit states are Adam's
  result = momentum->Step(views);
  EXPECT_NE(result.status().message().find("int8 states for sgd"), std::string::npos) << result.status().ToString();
  EXPECT_TRUE(SameBits(model, stepped));
}

TEST(OptimizerTest, StepsCountOnlyWhenFinishedAndSkippedStepsDoNotCount) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  std::vector<ChunkArrays> model = RandomModel(rng, DType::kFloat32);
  ASSERT_OK_AND_ASSIGN(auto optimizer, Optimizer::Create({}, LossScalerConfig{}));
  ASSERT_OK_AND_ASSIGN(StepPlan first, optimizer->PlanStep(GradStats{.sum_squares = 4.0}));
  EXPECT_EQ(first.step, 1);
  // Planning changes nothing: a plan that is not finished (its update
  // failed) is planned again with the same step and scale.
  ASSERT_OK_AND_ASSIGN(StepPlan again, optimizer->PlanStep(GradStats{.sum_squares = 4.0}));
  EXPECT_EQ(again.step, 1);
  EXPECT_EQ(optimizer->steps_taken(), 0);
  ASSERT_OK(optimizer->FinishStep(again));
  EXPECT_EQ(optimizer->steps_taken(), 1);
  // A stale plan cannot be finished twice.
  EXPECT_EQ(optimizer->FinishStep(first).code(), StatusCode::kInvalidArgument);

  ASSERT_OK_AND_ASSIGN(StepPlan skipped,
                       optimizer->PlanStep(GradStats{.sum_squares = std::numeric_limits<double>::infinity()}));
  EXPECT_TRUE(skipped.skip);
  ASSERT_OK(optimizer->FinishStep(skipped));
  ASSERT_OK_AND_ASSIGN(StepPlan second, optimizer->PlanStep(GradStats{.sum_squares = 4.0}));
  EXPECT_EQ(second.step, 2);
  EXPECT_EQ(second.loss_scale, 32768.0f);  // backed off by the skip
  EXPECT_FLOAT_EQ(second.grad_multiplier, 1.0f / 32768);
  // A skipping plan leaves a chunk alone even when asked to update it.
  const std::vector<ChunkArrays> before = model;
  ASSERT_OK(optimizer->UpdateChunk(skipped, model[0].view()));
  EXPECT_TRUE(SameBits(model, before));
  // A plan that is not one is refused.
  EXPECT_EQ(optimizer->UpdateChunk(StepPlan{.step = 0}, model[0].view()).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(optimizer->UpdateChunk(StepPlan{.step = 3, .grad_multiplier = std::numeric_limits<float>::infinity()},
                                   model[0].view())
                .code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(SameBits(model, before));
}

TEST(OptimizerTest, ManyChunksAtOnceEqualOneAtATimeBitForBit) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  std::vector<ChunkArrays> together;
  for (size_t n : {size_t{3}, size_t{65536 * 2 + 5}, size_t{1}, size_t{40000}, size_t{0}, size_t{777}}) {
    together.push_back(RandomChunk(n, DType::kFloat16, DType::kBFloat16, rng));
  }
  std::vector<ChunkArrays> alone = together;
  const std::vector<ChunkArrays> before = together;
  ASSERT_OK_AND_ASSIGN(auto optimizer, Optimizer::Create({.weight_decay = 0.01f}));
  const StepPlan plan{.step = 4, .grad_multiplier = 0.5f};
  std::vector<ChunkTensors> views = Views(together);
  ASSERT_OK(optimizer->UpdateChunks(plan, views));
  for (ChunkArrays& a : alone) ASSERT_OK(optimizer->UpdateChunk(plan, a.view()));
  EXPECT_TRUE(SameBits(together, alone));
  EXPECT_FALSE(SameBits(together, before));  // the update did change them
}

// Step counts are per tensor (torch.optim's state['step']): a tensor left
// out of a finished step keeps its count, a skipped (inf/NaN) plan counts
// no one's, and an update as a tensor's own step is that step's update.
TEST(OptimizerTest, StepCountsArePerTensorAndAnUpdateUsesTheTensorsOwn) {
  ASSERT_OK_AND_ASSIGN(auto optimizer, Optimizer::Create({.weight_decay = 0.01}, LossScalerConfig{}));
  ASSERT_OK_AND_ASSIGN(StepPlan first, optimizer->PlanStep(GradStats{.sum_squares = 4.0}));
  const TensorId left_out[] = {TensorId(3), TensorId(1), TensorId(3)};  // listed twice: left out once
  ASSERT_OK(optimizer->FinishStep(first, left_out));
  EXPECT_EQ(optimizer->AllTensorSteps(5), (std::vector<int64_t>{1, 0, 1, 0, 1}));
  EXPECT_EQ(optimizer->tensor_steps(TensorId(900)), 1);  // never left out: the global count
  ASSERT_OK_AND_ASSIGN(StepPlan skipped,
                       optimizer->PlanStep(GradStats{.sum_squares = std::numeric_limits<double>::infinity()}));
  const TensorId all_of_them[] = {TensorId(0), TensorId(2)};
  ASSERT_OK(optimizer->FinishStep(skipped, all_of_them));
  EXPECT_EQ(optimizer->AllTensorSteps(5), (std::vector<int64_t>{1, 0, 1, 0, 1}));
  ASSERT_OK_AND_ASSIGN(StepPlan second, optimizer->PlanStep(GradStats{.sum_squares = 4.0}));
  EXPECT_EQ(optimizer->TensorStep(second, TensorId(0)), 2);
  EXPECT_EQ(optimizer->TensorStep(second, TensorId(1)), 1);

  // Tensor 1's update in step 2 is its first: the update a fresh optimizer's step 1 makes.
  std::mt19937_64 rng(::strata::testing::TestSeed());
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kSgd}) {
    const OptimizerConfig config{.kind = kind, .weight_decay = 0.01, .momentum = 0.9, .dampening = 0.5};
    ASSERT_OK_AND_ASSIGN(auto counted, Optimizer::Create(config));
    ASSERT_OK_AND_ASSIGN(auto fresh, Optimizer::Create(config));
    std::vector<ChunkArrays> own = RandomModel(rng, DType::kFloat32), reference = own;
    ASSERT_OK(counted->FinishStep(StepPlan{.step = 1}, std::span(&left_out[1], 1)));
    const StepPlan plan{.step = 2, .loss_scale = 1.0f};
    for (ChunkArrays& a : own) ASSERT_OK(counted->UpdateChunk(plan, a.view(), counted->TensorStep(plan, TensorId(1))));
    for (ChunkArrays& a : reference) ASSERT_OK(fresh->UpdateChunk(StepPlan{.step = 1}, a.view()));
    EXPECT_TRUE(SameBits(own, reference)) << OptimizerKindName(kind);
    // No tensor's step is past the plan's.
    EXPECT_EQ(counted->UpdateChunk(plan, own[0].view(), 3).code(), StatusCode::kInvalidArgument);
  }

  // Restored: each tensor's count within the steps taken, and tensors past the list at the steps taken.
  const int64_t restored[] = {5, 2};
  ASSERT_OK(optimizer->Restore(5, Optimizer::ScalerState{}, restored));
  EXPECT_EQ(optimizer->AllTensorSteps(4), (std::vector<int64_t>{5, 2, 5, 5}));
  const int64_t ahead[] = {6};
  const Status refused = optimizer->Restore(5, Optimizer::ScalerState{}, ahead);
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument) << refused.ToString();
  EXPECT_NE(refused.message().find("tensor 0 has taken 6 steps"), std::string::npos) << refused.ToString();
  EXPECT_EQ(optimizer->AllTensorSteps(2), (std::vector<int64_t>{5, 2}));  // unchanged
}

// Each param group's chunks are updated with its own hyperparameters, set
// between steps: the update a one-group optimizer of those values makes.
TEST(OptimizerTest, EachParamGroupUpdatesWithItsOwnValuesSetBetweenSteps) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kSgd}) {
    const OptimizerConfig config{.kind = kind, .lr = 1e-2, .weight_decay = 0.01, .momentum = 0.9};
    ASSERT_OK_AND_ASSIGN(auto grouped, Optimizer::Create(config, std::nullopt, 2));
    EXPECT_EQ(grouped->group(1).lr, 1e-2);  // every group starts at the config's values
    const GroupHyperparams second{.lr = 3e-3, .beta1 = 0.8, .beta2 = 0.99, .eps = 1e-6, .weight_decay = 0.0,
                                  .momentum = 0.5, .dampening = 0.1};
    ASSERT_OK(grouped->SetGroup(1, second));
    ASSERT_OK_AND_ASSIGN(auto first_alone, Optimizer::Create(config));
    ASSERT_OK_AND_ASSIGN(auto second_alone, Optimizer::Create(WithHyperparams(config, second)));
    std::vector<ChunkArrays> model = RandomModel(rng, DType::kFloat32), reference = model;
    std::vector<ChunkTensors> views = Views(model);
    views[1].param_group = 1;
    const StepPlan plan{.step = 2, .grad_multiplier = 0.5f};
    ASSERT_OK(grouped->UpdateChunks(plan, views));
    ASSERT_OK(first_alone->UpdateChunk(plan, reference[0].view()));
    ASSERT_OK(second_alone->UpdateChunk(plan, reference[1].view()));
    ASSERT_OK(first_alone->UpdateChunk(plan, reference[2].view()));
    EXPECT_TRUE(SameBits(model, reference)) << OptimizerKindName(kind);

    // A value set before the next update is the one it uses.
    ASSERT_OK(grouped->SetGroup(0, HyperparamsOf(WithHyperparams(config, second))));
    ASSERT_OK(grouped->UpdateChunk(plan, views[0]));
    ASSERT_OK(second_alone->UpdateChunk(plan, reference[0].view()));
    EXPECT_TRUE(SameBits(model, reference)) << OptimizerKindName(kind);
  }
}

// SGD: a group of momentum 0 is plain SGD, its buffer untouched, as in torch.
TEST(OptimizerTest, ASgdGroupWithoutMomentumLeavesItsBuffer) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  const OptimizerConfig config{.kind = OptimizerKind::kSgd, .lr = 1e-2, .momentum = 0.9};
  ASSERT_OK_AND_ASSIGN(auto grouped, Optimizer::Create(config, std::nullopt, 2));
  ASSERT_OK(grouped->SetGroup(1, HyperparamsOf(WithHyperparams(config, {.lr = 1e-2, .dampening = 0.5}))));
  ASSERT_OK_AND_ASSIGN(auto plain, Optimizer::Create(WithHyperparams(config, {.lr = 1e-2})));
  ChunkArrays chunk = RandomChunk(100, DType::kFloat32, DType::kFloat32, rng), reference = chunk;
  ChunkTensors view = chunk.view(), plain_view = reference.view();
  view.param_group = 1;
  plain_view.state[0] = nullptr;
  ASSERT_OK(grouped->UpdateChunk(StepPlan{.step = 3}, view));
  ASSERT_OK(plain->UpdateChunk(StepPlan{.step = 3}, plain_view));
  EXPECT_EQ(chunk.master, reference.master);
  EXPECT_EQ(chunk.state0, reference.state0);
}

TEST(OptimizerTest, BadGroupValuesNameTheGroupAndFieldAndChangeNothing) {
  ASSERT_OK_AND_ASSIGN(auto optimizer, Optimizer::Create({.lr = 1e-2}, std::nullopt, 3));
  struct Bad {
    uint32_t group;
    GroupHyperparams values;
    const char* message;
  };
  for (const Bad& bad : std::vector<Bad>{{1, {.lr = -1}, "param group 1: lr -1 must be"},
                                         {2, {.beta1 = 1.0}, "param group 2: beta1 1 must be in [0, 1)"},
                                         {2, {.eps = 0}, "param group 2: eps 0 must be > 0"},
                                         {0, {.weight_decay = -0.1}, "param group 0: weight_decay -0.1"},
                                         {3, {}, "param group 3 does not exist: this optimizer has 3"}}) {
    const Status status = optimizer->SetGroup(bad.group, bad.values);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << bad.message;
    EXPECT_NE(status.message().find(bad.message), std::string::npos) << status.ToString();
  }
  for (uint32_t g = 0; g < 3; ++g) EXPECT_EQ(optimizer->group(g).lr, 1e-2);  // unchanged

  // SGD momentum needs the buffers the optimizer keeps only with optimizer.momentum > 0.
  ASSERT_OK_AND_ASSIGN(auto sgd, Optimizer::Create({.kind = OptimizerKind::kSgd}));
  const Status momentum = sgd->SetGroup(0, {.momentum = 0.9});
  EXPECT_NE(momentum.message().find("optimizer.momentum"), std::string::npos) << momentum.ToString();
  EXPECT_EQ(Optimizer::Create({}, std::nullopt, 0).status().code(), StatusCode::kInvalidArgument);

  // A chunk of a group the optimizer lacks.
  std::mt19937_64 rng(::strata::testing::TestSeed());
  ChunkArrays chunk = RandomChunk(10, DType::kFloat32, DType::kFloat32, rng);
  ChunkTensors view = chunk.view();
  view.param_group = 3;
  const Status outside = optimizer->UpdateChunk(StepPlan{.step = 1}, view);
  EXPECT_NE(outside.message().find("a chunk of param group 3"), std::string::npos) << outside.ToString();

  // Restored groups: validated all before any is set; none given: the config's.
  const GroupHyperparams restored[] = {{.lr = 1}, {.lr = 2}, {.lr = -3}};
  EXPECT_EQ(optimizer->Restore(0, std::nullopt, {}, restored).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(optimizer->group(0).lr, 1e-2);
  const GroupHyperparams two[] = {{.lr = 1}, {.lr = 2}};
  EXPECT_EQ(optimizer->Restore(0, std::nullopt, {}, two).code(), StatusCode::kInvalidArgument);
  const GroupHyperparams good[] = {{.lr = 1}, {.lr = 2}, {.lr = 3}};
  ASSERT_OK(optimizer->Restore(0, std::nullopt, {}, good));
  EXPECT_EQ(optimizer->group(2).lr, 3);
  ASSERT_OK(optimizer->Restore(0, std::nullopt));
  EXPECT_EQ(optimizer->group(2).lr, 1e-2);
}

TEST(OptimizerTest, BadConfigsNameTheField) {
  struct Bad {
    OptimizerConfig config;
    const char* field;
  };
  for (const Bad& bad : std::vector<Bad>{{{.lr = -1}, "lr"},
                                         {{.beta1 = 1.0f}, "beta1"},
                                         {{.beta2 = -0.1f}, "beta2"},
                                         {{.eps = 0}, "eps"},
                                         {{.weight_decay = std::numeric_limits<float>::quiet_NaN()}, "weight_decay"},
                                         {{.max_grad_norm = -1}, "max_grad_norm"},
                                         {{.kind = OptimizerKind::kSgd, .dampening = 2}, "dampening"},
                                         {{.kind = OptimizerKind::kSgd, .nesterov = true}, "nesterov"}}) {
    Result<std::unique_ptr<Optimizer>> result = Optimizer::Create(bad.config);
    EXPECT_EQ(result.status().code(), StatusCode::kInvalidArgument) << bad.field;
    EXPECT_NE(result.status().message().find(bad.field), std::string::npos) << result.status().ToString();
  }
  EXPECT_EQ(ParseOptimizerKind("lamb").status().code(), StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(OptimizerKind kind, ParseOptimizerKind("sgd"));
  EXPECT_EQ(kind, OptimizerKind::kSgd);
}

// --- loss scaler -------------------------------------------------------------

TEST(LossScalerTest, GrowsAfterTheIntervalAndBacksOffOnOverflow) {
  LossScaler scaler({.init_scale = 1024, .growth_factor = 2, .backoff_factor = 0.5, .growth_interval = 3});
  scaler.Update(false);
  scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 1024);
  scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 2048);  // three good steps
  scaler.Update(false);
  scaler.Update(false);
  scaler.Update(true);  // an overflow restarts the count
  EXPECT_EQ(scaler.scale(), 1024);
  EXPECT_EQ(scaler.good_steps(), 0);
  EXPECT_EQ(scaler.overflows(), 1);
  scaler.Update(false);
  scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 1024);
}

TEST(LossScalerTest, StaysWithinItsBounds) {
  LossScaler scaler({.init_scale = 4, .growth_interval = 1, .min_scale = 1, .max_scale = 16});
  for (int i = 0; i < 10; ++i) scaler.Update(true);
  EXPECT_EQ(scaler.scale(), 1);
  for (int i = 0; i < 10; ++i) scaler.Update(false);
  EXPECT_EQ(scaler.scale(), 16);
}

TEST(LossScalerTest, BadConfigsNameTheField) {
  EXPECT_EQ(ValidateLossScalerConfig({.init_scale = 0}).code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ValidateLossScalerConfig({.growth_factor = 1}).message().find("growth_factor"), std::string::npos);
  EXPECT_NE(ValidateLossScalerConfig({.backoff_factor = 1}).message().find("backoff_factor"), std::string::npos);
  EXPECT_NE(ValidateLossScalerConfig({.growth_interval = 0}).message().find("growth_interval"), std::string::npos);
  EXPECT_NE(ValidateLossScalerConfig({.init_scale = 8, .min_scale = 16}).message().find("min_scale"),
            std::string::npos);
  EXPECT_EQ(Optimizer::Create({}, LossScalerConfig{.backoff_factor = 0}).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::optim
