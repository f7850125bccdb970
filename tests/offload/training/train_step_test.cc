// RunTrainStep: the optimizer step over every trainable group, in host
// moments of a pipeline iteration, against the optimizer run on plain arrays.
#include "offload/training/train_step.h"

#include <gtest/gtest.h>

#include <array>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "memory/chunk_layout.h"
#include "memory/tier_pool.h"
#include "src/base/half.h"
#include "strata/storage.h"
#include "tests/offload/training/train_model.h"
#include "tests/test_util.h"

namespace strata::offload {
namespace {

TEST(TrainStepTest, UpdatesEveryGroupLikeTheOptimizerOnArraysAndZeroesTheGrads) {
  Model model(/*max_grad_norm=*/1.0);
  Model reference_config(1.0);  // only for a second optimizer with the same settings
  std::mt19937 rng(7);
  std::vector<std::vector<float>> w(kLayers), m(kLayers), v(kLayers);
  std::vector<optim::ChunkTensors> arrays(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    w[l] = Random(rng, 1.0f);
    model.Write(l, ChunkKind::kParam, w[l]);
    m[l].assign(kChunkElems, 0.0f);
    v[l].assign(kChunkElems, 0.0f);
  }
  for (int step = 1; step <= 3; ++step) {
    std::vector<std::vector<float>> grads(kLayers);
    for (int l = 0; l < kLayers; ++l) {
      grads[l] = Random(rng, 0.1f);
      model.Write(l, ChunkKind::kGrad, grads[l]);
      arrays[l] = {.n = kChunkElems, .master = w[l].data(), .grad = grads[l].data(),
                   .state = {m[l].data(), v[l].data()}};
    }
    ASSERT_OK_AND_ASSIGN(TrainStepReport report, model.Iteration());
    ASSERT_OK_AND_ASSIGN(optim::StepPlan plan, reference_config.optimizer->Step(arrays));
    EXPECT_EQ(report.groups, static_cast<uint32_t>(kLayers));  // the frozen tensor has no group to update
    EXPECT_EQ(report.kernel_elems, kLayers * kChunkElems);
    // The phases account for the step: each measured, none beyond the whole.
    EXPECT_GT(report.seconds.kernel, 0);
    EXPECT_GT(report.seconds.stats, 0);
    EXPECT_GT(report.seconds.access, 0);
    EXPECT_LE(report.seconds.Sum(), report.seconds.total);
    EXPECT_EQ(report.seconds.overlap_wait + report.seconds.put_back + report.seconds.gather, 0);
    EXPECT_EQ(report.plan.step, step);
    EXPECT_NEAR(report.plan.grad_norm, plan.grad_norm, 1e-9 * plan.grad_norm);
    EXPECT_LT(report.plan.clip_coefficient, 1.0f);  // the norm is above 1: clipped
    for (int l = 0; l < kLayers; ++l) {
      EXPECT_EQ(model.Read(l, ChunkKind::kParam), w[l]) << "layer " << l << " step " << step;
      EXPECT_EQ(model.Read(l, ChunkKind::kExpAvgSq), v[l]) << "layer " << l << " step " << step;
      EXPECT_EQ(model.Read(l, ChunkKind::kGrad), std::vector<float>(kChunkElems, 0.0f)) << "layer " << l;
    }
  }
  EXPECT_EQ(model.optimizer->steps_taken(), 3);
  // The states did not all fit the host: some groups were read from NVMe and written back.
  EXPECT_GT(model.engine->stats().links[static_cast<int>(Tier::kNvme)][static_cast<int>(Tier::kHost)].bytes, 0u);
}

TEST(TrainStepTest, TheNormSumsGradsWhereTheyLieAndCopiesOnlyThoseElsewhere) {
  Model model;
  std::mt19937 rng(11);
  double sum_squares = 0;
  for (int l = 0; l < kLayers; ++l) {
    model.Write(l, ChunkKind::kParam, Random(rng, 1.0f));
    const std::vector<float> grad = Random(rng, 0.1f);
    model.Write(l, ChunkKind::kGrad, grad);
    for (float g : grad) sum_squares += double{g} * g;
  }
  std::map<Tier, uint64_t> grads_on;  // where the grad chunks lie as the step begins: bytes
  model.before_step = [&] {
    for (int l = 0; l < kLayers; ++l) {
      const ChunkInfo grad = model.engine->chunks()[model.engine->ChunkOf(TensorId(l), ChunkKind::kGrad)->value()];
      Result<Tier> tier = model.engine->ChunkTier(grad.id);
      STRATA_CHECK(tier.ok(), "{}", tier.status().ToString());
      grads_on[*tier] += grad.size_bytes;
    }
  };
  ASSERT_OK_AND_ASSIGN(TrainStepReport report, model.Iteration());
  ASSERT_GT(grads_on[Tier::kHost], 0u) << "the test means some grads in host memory";
  EXPECT_EQ(report.stats_copied_bytes, grads_on[Tier::kNvme]);  // the device's and the host's summed in place
  EXPECT_NEAR(report.plan.grad_norm, std::sqrt(sum_squares), 1e-9 * std::sqrt(sum_squares));
}

// An engine of one trainable tensor of one 4096-element fp32 chunk, whose
// host tier holds `host_chunks` chunks.
std::unique_ptr<Engine> OneGroupEngine(uint64_t host_chunks) {
  Options options;
  options.device.backend = DeviceBackendKind::kEmulated;
  options.device.budget_bytes = 4 * kChunkElems * 4;
  options.host.budget_bytes = host_chunks * kChunkElems * 4;
  options.chunk.size_elems = kChunkElems;
  options.nvme.capacity_bytes = uint64_t{16} << 20;
  auto storage = CreateMemoryStorage(uint64_t{16} << 20);
  STRATA_CHECK(storage.ok());
  auto engine = Engine::Create(options, {.storage = std::move(storage).value()});
  STRATA_CHECK(engine.ok(), "{}", engine.status().ToString());
  STRATA_CHECK((*engine)->RegisterTensor({"w", {static_cast<int64_t>(kChunkElems)}, DType::kFloat32, true, "w"}).ok());
  STRATA_CHECK((*engine)->Finalize().ok());
  return std::move(engine).value();
}

TEST(TrainStepTest, AHostTierThatCannotHoldOneGroupsUpdateIsRefusedWithTheFigures) {
  auto config = optim::OptimizerConfigFromOptions(Options{});  // AdamW: grad, param and two states per group
  ASSERT_OK(config.status());
  ASSERT_OK_AND_ASSIGN(auto optimizer, optim::Optimizer::Create(*config));
  // Four 16KiB chunks, and one besides for the next group's arriving (Note [Room for a step]).
  Status refused = CheckStepRoom(*OneGroupEngine(4), *optimizer);
  ASSERT_EQ(refused.code(), StatusCode::kOutOfMemory) << refused.ToString();
  for (const char* part : {"host.budget", "80KiB", "64KiB"}) {
    EXPECT_NE(refused.message().find(part), std::string::npos) << part << " not in " << refused.ToString();
  }
  EXPECT_OK(CheckStepRoom(*OneGroupEngine(5), *optimizer));
  config->kind = OptimizerKind::kSgd;  // no momentum: grad and param only
  ASSERT_OK_AND_ASSIGN(auto sgd, optim::Optimizer::Create(*config));
  EXPECT_OK(CheckStepRoom(*OneGroupEngine(3), *sgd));
  EXPECT_EQ(CheckStepRoom(*OneGroupEngine(2), *sgd).code(), StatusCode::kOutOfMemory);
}

TEST(TrainStepTest, ACorruptStateOnNvmeEndsTheStepUncountedAndNamesTheChunk) {
  Model model;
  std::mt19937 rng(3);
  for (int l = 0; l < kLayers; ++l) model.Write(l, ChunkKind::kGrad, Random(rng, 0.1f));
  ASSERT_OK(model.Iteration().status());
  for (int l = 0; l < kLayers; ++l) model.Write(l, ChunkKind::kGrad, Random(rng, 0.1f));
  model.faults->CorruptReads(1);
  Result<TrainStepReport> failed = model.Iteration();
  ASSERT_EQ(failed.status().code(), StatusCode::kCorruption) << failed.status().ToString();
  EXPECT_NE(failed.status().message().find("chunk"), std::string::npos) << failed.status().ToString();
  EXPECT_EQ(model.optimizer->steps_taken(), 1);  // not counted
  // The pipeline and the engine go on: the next step runs (the corrupt read left the slot as it was).
  ASSERT_OK_AND_ASSIGN(TrainStepReport report, model.Iteration());
  EXPECT_EQ(report.plan.step, 2);
}

TEST(TrainStepTest, InfiniteGradientsSkipTheUpdateButStillZeroTheGrads) {
  Model model;
  const std::vector<float> before = model.Read(0, ChunkKind::kParam);
  std::vector<float> grad(kChunkElems, 0.5f);
  grad[17] = std::numeric_limits<float>::infinity();
  model.Write(0, ChunkKind::kGrad, grad);
  ASSERT_OK_AND_ASSIGN(TrainStepReport report, model.Iteration());
  EXPECT_TRUE(report.plan.skip);
  EXPECT_EQ(model.Read(0, ChunkKind::kParam), before);
  EXPECT_EQ(model.Read(0, ChunkKind::kGrad), std::vector<float>(kChunkElems, 0.0f));
  EXPECT_EQ(model.optimizer->steps_taken(), 0);
}

}  // namespace
}  // namespace strata::offload

