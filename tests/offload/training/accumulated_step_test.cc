// RunAccumulatedStep: a step over micro-batches in the standard and the
// layered order, the caller adding each pass's gradients.
#include "offload/training/accumulated_step.h"

#include <gtest/gtest.h>

#include <limits>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "tests/offload/training/train_model.h"
#include "tests/test_util.h"

namespace strata::offload {
namespace {

void ExpectStatus(const Status& status, StatusCode code, const std::string& text) {
  EXPECT_EQ(status.code(), code) << status.ToString();
  EXPECT_NE(status.ToString().find(text), std::string::npos) << status.ToString();
}

// The frozen tensor (block 0, as an embedding), then three blocks of two layers each (block b: tensors 2b-2 and
// 2b-1).
AccumulatedStep FourBlocks(uint32_t micro_batches, AccumulationOrder order) {
  return {.blocks = {{TensorId(6)}, {TensorId(0), TensorId(1)}, {TensorId(2), TensorId(3)}, {TensorId(4), TensorId(5)}},
          .micro_batches = micro_batches,
          .order = order};
}

// Each backward pass adds micro-batch m's gradient of step k into the block's grad chunks; records every pass.
struct Passes {
  Model* model;
  int step = 0;
  int rank = 0;  // data parallel: whose gradients
  std::vector<std::pair<uint32_t, uint32_t>> forward, backward;  // (block, micro-batch)
  std::vector<std::tuple<uint32_t, uint32_t, bool>> order;      // every pass: (block, micro-batch, backward)

  Status operator()(const BlockPass& pass) {
    (pass.backward ? backward : forward).emplace_back(pass.block, pass.micro_batch);
    order.emplace_back(pass.block, pass.micro_batch, pass.backward);
    if (!pass.backward) return Status::Ok();
    EXPECT_EQ(pass.grads->size(), pass.block == 0 ? 0u : 2u);
    for (size_t i = 0; i < pass.grads->size(); ++i) {
      const int layer = static_cast<int>(2 * pass.block - 2 + i);
      const std::vector<float> grad = RankGrad(10 * rank + static_cast<int>(pass.micro_batch), layer, step);
      float* data = reinterpret_cast<float*>((*pass.grads)[i].data());
      for (size_t e = 0; e < grad.size(); ++e) data[e] += grad[e];
    }
    return Status::Ok();
  }
};

// Bytes moved host <-> device so far.
uint64_t DeviceTraffic(const Engine& engine) {
  const MemoryStats stats = engine.stats();
  return stats.links[static_cast<int>(Tier::kHost)][static_cast<int>(Tier::kDevice)].bytes +
         stats.links[static_cast<int>(Tier::kDevice)][static_cast<int>(Tier::kHost)].bytes;
}

// Three steps of `micro_batches` in `order`: every layer's param, master and moments after, and the bytes moved
// host <-> device in the last step (the first two record the trace and make the plan).
std::pair<std::vector<std::vector<float>>, uint64_t> Train(uint32_t micro_batches, AccumulationOrder order,
                                                           Passes* seen = nullptr) {
  Model model;
  Passes passes{.model = &model};
  uint64_t before = 0;
  for (int k = 0; k < 3; ++k) {
    passes.step = k;
    passes.forward.clear();
    passes.backward.clear();
    passes.order.clear();
    before = DeviceTraffic(*model.engine);
    auto report = RunAccumulatedStep(*model.engine, *model.pipeline, *model.optimizer,
                                     FourBlocks(micro_batches, order), std::ref(passes));
    EXPECT_TRUE(report.ok()) << report.status().ToString();
  }
  const uint64_t moved = DeviceTraffic(*model.engine) - before;
  std::vector<std::vector<float>> states;
  for (int l = 0; l < kLayers; ++l) {
    for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kMaster, ChunkKind::kExpAvg, ChunkKind::kExpAvgSq}) {
      if (model.engine->ChunkOf(TensorId(l), kind)) states.push_back(model.Read(l, kind));
    }
  }
  if (seen != nullptr) *seen = passes;
  return {states, moved};
}

