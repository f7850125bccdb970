// A small model trained through the whole C++ stack (engine, pipeline,
// optimizer, RunTrainStep), for the train-step and checkpoint tests.
#pragma once

#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "offload/training/overlap_updates.h"
#include "offload/training/grad_reducer.h"
#include "offload/schedule/pipeline.h"
#include "offload/training/train_step.h"
#include "optim/optimizer.h"
#include "strata/comm.h"
#include "strata/engine.h"
#include "strata/storage.h"

namespace strata::offload {

constexpr uint64_t kChunkElems = 4096;
constexpr int kLayers = 6;

// Six trainable layers of one chunk each and a frozen one, fp32; the host
// holds a few chunks, the rest (the optimizer states first) live on NVMe
// behind a fault injector.
struct Model {
  FaultInjectingStorage* faults = nullptr;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<Pipeline> pipeline;
  std::unique_ptr<optim::Optimizer> optimizer;
  UpdateFence* fence = nullptr;  // the updates' (an asynchronous checkpoint)
  OverlapUpdates* overlap = nullptr;  // each layer's update begun as its backward moment ends
  std::function<void()> before_step;  // runs after backward, before the step
  std::vector<bool> skip;        // the steps' TrainStepOptions::skip: tensors left out

  // With `comm`, one rank of its group (the states sharded across them).
  // With `shard_params`, the params too (option comm.shard_params).
  // With `compute`, the engine's ComputeSeam: it runs instead of the update kernels.
  explicit Model(double max_grad_norm = 0.0, Communicator* comm = nullptr, bool shard_params = false,
                 uint32_t comm_timeout_ms = 60'000, ComputeSeam* compute = nullptr) {
    Options options;
    options.comm.timeout_ms = comm_timeout_ms;
    options.comm.shard_params = shard_params;
    options.device.backend = DeviceBackendKind::kEmulated;
    options.device.budget_bytes = 4 * kChunkElems * 4;
    options.host.budget_bytes = 16 * kChunkElems * 4;
    options.chunk.size_elems = kChunkElems;
    options.log_level = LogLevel::kWarning;
    options.optimizer.weight_decay = 0.01;
    options.optimizer.max_grad_norm = max_grad_norm;
    auto memory = CreateMemoryStorage(uint64_t{64} << 20);
    STRATA_CHECK(memory.ok());
    auto wrapped = std::make_unique<FaultInjectingStorage>(std::move(memory).value());
    faults = wrapped.get();
    options.nvme.capacity_bytes = uint64_t{64} << 20;
    auto created = Engine::Create(
        options, {.device = nullptr, .storage = std::move(wrapped), .comm = comm, .compute = compute});
    STRATA_CHECK(created.ok(), "{}", created.status().ToString());
    engine = std::move(created).value();
    for (int l = 0; l < kLayers; ++l) {
      const std::string name = "layer" + std::to_string(l);
      STRATA_CHECK(
          engine->RegisterTensor({name, {static_cast<int64_t>(kChunkElems)}, DType::kFloat32, true, name}).ok());
    }
    STRATA_CHECK(engine->RegisterTensor({"frozen", {64}, DType::kFloat32, false, "frozen"}).ok());
    STRATA_CHECK(engine->Finalize().ok());
    auto made = Pipeline::Create(*engine, {});
    STRATA_CHECK(made.ok(), "{}", made.status().ToString());
    pipeline = std::move(made).value();
    auto config = optim::OptimizerConfigFromOptions(options);
    STRATA_CHECK(config.ok());
    auto opt = optim::Optimizer::Create(*config);
    STRATA_CHECK(opt.ok());
    optimizer = std::move(opt).value();
  }