namespace strata::offload {
namespace {

TEST(TrainStepTest, SkippedTensorsAreLeftAsTheyAreAndTheOthersUpdated) {
  Model model;
  std::mt19937 rng(5);
  std::vector<std::vector<float>> before(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    before[l] = Random(rng, 1.0f);
    model.Write(l, ChunkKind::kParam, before[l]);
    model.Write(l, ChunkKind::kGrad, Random(rng, 0.1f));
  }
  std::vector<bool> skip(kLayers + 1, false);
  skip[2] = true;
  ASSERT_OK(model.pipeline->BeginIteration());
  ASSERT_OK(RunTrainStep(*model.engine, *model.pipeline, *model.optimizer, {.skip = skip}).status());
  ASSERT_OK(model.pipeline->EndIteration());
  for (int l = 0; l < kLayers; ++l) {
    if (l == 2) {
      EXPECT_EQ(model.Read(l, ChunkKind::kParam), before[l]);
      EXPECT_EQ(model.Read(l, ChunkKind::kExpAvg), std::vector<float>(kChunkElems, 0.0f));
    } else {
      EXPECT_NE(model.Read(l, ChunkKind::kParam), before[l]) << "layer " << l;
    }
  }
}

}  // namespace
}  // namespace strata::offload

namespace strata::offload {
namespace {


// torch.optim counts steps per parameter: a tensor left out of step 2 takes
// its third step as its second (Adam's bias corrections), in every later
// update, as a fresh optimizer stepping that tensor alone in the steps that
// update it does.
TEST(TrainStepTest, ATensorLeftOutOfAStepKeepsItsStepCountForItsLaterUpdates) {
  Model model;
  std::mt19937 rng(9);
  std::vector<std::vector<float>> w(kLayers), m(kLayers), v(kLayers);
  std::vector<std::unique_ptr<optim::Optimizer>> alone(kLayers);
  for (int l = 0; l < kLayers; ++l) {
    w[l] = Random(rng, 1.0f);
    model.Write(l, ChunkKind::kParam, w[l]);
    m[l].assign(kChunkElems, 0.0f);
    v[l].assign(kChunkElems, 0.0f);
    ASSERT_OK_AND_ASSIGN(alone[l], optim::Optimizer::Create(model.optimizer->config()));
  }
  for (int step = 1; step <= 4; ++step) {
    model.skip.assign(kLayers + 1, false);
    model.skip[2] = step == 2;
    for (int l = 0; l < kLayers; ++l) {
      if (model.skip[l]) continue;  // no gradient reached it: its grad chunk stays zero
      std::vector<float> grad = Random(rng, 0.1f);
      model.Write(l, ChunkKind::kGrad, grad);
      const optim::ChunkTensors arrays{.n = kChunkElems, .master = w[l].data(), .grad = grad.data(),
                                       .state = {m[l].data(), v[l].data()}};
      ASSERT_OK(alone[l]->Step(std::span(&arrays, 1)).status());
    }
    ASSERT_OK(model.Iteration().status());
  }
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(model.Read(l, ChunkKind::kParam), w[l]) << "layer " << l;
    EXPECT_EQ(model.Read(l, ChunkKind::kExpAvg), m[l]) << "layer " << l;
    EXPECT_EQ(model.Read(l, ChunkKind::kExpAvgSq), v[l]) << "layer " << l;
    EXPECT_EQ(model.optimizer->tensor_steps(TensorId(l)), l == 2 ? 3 : 4) << "layer " << l;
  }
  EXPECT_EQ(model.optimizer->steps_taken(), 4);
}

// Four tensors in one chunk (sizes multiples of 16, so every range's vector
// lanes fall as in the reference: bit for bit), left out of different steps:
// each updated with its own count, runs of equal counts together.
TEST(TrainStepTest, ChunkMatesWithDifferentStepCountsAreUpdatedWithTheirOwn) {
  constexpr int64_t kSizes[] = {1024, 1008, 992, 1024};
  constexpr int kTensors = 4;
  const std::vector<std::vector<int>> left_out = {{1}, {2}, {}, {0}, {1, 3}};
  for (const char* kind : {"adamw", "adam", "sgd"}) {
    SCOPED_TRACE(kind);
    Options options;
    options.device.backend = DeviceBackendKind::kEmulated;
    options.host.budget_bytes = 32 * kChunkElems * 4;
    options.chunk.size_elems = kChunkElems;
    options.log_level = LogLevel::kWarning;
    ASSERT_OK(SetOption(options, "optimizer.kind", kind));
    options.optimizer.weight_decay = 0.01;
    options.optimizer.momentum = 0.9;
    options.optimizer.dampening = 0.5;  // SGD's first update of a tensor (buffer = gradient) differs from a later one
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Engine> engine, Engine::Create(options));
    for (int t = 0; t < kTensors; ++t) {
      ASSERT_OK(engine->RegisterTensor({"t" + std::to_string(t), {kSizes[t]}, DType::kFloat32, true, "m"}).status());
    }
    ASSERT_OK(engine->Finalize());
    ASSERT_EQ(engine->chunks()[engine->ChunkOf(TensorId(3), ChunkKind::kParam)->value()].tensors.size(), 4u);
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Pipeline> pipeline, Pipeline::Create(*engine, {}));
    ASSERT_OK_AND_ASSIGN(const optim::OptimizerConfig config, optim::OptimizerConfigFromOptions(options));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<optim::Optimizer> optimizer, optim::Optimizer::Create(config));
    const auto tensor = [&](int t, ChunkKind k) {
      auto access = engine->Access(TensorId(t), k, Tier::kHost);
      STRATA_CHECK(access.ok(), "{}", access.status().ToString());
      return std::move(access).value();
    };
    std::mt19937 rng(13);
    std::vector<std::vector<float>> w(kTensors), m(kTensors), v(kTensors);
    std::vector<std::unique_ptr<optim::Optimizer>> alone(kTensors);
    for (int t = 0; t < kTensors; ++t) {
      w[t] = Random(rng, 1.0f);
      w[t].resize(kSizes[t]);
      std::memcpy(tensor(t, ChunkKind::kParam).data(), w[t].data(), kSizes[t] * sizeof(float));
      m[t].assign(kSizes[t], 0.0f);
      v[t].assign(kSizes[t], 0.0f);
      ASSERT_OK_AND_ASSIGN(alone[t], optim::Optimizer::Create(config));
    }
    for (const std::vector<int>& out : left_out) {
      std::vector<bool> skip(kTensors, false);
      for (int t : out) skip[t] = true;
      for (int t = 0; t < kTensors; ++t) {
        if (skip[t]) continue;
        std::vector<float> grad = Random(rng, 0.1f);
        grad.resize(kSizes[t]);
        std::memcpy(tensor(t, ChunkKind::kGrad).data(), grad.data(), kSizes[t] * sizeof(float));
        const optim::ChunkTensors arrays{.n = static_cast<size_t>(kSizes[t]), .master = w[t].data(),
                                         .grad = grad.data(), .state = {m[t].data(), v[t].data()}};
        ASSERT_OK(alone[t]->Step(std::span(&arrays, 1)).status());
      }
      ASSERT_OK(pipeline->BeginIteration());
      ASSERT_OK(RunTrainStep(*engine, *pipeline, *optimizer, {.skip = skip}).status());
      ASSERT_OK(pipeline->EndIteration());
    }
    for (int t = 0; t < kTensors; ++t) {
      const auto values = [&](ChunkKind k) {
        const float* data = static_cast<const float*>(tensor(t, k).data());
        return std::vector<float>(data, data + kSizes[t]);
      };
      EXPECT_EQ(values(ChunkKind::kParam), w[t]) << "tensor " << t;
      EXPECT_EQ(values(ChunkKind::kExpAvg), m[t]) << "tensor " << t;
      if (std::string(kind) != "sgd") {
        EXPECT_EQ(values(ChunkKind::kExpAvgSq), v[t]) << "tensor " << t;
      }
      EXPECT_EQ(optimizer->tensor_steps(TensorId(t)), alone[t]->steps_taken()) << "tensor " << t;
    }
  }
}

