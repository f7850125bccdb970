#include "offload/workloads/capacity_plan.h"

#include <nlohmann/json.hpp>

#include "memory/chunk_layout.h"
#include "offload/workloads/gpt_model.h"

#include "test_util.h"

namespace strata::offload {
namespace {

ModelShape Small() { return ModelShape{.layers = 4, .hidden = 256, .vocab = 1024, .sequence = 128, .batch = 2}; }

TEST(CapacityPlanTest, ASmallModelStaysOnTheGpuAndTheStepIsComputePlusOptimizer) {
  ASSERT_OK_AND_ASSIGN(CapacityPlan plan, PlanCapacity(Small(), MachineSpec{.hbm_bytes = uint64_t{8} << 30}));
  EXPECT_GT(plan.params, 4u * 12 * 256 * 256);
  EXPECT_EQ(plan.nvme_chunk_bytes, 0u);
  EXPECT_EQ(plan.host_chunk_bytes, plan.param_bytes + plan.grad_bytes + plan.state_bytes);
  EXPECT_EQ(plan.prediction.bytes_moved(), 0u);  // everything stays resident
  EXPECT_DOUBLE_EQ(plan.prediction.stall_seconds, 0);
  EXPECT_NEAR(plan.step_seconds, plan.compute_seconds + plan.optimizer_seconds, 1e-12);
  // The states fit beside everything else: every update runs on the GPU.
  EXPECT_GT(plan.updates, 0u);
  EXPECT_EQ(plan.updates_on_device, plan.updates);
  // Master, exp_avg, exp_avg_sq (fp32) mirror the grad chunks (bf16): 6x.
  EXPECT_NEAR(static_cast<double>(plan.state_bytes) / static_cast<double>(plan.grad_bytes), 6.0, 0.06);
  nlohmann::json json = nlohmann::json::parse(CapacityPlanJson(plan));
  EXPECT_EQ(json["params"].get<uint64_t>(), plan.params);
  EXPECT_NE(FormatCapacityPlan(plan).find("bottleneck"), std::string::npos);
}

// The model of the step is the engine's step: forward and backward a module each, then the updates in layout
// order, as RunTrainStep runs them, each over every chunk of its group.
TEST(CapacityPlanTest, TheStepsUpdatesComeAfterBackwardInLayoutOrder) {
  const std::vector<TensorSpec> specs = GptTensorSpecs(Small(), DType::kBFloat16);
  ASSERT_OK_AND_ASSIGN(const memory::ChunkLayout layout,
                       memory::ChunkLayout::Build(specs, 0, memory::kWidestSearchMinElems,
                                                  memory::kWidestSearchMaxElems));
  const GptStep step = GptStepTrace(specs, layout, Small(), MachineSpec{});
  const size_t modules = Small().layers + 2;
  std::vector<uint32_t> updated;
  for (size_t k = 0; k < step.trace.moments.size(); ++k) {
    const TraceMoment& m = step.trace.moments[k];
    EXPECT_EQ(m.tier, k < 2 * modules ? Tier::kDevice : Tier::kHost) << "moment " << k;
    if (m.tier == Tier::kHost) updated.push_back(layout.chunk(m.chunks.front()).group);
  }
  std::vector<uint32_t> trainable;
  for (uint32_t g = 0; g < layout.groups().size(); ++g) {
    if (layout.groups()[g].trainable) trainable.push_back(g);
  }
  EXPECT_EQ(updated, trainable);
}

TEST(CapacityPlanTest, StatesBeyondDramLiveOnNvmeAndTheOptimizerStreamsThem) {
  // HBM for params, grads and activations but not the states (45 MiB):
  // the updates run on the CPU.
  MachineSpec machine{.hbm_bytes = 40 << 20, .dram_bytes = 56 << 20, .nvme_bytes = uint64_t{1} << 30};
  ASSERT_OK_AND_ASSIGN(CapacityPlan plan, PlanCapacity(Small(), machine));
  EXPECT_EQ(plan.updates_on_device, 0u);
  EXPECT_GT(plan.nvme_state_bytes, 0u);
  EXPECT_EQ(plan.nvme_chunk_bytes, plan.nvme_state_bytes);  // params and grads stay in DRAM
  EXPECT_LE(plan.host_chunk_bytes, machine.dram_bytes);
  EXPECT_GT(plan.prediction.bytes[static_cast<int>(Link::kNvmeRead)], 0u);
  EXPECT_EQ(plan.prediction.bytes[static_cast<int>(Link::kNvmeWrite)],
            plan.prediction.bytes[static_cast<int>(Link::kNvmeRead)]);
  // The same with every state in DRAM: the optimizer step is shorter.
  machine.dram_bytes = uint64_t{1} << 30;
  ASSERT_OK_AND_ASSIGN(CapacityPlan in_dram, PlanCapacity(Small(), machine));
  EXPECT_EQ(in_dram.nvme_state_bytes, 0u);
  EXPECT_EQ(in_dram.updates_on_device, 0u);
  EXPECT_GT(plan.optimizer_seconds, in_dram.optimizer_seconds);
}

TEST(CapacityPlanTest, Bf16MomentsFitWhereFp32OnesAreRefusedAndUpdateOnTheCpu) {
  // DRAM for the model states with bf16 moments (12 bytes a parameter) but not fp32 ones (16), no NVMe.
  ASSERT_OK_AND_ASSIGN(const CapacityPlan sized, PlanCapacity(Small(), MachineSpec{}, {}, DType::kBFloat16));
  const uint64_t bf16_states = sized.param_bytes + sized.grad_bytes + sized.state_bytes;
  MachineSpec machine{.hbm_bytes = uint64_t{8} << 30, .dram_bytes = bf16_states + (bf16_states >> 4)};
  const Result<CapacityPlan> fp32 = PlanCapacity(Small(), machine);
  ASSERT_EQ(fp32.status().code(), StatusCode::kOutOfMemory) << fp32.status().ToString();
  EXPECT_NE(fp32.status().message().find("raise --dram"), std::string::npos) << fp32.status().ToString();
  ASSERT_OK_AND_ASSIGN(const CapacityPlan bf16, PlanCapacity(Small(), machine, {}, DType::kBFloat16));
  EXPECT_EQ(bf16.moment_dtype, DType::kBFloat16);
  // The master stays fp32: 4 + 2 + 2 bytes a parameter of states, against fp32 moments' 12.
  machine.dram_bytes = uint64_t{1} << 30;
  ASSERT_OK_AND_ASSIGN(const CapacityPlan both_fit, PlanCapacity(Small(), machine));
  EXPECT_NEAR(static_cast<double>(bf16.state_bytes) / static_cast<double>(both_fit.state_bytes), 8.0 / 12.0, 0.01);
  // HBM enough for every state: fp32 moments update on the GPU, bf16 ones on the CPU, at 20 bytes a parameter
  // against 28.
  EXPECT_EQ(both_fit.updates_on_device, both_fit.updates);
  EXPECT_EQ(bf16.updates, both_fit.updates);
  EXPECT_EQ(bf16.updates_on_device, 0u);
  machine.gpu_adam_gparams = 1e-3;  // so slow that fp32's updates stay on the CPU too
  ASSERT_OK_AND_ASSIGN(const CapacityPlan on_cpu, PlanCapacity(Small(), machine));
  EXPECT_EQ(on_cpu.updates_on_device, 0u);
  EXPECT_NEAR(bf16.update_compute_seconds / on_cpu.update_compute_seconds, 20.0 / 28.0, 1e-9);
  EXPECT_GE(bf16.optimizer_seconds, bf16.update_compute_seconds);  // and their stalls
  const nlohmann::json json = nlohmann::json::parse(CapacityPlanJson(bf16));
  EXPECT_EQ(json["states"], "bf16");
  EXPECT_DOUBLE_EQ(json["bytes_per_param"]["optimizer_states"].get<double>(), bf16.per_param(bf16.state_bytes));
  EXPECT_NE(FormatCapacityPlan(bf16).find("bf16 exp_avg and exp_avg_sq"), std::string::npos);
}

TEST(CapacityPlanTest, Int8MomentsFitWhereBf16OnesAreRefusedAtTheir8BitKernelsRate) {
  // DRAM for the model states with int8 moments (4 + 2 x 260/256 bytes of states a parameter) but not bf16 ones.
  ASSERT_OK_AND_ASSIGN(const CapacityPlan sized, PlanCapacity(Small(), MachineSpec{}, {}, DType::kInt8Block));
  const uint64_t int8_states = sized.param_bytes + sized.grad_bytes + sized.state_bytes;
  MachineSpec machine{.hbm_bytes = uint64_t{8} << 30, .dram_bytes = int8_states + (int8_states >> 4)};
  const Result<CapacityPlan> bf16 = PlanCapacity(Small(), machine, {}, DType::kBFloat16);
  ASSERT_EQ(bf16.status().code(), StatusCode::kOutOfMemory) << bf16.status().ToString();
  ASSERT_OK_AND_ASSIGN(const CapacityPlan int8, PlanCapacity(Small(), machine, {}, DType::kInt8Block));
  machine.dram_bytes = uint64_t{1} << 30;
  machine.gpu_adam_gparams = 1e-3;  // fp32's updates on the CPU too
  ASSERT_OK_AND_ASSIGN(const CapacityPlan fp32, PlanCapacity(Small(), machine));
  EXPECT_NEAR(static_cast<double>(int8.state_bytes) / static_cast<double>(fp32.state_bytes),
              (4.0 + 2.0 * 260.0 / 256.0) / 12.0, 0.01);
  EXPECT_EQ(int8.updates_on_device, 0u);  // the small tensors' fp32 moments too
  // At the 8-bit kernel's rate (0.45 of fp32's), not by its bytes; the small tensors' groups at fp32's.
  const double ratio = int8.optimizer_seconds / fp32.optimizer_seconds;
  EXPECT_GT(ratio, 1.9);
  EXPECT_LT(ratio, 1.0 / 0.45);
  EXPECT_EQ(nlohmann::json::parse(CapacityPlanJson(int8))["states"], "int8");
  EXPECT_NE(FormatCapacityPlan(int8).find("int8 exp_avg and exp_avg_sq"), std::string::npos);
}

TEST(CapacityPlanTest, LayeredAccumulationMovesEachChunkOnceAStepWhateverTheMicroBatches) {
  // HBM for a few of the chunks: every layer's stream (Note [Layered accumulation]); one sequence a micro-batch.
  ModelShape model = Small();
  model.batch = 1;
  const MachineSpec machine{.hbm_bytes = 16 << 20, .hbm_reserve_fraction = 0, .dram_bytes = uint64_t{1} << 30,
                            .pcie_gbps = 1, .gpu_tflops = 1000};
  ASSERT_OK_AND_ASSIGN(CapacityPlan one, PlanCapacity(model, machine, {.micro_batches = 1, .layered = true}));
  ASSERT_OK_AND_ASSIGN(CapacityPlan standard, PlanCapacity(model, machine, {.micro_batches = 8}));
  ASSERT_OK_AND_ASSIGN(CapacityPlan layered, PlanCapacity(model, machine, {.micro_batches = 8, .layered = true}));
  const auto moved = [](const CapacityPlan& p) { return static_cast<double>(p.prediction.bytes_moved()); };
  EXPECT_GT(moved(one), 0);
  EXPECT_LE(moved(layered), 1.15 * moved(one));
  EXPECT_GE(moved(standard), 6 * moved(one));
  // Bound by moving parameters: layered takes a fraction of the standard step, for the same model FLOPs.
  EXPECT_LT(layered.step_seconds, 0.4 * standard.step_seconds);
  EXPECT_DOUBLE_EQ(layered.model_flops, standard.model_flops);
  EXPECT_NEAR(standard.model_flops, 8 * one.model_flops, 1e-6 * standard.model_flops);
  // The layer inputs of every micro-batch are held: 8 x (embedding and 4 layers) x s*b*h bf16 values.
  EXPECT_EQ(layered.boundary_bytes, 8u * 5 * 2 * 128 * 1 * 256);
  EXPECT_EQ(standard.boundary_bytes, 0u);
  EXPECT_NE(FormatCapacityPlan(layered).find("8 micro-batches, layered accumulation"), std::string::npos);
  nlohmann::json json = nlohmann::json::parse(CapacityPlanJson(layered));
  EXPECT_EQ(json["accumulation"].get<std::string>(), "layered");
  EXPECT_EQ(json["micro_batches"].get<uint32_t>(), 8u);
  // A GPU that cannot hold the inputs of 64 micro-batches is refused with the figures.
  Result<CapacityPlan> refused = PlanCapacity(model, machine, {.micro_batches = 64, .layered = true});
  ASSERT_EQ(refused.status().code(), StatusCode::kOutOfMemory) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("layer inputs held"), std::string::npos) << refused.status().ToString();
  EXPECT_EQ(PlanCapacity(model, machine, {.micro_batches = 0}).status().code(), StatusCode::kInvalidArgument);
}

TEST(CapacityPlanTest, AModelThatFitsNowhereIsRefusedWithTheShortfall) {
  Result<CapacityPlan> plan =
      PlanCapacity(Small(), MachineSpec{.hbm_bytes = uint64_t{8} << 30, .dram_bytes = 4 << 20, .nvme_bytes = 0});
  EXPECT_EQ(plan.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(plan.status().message().find("short"), std::string::npos) << plan.status().ToString();
}

TEST(CapacityPlanTest, ActivationsBeyondTheGpuAreRefusedNamingTheMoment) {
  ModelShape big_batch = Small();
  big_batch.batch = 512;
  Result<CapacityPlan> plan = PlanCapacity(big_batch, MachineSpec{.hbm_bytes = uint64_t{1} << 30});
  EXPECT_EQ(plan.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(plan.status().message().find("cannot run this model at batch 512"), std::string::npos)
      << plan.status().ToString();
  EXPECT_NE(plan.status().message().find("moment"), std::string::npos);
}

TEST(CapacityPlanTest, ATightGpuStreamsChunksAndPredictsTheirStall) {
  // HBM for the activations and a few layers: chunks stream over PCIe.
  ModelShape model{.layers = 8, .hidden = 1024, .vocab = 4096, .sequence = 256, .batch = 1};
  ASSERT_OK_AND_ASSIGN(CapacityPlan roomy, PlanCapacity(model, MachineSpec{.hbm_bytes = uint64_t{4} << 30}));
  ASSERT_OK_AND_ASSIGN(CapacityPlan tight, PlanCapacity(model, MachineSpec{.hbm_bytes = 256 << 20, .pcie_gbps = 1}));
  EXPECT_EQ(roomy.prediction.bytes_moved(), 0u);
  EXPECT_GT(tight.prediction.bytes_moved(), 0u);
  EXPECT_GE(tight.step_seconds, roomy.step_seconds);
  // The stall: the step takes at least its bytes to the GPU at 1 GB/s, far beyond the compute, and is mostly
  // waiting for them.
  const double to_gpu_seconds = static_cast<double>(tight.prediction.bytes[static_cast<int>(Link::kHostToDevice)]) / 1e9;
  EXPECT_GE(tight.step_seconds, to_gpu_seconds);
  EXPECT_GT(to_gpu_seconds, 100 * tight.compute_seconds);
  EXPECT_GT(tight.prediction.stall_seconds, 0.5 * tight.step_seconds);
}

TEST(CapacityPlanTest, BadInputsAreInvalidArgument) {
  ModelShape zero = Small();
  zero.layers = 0;
  EXPECT_EQ(PlanCapacity(zero, {}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanCapacity(Small(), MachineSpec{.gpu_tflops = 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanCapacity(Small(), MachineSpec{.hbm_reserve_fraction = 1.0}).status().code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::offload
