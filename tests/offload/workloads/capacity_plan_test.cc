#include "offload/workloads/capacity_plan.h"

#include <nlohmann/json.hpp>

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