// Data parallel, every rank leaves out the same tensors (the adapter agrees
// on them): the counts stay the same on every rank, and each rank's range
// is updated as its tensor's own step, as one rank stepping alone does.
TEST(TrainStepTest, DataParallelRanksLeavingOutTheSameTensorsKeepTheSameCounts) {
  const auto train = [](Model& model, Communicator* comm) -> Status {
    std::mt19937 rng(11);
    for (int l = 0; l < kLayers; ++l) model.Write(l, ChunkKind::kParam, Random(rng, 1.0f));
    for (int step = 0; step < 3; ++step) {
      model.skip.assign(kLayers + 1, false);
      model.skip[2] = step == 1;
      for (int l = 0; l < kLayers; ++l) {
        // The same gradients on every rank: their mean is exactly them.
        if (!model.skip[l]) model.Write(l, ChunkKind::kGrad, RankGrad(0, l, step));
      }
      STRATA_RETURN_IF_ERROR(model.Iteration(comm).status());
    }
    return Status::Ok();
  };
  Model single;
  ASSERT_OK(train(single, nullptr));
  std::vector<std::vector<float>> expected;
  for (int l = 0; l < kLayers; ++l) expected.push_back(single.Read(l, ChunkKind::kParam));
  const std::vector<int64_t> counts = single.optimizer->AllTensorSteps(kLayers + 1);
  EXPECT_EQ(counts[2], 2);
  OnRanks(2, [&](int r, Communicator& comm) {
    Model rank(0.0, &comm);
    ASSERT_OK(train(rank, &comm));
    EXPECT_EQ(rank.optimizer->AllTensorSteps(kLayers + 1), counts) << "rank " << r;
    for (int l = 0; l < kLayers; ++l) EXPECT_EQ(rank.Read(l, ChunkKind::kParam), expected[l]) << "rank " << r;
  });
}

