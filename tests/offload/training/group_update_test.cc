// GroupUpdate::Run: one group's update, where its caller says it runs.
#include "offload/training/group_update.h"

#include <gtest/gtest.h>

#include <vector>

#include "strata/device.h"
#include "tests/offload/training/train_model.h"

namespace strata::offload {
namespace {

// A framework's default CUDA stream is the handle 0, so a null stream cannot
// mean "on the host": an update asked of the device on it goes to the
// device. Here, with no GPU, that fails; run on the host instead, on a GPU
// it would have read device memory as host memory.
TEST(GroupUpdateTest, AnUpdateAskedOfTheDeviceOnTheNullStreamIsNotRunOnTheHost) {
  if (CudaDeviceAvailable()) GTEST_SKIP() << "a CUDA device is present: these chunks are host memory it cannot update";
  Model model;
  model.Write(0, ChunkKind::kGrad, std::vector<float>(kChunkElems, 0.5f));
  const std::vector<float> before = model.Read(0, ChunkKind::kParam);
  const std::vector<Group> groups = TrainableGroups(*model.engine);
  ASSERT_FALSE(groups.empty());
  const Group& g = groups.front();
  const size_t n = UsedElems(g[ChunkKind::kParam]);
  const std::vector<bool> skip;  // GroupUpdate keeps a reference to it
  const GroupUpdate update(*model.engine, *model.optimizer, model.optimizer->PlanAhead(), skip);
  ASSERT_TRUE(model.pipeline->BeginIteration().ok());
  ASSERT_TRUE(model.pipeline->BeginHostMoment().ok());
  HeldChunks held;
  ASSERT_TRUE(AccessGroup(*model.pipeline, g, model.optimizer->num_states(), held).ok());
  const Status on_device = update.Run(g, 0, n, nullptr, held, {.on_device = true, .stream = nullptr});
  const Status on_host = update.Run(g, 0, n, nullptr, held, {.on_device = false});
  for (ChunkAccess& a : held) a.Release();
  ASSERT_TRUE(model.pipeline->EndMoment().ok());
  ASSERT_TRUE(model.pipeline->EndIteration().ok());

  EXPECT_FALSE(on_device.ok());
  EXPECT_TRUE(on_host.ok()) << on_host.ToString();
  EXPECT_NE(model.Read(0, ChunkKind::kParam), before);  // the host update did run, once asked
  EXPECT_EQ(model.Read(0, ChunkKind::kGrad), std::vector<float>(kChunkElems, 0.0f));
}

}  // namespace
}  // namespace strata::offload
