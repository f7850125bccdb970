// Checkpoints and the optimizer's per-tensor step counts (Note [Step counts
// per tensor] in optim/optimizer.cc): saved, restored, and taken as the
// global count from a manifest saved before they were kept.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <vector>

#include <nlohmann/json.hpp>

#include "strata/checkpoint.h"
#include "tests/offload/training/train_model.h"
#include "tests/test_util.h"

namespace strata::offload {
namespace {

namespace fs = std::filesystem;
using testing::ScratchDir;

// Layer 2 is left out of step 0, layer 4 of steps 0 and 1: after three
// steps they have taken 2 and 1.
std::set<int> LeftOut(int step) {
  if (step == 0) return {2, 4};
  if (step == 1) return {4};
  return {};
}

// Steps [from, to), each layer with gradients of its own but those LeftOut names.
void Train(Model& model, int from, int to) {
  for (int step = from; step < to; ++step) {
    const std::set<int> out = LeftOut(step);
    model.skip.assign(kLayers + 1, false);
    for (int l = 0; l < kLayers; ++l) {
      model.skip[l] = out.contains(l);
      std::mt19937 rng(static_cast<uint32_t>(31 * step + l));
      if (!model.skip[l]) model.Write(l, ChunkKind::kGrad, Random(rng, 0.1f));
    }
    ASSERT_OK(model.Iteration().status());
  }
}

// `model` from its initial parameters through `steps` steps, saved under `root`.
void TrainAndSave(Model& model, int steps, const std::string& root) {
  std::mt19937 rng(17);
  for (int l = 0; l < kLayers; ++l) model.Write(l, ChunkKind::kParam, Random(rng, 0.5f));
  Train(model, 0, steps);
  ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, root).status());
}

// 3 steps with layers left out, save, 3 more: a fresh engine that loads the
// checkpoint and runs the 3 more ends where the first did, bit for bit.
TEST(CheckpointStepCountsTest, EachTensorsCountIsSavedAndRestored) {
  ScratchDir dir("ckpt");
  Model first;
  TrainAndSave(first, 3, dir.path());
  const std::vector<int64_t> counts = first.optimizer->AllTensorSteps(kLayers + 1);
  EXPECT_EQ(counts, (std::vector<int64_t>{3, 3, 2, 3, 1, 3, 3}));
  ASSERT_OK_AND_ASSIGN(std::string described, DescribeCheckpoint(dir.path()));
  EXPECT_NE(described.find("3 steps taken (2 tensor(s) left out of some)"), std::string::npos) << described;
  Train(first, 3, 6);

  Model second;
  ASSERT_OK(LoadCheckpoint(*second.engine, *second.optimizer, dir.path()).status());
  EXPECT_EQ(second.optimizer->AllTensorSteps(kLayers + 1), counts);
  Train(second, 3, 6);
  for (int l = 0; l < kLayers; ++l) {
    for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kExpAvg, ChunkKind::kExpAvgSq}) {
      EXPECT_EQ(second.Read(l, kind), first.Read(l, kind)) << "layer " << l << " " << ChunkKindName(kind);
    }
  }
}

// A manifest without the counts (saved before they were kept) loads every
// tensor at the steps taken; counts that cannot be are Corruption naming
// the tensor, before anything is read.
TEST(CheckpointStepCountsTest, AManifestWithoutCountsLoadsEveryTensorAtTheStepsTaken) {
  ScratchDir dir("ckpt");
  Model model;
  TrainAndSave(model, 2, dir.path());
  const fs::path path = fs::path(dir.path()) / "step-00000002" / "manifest.json";
  const nlohmann::json manifest = nlohmann::json::parse(std::ifstream(path));
  const auto rewrite = [&](const nlohmann::json& changed) { std::ofstream(path) << changed.dump(); };

  nlohmann::json older = manifest;
  older["optimizer"].erase("tensor_steps");
  rewrite(older);
  Model loaded;
  ASSERT_OK(LoadCheckpoint(*loaded.engine, *loaded.optimizer, dir.path()).status());
  EXPECT_EQ(loaded.optimizer->AllTensorSteps(kLayers + 1), std::vector<int64_t>(kLayers + 1, 2));

  nlohmann::json ahead = manifest;
  ahead["optimizer"]["tensor_steps"][3] = 5;
  rewrite(ahead);
  Model refused;
  const Status status = LoadCheckpoint(*refused.engine, *refused.optimizer, dir.path()).status();
  EXPECT_EQ(status.code(), StatusCode::kCorruption) << status.ToString();
  EXPECT_NE(status.message().find("tensor 'layer3' has taken 5 steps"), std::string::npos) << status.ToString();
  EXPECT_EQ(refused.optimizer->steps_taken(), 0);

  nlohmann::json short_list = manifest;
  short_list["optimizer"]["tensor_steps"].erase(0);
  rewrite(short_list);
  EXPECT_EQ(LoadCheckpoint(*refused.engine, *refused.optimizer, dir.path()).status().code(), StatusCode::kCorruption);
}

}  // namespace
}  // namespace strata::offload