// `world` ranks (threads) with their own gradients against one rank
// stepping their mean: the same parameters on every rank, bit for bit
// without clipping.
// With `shard_params` (ZeRO-3), the param chunks are gathered from the
// ranks' master shards in each layer's moment, by the reducer.
void RunDataParallel(int world, double max_grad_norm, bool exact, bool during_backward = false,
                     bool shard_params = false) {
  during_backward = during_backward || shard_params;
  constexpr int kSteps = 3;
  std::mt19937 rng(11);
  std::vector<std::vector<float>> initial(kLayers);
  for (auto& w : initial) w = Random(rng, 1.0f);

  Model single(max_grad_norm);
  for (int l = 0; l < kLayers; ++l) single.Write(l, ChunkKind::kParam, initial[l]);
  std::vector<double> single_norms;
  for (int step = 0; step < kSteps; ++step) {
    for (int l = 0; l < kLayers; ++l) {
      std::vector<float> sum(kChunkElems, 0.0f), mean(kChunkElems);
      for (int r = 0; r < world; ++r) {
        const std::vector<float> g = RankGrad(r, l, step);
        for (size_t i = 0; i < kChunkElems; ++i) sum[i] += g[i];
      }
      for (size_t i = 0; i < kChunkElems; ++i) mean[i] = sum[i] * (1.0f / static_cast<float>(world));
      single.Write(l, ChunkKind::kGrad, mean);
    }
    ASSERT_OK_AND_ASSIGN(TrainStepReport report, single.Iteration());
    single_norms.push_back(report.plan.grad_norm);
  }

  auto group = CreateLoopbackGroup(world, {.timeout_ms = 20'000});
  ASSERT_OK(group.status());
  std::vector<std::vector<std::vector<float>>> params(world);
  std::vector<std::vector<double>> norms(world);
  std::vector<uint64_t> state_bytes(world, 0), comm_bytes(world, 0), all_bytes(world, 0), stored(world, 0);
  std::vector<Status> results(world, Status::Ok());
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      Model rank(max_grad_norm, (*group)[r].get(), shard_params);
      std::unique_ptr<GradReducer> reducer;
      if (during_backward) reducer = std::make_unique<GradReducer>(*rank.engine, *(*group)[r]);
      for (const ChunkInfo& chunk : rank.engine->chunks()) {
        if (IsOptimizerState(chunk.kind)) state_bytes[r] += chunk.size_bytes;
      }
      stored[r] = rank.engine->layout().total_bytes;
      for (int l = 0; l < kLayers; ++l) {
        if (shard_params) {
          rank.WriteShard(l, initial[l]);
        } else {
          rank.Write(l, ChunkKind::kParam, initial[l]);
        }
      }
      const uint64_t before = (*group)[r]->stats().total_bytes();
      for (int step = 0; step < kSteps && results[r].ok(); ++step) {
        for (int l = 0; l < kLayers; ++l) rank.Write(l, ChunkKind::kGrad, RankGrad(r, l, step));
        Result<TrainStepReport> report = rank.Iteration((*group)[r].get(), reducer.get());
        results[r] = report.status();
        if (report.ok()) norms[r].push_back(report->plan.grad_norm);
        if (report.ok()) comm_bytes[r] = report->comm_bytes;
      }
      if (reducer) EXPECT_OK(reducer->Drain());  // the gathers ahead of the next step too
      all_bytes[r] = (*group)[r]->stats().total_bytes() - before;
      EXPECT_GE((*group)[r]->stats().reduce_scatter.calls, static_cast<uint64_t>(kSteps * kLayers)) << "rank " << r;
      // From the second step on, every layer's chunk was gathered ahead
      // (the sequence of the step before), and nothing twice.
      if (shard_params) {
        EXPECT_EQ(reducer->gathered_ahead(), static_cast<uint64_t>((kSteps - 1) * kLayers));
      }
      for (int l = 0; l < kLayers && results[r].ok(); ++l) {
        params[r].push_back(shard_params ? rank.Gathered(l, *reducer) : rank.Read(l, ChunkKind::kParam));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < world; ++r) ASSERT_OK(results[r]);
  // A step sends every group's fp32 gradients reduce-scattered (each
  // shard with its group's tag, kTagBits values) and its (fp32) params gathered, (W-1)
  // shards of each, and the norm all-reduced.
  // Parameters sharded: the step gathers nothing; each layer's param chunk
  // is gathered once in its moment (its shard and an 8-byte tag), and the
  // last step gathers the next one's first two ahead.
  const uint64_t shard = memory::ShardOf(kChunkElems, 0, world).elems;
  const uint64_t reduced = kLayers * (world - 1) * (shard + GradReducer::kTagBits) * sizeof(float);
  const uint64_t gathered = kLayers * (world - 1) * (shard * sizeof(float) + (shard_params ? sizeof(uint64_t) : 0));
  const uint64_t norm = 2 * (world - 1) * sizeof(double) / world;
  const uint64_t ahead = shard_params ? GradReducer::kPrefetchDepth * gathered / kLayers : 0;
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(comm_bytes[r], reduced + (shard_params ? 0 : gathered) + norm) << "rank " << r;
    EXPECT_EQ(all_bytes[r], kSteps * (reduced + gathered + norm) + ahead) << "rank " << r;
  }
  // Parameters sharded, a rank stores 1/W of the params too, the frozen
  // layer's included: only the (whole) grad chunks stay whole.
  for (int r = 0; r < world && shard_params; ++r) {
    const uint64_t whole = single.engine->layout().total_bytes;
    const uint64_t grads = kLayers * kChunkElems * sizeof(float);
    EXPECT_LE(stored[r], grads + (whole - grads) / world + 4 * kLayers * memory::kSlotAlignmentBytes + 2 * 4096)
        << "rank " << r;
  }
  // Each rank holds its shard of the states: 1/W of them, up to the 4 KiB slot rounding.
  uint64_t whole_state_bytes = 0;
  for (const ChunkInfo& chunk : single.engine->chunks()) {
    if (IsOptimizerState(chunk.kind)) whole_state_bytes += chunk.size_bytes;
  }
  for (int r = 0; r < world; ++r) {
    // (Parameters sharded: the fp32 params gain a master shard.)
    const uint64_t states = shard_params ? whole_state_bytes * 3 / 2 : whole_state_bytes;
    EXPECT_LE(state_bytes[r], states / world + 3 * kLayers * memory::kSlotAlignmentBytes) << "rank " << r;
    if (!shard_params && world > 1) {
      EXPECT_LT(state_bytes[r], whole_state_bytes) << "rank " << r;
    }
  }
  for (int r = 0; r < world; ++r) ASSERT_EQ(params[r].size(), static_cast<size_t>(kLayers)) << "rank " << r;
  for (int l = 0; l < kLayers; ++l) {
    const std::vector<float> reference = single.Read(l, ChunkKind::kParam);
    for (int r = 1; r < world; ++r) EXPECT_EQ(params[0][l], params[r][l]) << "layer " << l << ": ranks 0 and " << r;
    if (exact) {
      EXPECT_EQ(params[0][l], reference) << "layer " << l;
    } else {
      for (size_t i = 0; i < kChunkElems; ++i) {
        ASSERT_NEAR(params[0][l][i], reference[i], 1e-6f * std::max(1.0f, std::abs(reference[i]))) << l << " " << i;
      }
    }
  }
  for (int step = 0; step < kSteps; ++step) {
    for (int r = 1; r < world; ++r) EXPECT_EQ(norms[0][step], norms[r][step]);
    EXPECT_NEAR(norms[0][step], single_norms[step], 1e-9 * single_norms[step]);
  }
}

TEST(TrainStepTest, TwoRanksStepLikeOneRankWithTheMeanGradientBitForBit) {
  RunDataParallel(2, 0.0, /*exact=*/true);
}

// A group of one rank (NCCL on a single GPU) runs the data-parallel path,
// its gradients reduced during backward: it steps like no communicator.
TEST(TrainStepTest, OneRankWithACommunicatorStepsLikeNone) {
  RunDataParallel(1, 0.0, /*exact=*/true, /*during_backward=*/true);
}

// 4096 elements over three ranks: shards of 1376, the last one short (1344).
TEST(TrainStepTest, ThreeRanksWithAShortLastShardStepLikeOneRank) { RunDataParallel(3, 0.0, /*exact=*/true); }

TEST(TrainStepTest, TwoRanksClipByTheGlobalNorm) { RunDataParallel(2, 0.5, /*exact=*/false); }

// Gradients reduced during backward (each layer's as its moment ends, on
// the reducer's thread) give the same step, bit for bit.
TEST(TrainStepTest, GradientsReducedDuringBackwardStepTheSame) {
  RunDataParallel(2, 0.0, /*exact=*/true, /*during_backward=*/true);
  RunDataParallel(3, 0.5, /*exact=*/false, /*during_backward=*/true);
}

// ZeRO-3: each rank stores its shard of the params (as its fp32 master
// shard) and gathers a param chunk when a moment needs it; the step updates
// the shards only. The same parameters as one rank, bit for bit.
TEST(TrainStepTest, ShardedParamsStepLikeOneRankAndAreGatheredWhenNeeded) {
  RunDataParallel(2, 0.0, /*exact=*/true, /*during_backward=*/true, /*shard_params=*/true);
  RunDataParallel(3, 0.0, /*exact=*/true, /*during_backward=*/true, /*shard_params=*/true);
  RunDataParallel(2, 0.5, /*exact=*/false, /*during_backward=*/true, /*shard_params=*/true);
}

// Ranks gathering different param chunks (a forward that differs between
// them) are refused on every rank, naming what each gathered, instead of
// mixing two layers' parameters; and only a transient param chunk gathers.
TEST(TrainStepTest, RanksGatheringDifferentParamChunksAreRefused) {
  std::vector<Status> results(2, Status::Ok()), refused(2, Status::Ok());
  OnRanks(2, [&](int r, Communicator& comm) {
    Model rank(0.0, &comm, /*shard_params=*/true);
    GradReducer reducer(*rank.engine, comm);
    {
      const ChunkId grad = *rank.engine->ChunkOf(TensorId(0), ChunkKind::kGrad);
      auto grad_access = rank.engine->AccessChunk(grad, Tier::kDevice);
      refused[r] = grad_access.ok() ? reducer.Gather(grad, *grad_access) : grad_access.status();
    }
    const ChunkId param = *rank.engine->ChunkOf(TensorId(r), ChunkKind::kParam);
    auto access = rank.engine->AccessChunk(param, Tier::kDevice);
    results[r] = access.ok() ? reducer.Gather(param, *access) : access.status();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(refused[r].code(), StatusCode::kInvalidArgument) << refused[r].ToString();
    EXPECT_NE(refused[r].message().find("not a transient param chunk"), std::string::npos) << refused[r].ToString();
    EXPECT_EQ(results[r].code(), StatusCode::kInvalidArgument) << results[r].ToString();
    EXPECT_NE(results[r].message().find(fmt::format("rank {} gathered group {}", 1 - r, 1 - r)), std::string::npos)
        << results[r].ToString();
  }
}

// A gather ahead fills its chunk itself when the chunk is on the device
// already, in hold (the pipeline's fetch came first), so the Gather that
// needs it copies nothing; a chunk still free is filled by the Gather; and
// a chunk moved after it was filled ahead (dropped and materialized anew as
// zeros) is filled again by the Gather, not taken as it is.
TEST(TrainStepTest, AGatherAheadFillsAChunkOnTheDeviceAndOnlyWhileItStaysThere) {
  OnRanks(2, [&](int r, Communicator& comm) {
    Model rank(0.0, &comm, /*shard_params=*/true);
    std::mt19937 rng(23);  // the same weights on both ranks
    std::vector<std::vector<float>> initial(4);
    for (int l = 0; l < 4; ++l) {
      initial[l] = Random(rng, 1.0f);
      rank.WriteShard(l, initial[l]);
    }
    GradReducer reducer(*rank.engine, comm);
    const auto param = [&](int l) { return *rank.engine->ChunkOf(TensorId(l), ChunkKind::kParam); };
    for (int l = 0; l < 4; ++l) EXPECT_EQ(rank.Gathered(l, reducer), initial[l]) << "rank " << r << ", layer " << l;
    reducer.ReleaseGathered();  // 0, 1, 2, 3: the sequence the next gathers go ahead along
    for (int l = 0; l < 4; ++l) ASSERT_OK(rank.engine->MoveChunk(param(l), Tier::kHost));  // dropped
    for (int l : {1, 3}) ASSERT_OK(rank.engine->MoveChunk(param(l), Tier::kDevice));       // zeros, in hold
    EXPECT_EQ(rank.Gathered(0, reducer), initial[0]);  // queues 1, 2 and 3 ahead
    ASSERT_OK(reducer.Drain());
    EXPECT_EQ(reducer.gathered_ahead(), 0u);
    EXPECT_EQ(reducer.filled_ahead(), 0u);
    ASSERT_OK(rank.engine->MoveChunk(param(3), Tier::kHost));  // filled ahead, then dropped
    EXPECT_EQ(rank.Gathered(1, reducer), initial[1]) << "rank " << r;
    EXPECT_EQ(reducer.filled_ahead(), 1u);
    EXPECT_EQ(rank.Gathered(2, reducer), initial[2]) << "rank " << r;
    EXPECT_EQ(rank.Gathered(3, reducer), initial[3]) << "rank " << r;
    EXPECT_EQ(reducer.gathered_ahead(), 3u);
    EXPECT_EQ(reducer.filled_ahead(), 1u);
  });
}

// A rank whose master shard cannot be read (an NVMe error) still joins the
// gather, tagged as failed: both ranks' gathers fail at once, the other
// naming it, and every later gather fails fast on both rather than fall
// out of step (no Timeout). The step, too, needs the reducer that gathered.
TEST(TrainStepTest, AShardThatCannotBeReadFailsTheGatherOnEveryRankInStep) {
  std::vector<Status> first(2, Status::Ok()), later(2, Status::Ok()), step(2, Status::Ok());
  OnRanks(2, [&](int r, Communicator& comm) {
    Model rank(0.0, &comm, /*shard_params=*/true);
    GradReducer reducer(*rank.engine, comm);
    // The last layer's master shard on NVMe, behind the fault injector.
    const ChunkId master = *rank.engine->ChunkOf(TensorId(kLayers - 1), ChunkKind::kMaster);
    ASSERT_OK(rank.engine->MoveChunk(master, Tier::kNvme));
    if (r == 0) rank.faults->FailReads(EIO);
    for (int attempt = 0; attempt < 2; ++attempt) {
      const ChunkId param = *rank.engine->ChunkOf(TensorId(kLayers - 1 - attempt), ChunkKind::kParam);
      auto access = rank.engine->AccessChunk(param, Tier::kDevice);
      ASSERT_OK(access.status());
      (attempt == 0 ? first : later)[r] = reducer.Gather(param, *access);
    }
    step[r] = RunTrainStep(*rank.engine, *rank.pipeline, *rank.optimizer, {.comm = &comm}).status();
  });
  EXPECT_EQ(first[0].code(), StatusCode::kIoError) << first[0].ToString();
  EXPECT_NE(first[0].message().find("reading the master shard of chunk group"), std::string::npos) << first[0].ToString();
  EXPECT_EQ(first[1].code(), StatusCode::kIoError) << first[1].ToString();
  EXPECT_NE(first[1].message().find("rank(s) 0 could not read their master shard"), std::string::npos)
      << first[1].ToString();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(later[r].code(), StatusCode::kIoError) << "rank " << r << ": " << later[r].ToString();
    EXPECT_EQ(step[r].code(), StatusCode::kInvalidArgument) << step[r].ToString();
    EXPECT_NE(step[r].message().find("no GradReducer was given"), std::string::npos) << step[r].ToString();
  }
}

// Parameters sharded, the device must hold the reducer's kept gathers and a
// moment's own chunks: a budget short of that is refused at Finalize, naming
// the option, on every rank.
TEST(TrainStepTest, ShardedParamsNeedDeviceRoomForTheKeptGathers) {
  std::vector<Status> results(2, Status::Ok());
  OnRanks(2, [&](int r, Communicator& comm) {
    Options options;
    options.device.backend = DeviceBackendKind::kEmulated;
    options.device.budget_bytes = 3 * kChunkElems * 4;  // three chunks: one short
    options.host.budget_bytes = 64 * kChunkElems * 4;
    options.chunk.size_elems = kChunkElems;
    options.log_level = LogLevel::kWarning;
    options.comm.shard_params = true;
    auto engine = Engine::Create(options, {.comm = &comm});
    ASSERT_OK(engine.status());
    ASSERT_OK((*engine)->RegisterTensor({"w", {static_cast<int64_t>(kChunkElems)}, DType::kFloat32, true, "m"})
                  .status());
    results[r] = (*engine)->Finalize();
  });
  for (const Status& result : results) {
    EXPECT_EQ(result.code(), StatusCode::kOutOfMemory) << result.ToString();
    EXPECT_NE(result.message().find("comm.shard_params"), std::string::npos) << result.ToString();
  }
}

// bf16 gradients travel in bf16 (comm.reduce_dtype grad, the default: 2
// bytes an element, the sum rounded to bf16 before the mean) or in fp32
// (comm.reduce_dtype fp32: twice the bytes, the exact mean).
TEST(TrainStepTest, GradientsAreReducedInTheGradDtypeUnlessFp32IsAsked) {
  for (const char* wire : {"grad", "fp32"}) {
    SCOPED_TRACE(wire);
    std::vector<Result<GradReducer::Reduced>> reduced(2, Internal("not run"));
    OnRanks(2, [&](int r, Communicator& comm) {
      Options options;
      options.device.backend = DeviceBackendKind::kEmulated;
      options.host.budget_bytes = 64 * kChunkElems * 4;
      options.chunk.size_elems = kChunkElems;
      options.log_level = LogLevel::kWarning;
      options.compute_dtype = DType::kBFloat16;
      ASSERT_OK(SetOption(options, "comm.reduce_dtype", wire));
      auto engine = Engine::Create(options, {.comm = &comm});
      ASSERT_OK(engine.status());
      ASSERT_OK_AND_ASSIGN(TensorId w, (*engine)->RegisterTensor(
                                           {"w", {static_cast<int64_t>(kChunkElems)}, DType::kBFloat16, true, "m"}));
      ASSERT_OK((*engine)->Finalize());
      {
        ASSERT_OK_AND_ASSIGN(TensorAccess grad, (*engine)->Access(w, ChunkKind::kGrad, Tier::kHost));
        // 1 + 0.75 of bf16's ulp at 1: rounded to bf16, 1 + ulp.
        for (size_t i = 0; i < kChunkElems; ++i) optim::StoreFloat(grad.data(), DType::kBFloat16, i, r == 0 ? 1.0f : 0.75f / 128);
      }
      GradReducer reducer(**engine, comm);
      reduced[r] = reducer.Take(*(*engine)->ChunkOf(w, ChunkKind::kGrad));
    });
    const bool fp32 = std::string(wire) == "fp32";
    const float mean = fp32 ? (1.0f + 0.75f / 128) / 2 : (1.0f + 1.0f / 128) / 2;
    for (int r = 0; r < 2; ++r) {
      ASSERT_OK(reduced[r].status());
      EXPECT_EQ(reduced[r]->shard, std::vector<float>(kChunkElems / 2, mean)) << "rank " << r;
      EXPECT_EQ(reduced[r]->bytes, (kChunkElems / 2 + GradReducer::kTagBits) * (fp32 ? 4 : 2)) << "rank " << r;
    }
  }
}

// The overflow check is global: one rank's inf gradient makes every rank
// skip the step (the norm's all-reduced sum of squares is inf everywhere),
// so the ranks' parameters never part.
TEST(TrainStepTest, AnInfGradientOnOneRankSkipsTheStepOnEveryRank) {
  auto group = CreateLoopbackGroup(2, {.timeout_ms = 20'000});
  ASSERT_OK(group.status());
  std::vector<Status> results(2, Status::Ok());
  // Bytes, not std::vector<bool>'s packed bits: each rank's thread writes its own.
  std::array<bool, 2> skipped{}, unchanged{};
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Model rank(0.0, (*group)[r].get());
      std::mt19937 rng(5);
      const std::vector<float> initial = Random(rng, 1.0f);
      for (int l = 0; l < kLayers; ++l) rank.Write(l, ChunkKind::kParam, initial);
      for (int l = 0; l < kLayers; ++l) {
        std::vector<float> grad = RankGrad(r, l, 0);
        if (r == 1 && l == 3) grad[17] = std::numeric_limits<float>::infinity();
        rank.Write(l, ChunkKind::kGrad, grad);
      }
      Result<TrainStepReport> report = rank.Iteration((*group)[r].get());
      results[r] = report.status();
      if (!report.ok()) return;
      skipped[r] = report->plan.skip;
      unchanged[r] = true;
      for (int l = 0; l < kLayers; ++l) unchanged[r] = unchanged[r] && rank.Read(l, ChunkKind::kParam) == initial;
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_OK(results[r]);
    EXPECT_TRUE(skipped[r]) << "rank " << r;
    EXPECT_TRUE(unchanged[r]) << "rank " << r;
  }
}

// Ranks whose backward completes groups in different orders would sum one
// group's gradients with another's: every rank finds it, by the groups'
// tags, and names it.
TEST(TrainStepTest, RanksReducingGroupsInDifferentOrdersAreRefusedNotSummed) {
  auto group = CreateLoopbackGroup(2, {.timeout_ms = 20'000});
  ASSERT_OK(group.status());
  std::vector<Status> results(2, Status::Ok());
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Model rank(0.0, (*group)[r].get());
      GradReducer reducer(*rank.engine, *(*group)[r]);
      const ChunkId first = *rank.engine->ChunkOf(TensorId(r == 0 ? 0 : 1), ChunkKind::kGrad);
      const ChunkId second = *rank.engine->ChunkOf(TensorId(r == 0 ? 1 : 0), ChunkKind::kGrad);
      results[r] = reducer.Submit(first);
      if (results[r].ok()) results[r] = reducer.Submit(second);
      if (results[r].ok()) results[r] = reducer.Take(first).status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].code(), StatusCode::kInvalidArgument) << results[r].ToString();
    EXPECT_NE(results[r].message().find("every rank must run the same backward"), std::string::npos)
        << results[r].ToString();
  }
}

// A chunk submitted again (a gradient that arrived late) is reduced with
// its latest values; a chunk that is not a grad chunk is refused.
TEST(TrainStepTest, AResubmittedChunkIsReducedWithItsLatestGradients) {
  auto group = CreateLoopbackGroup(2, {.timeout_ms = 20'000});
  ASSERT_OK(group.status());
  std::vector<std::vector<float>> shards(2);
  std::vector<Status> results(2, Status::Ok()), wrong_kind(2, Status::Ok());
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Model rank(0.0, (*group)[r].get());
      GradReducer reducer(*rank.engine, *(*group)[r]);
      const ChunkId grad = *rank.engine->ChunkOf(TensorId(0), ChunkKind::kGrad);
      wrong_kind[r] = reducer.Submit(*rank.engine->ChunkOf(TensorId(0), ChunkKind::kParam));
      rank.Write(0, ChunkKind::kGrad, std::vector<float>(kChunkElems, 1.0f));
      results[r] = reducer.Submit(grad);
      rank.Write(0, ChunkKind::kGrad, std::vector<float>(kChunkElems, 3.0f + r));
      if (results[r].ok()) results[r] = reducer.Submit(grad);
      Result<GradReducer::Reduced> reduced = reducer.Take(grad);
      if (results[r].ok()) results[r] = reduced.status();
      if (reduced.ok()) shards[r] = reduced->shard;
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_OK(results[r]);
    EXPECT_EQ(wrong_kind[r].code(), StatusCode::kInvalidArgument);
    ASSERT_EQ(shards[r].size(), kChunkElems / 2);
    EXPECT_EQ(shards[r], std::vector<float>(kChunkElems / 2, 3.5f)) << "rank " << r << ": the mean of 3 and 4";
  }
}

// A recycled shard's memory takes the next reduction (no fresh pages per
// reduction), and its values are that reduction's, not the old ones.
TEST(TrainStepTest, ARecycledShardIsReusedForTheNextReduction) {
  OnRanks(2, [&](int r, Communicator& comm) {
    Model rank(0.0, &comm);
    GradReducer reducer(*rank.engine, comm);
    const ChunkId grad = *rank.engine->ChunkOf(TensorId(0), ChunkKind::kGrad);
    rank.Write(0, ChunkKind::kGrad, std::vector<float>(kChunkElems, 1.0f + r));
    ASSERT_OK_AND_ASSIGN(GradReducer::Reduced first, reducer.Take(grad));
    EXPECT_EQ(first.shard, std::vector<float>(kChunkElems / 2, 1.5f));
    first.shard.reserve(kChunkElems);  // a capacity no fresh shard has: recognizable when it comes back
    const float* memory = first.shard.data();
    reducer.Recycle(std::move(first.shard));
    rank.Write(0, ChunkKind::kGrad, std::vector<float>(kChunkElems, 5.0f + r));
    ASSERT_OK_AND_ASSIGN(GradReducer::Reduced second, reducer.Take(grad));
    EXPECT_EQ(second.shard.data(), memory) << "rank " << r;
    EXPECT_EQ(second.shard.capacity(), kChunkElems) << "rank " << r;
    EXPECT_EQ(second.shard, std::vector<float>(kChunkElems / 2, 5.5f)) << "rank " << r;
  });
}

// A sharded engine stepped without its communicator (or with another
// group's) would update a range its chunks do not hold: refused up front.
TEST(TrainStepTest, ShardedEngineNeedsItsOwnCommunicator) {
  auto group = CreateLoopbackGroup(2, {.timeout_ms = 20'000});
  ASSERT_OK(group.status());
  std::vector<Status> alone(2, Status::Ok()), swapped(2, Status::Ok());
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Model rank(0.0, (*group)[r].get());
      alone[r] = rank.Iteration(nullptr).status();
      swapped[r] = rank.Iteration((*group)[1 - r].get()).status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(alone[r].code(), StatusCode::kInvalidArgument) << alone[r].ToString();
    EXPECT_NE(alone[r].message().find("no communicator"), std::string::npos) << alone[r].ToString();
    EXPECT_EQ(swapped[r].code(), StatusCode::kInvalidArgument) << swapped[r].ToString();
  }
  Model single;
  Status unsharded = single.Iteration((*group)[0].get()).status();
  EXPECT_EQ(unsharded.code(), StatusCode::kInvalidArgument) << unsharded.ToString();
}

}  // namespace
}  // namespace strata::offload

namespace strata::offload {
namespace {

// Two models, one stepping after backward and one beginning each layer's
// overlapped update, with the same loss scaler and clipping, see the
// same gradients (scaled by the loss scale): small ones, large ones that
// clip, and an overflow in one layer.
struct OverlapPair {
  static constexpr double kMaxGradNorm = 1.0;
  Model after{kMaxGradNorm}, early{kMaxGradNorm};
  std::unique_ptr<OverlapUpdates> overlapped;

  explicit OverlapPair(uint64_t kept_bytes) {
    for (Model* m : {&after, &early}) {
      Options options;
      options.optimizer.weight_decay = 0.01;
      options.optimizer.max_grad_norm = kMaxGradNorm;
      auto config = optim::OptimizerConfigFromOptions(options);
      STRATA_CHECK(config.ok());
      auto made = optim::Optimizer::Create(*config, optim::LossScalerConfig{.init_scale = 1024.0f});
      STRATA_CHECK(made.ok());
      m->optimizer = std::move(made).value();
    }
    auto made = OverlapUpdates::Create(*early.engine, *early.pipeline, *early.optimizer, {.kept_bytes = kept_bytes});
    STRATA_CHECK(made.ok(), "{}", made.status().ToString());
    overlapped = std::move(made).value();
    early.overlap = overlapped.get();
    std::mt19937 rng(11);
    for (int l = 0; l < kLayers; ++l) {
      const std::vector<float> w = Random(rng, 1.0f);
      after.Write(l, ChunkKind::kParam, w);
      early.Write(l, ChunkKind::kParam, w);
    }
  }

  // Step k's gradients: `scale` times a fixed pattern, times the loss scale;
  // with `overflow`, layer 2's carry an inf.
  void WriteGrads(int k, float scale, bool overflow) {
    for (Model* m : {&after, &early}) {
      for (int l = 0; l < kLayers; ++l) {
        std::vector<float> g = RankGrad(0, l, k);
        for (float& x : g) x *= scale * m->optimizer->loss_scale();
        if (overflow && l == 2) g[5] = std::numeric_limits<float>::infinity();
        m->Write(l, ChunkKind::kGrad, g);
      }
    }
  }
};

TEST(TrainStepTest, OverlappedUpdatesGiveTheStepsResultsBitForBit) {
  struct Case {
    float scale;
    bool overflow;
    bool clips;
  };
  // The norm of 6 x 4096 gradients of scale s is about 157 s.
  const Case steps[] = {{1e-3f, false, false}, {1e-1f, false, true}, {1e-3f, true, false},
                        {1e-3f, false, false}, {1e-1f, false, true}, {1e-3f, false, false}};
  // Room for every group's copy, and for two of them (the others updated after backward).
  for (uint64_t kept : {uint64_t{1} << 30, 2 * 4 * kChunkElems * sizeof(float)}) {
    SCOPED_TRACE("kept bytes " + std::to_string(kept));
    OverlapPair pair(kept);
    const uint32_t overlap_groups = kept >> 30 ? kLayers : 2;
    for (int k = 0; k < 6; ++k) {
      SCOPED_TRACE("step " + std::to_string(k));
      pair.WriteGrads(k, steps[k].scale, steps[k].overflow);
      ASSERT_OK_AND_ASSIGN(TrainStepReport after, pair.after.Iteration());
      ASSERT_OK_AND_ASSIGN(TrainStepReport early, pair.early.Iteration());
      EXPECT_EQ(after.plan.skip, steps[k].overflow);
      EXPECT_EQ(after.plan.clip_coefficient < 1.0f, steps[k].clips);
      EXPECT_EQ(early.plan.step, after.plan.step);
      EXPECT_EQ(early.plan.grad_norm, after.plan.grad_norm);
      EXPECT_EQ(early.groups, static_cast<uint32_t>(kLayers));
      const bool stands = !steps[k].overflow && !steps[k].clips;
      EXPECT_EQ(early.overlap_groups, stands ? overlap_groups : 0u);
      // A group whose gradients overflowed was left as it was, and is updated (skipped) by the step.
      EXPECT_EQ(early.redone_groups, stands ? 0u : overlap_groups - (steps[k].overflow && kept >> 30 ? 1 : 0));
      // The step's kernels ran over the groups it updated itself, and again over those it redid from their copy.
      EXPECT_EQ(early.kernel_elems, (kLayers - early.overlap_groups) * kChunkElems);
      EXPECT_EQ(early.seconds.put_back > 0, early.redone_groups > 0);
      // Every group's statistics were taken beside backward, those whose copy did not fit included.
      EXPECT_EQ(early.stats_read_groups, 0u);
      EXPECT_EQ(after.stats_read_groups, static_cast<uint32_t>(kLayers));
      EXPECT_LE(early.seconds.Sum(), early.seconds.total);
      for (int l = 0; l < kLayers; ++l) {
        for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kExpAvg, ChunkKind::kExpAvgSq, ChunkKind::kGrad}) {
          EXPECT_EQ(pair.early.Read(l, kind), pair.after.Read(l, kind)) << "layer " << l << " kind " << int(kind);
        }
      }
      EXPECT_EQ(pair.early.optimizer->loss_scale(), pair.after.optimizer->loss_scale());
    }
    EXPECT_EQ(pair.early.optimizer->steps_taken(), 5);
  }
}

TEST(TrainStepTest, AGradientAfterItsGroupsUpdateBeganIsAddedAndTheGroupRedone) {
  OverlapPair pair(uint64_t{1} << 30);
  const ChunkId grad3 = *pair.early.engine->ChunkOf(TensorId(3), ChunkKind::kGrad);
  for (int k = 0; k < 3; ++k) {
    SCOPED_TRACE("step " + std::to_string(k));
    pair.WriteGrads(k, 1e-3f, false);
    // Layer 3's gradients come in two parts; the second arrives after backward.
    std::vector<float> late = RankGrad(1, 3, k);
    for (float& x : late) x *= 1e-3f * pair.after.optimizer->loss_scale();
    std::vector<float> whole = pair.after.Read(3, ChunkKind::kGrad);
    for (size_t i = 0; i < whole.size(); ++i) whole[i] += late[i];
    pair.after.Write(3, ChunkKind::kGrad, whole);
    pair.early.before_step = [&] {
      ASSERT_TRUE(pair.overlapped->Late(grad3));
      // Into the chunk its update zeroed, once done with it (a pipeline access of it would wait as long).
      ASSERT_OK(pair.overlapped->Wait());
      pair.early.Write(3, ChunkKind::kGrad, late);
    };
    ASSERT_OK_AND_ASSIGN(TrainStepReport after, pair.after.Iteration());
    ASSERT_OK_AND_ASSIGN(TrainStepReport early, pair.early.Iteration());
    EXPECT_EQ(early.plan.grad_norm, after.plan.grad_norm);
    EXPECT_EQ(early.overlap_groups, static_cast<uint32_t>(kLayers - 1));
    EXPECT_EQ(early.redone_groups, 1u);
    for (int l = 0; l < kLayers; ++l) {
      for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kExpAvg, ChunkKind::kExpAvgSq, ChunkKind::kGrad}) {
        EXPECT_EQ(pair.early.Read(l, kind), pair.after.Read(l, kind)) << "layer " << l << " kind " << int(kind);
      }
    }
  }
}