  std::vector<float> Read(int tensor, ChunkKind kind) {
    auto access = engine->Access(TensorId(tensor), kind, Tier::kHost);
    STRATA_CHECK(access.ok(), "{}", access.status().ToString());
    const float* data = static_cast<const float*>(access->data());
    return std::vector<float>(data, data + access->num_elements());
  }
  void Write(int tensor, ChunkKind kind, const std::vector<float>& values) {
    auto access = engine->Access(TensorId(tensor), kind, Tier::kHost);
    STRATA_CHECK(access.ok(), "{}", access.status().ToString());
    std::memcpy(access->data(), values.data(), values.size() * sizeof(float));
  }
  // Parameters sharded: this rank's range of `values` into the master shard.
  void WriteShard(int tensor, const std::vector<float>& values) {
    const ChunkInfo master = engine->chunks()[engine->ChunkOf(TensorId(tensor), ChunkKind::kMaster)->value()];
    auto access = engine->AccessChunk(master.id, Tier::kHost);
    STRATA_CHECK(access.ok(), "{}", access.status().ToString());
    std::memcpy(access->data(), values.data() + master.shard_offset_bytes / sizeof(float), master.used_bytes);
  }
  // Parameters sharded: the whole param chunk of `tensor`, gathered.
  std::vector<float> Gathered(int tensor, GradReducer& reducer) {
    const ChunkId param = *engine->ChunkOf(TensorId(tensor), ChunkKind::kParam);
    auto access = engine->AccessChunk(param, Tier::kDevice);
    STRATA_CHECK(access.ok(), "{}", access.status().ToString());
    const Status gathered = reducer.Gather(param, *access);
    STRATA_CHECK(gathered.ok(), "{}", gathered.ToString());
    const float* data = reinterpret_cast<const float*>(access->data());
    return std::vector<float>(data, data + kChunkElems);
  }
  // One iteration: a device moment per layer (as backward would), then the
  // step. With `reducer`, each layer's gradients are submitted to it as its
  // backward moment ends, and a transient param chunk is gathered by it.
  Result<TrainStepReport> Iteration(Communicator* comm = nullptr, GradReducer* reducer = nullptr) {
    STRATA_RETURN_IF_ERROR(pipeline->BeginIteration());
    Status backward = Status::Ok();
    for (int l = kLayers - 1; l >= 0 && backward.ok(); --l) {
      STRATA_RETURN_IF_ERROR(pipeline->BeginMoment());
      for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kGrad}) {
        if (!backward.ok()) break;
        const ChunkId chunk = *engine->ChunkOf(TensorId(l), kind);
        Result<ChunkAccess> access = pipeline->Access(chunk);
        backward = access.status();
        if (backward.ok() && engine->chunks()[chunk.value()].transient) backward = reducer->Gather(chunk, *access);
      }
      STRATA_RETURN_IF_ERROR(pipeline->EndMoment());
      if (backward.ok() && reducer != nullptr) {
        backward = reducer->Submit(*engine->ChunkOf(TensorId(l), ChunkKind::kGrad));
      }
      if (backward.ok() && overlap != nullptr) {
        backward = overlap->Begin(*engine->ChunkOf(TensorId(l), ChunkKind::kGrad)).status();
      }
    }
    if (backward.ok() && before_step) before_step();
    const TrainStepOptions options{.skip = skip, .comm = comm, .reducer = reducer, .fence = fence, .overlap = overlap};
    Result<TrainStepReport> report =
        backward.ok() ? RunTrainStep(*engine, *pipeline, *optimizer, options) : Result<TrainStepReport>(backward);
    const Status ended = pipeline->EndIteration();
    if (!report.ok()) return report;
    STRATA_RETURN_IF_ERROR(ended);
    return report;
  }
};

inline std::vector<float> Random(std::mt19937& rng, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(kChunkElems);
  for (float& x : v) x = normal(rng);
  return v;
}

// Runs `body(r, comm)` on every rank r of a loopback group of `world`, each
// on a thread of its own; returns once all have.
inline void OnRanks(int world, const std::function<void(int, Communicator&)>& body) {
  auto group = CreateLoopbackGroup(world, {.timeout_ms = 20'000});
  STRATA_CHECK(group.ok(), "{}", group.status().ToString());
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { body(r, *(*group)[r]); });
  for (std::thread& t : threads) t.join();
}

// Rank r's gradient for layer l at step k (the same on every call).
inline std::vector<float> RankGrad(int rank, int layer, int step) {
  std::mt19937 rng(static_cast<uint32_t>(1000 * rank + 10 * layer + step));
  return Random(rng, 0.1f);
}

}  // namespace strata::offload