TEST(AccumulatedStepTest, TheLayeredOrderRunsBlockByBlockAndStepsLikeTheStandardBitForBit) {
  Passes layered_passes{}, standard_passes{};
  auto [layered, layered_moved] = Train(4, AccumulationOrder::kLayered, &layered_passes);
  auto [standard, standard_moved] = Train(4, AccumulationOrder::kStandard, &standard_passes);
  EXPECT_EQ(layered, standard);
  std::vector<std::pair<uint32_t, uint32_t>> block_major, batch_major;
  for (uint32_t outer = 0; outer < 4; ++outer) {
    for (uint32_t inner = 0; inner < 4; ++inner) {
      block_major.emplace_back(outer, inner);
      batch_major.emplace_back(inner, outer);
    }
  }
  EXPECT_EQ(layered_passes.forward, block_major);
  EXPECT_EQ(standard_passes.forward, batch_major);
  EXPECT_EQ(layered_passes.backward.front(), std::make_pair(3u, 0u));
  EXPECT_EQ(layered_passes.backward[4], std::make_pair(2u, 0u));
  EXPECT_EQ(standard_passes.backward[1], std::make_pair(2u, 0u));
  // Standard: each micro-batch's backward before the next one's forward.
  EXPECT_EQ(standard_passes.order[4], std::make_tuple(3u, 0u, true));
  EXPECT_EQ(standard_passes.order[8], std::make_tuple(0u, 1u, false));
  EXPECT_EQ(layered_passes.order[16], std::make_tuple(3u, 0u, true));
}

TEST(AccumulatedStepTest, LayeredChunksMoveOnceAStepWhateverTheMicroBatches) {
  // Six param and six grad chunks through a device of four: every pass moves some.
  const uint64_t one = Train(1, AccumulationOrder::kLayered).second;
  const uint64_t layered = Train(8, AccumulationOrder::kLayered).second;
  const uint64_t standard = Train(8, AccumulationOrder::kStandard).second;
  EXPECT_GT(one, 0u);
  EXPECT_LE(layered, one + one * 15 / 100);
  EXPECT_GE(standard, 4 * one);
}

TEST(AccumulatedStepTest, EachGroupsOverlappedUpdateBeginsAsItsBlocksLastPassEnds) {
  Model model;
  ASSERT_OK_AND_ASSIGN(auto overlapped, OverlapUpdates::Create(*model.engine, *model.pipeline, *model.optimizer,
                                                          {.kept_bytes = uint64_t{1} << 20}));
  Passes passes{.model = &model};
  auto report = RunAccumulatedStep(*model.engine, *model.pipeline, *model.optimizer,
                                   FourBlocks(2, AccumulationOrder::kLayered), std::ref(passes),
                                   {.overlap = overlapped.get()});
  ASSERT_OK(report.status());
  EXPECT_EQ(report->overlap_groups, 6u);
  EXPECT_EQ(report->redone_groups, 0u);

  // A pass that fails after the last block's groups began: they are put back as they were.
  const std::vector<float> before = model.Read(5, ChunkKind::kParam);
  const Status failed = RunAccumulatedStep(*model.engine, *model.pipeline, *model.optimizer,
                                           FourBlocks(2, AccumulationOrder::kLayered), [&](const BlockPass& pass) {
                                             if (pass.backward && pass.block == 2) return IoError("no such batch");
                                             return passes(pass);
                                           },
                                           {.overlap = overlapped.get()})
                            .status();
  ExpectStatus(failed, StatusCode::kIoError, "no such batch");
  EXPECT_EQ(model.Read(5, ChunkKind::kParam), before);
  EXPECT_EQ(model.optimizer->steps_taken(), 1);
}