TEST(TrainStepTest, UndoPutsTheGroupsBackWithTheirLateGradientsAdded) {
  OverlapPair pair(uint64_t{1} << 30);
  const auto add_to_grads = [](Model& m, int layer, const std::vector<float>& more) {
    std::vector<float> g = m.Read(layer, ChunkKind::kGrad);
    for (size_t i = 0; i < g.size(); ++i) g[i] += more[i];
    m.Write(layer, ChunkKind::kGrad, g);
  };
  pair.WriteGrads(0, 1e-3f, false);
  const std::vector<float> late = RankGrad(1, 3, 0);
  // The reference: the first backward's gradients, layer 3's late part, then a second backward's.
  add_to_grads(pair.after, 3, late);
  for (int l = 0; l < kLayers; ++l) add_to_grads(pair.after, l, RankGrad(2, l, 0));
  ASSERT_OK(pair.after.Iteration().status());
  // Overlapped: every group's update begins in the first backward; layer 3's late part comes after
  // its update zeroed the chunk; a forward before the step puts them back; the second backward adds.
  Model& early = pair.early;
  ASSERT_OK(early.pipeline->BeginIteration());
  for (int l = kLayers - 1; l >= 0; --l) {
    ASSERT_OK(early.pipeline->BeginMoment());
    for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kGrad}) {
      ASSERT_OK(early.pipeline->Access(*early.engine->ChunkOf(TensorId(l), kind)).status());
    }
    ASSERT_OK(early.pipeline->EndMoment());
    ASSERT_OK_AND_ASSIGN(bool begun, pair.overlapped->Begin(*early.engine->ChunkOf(TensorId(l), ChunkKind::kGrad)));
    ASSERT_TRUE(begun);
  }
  ASSERT_TRUE(pair.overlapped->Late(*early.engine->ChunkOf(TensorId(3), ChunkKind::kGrad)));
  ASSERT_OK(pair.overlapped->Wait());
  early.Write(3, ChunkKind::kGrad, late);
  ASSERT_OK(pair.overlapped->Undo());
  for (int l = 0; l < kLayers; ++l) add_to_grads(early, l, RankGrad(2, l, 0));
  ASSERT_OK_AND_ASSIGN(
      TrainStepReport report,
      RunTrainStep(*early.engine, *early.pipeline, *early.optimizer, {.overlap = pair.overlapped.get()}));
  ASSERT_OK(early.pipeline->EndIteration());
  EXPECT_EQ(report.overlap_groups, 0u);  // undone: the step updated every group itself
  for (int l = 0; l < kLayers; ++l) {
    for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kExpAvg, ChunkKind::kExpAvgSq, ChunkKind::kGrad}) {
      EXPECT_EQ(early.Read(l, kind), pair.after.Read(l, kind)) << "layer " << l << " kind " << int(kind);
    }
  }
}

TEST(TrainStepTest, AFailedReadForAnOverlappedUpdateFailsTheStepAndTheNextOneRuns) {
  OverlapPair pair(uint64_t{1} << 30);
  for (int k = 0; k < 2; ++k) {
    pair.WriteGrads(k, 1e-3f, false);
    ASSERT_OK(pair.early.Iteration().status());
  }
  pair.WriteGrads(2, 1e-3f, false);
  pair.early.faults->FailReads(EIO, 1);  // the optimizer states live on NVMe: an update's read
  Result<TrainStepReport> failed = pair.early.Iteration();
  ASSERT_EQ(failed.status().code(), StatusCode::kIoError) << failed.status().ToString();
  EXPECT_NE(failed.status().message().find("overlapped update"), std::string::npos) << failed.status().ToString();
  EXPECT_EQ(pair.early.optimizer->steps_taken(), 2);  // not counted
  pair.WriteGrads(3, 1e-3f, false);
  ASSERT_OK_AND_ASSIGN(TrainStepReport next, pair.early.Iteration());  // the failed step's updates are gone
  EXPECT_EQ(next.plan.step, 3);
  EXPECT_EQ(next.overlap_groups, static_cast<uint32_t>(kLayers));
}

TEST(TrainStepTest, OverlappedUpdatesAreRefusedForAnotherGrad) {
  Model model;
  ASSERT_OK_AND_ASSIGN(auto overlapped, OverlapUpdates::Create(*model.engine, *model.pipeline, *model.optimizer,
                                                          {.kept_bytes = uint64_t{1} << 30}));
  ASSERT_OK(model.pipeline->BeginIteration());
  const ChunkId param = *model.engine->ChunkOf(TensorId(0), ChunkKind::kParam);
  EXPECT_EQ(overlapped->Begin(param).status().code(), StatusCode::kInvalidArgument);
  const ChunkId grad = *model.engine->ChunkOf(TensorId(0), ChunkKind::kGrad);
  ASSERT_OK_AND_ASSIGN(bool begun, overlapped->Begin(grad));
  EXPECT_TRUE(begun);
  Result<bool> again = overlapped->Begin(grad);
  EXPECT_EQ(again.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(again.status().message().find("begun already"), std::string::npos) << again.status().ToString();
  ASSERT_OK(RunTrainStep(*model.engine, *model.pipeline, *model.optimizer, {.overlap = overlapped.get()}).status());
  ASSERT_OK(model.pipeline->EndIteration());
}

}  // namespace
}  // namespace strata::offload