// Trainable layers in the block backward ends with: the groups its last
// pass makes final are not begun beside backward (nothing of it is left to
// hide them behind) but updated by the step, and the result is the run
// without overlap's bit for bit.
TEST(AccumulatedStepTest, TheGroupsTheLastPassMakesFinalAreLeftToTheStep) {
  const AccumulatedStep step{.blocks = {{TensorId(0), TensorId(1)},  // backward's last pass
                                        {TensorId(2), TensorId(3)},
                                        {TensorId(4), TensorId(5)}},
                             .micro_batches = 2,
                             .order = AccumulationOrder::kStandard};
  const auto train = [&](bool overlap) {
    Model model;
    std::unique_ptr<OverlapUpdates> overlapped;
    if (overlap) {
      overlapped = OverlapUpdates::Create(*model.engine, *model.pipeline, *model.optimizer,
                                          {.kept_bytes = uint64_t{1} << 20}).value();
    }
    for (int k = 0; k < 3; ++k) {
      const auto backward = [&](const BlockPass& pass) {
        for (size_t i = 0; pass.backward && i < pass.grads->size(); ++i) {
          const std::vector<float> grad = RankGrad(static_cast<int>(pass.micro_batch), 2 * pass.block + i, k);
          float* data = reinterpret_cast<float*>((*pass.grads)[i].data());
          for (size_t e = 0; e < grad.size(); ++e) data[e] += grad[e];
        }
        return Status::Ok();
      };
      Result<TrainStepReport> report = RunAccumulatedStep(*model.engine, *model.pipeline, *model.optimizer, step,
                                                          backward, {.overlap = overlapped.get()});
      EXPECT_OK(report.status());
      if (report.ok()) {
        EXPECT_EQ(report->overlap_groups, overlap ? 4u : 0u) << "step " << k;  // not block 0's two
      }
    }
    std::vector<std::vector<float>> params;
    for (int l = 0; l < kLayers; ++l) params.push_back(model.Read(l, ChunkKind::kParam));
    return params;
  };
  const std::vector<std::vector<float>> overlapped = train(true), alone = train(false);
  EXPECT_EQ(overlapped, alone);
  EXPECT_NE(overlapped[0], std::vector<float>(kChunkElems, 0.0f));
}

TEST(AccumulatedStepTest, TwoRanksReduceEachGroupAsItsBlockEndsAndStepAlikeInEitherOrder) {
  std::vector<std::vector<float>> last_layer;  // per order, then rank
  for (AccumulationOrder order : {AccumulationOrder::kStandard, AccumulationOrder::kLayered}) {
    std::vector<std::vector<float>> ranks(2);
    OnRanks(2, [&](int r, Communicator& comm) {
      Model model(0.0, &comm);
      GradReducer reducer(*model.engine, comm);
      Passes passes{.model = &model, .rank = r};
      for (int k = 0; k < 2; ++k) {
        passes.step = k;
        auto report = RunAccumulatedStep(*model.engine, *model.pipeline, *model.optimizer, FourBlocks(3, order),
                                         std::ref(passes), {.comm = &comm, .reducer = &reducer});
        ASSERT_OK(report.status());
      }
      EXPECT_OK(reducer.Drain());
      // Each of the six grad chunks reduced once a step, as its block's last pass ended.
      EXPECT_EQ(comm.stats().reduce_scatter.calls, 2u * kLayers);
      ranks[r] = model.Read(kLayers - 1, ChunkKind::kParam);
    });
    EXPECT_EQ(ranks[0], ranks[1]);
    last_layer.push_back(ranks[0]);
  }
  EXPECT_EQ(last_layer[0], last_layer[1]);
  EXPECT_NE(last_layer[0], std::vector<float>(kChunkElems, 0.0f));
}

// The seam the replay benchmark drives the step through: every update it
// is given where the kernels would have run, the kernels not run.
struct RecordedUpdates : ComputeSeam {
  std::mutex mu;
  std::vector<Update> updates;
  Status RunUpdate(const Update& update) override {
    std::lock_guard lock(mu);
    updates.push_back(update);
    return Status::Ok();
  }
};