namespace strata::offload {
namespace {

TEST(TrainStepTest, OverlappedUpdatesOfADataParallelEngineNeedItsReducer) {
  OnRanks(2, [](int, Communicator& comm) {
    Model model(0.0, &comm);
    Result<std::unique_ptr<OverlapUpdates>> refused =
        OverlapUpdates::Create(*model.engine, *model.pipeline, *model.optimizer, {.kept_bytes = 1 << 20});
    ASSERT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find("GradReducer"), std::string::npos) << refused.status().ToString();
  });
  // A communicator of one rank with a reducer takes the data-parallel step (NCCL on one GPU): refused there
  // when the updates were made without that reducer.
  OnRanks(1, [](int, Communicator& comm) {
    Model model(0.0, &comm);
    GradReducer reducer(*model.engine, comm);
    ASSERT_OK_AND_ASSIGN(auto overlapped, OverlapUpdates::Create(*model.engine, *model.pipeline, *model.optimizer,
                                                            {.kept_bytes = 1 << 20}));
    model.overlap = overlapped.get();
    Result<TrainStepReport> refused = model.Iteration(&comm, &reducer);
    ASSERT_EQ(refused.status().code(), StatusCode::kInvalidArgument) << refused.status().ToString();
    EXPECT_NE(refused.status().message().find("GradReducer"), std::string::npos) << refused.status().ToString();
    ASSERT_OK(reducer.Drain());
  });
}

}  // namespace
}  // namespace strata::offload