TEST(AccumulatedStepTest, AComputeSeamRunsInsteadOfEachUpdateAndEachPassKeepsItsActivationsRoom) {
  RecordedUpdates seam;
  Model model(0.0, nullptr, false, 60'000, &seam);
  Passes passes{.model = &model};
  AccumulatedStep step = FourBlocks(2, AccumulationOrder::kLayered);
  step.activation_bytes = [](const BlockPass& pass) { return 1000 * (pass.block + 1) + (pass.backward ? 100 : 0); };
  const std::vector<float> before = model.Read(5, ChunkKind::kParam);
  ASSERT_OK(RunAccumulatedStep(*model.engine, *model.pipeline, *model.optimizer, step, std::ref(passes)).status());
  EXPECT_EQ(model.Read(5, ChunkKind::kParam), before);  // no kernel ran
  EXPECT_EQ(model.optimizer->steps_taken(), 1);          // the step did
  ASSERT_EQ(seam.updates.size(), static_cast<size_t>(kLayers));
  std::set<uint32_t> groups;
  for (const ComputeSeam::Update& u : seam.updates) {
    groups.insert(u.group);
    EXPECT_EQ(u.elems, kChunkElems);
    EXPECT_EQ(u.where, Tier::kHost);  // recording: every host moment on the host
    EXPECT_FALSE(u.overlapped);
  }
  EXPECT_EQ(groups.size(), static_cast<size_t>(kLayers));
  // The recorded trace: each pass a device moment with the room it asked for, in pass order.
  const Trace* trace = model.pipeline->trace();
  ASSERT_NE(trace, nullptr);
  ASSERT_EQ(trace->moments.size(), passes.order.size() + kLayers);
  for (size_t k = 0; k < passes.order.size(); ++k) {
    const auto [block, micro_batch, backward] = passes.order[k];
    EXPECT_EQ(trace->moments[k].non_model_bytes, 1000 * (block + 1) + (backward ? 100 : 0)) << "moment " << k;
  }

  // Begun beside backward, the same updates come through the seam marked so.
  ASSERT_OK_AND_ASSIGN(auto overlapped, OverlapUpdates::Create(*model.engine, *model.pipeline, *model.optimizer,
                                                          {.kept_bytes = uint64_t{1} << 20}));
  seam.updates.clear();
  auto report = RunAccumulatedStep(*model.engine, *model.pipeline, *model.optimizer, step, std::ref(passes),
                                   {.overlap = overlapped.get()});
  ASSERT_OK(report.status());
  EXPECT_EQ(report->overlap_groups, static_cast<uint32_t>(kLayers));
  ASSERT_EQ(seam.updates.size(), static_cast<size_t>(kLayers));
  for (const ComputeSeam::Update& u : seam.updates) EXPECT_TRUE(u.overlapped);
  EXPECT_EQ(model.Read(5, ChunkKind::kParam), before);
}

TEST(AccumulatedStepTest, AStepThePlanSkipsCallsNoSeamAndZeroesTheGradientsAsEver) {
  RecordedUpdates seam;
  Model model(0.0, nullptr, false, 60'000, &seam);
  model.Write(3, ChunkKind::kGrad, std::vector<float>(kChunkElems, std::numeric_limits<float>::infinity()));
  ASSERT_OK_AND_ASSIGN(const TrainStepReport report,
                       RunAccumulatedStep(*model.engine, *model.pipeline, *model.optimizer,
                                          FourBlocks(1, AccumulationOrder::kStandard),
                                          [](const BlockPass&) { return Status::Ok(); }));
  EXPECT_TRUE(report.plan.skip);
  EXPECT_TRUE(seam.updates.empty());
  EXPECT_EQ(model.optimizer->steps_taken(), 0);
  EXPECT_EQ(model.Read(3, ChunkKind::kGrad), std::vector<float>(kChunkElems, 0.0f));
}

TEST(AccumulatedStepTest, WhatIsRefusedAndAFailedPassEndsTheStepUncounted) {
  Model model;
  auto run = [&](const AccumulatedStep& step, const std::function<Status(const BlockPass&)>& compute) {
    return RunAccumulatedStep(*model.engine, *model.pipeline, *model.optimizer, step, compute).status();
  };
  auto nothing = [](const BlockPass&) { return Status::Ok(); };
  ExpectStatus(run({}, nothing), StatusCode::kInvalidArgument, "no blocks");
  ExpectStatus(run(FourBlocks(0, AccumulationOrder::kLayered), nothing), StatusCode::kInvalidArgument,
                "micro_batches is 0");
  ExpectStatus(run({.blocks = {{TensorId(0)}, {TensorId(99)}}}, nothing), StatusCode::kInvalidArgument,
                "block 1 names tensor 99, which the engine does not have (7 tensors are registered)");
  const Status failed = run(FourBlocks(2, AccumulationOrder::kLayered), [](const BlockPass& pass) {
    return pass.backward && pass.block == 2 ? IoError("no such batch") : Status::Ok();
  });
  ExpectStatus(failed, StatusCode::kIoError, "no such batch");
  EXPECT_EQ(model.optimizer->steps_taken(), 0u);
  ASSERT_OK(run(FourBlocks(2, AccumulationOrder::kLayered), nothing));  // the pipeline is ready for the next
  EXPECT_EQ(model.optimizer->steps_taken(), 1u);
}

}  // namespace
}  // namespace strata::offload