namespace strata::offload {
namespace {

// Tensor `tensor`'s chunk of `kind` as this rank holds it (a shard, where sharded).
std::vector<std::byte> ChunkBytes(Model& m, int tensor, ChunkKind kind) {
  const ChunkId id = *m.engine->ChunkOf(TensorId(tensor), kind);
  auto access = m.engine->AccessChunk(id, Tier::kHost);
  STRATA_CHECK(access.ok(), "{}", access.status().ToString());
  const std::byte* data = access->data();
  return std::vector<std::byte>(data, data + m.engine->chunks()[id.value()].used_bytes);
}

// Data parallel: on `world` ranks, a model whose updates begin beside
// backward on each group's reduction and one stepping after backward see
// the same gradients (small ones, large ones that clip, an overflow on one
// rank alone): the same parameters and states bit for bit, every step.
void RunDataParallelOverlap(int world, bool shard_params) {
  constexpr double kMaxGradNorm = 1.0;
  struct Step {
    float scale;
    bool overflow;  // rank 1's layer 2 carries an inf
    bool stands;
  };
  // RankGrad's 6 x 4096 gradients have a norm of about 9, their mean over W ranks about 9 / sqrt(W).
  const Step steps[] = {{1e-2f, false, true}, {10.0f, false, false}, {1e-2f, true, false}, {1e-2f, false, true}};
  auto after_group = CreateLoopbackGroup(world, {.timeout_ms = 20'000});
  auto early_group = CreateLoopbackGroup(world, {.timeout_ms = 20'000});
  ASSERT_OK(after_group.status());
  ASSERT_OK(early_group.status());
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      Communicator& after_comm = *(*after_group)[r];
      Communicator& early_comm = *(*early_group)[r];
      Model after(kMaxGradNorm, &after_comm, shard_params), early(kMaxGradNorm, &early_comm, shard_params);
      GradReducer after_reducer(*after.engine, after_comm), early_reducer(*early.engine, early_comm);
      auto overlapped = OverlapUpdates::Create(*early.engine, *early.pipeline, *early.optimizer,
                                          {.kept_bytes = uint64_t{1} << 30, .reducer = &early_reducer});
      ASSERT_OK(overlapped.status());
      early.overlap = overlapped->get();
      std::mt19937 rng(11);
      for (int l = 0; l < kLayers; ++l) {
        const std::vector<float> w = Random(rng, 1.0f);
        for (Model* m : {&after, &early}) {
          if (shard_params) {
            m->WriteShard(l, w);
          } else {
            m->Write(l, ChunkKind::kParam, w);
          }
        }
      }
      for (int k = 0; k < 4; ++k) {
        SCOPED_TRACE("rank " + std::to_string(r) + " step " + std::to_string(k));
        for (Model* m : {&after, &early}) {
          for (int l = 0; l < kLayers; ++l) {
            std::vector<float> g = RankGrad(r, l, k);
            for (float& x : g) x *= steps[k].scale;
            if (steps[k].overflow && r == 1 && l == 2) g[5] = std::numeric_limits<float>::infinity();
            m->Write(l, ChunkKind::kGrad, g);
          }
        }
        ASSERT_OK_AND_ASSIGN(TrainStepReport a, after.Iteration(&after_comm, &after_reducer));
        ASSERT_OK_AND_ASSIGN(TrainStepReport e, early.Iteration(&early_comm, &early_reducer));
        EXPECT_EQ(e.plan.grad_norm, a.plan.grad_norm);
        EXPECT_EQ(a.plan.skip, steps[k].overflow);
        EXPECT_EQ(e.overlap_groups, steps[k].stands ? static_cast<uint32_t>(kLayers) : 0u);
        EXPECT_EQ(e.groups, static_cast<uint32_t>(kLayers));
        EXPECT_EQ(e.comm_bytes, a.comm_bytes);  // the same collectives
        for (int l = 0; l < kLayers; ++l) {
          const std::vector<ChunkKind> kinds = {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq, ChunkKind::kGrad,
                                                shard_params ? ChunkKind::kMaster : ChunkKind::kParam};
          for (ChunkKind kind : kinds) {
            if (kind == ChunkKind::kMaster) {
              EXPECT_EQ(early.Gathered(l, early_reducer), after.Gathered(l, after_reducer)) << "layer " << l;
              continue;
            }
            EXPECT_EQ(ChunkBytes(early, l, kind), ChunkBytes(after, l, kind)) << "layer " << l << " kind " << int(kind);
          }
        }
      }
      EXPECT_OK(after_reducer.Drain());
      EXPECT_OK(early_reducer.Drain());
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST(TrainStepTest, TwoRanksWithOverlappedUpdatesStepAsWithoutBitForBit) { RunDataParallelOverlap(2, false); }
TEST(TrainStepTest, FourRanksWithOverlappedUpdatesStepAsWithoutBitForBit) { RunDataParallelOverlap(4, false); }
TEST(TrainStepTest, ShardedParamsWithOverlappedUpdatesStepAsWithoutBitForBit) { RunDataParallelOverlap(2, true); }

}  // namespace
}  // namespace strata::offload
