#include "offload/schedule/pipeline.h"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "test_util.h"

namespace strata::offload {
namespace {

constexpr uint64_t kChunkElems = 16384;  // 64 KiB fp32 chunks, one per layer

// An engine with one frozen fp32 tensor (one param chunk) per layer, a
// device holding `device_chunks` of them, copies throttled to imitate PCIe,
// and optionally an NVMe tier (memory storage behind a fault injector) that
// homes the layers the host budget does not hold.
struct LayerModel {
  FaultInjectingStorage* faults = nullptr;
  std::unique_ptr<Engine> engine;
  std::vector<ChunkId> layers;

  LayerModel(uint32_t num_layers, uint32_t device_chunks, uint32_t host_chunks = 64, bool nvme = false) {
    Options options;
    options.device.backend = DeviceBackendKind::kEmulated;
    options.device.budget_bytes = device_chunks * kChunkElems * 4;
    options.host.budget_bytes = host_chunks * kChunkElems * 4;
    options.chunk.size_elems = kChunkElems;
    options.device.emulated_bandwidth_gbps = 1.0;  // 64 KiB in ~66 us
    options.log_level = LogLevel::kWarning;
    EngineSeams seams;
    if (nvme) {
      auto memory = CreateMemoryStorage(uint64_t{64} << 20);
      STRATA_CHECK(memory.ok());
      auto wrapped = std::make_unique<FaultInjectingStorage>(std::move(memory).value());
      faults = wrapped.get();
      seams.storage = std::move(wrapped);
      options.nvme.capacity_bytes = uint64_t{64} << 20;
    }
    auto created = Engine::Create(options, std::move(seams));
    STRATA_CHECK(created.ok(), "{}", created.status().ToString());
    engine = std::move(created).value();
    for (uint32_t l = 0; l < num_layers; ++l) {
      auto id = engine->RegisterTensor(
          {"layer" + std::to_string(l), {static_cast<int64_t>(kChunkElems)}, DType::kFloat32, false, "layer" + std::to_string(l)});
      STRATA_CHECK(id.ok(), "{}", id.status().ToString());
    }
    STRATA_CHECK(engine->Finalize().ok());
    for (uint32_t l = 0; l < num_layers; ++l) layers.push_back(*engine->ChunkOf(TensorId(l), ChunkKind::kParam));
  }
};

void BusyFor(std::chrono::microseconds how_long) {
  const auto end = std::chrono::steady_clock::now() + how_long;
  while (std::chrono::steady_clock::now() < end) {
  }
}

// An event the test completes: a fence that keeps a chunk from moving
// (ChunkAccess::ReleaseAfter: the framework still reads it), or a gate an
// overlapped update waits at.
class Gate final : public Event {
 public:
  void Open() {
    {
      std::lock_guard lock(mu_);
      open_ = true;
    }
    opened_.notify_all();
  }
  Status Wait(uint32_t timeout_ms) override {
    std::unique_lock lock(mu_);
    if (!opened_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return open_; })) {
      return Timeout("test gate: still closed after {} ms", timeout_ms);
    }
    return Status::Ok();
  }
  bool Done() override {
    std::lock_guard lock(mu_);
    return open_;
  }

 private:
  std::mutex mu_;  // guards open_
  std::condition_variable opened_;
  bool open_ = false;
};

// Writes layer `l`'s pattern into its chunk, or checks it.
Status WriteOrCheck(ChunkAccess& access, uint32_t l, bool write) {
  uint32_t* words = reinterpret_cast<uint32_t*>(access.data());
  for (uint64_t i = 0; i < kChunkElems; i += write ? 1 : 997) {
    const uint32_t expected = l * 100000 + static_cast<uint32_t>(i);
    if (write) {
      words[i] = expected;
    } else if (words[i] != expected) {
      return Internal("layer {} word {} holds {}, not {}", l, i, words[i], expected);
    }
  }
  return Status::Ok();
}

// After forward and backward: one update (a host moment) per layer of
// `layers`, which the plan may move to the device when `device_seconds` is set.
struct Updates {
  std::vector<uint32_t> layers;
  std::optional<double> device_seconds;
};

// One iteration: forward over the layers, backward in reverse (or `order`);
// then `updates`. Each access checks the layer's bytes (written on the first
// iteration) and computes.
Status RunIteration(Pipeline& pipeline, const LayerModel& model, bool first, const std::vector<uint32_t>* order = nullptr,
                    const Updates* updates = nullptr) {
  STRATA_RETURN_IF_ERROR(pipeline.BeginIteration());
  std::vector<uint32_t> sequence;
  if (order != nullptr) {
    sequence = *order;
  } else {
    for (uint32_t l = 0; l < model.layers.size(); ++l) sequence.push_back(l);
    for (uint32_t l = static_cast<uint32_t>(model.layers.size()); l-- > 0;) sequence.push_back(l);
  }
  Status first_error;
  for (size_t m = 0; m < sequence.size(); ++m) {
    const uint32_t l = sequence[m];
    STRATA_RETURN_IF_ERROR(pipeline.BeginMoment(/*non_model_bytes=*/0));
    {  // the access is released before EndMoment, as the pipeline asks
      Result<ChunkAccess> access = pipeline.Access(model.layers[l]);
      if (access.ok()) {
        if (!first || m < sequence.size() / 2) STRATA_RETURN_IF_ERROR(WriteOrCheck(*access, l, first));
        BusyFor(std::chrono::microseconds(300));
      } else if (first_error.ok()) {
        first_error = access.status();
      }
    }
    STRATA_RETURN_IF_ERROR(pipeline.EndMoment());
  }
  for (uint32_t l : updates != nullptr ? updates->layers : std::vector<uint32_t>{}) {
    STRATA_ASSIGN_OR_RETURN(Tier where, pipeline.BeginHostMoment(updates->device_seconds));
    {  // the access is released before EndMoment, as the pipeline asks
      Result<ChunkAccess> access = pipeline.Access(model.layers[l]);
      if (access.ok()) {
        if (Result<Tier> tier = model.engine->ChunkTier(model.layers[l]); !tier.ok() || *tier != where) {
          return Internal("layer {} is updated on {} but its chunk is not there", l, TierName(where));
        }
        STRATA_RETURN_IF_ERROR(WriteOrCheck(*access, l, first));
        BusyFor(std::chrono::microseconds(300));
      } else if (first_error.ok()) {
        first_error = access.status();
      }
    }
    STRATA_RETURN_IF_ERROR(pipeline.EndMoment());
  }
  STRATA_RETURN_IF_ERROR(pipeline.EndIteration());
  return first_error;
}

TEST(PipelineTest, WarmUpRecordsThenIterationsFollowThePlan) {
  LayerModel model(/*num_layers=*/10, /*device_chunks=*/4);
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {}));
  ASSERT_OK(RunIteration(*pipeline, model, /*first=*/true));
  ASSERT_NE(pipeline->plan(), nullptr);
  ASSERT_NE(pipeline->trace(), nullptr);
  EXPECT_EQ(pipeline->trace()->moments.size(), 20u);
  EXPECT_EQ(pipeline->plan()->num_moments, 20u);
  EXPECT_GT(pipeline->plan()->prediction.fetches, 0u);
  for (int i = 0; i < 3; ++i) ASSERT_OK(RunIteration(*pipeline, model, /*first=*/false));
  PipelineStats stats = pipeline->stats();
  EXPECT_EQ(stats.iterations, 4u);
  EXPECT_EQ(stats.recordings, 1u);
  EXPECT_EQ(stats.planned_iterations, 3u);
  EXPECT_EQ(stats.divergences, 0u);
  EXPECT_EQ(stats.stall_per_moment.size(), 20u);
  // Chunks of one size: the device follows the plan exactly once in step.
  EXPECT_EQ(stats.demand_fetches, 0u);
  EXPECT_EQ(stats.forced_evictions, 0u);
  EXPECT_EQ(stats.reconciled, 0u);
  EXPECT_GT(stats.bytes[static_cast<int>(Link::kHostToDevice)], 0u);
  nlohmann::json json = nlohmann::json::parse(pipeline->StatsJson());
  EXPECT_EQ(json["planned_iterations"].get<uint64_t>(), 3u);
  EXPECT_TRUE(json.contains("stall_fraction"));
}

// 40 layers, a host of 32 (four of them kept for staging reads, two as
// slack): layers 0-25, homed on the host, run forward and backward on a
// 4-chunk device; 26-39, homed on NVMe, are updated on the host after backward.
constexpr uint32_t kStepDeviceLayers = 26, kStepLayers = 40, kStepUpdates = kStepLayers - kStepDeviceLayers;
struct StepModel {
  LayerModel model{kStepLayers, /*device_chunks=*/4, /*host_chunks=*/32, /*nvme=*/true};
  std::vector<uint32_t> device_order;
  Updates updates;
  StepModel() {
    for (uint32_t l = 0; l < kStepDeviceLayers; ++l) device_order.push_back(l);
    for (uint32_t l = kStepDeviceLayers; l-- > 0;) device_order.push_back(l);
    for (uint32_t l = kStepDeviceLayers; l < kStepLayers; ++l) updates.layers.push_back(l);
  }
  Status Run(Pipeline& pipeline, bool first) { return RunIteration(pipeline, model, first, &device_order, &updates); }
};

TEST(PipelineTest, HostUpdatesReadTheirNvmeChunksAheadAndWriteThemBack) {
  StepModel step;
  ASSERT_EQ(step.model.engine->host_staging_bytes(), 4 * kChunkElems * 4);
  for (uint32_t l : step.updates.layers) ASSERT_EQ(*step.model.engine->ChunkHome(step.model.layers[l]), Tier::kNvme);
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*step.model.engine, {}));
  ASSERT_OK(step.Run(*pipeline, true));
  const Plan* plan = pipeline->plan();
  ASSERT_NE(plan, nullptr);
  ASSERT_EQ(plan->num_moments, 2 * kStepDeviceLayers + kStepUpdates);
  // Each update's chunk is read once, before the moment that needs it; more
  // of them during forward and backward than the staging memory holds (four
  // chunks): the host slots of the four on the device hold them too.
  uint32_t reads = 0, ahead = 0, in_forward_backward = 0;
  for (uint32_t k = 0; k < plan->num_moments; ++k) {
    for (const PlannedRead& r : plan->host_reads_at[k]) {
      reads++;
      EXPECT_EQ(r.needed, 2 * kStepDeviceLayers + (r.chunk.value() - step.model.layers[kStepDeviceLayers].value()));
      if (k < r.needed) ahead++;
      if (k < 2 * kStepDeviceLayers) in_forward_backward++;
    }
  }
  EXPECT_EQ(reads, kStepUpdates);
  EXPECT_GE(ahead, kStepUpdates / 2);
  EXPECT_GT(in_forward_backward, 4u);
  ASSERT_OK(step.Run(*pipeline, false));  // the first replayed iteration: the device and host put in step
  std::array<uint64_t, kNumLinks> moved = {};
  for (int i = 0; i < 3; ++i) {
    ASSERT_OK(step.Run(*pipeline, false));  // every byte checked
    for (int l = 0; l < kNumLinks; ++l) moved[l] += pipeline->stats().bytes[l];
  }
  PipelineStats stats = pipeline->stats();
  EXPECT_EQ(stats.planned_iterations, 4u);
  EXPECT_EQ(stats.divergences, 0u);
  EXPECT_EQ(stats.demand_fetches, 0u);
  EXPECT_EQ(stats.forced_evictions, 0u);
  // Each update's chunk read and written once an iteration. Reads ahead and
  // write-backs run beside the moments, and an iteration counts the bytes
  // moved between its BeginIteration and EndIteration: the write-backs of its
  // last updates, and reads ahead of the next, may end after it ends (under
  // load, all of them), counted in the iteration next to it or in none. So
  // the three together, within one iteration's update chunks.
  const double chunk = kChunkElems * 4;
  EXPECT_NEAR(moved[static_cast<int>(Link::kNvmeRead)], 3 * kStepUpdates * chunk, kStepUpdates * chunk);
  EXPECT_NEAR(moved[static_cast<int>(Link::kNvmeWrite)], 3 * kStepUpdates * chunk, kStepUpdates * chunk);
}

// Word i of layer l's chunk at version v.
uint32_t Word(uint32_t l, uint64_t i, uint32_t v) { return l * 100000 + static_cast<uint32_t>(i) + v; }

Status CheckVersion(const ChunkAccess& access, uint32_t l, uint32_t v) {
  const uint32_t* words = reinterpret_cast<const uint32_t*>(access.data());
  for (uint64_t i = 0; i < kChunkElems; i += 991) {
    if (words[i] != Word(l, i, v)) return Internal("layer {} word {} holds {}, not version {}", l, i, words[i], v);
  }
  return Status::Ok();
}

void WriteVersion(ChunkAccess& access, uint32_t l, uint32_t v) {
  uint32_t* words = reinterpret_cast<uint32_t*>(access.data());
  for (uint64_t i = 0; i < kChunkElems; ++i) words[i] = Word(l, i, v);
}

// Layers 0..3 compute on the device, forward and backward; as soon as
// layer l's backward is done, its update runs beside the rest of backward:
// it moves layer l and its state (layer 4 + l) to the next version. Every
// access checks the version it should see. `overlapped` counts the updates
// that saw the training loop begin the next moment while they computed.
struct OverlapStep {
  static constexpr uint32_t kLayers = 4;
  LayerModel model;
  std::atomic<uint32_t> begun{0};
  uint32_t overlapped = 0;

  explicit OverlapStep(bool nvme) : model(2 * kLayers, /*device_chunks=*/2, /*host_chunks=*/nvme ? 4 : 64, nvme) {}

  Status DeviceMoment(Pipeline& pipeline, uint32_t l, uint32_t version, bool write) {
    STRATA_RETURN_IF_ERROR(pipeline.BeginMoment());
    begun++;
    {
      STRATA_ASSIGN_OR_RETURN(ChunkAccess access, pipeline.Access(model.layers[l]));
      if (write) {
        WriteVersion(access, l, version);
      } else {
        STRATA_RETURN_IF_ERROR(CheckVersion(access, l, version));
      }
      BusyFor(std::chrono::microseconds(300));
    }
    return pipeline.EndMoment();
  }

  Status Run(Pipeline& pipeline, uint32_t version) {
    STRATA_RETURN_IF_ERROR(pipeline.BeginIteration());
    for (uint32_t l = 0; l < kLayers; ++l) STRATA_RETURN_IF_ERROR(DeviceMoment(pipeline, l, version, version == 0));
    std::vector<std::shared_future<Status>> updates;
    std::atomic<uint32_t> seen{0};
    for (uint32_t l = kLayers; l-- > 0;) {
      STRATA_RETURN_IF_ERROR(DeviceMoment(pipeline, l, version, false));
      const uint32_t next_moment = begun.load() + 1;
      const bool last = l == 0;
      STRATA_ASSIGN_OR_RETURN(
          std::shared_future<Status> done,
          pipeline.RunOverlapped({model.layers[l], model.layers[kLayers + l]}, std::nullopt,
                             [&, l, next_moment, last](Tier where, std::vector<ChunkAccess>& held) -> Status {
                               if (where != Tier::kHost) return Internal("an update ran on {}", TierName(where));
                               const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
                               while (!last && begun.load() < next_moment && std::chrono::steady_clock::now() < deadline) {
                               }
                               if (!last && begun.load() >= next_moment) seen++;
                               for (uint32_t k : {0u, 1u}) {
                                 const uint32_t layer = k == 0 ? l : kLayers + l;
                                 // A state is written on the first iteration, as forward writes the layers.
                                 if (k == 0 || version > 0) STRATA_RETURN_IF_ERROR(CheckVersion(held[k], layer, version));
                                 WriteVersion(held[k], layer, version + 1);
                               }
                               return Status::Ok();
                             }));
      updates.push_back(done);
    }
    Status first;
    for (const std::shared_future<Status>& u : updates) {
      const Status s = u.get();
      if (first.ok()) first = s;
    }
    overlapped = seen.load();
    const Status ended = pipeline.EndIteration();
    return first.ok() ? ended : first;
  }
};

TEST(PipelineTest, OverlappedUpdatesRunWhileItGoesOnAndTheirChunksWaitForThem) {
  for (bool nvme : {false, true}) {
    SCOPED_TRACE(nvme ? "states on NVMe" : "states on the host");
    OverlapStep step(nvme);
    if (nvme) {
      ASSERT_EQ(*step.model.engine->ChunkHome(step.model.layers.back()), Tier::kNvme);
    }
    ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*step.model.engine, {.wait_timeout_ms = 10'000}));
    for (uint32_t version = 0; version < 5; ++version) {
      ASSERT_OK(step.Run(*pipeline, version));  // every version checked where it is read
      EXPECT_EQ(step.overlapped, OverlapStep::kLayers - 1) << "iteration " << version;
    }
    const Trace* trace = pipeline->trace();
    ASSERT_NE(trace, nullptr);
    ASSERT_EQ(trace->moments.size(), 3 * OverlapStep::kLayers);
    EXPECT_TRUE(trace->moments[OverlapStep::kLayers + 1].overlap);
    EXPECT_GT(trace->moments[OverlapStep::kLayers + 1].compute_seconds, 0.0);  // measured on the update's thread
    const PipelineStats stats = pipeline->stats();
    EXPECT_EQ(stats.divergences, 0u);
    EXPECT_GE(stats.planned_iterations, 3u);
  }
}

TEST(PipelineTest, CreateOnAClosedEngineSaysTheEngineIsClosed) {
  LayerModel model(2, /*device_chunks=*/2);
  ASSERT_OK(model.engine->Close());
  Result<std::unique_ptr<Pipeline>> refused = Pipeline::Create(*model.engine, {});
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("the engine is closed"), std::string::npos) << refused.status().ToString();
  EXPECT_EQ(refused.status().message().find("not finalized"), std::string::npos) << refused.status().ToString();
}

TEST(PipelineTest, AnOverlappedUpdateOfAChunkThatDoesNotExistIsRefusedBeforeItBegins) {
  LayerModel model(2, /*device_chunks=*/2);
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {}));
  ASSERT_OK(pipeline->BeginIteration());
  bool ran = false;
  Result<std::shared_future<Status>> refused =
      pipeline->RunOverlapped({ChunkId(999)}, std::nullopt, [&](Tier, std::vector<ChunkAccess>&) {
        ran = true;
        return Status::Ok();
      });
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("999"), std::string::npos) << refused.status().ToString();
  EXPECT_FALSE(ran);
  ASSERT_OK(pipeline->BeginMoment());  // no moment was left open
  ASSERT_OK(pipeline->EndMoment());
  ASSERT_OK(pipeline->EndIteration());
}

TEST(PipelineTest, FailedNvmeReadAheadOfAnUpdateSurfacesAtTheUpdatesAccess) {
  StepModel step;
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*step.model.engine, {.wait_timeout_ms = 10'000}));
  ASSERT_OK(step.Run(*pipeline, true));
  ASSERT_OK(step.Run(*pipeline, false));
  step.model.faults->FailReads(EIO, 1);  // only the updates' chunks are read from NVMe
  Status status = step.Run(*pipeline, false);
  EXPECT_EQ(status.code(), StatusCode::kIoError) << status.ToString();
  EXPECT_NE(status.message().find("prefetching chunk"), std::string::npos) << status.ToString();
  ASSERT_OK(step.Run(*pipeline, false));  // nothing lost
}

TEST(PipelineTest, FailedWriteBackAfterAnUpdateIsReportedAndLosesNothing) {
  StepModel step;
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*step.model.engine, {.wait_timeout_ms = 10'000}));
  ASSERT_OK(step.Run(*pipeline, true));
  ASSERT_OK(step.Run(*pipeline, false));
  // Only the updates' chunks are written to NVMe: the first write-back fails.
  step.model.faults->FailWrites(EIO, 1);
  Status status = step.Run(*pipeline, false);
  EXPECT_EQ(status.code(), StatusCode::kIoError) << status.ToString();
  EXPECT_NE(status.message().find("back to NVMe after its host moment"), std::string::npos) << status.ToString();
  ASSERT_OK(step.Run(*pipeline, false));  // the chunk kept its update on the host: every byte checks
  ASSERT_OK(step.Run(*pipeline, false));
}

TEST(PipelineTest, AnUpdateMovesToTheDeviceWhenItsChunksFitThere) {
  LayerModel model(4, /*device_chunks=*/8);
  const std::vector<uint32_t> order = {0, 1, 1, 0};
  const Updates updates{.layers = {2, 3}, .device_seconds = 1e-4};
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {}));
  ASSERT_OK(RunIteration(*pipeline, model, true, &order, &updates));  // on the host while recording
  EXPECT_EQ(pipeline->plan()->compute_tier, (std::vector<Tier>{Tier::kDevice, Tier::kDevice, Tier::kDevice,
                                                                Tier::kDevice, Tier::kDevice, Tier::kDevice}));
  for (int i = 0; i < 2; ++i) ASSERT_OK(RunIteration(*pipeline, model, false, &order, &updates));  // checks the tier
  EXPECT_EQ(pipeline->stats().divergences, 0u);
  EXPECT_EQ(pipeline->stats().bytes[static_cast<int>(Link::kHostToDevice)], 0u);  // they stay there
  // Without a device time the plan keeps them on the host.
  const Updates host_only{.layers = {2, 3}};
  ASSERT_OK(RunIteration(*pipeline, model, false, &order, &host_only));
  ASSERT_OK(RunIteration(*pipeline, model, false, &order, &host_only));
  EXPECT_EQ(pipeline->plan()->compute_tier[4], Tier::kHost);
}

TEST(PipelineTest, ADifferentSequenceFallsBackOnDemandAndIsRecordedAgain) {
  LayerModel model(8, 3);
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {}));
  ASSERT_OK(RunIteration(*pipeline, model, true));
  ASSERT_OK(RunIteration(*pipeline, model, false));
  // An evaluation pass: forward only, in another order. No error.
  const std::vector<uint32_t> eval = {0, 2, 1, 3, 4, 5, 6, 7};
  ASSERT_OK(RunIteration(*pipeline, model, false, &eval));
  EXPECT_EQ(pipeline->stats().divergences, 1u);
  // The next iteration records the new sequence; the one after follows it.
  ASSERT_OK(RunIteration(*pipeline, model, false, &eval));
  EXPECT_EQ(pipeline->stats().recordings, 2u);
  ASSERT_OK(RunIteration(*pipeline, model, false, &eval));
  EXPECT_EQ(pipeline->stats().divergences, 1u);
  EXPECT_EQ(pipeline->stats().planned_iterations, 2u);
  EXPECT_EQ(pipeline->plan()->num_moments, 8u);
}

TEST(PipelineTest, FailedNvmeReadDuringPrefetchSurfacesAtTheAccessThatNeedsIt) {
  // Two layers fit on the host: the rest are homed on NVMe.
  LayerModel model(8, /*device_chunks=*/3, /*host_chunks=*/2, /*nvme=*/true);
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {.wait_timeout_ms = 10'000}));
  ASSERT_OK(RunIteration(*pipeline, model, true));
  ASSERT_OK(RunIteration(*pipeline, model, false));
  model.faults->FailReads(EIO, 1);
  const auto start = std::chrono::steady_clock::now();
  Status status = RunIteration(*pipeline, model, false);
  EXPECT_EQ(status.code(), StatusCode::kIoError) << status.ToString();
  EXPECT_NE(status.message().find("prefetching chunk"), std::string::npos) << status.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));  // an error, not a hang
  // The chunk was not lost: the next iteration reads every layer intact.
  ASSERT_OK(RunIteration(*pipeline, model, false));
}

TEST(PipelineTest, FailedNvmeWriteDuringAnIterationIsReportedAndLosesNothing) {
  LayerModel model(8, /*device_chunks=*/3, /*host_chunks=*/2, /*nvme=*/true);
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {.wait_timeout_ms = 10'000}));
  ASSERT_OK(RunIteration(*pipeline, model, true));
  ASSERT_OK(RunIteration(*pipeline, model, false));
  // The next write to NVMe fails: a planned eviction of an NVMe-homed layer
  // (reported by EndIteration), or the host making room for a staging read
  // (reported by the access that needed the staged chunk), whichever writes
  // first. Either way the iteration returns the error.
  model.faults->FailWrites(EIO, 1);
  Status status = RunIteration(*pipeline, model, false);
  EXPECT_EQ(status.code(), StatusCode::kIoError) << status.ToString();
  EXPECT_NE(status.message().find("injected fault: write"), std::string::npos) << status.ToString();
  ASSERT_OK(RunIteration(*pipeline, model, false));  // every layer intact
}

TEST(PipelineTest, DestroyingItWithTransfersQueuedNeitherHangsNorLosesData) {
  LayerModel model(8, 3, /*host_chunks=*/2, /*nvme=*/true);
  {
    ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {}));
    ASSERT_OK(RunIteration(*pipeline, model, true));
    ASSERT_OK(pipeline->BeginIteration());  // reconciliation and moment 0's moves queued
    ASSERT_OK(pipeline->BeginMoment());
    ASSERT_OK(pipeline->EndMoment());
  }
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {}));
  ASSERT_OK(RunIteration(*pipeline, model, false));  // a new pipeline finds every layer intact
}

TEST(PipelineTest, ActivationsFindTheirRoomFreeWhenTheMomentBegins) {
  // Four chunk slots; the backward moments' activations take two of them.
  LayerModel model(6, /*device_chunks=*/4);
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {}));
  const uint64_t budget = model.engine->options().device.budget_bytes;
  const uint64_t activations = 2 * kChunkElems * 4;
  for (int it = 0; it < 4; ++it) {
    ASSERT_OK(pipeline->BeginIteration());
    for (int pass = 0; pass < 2; ++pass) {
      for (uint32_t i = 0; i < model.layers.size(); ++i) {
        const uint32_t l = pass == 0 ? i : static_cast<uint32_t>(model.layers.size()) - 1 - i;
        const uint64_t non_model = pass == 1 ? activations : 0;
        ASSERT_OK(pipeline->BeginMoment(non_model));
        if (it > 0) {  // replayed: the plan's room is free now
          EXPECT_LE(model.engine->stats().tiers[static_cast<int>(Tier::kDevice)].used_bytes + non_model, budget)
              << "iteration " << it << " moment " << pass * model.layers.size() + i;
        }
        ASSERT_OK(pipeline->Access(model.layers[l]).status());
        ASSERT_OK(pipeline->EndMoment());
      }
    }
    ASSERT_OK(pipeline->EndIteration());
  }
  EXPECT_EQ(pipeline->stats().planned_iterations, 3u);
}

TEST(PipelineTest, WithoutAdaptiveItNeverPlans) {
  LayerModel model(6, 3);
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {.policy = Policy::kOnDemand}));
  ASSERT_OK(RunIteration(*pipeline, model, true));
  ASSERT_OK(RunIteration(*pipeline, model, false));
  EXPECT_EQ(pipeline->plan(), nullptr);
  EXPECT_EQ(pipeline->stats().recordings, 0u);
  EXPECT_EQ(pipeline->stats().planned_iterations, 0u);
  // Every access moved its layer on demand, inside the access: the stall is
  // the host->device link's, at least the throttled copies' time for the
  // bytes it moved (1 GB/s, LayerModel), and no NVMe link is charged (there is none).
  const PipelineStats stats = pipeline->stats();
  EXPECT_GT(stats.demand_fetches, 0u);
  const double copy_seconds = static_cast<double>(stats.bytes[static_cast<int>(Link::kHostToDevice)]) / 1e9;
  EXPECT_GT(copy_seconds, 0);
  EXPECT_GE(stats.stall_per_link[static_cast<int>(Link::kHostToDevice)], copy_seconds);
  EXPECT_EQ(stats.stall_per_link[static_cast<int>(Link::kNvmeRead)], 0);
  EXPECT_EQ(stats.stall_per_link[static_cast<int>(Link::kNvmeWrite)], 0);
  EXPECT_TRUE(nlohmann::json::parse(pipeline->StatsJson()).contains("stall_seconds_per_link"));
}

TEST(PipelineTest, StaticPolicyKeepsItsShareOnTheDeviceAndMovesTheSameEveryIteration) {
  LayerModel model(8, /*device_chunks=*/6);
  const std::vector<uint32_t> order = {0, 1, 2, 3, 4, 5, 6, 7, 7, 6, 5, 4, 3, 2, 1, 0};
  const Updates updates{.layers = {1, 6}};  // a CPU update of a kept layer and of another
  ASSERT_OK_AND_ASSIGN(auto pipeline,
                       Pipeline::Create(*model.engine, {.policy = Policy::kStatic, .static_device_params = 0.5}));
  std::vector<std::array<uint64_t, kNumLinks>> bytes;
  for (int it = 0; it < 4; ++it) {
    ASSERT_OK(RunIteration(*pipeline, model, it == 0, &order, &updates));  // layer 1 on the host while updated
    for (uint32_t l = 0; l < 4; ++l) EXPECT_EQ(*model.engine->ChunkTier(model.layers[l]), Tier::kDevice) << l;
    bytes.push_back(pipeline->stats().bytes);
  }
  EXPECT_EQ(pipeline->plan(), nullptr);
  EXPECT_EQ(pipeline->stats().recordings, 0u);
  EXPECT_EQ(bytes[2], bytes[3]);  // no surprises
  // Layers 0-3 never leave but for layer 1's update: 1 down, 1 up per iteration;
  // layers 4-7 (8 uses, 2 free slots) move on demand.
  EXPECT_GE(bytes[3][static_cast<int>(Link::kHostToDevice)], 5 * kChunkElems * 4);
  nlohmann::json json = nlohmann::json::parse(pipeline->StatsJson());
  EXPECT_EQ(json["policy"].get<std::string>(), "static");
  // A share that leaves no room to move the rest through is refused.
  Result<std::unique_ptr<Pipeline>> greedy =
      Pipeline::Create(*model.engine, {.policy = Policy::kStatic, .static_device_params = 0.9});
  EXPECT_EQ(greedy.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(greedy.status().message().find("placement.device_params"), std::string::npos) << greedy.status().ToString();
  // The options give the policy and the share.
  Options options;
  ASSERT_OK(SetOption(options, "placement.policy", "static"));
  ASSERT_OK(SetOption(options, "placement.device_params", "0.25"));
  EXPECT_EQ(PipelineOptionsOf(options).policy, Policy::kStatic);
  EXPECT_EQ(PipelineOptionsOf(options).static_device_params, 0.25);
  EXPECT_EQ(SetOption(options, "placement.policy", "lru").code(), StatusCode::kInvalidArgument);
}

TEST(PipelineTest, CallsOutOfOrderAreInvalidArgument) {
  LayerModel model(2, 2);
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {}));
  ASSERT_OK(pipeline->BeginIteration());
  EXPECT_EQ(pipeline->Access(model.layers[0]).status().code(), StatusCode::kInvalidArgument);
  ASSERT_OK(pipeline->BeginMoment());
  EXPECT_EQ(pipeline->BeginMoment().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pipeline->Access(ChunkId(99)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(pipeline->EndIteration().code(), StatusCode::kInvalidArgument);
  ASSERT_OK(pipeline->EndMoment());
  EXPECT_EQ(pipeline->EndMoment().code(), StatusCode::kInvalidArgument);
  ASSERT_OK(pipeline->EndIteration());
  EXPECT_EQ(Pipeline::Create(*model.engine, {.wait_timeout_ms = 0}).status().code(), StatusCode::kInvalidArgument);
}

// Random sequences repeated over iterations (and changed now and then):
// every layer keeps its bytes (RunIteration checks them) with NVMe in play.
TEST(PipelineTest, RandomSequencesKeepEveryByte) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  LayerModel model(9, 3, /*host_chunks=*/4, /*nvme=*/true);
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {}));
  ASSERT_OK(RunIteration(*pipeline, model, true));
  std::vector<uint32_t> sequence;
  for (int i = 0; i < 12; ++i) {
    if (i % 4 == 0) {
      sequence.clear();
      for (int m = 0; m < 15; ++m) sequence.push_back(static_cast<uint32_t>(rng() % model.layers.size()));
    }
    SCOPED_TRACE("iteration " + std::to_string(i));
    ASSERT_OK(RunIteration(*pipeline, model, false, &sequence));
  }
  EXPECT_GE(pipeline->stats().planned_iterations, 6u);
}

// Random steps (device moments with activations, then CPU updates), each
// repeated over several iterations: every byte kept, and whenever an
// iteration follows its plan, a moment's chunks on the device and its
// activations fit in the device budget when the moment begins.
TEST(PipelineTest, RandomStepsKeepEveryByteAndTheDeviceBudget) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  LayerModel model(12, /*device_chunks=*/5, /*host_chunks=*/8, /*nvme=*/true);
  const uint64_t chunk = kChunkElems * 4;
  const uint64_t budget = model.engine->options().device.budget_bytes;
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {}));
  std::vector<bool> written(model.layers.size(), false);
  for (int round = 0; round < 4; ++round) {
    struct Step {
      uint32_t layer;
      uint64_t activations;
      bool on_host;
    };
    std::vector<Step> steps;
    for (int m = 0; m < 12; ++m) {
      steps.push_back({static_cast<uint32_t>(rng() % model.layers.size()), (rng() % 3) * chunk, false});
    }
    for (int m = 0; m < 3; ++m) steps.push_back({static_cast<uint32_t>(rng() % model.layers.size()), 0, true});
    for (int it = 0; it < 4; ++it) {
      SCOPED_TRACE("round " + std::to_string(round) + " iteration " + std::to_string(it));
      ASSERT_OK(pipeline->BeginIteration());
      const uint64_t planned = pipeline->stats().planned_iterations;
      std::vector<std::string> over_budget;  // checked once the iteration says whether it followed a plan
      for (size_t m = 0; m < steps.size(); ++m) {
        const Step& step = steps[m];
        if (step.on_host) {
          ASSERT_OK(pipeline->BeginHostMoment().status());
        } else {
          ASSERT_OK(pipeline->BeginMoment(step.activations));
          const uint64_t used = model.engine->stats().tiers[static_cast<int>(Tier::kDevice)].used_bytes;
          if (used + step.activations > budget) {
            over_budget.push_back(fmt::format("moment {}: {} of chunks and {} of activations", m, used, step.activations));
          }
        }
        {
          ASSERT_OK_AND_ASSIGN(ChunkAccess access, pipeline->Access(model.layers[step.layer]));
          ASSERT_OK(WriteOrCheck(access, step.layer, !written[step.layer]));
          written[step.layer] = true;
        }
        ASSERT_OK(pipeline->EndMoment());
      }
      ASSERT_OK(pipeline->EndIteration());
      if (pipeline->stats().planned_iterations > planned) {
        EXPECT_TRUE(over_budget.empty()) << fmt::format("{}", fmt::join(over_budget, "; "));
      }
      EXPECT_LE(model.engine->stats().tiers[static_cast<int>(Tier::kHost)].peak_bytes,
                model.engine->options().host.budget_bytes);
    }
  }
  EXPECT_GE(pipeline->stats().planned_iterations, 8u);
}

// Note [Waits on queued moves] in pipeline_impl.h: a move that does not end
// within the pipeline's wait is a Timeout naming the chunk, the move and the
// time waited, never taken as done.
constexpr uint32_t kShortWaitMs = 200;

bool Names(const Status& status, const std::string& what) {
  return status.message().find(what) != std::string::npos;
}

// An overlapped update that outlasts the wait: the access of its chunk
// and the chunk's write-back behind it fail, and once the update ends the
// chunk holds what it wrote.
TEST(PipelineTest, AnOverlappedUpdateThatOutlastsTheWaitFailsWhatWaitsForItAndLosesNothing) {
  LayerModel model(4, /*device_chunks=*/2, /*host_chunks=*/2, /*nvme=*/true);
  const uint32_t l = 1;
  const ChunkId chunk = model.layers[l];
  ASSERT_EQ(*model.engine->ChunkHome(chunk), Tier::kNvme);  // written back after its update
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {.wait_timeout_ms = kShortWaitMs}));
  Gate gate;
  ASSERT_OK(pipeline->BeginIteration());
  ASSERT_OK_AND_ASSIGN(
      std::shared_future<Status> update,
      pipeline->RunOverlapped({chunk}, std::nullopt, [&](Tier, std::vector<ChunkAccess>& held) -> Status {
        STRATA_RETURN_IF_ERROR(gate.Wait(10'000));
        WriteVersion(held[0], l, 1);
        return Status::Ok();
      }));
  ASSERT_OK(pipeline->BeginHostMoment().status());
  const auto start = std::chrono::steady_clock::now();
  Status accessed = pipeline->Access(chunk).status();
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(kShortWaitMs));
  EXPECT_EQ(accessed.code(), StatusCode::kTimeout) << accessed.ToString();
  EXPECT_TRUE(Names(accessed, fmt::format("the overlapped update of chunk {} did not finish within {} ms",
                                          chunk.value(), kShortWaitMs)))
      << accessed.ToString();
  ASSERT_OK(pipeline->EndMoment());
  std::this_thread::sleep_for(std::chrono::milliseconds(5 * kShortWaitMs));  // the write-back's wait runs out too
  gate.Open();
  ASSERT_OK(update.get());
  const Status ended = pipeline->EndIteration();
  EXPECT_EQ(ended.code(), StatusCode::kTimeout) << ended.ToString();
  EXPECT_TRUE(Names(ended, fmt::format("writing chunk {} back to NVMe after its host moment: pipeline: the last move "
                                       "or update of chunk {} did not finish within {} ms",
                                       chunk.value(), chunk.value(), kShortWaitMs)))
      << ended.ToString();
  // The chunk holds the update, wherever it is read: on the host where the
  // write-back left it, then back from NVMe after a write-back that ran.
  for (int it = 0; it < 3; ++it) {
    SCOPED_TRACE("iteration " + std::to_string(it));
    ASSERT_OK(pipeline->BeginIteration());
    ASSERT_OK(pipeline->BeginHostMoment().status());
    {
      ASSERT_OK_AND_ASSIGN(ChunkAccess access, pipeline->Access(chunk));
      ASSERT_OK(CheckVersion(access, l, 1));
    }
    ASSERT_OK(pipeline->EndMoment());
    ASSERT_OK(pipeline->EndIteration());
  }
}

// A replayed moment whose room for activations is not free in time does not
// begin: the chunk it waited for cannot leave the device (the framework has
// not let it go), and BeginMoment says which and how long it waited.
TEST(PipelineTest, RoomNotMadeInTimeFailsTheMomentAndLosesNothing) {
  LayerModel model(6, /*device_chunks=*/4);
  const auto n = static_cast<uint32_t>(model.layers.size());
  const uint64_t activations = 2 * kChunkElems * 4;  // in backward
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {.wait_timeout_ms = kShortWaitMs}));
  const auto layer_at = [n](uint32_t m) { return m < n ? m : 2 * n - 1 - m; };
  // One iteration, forward then backward, writing each layer (`first`) or
  // checking it; the access of moment `fenced` is let go after `gate`. Stops
  // at the first error, with the iteration ended.
  const auto run = [&](bool first, std::optional<uint32_t> fenced, std::shared_ptr<Gate> gate) -> Status {
    STRATA_RETURN_IF_ERROR(pipeline->BeginIteration());
    Status status = Status::Ok();
    for (uint32_t m = 0; m < 2 * n && status.ok(); ++m) {
      status = pipeline->BeginMoment(m < n ? 0 : activations);
      if (!status.ok()) break;
      {
        Result<ChunkAccess> access = pipeline->Access(model.layers[layer_at(m)]);
        status = access.status();
        if (status.ok() && (first ? m < n : true)) status = WriteOrCheck(*access, layer_at(m), first && m < n);
        if (status.ok() && fenced == m) access->ReleaseAfter(gate);
      }
      const Status ended = pipeline->EndMoment();
      if (status.ok()) status = ended;
    }
    if (gate != nullptr) gate->Open();
    const Status ended = pipeline->EndIteration();
    return status.ok() ? ended : status;
  };
  ASSERT_OK(run(true, std::nullopt, nullptr));
  ASSERT_OK(run(false, std::nullopt, nullptr));
  // A moment k whose room the plan makes by evicting a layer used before it,
  // last at moment j: the access of moment j is let go after a closed gate.
  const Plan* plan = pipeline->plan();
  ASSERT_NE(plan, nullptr);
  std::optional<uint32_t> k, j;
  for (uint32_t m = 1; m < 2 * n && !k; ++m) {
    for (ChunkId evicted : plan->evictions_at[m]) {
      for (uint32_t before = m; before-- > 0 && !k;) {
        if (model.layers[layer_at(before)] == evicted) k = m, j = before;
      }
    }
  }
  ASSERT_TRUE(k.has_value()) << "no moment's room is made by evicting a layer used before it";
  const Status status = run(false, *j, std::make_shared<Gate>());
  EXPECT_EQ(status.code(), StatusCode::kTimeout) << status.ToString();
  EXPECT_TRUE(Names(status, fmt::format("making room on the device for moment {}: pipeline: the eviction of chunk {} "
                                        "did not finish within {} ms",
                                        *k, model.layers[layer_at(*j)].value(), kShortWaitMs)))
      << status.ToString();
  for (int it = 0; it < 3; ++it) ASSERT_OK(run(false, std::nullopt, nullptr));  // every layer intact
  EXPECT_GE(pipeline->stats().planned_iterations, 1u);
}

// A fetch queued behind an overlapped update of its chunk that
// outlasts the wait moves nothing, and the access that needs the chunk says
// why; the update's bytes are kept.
TEST(PipelineTest, AFetchBehindAnUpdateThatOutlastsTheWaitFailsItsAccessAndLosesNothing) {
  LayerModel model(2, /*device_chunks=*/2);
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {.wait_timeout_ms = kShortWaitMs}));
  // Forward 0 1, backward 1 with layer 1's update beside it, backward 0, and
  // layer 1 again (a fetch the plan queues behind the update). Layer 1 is at
  // `version`, and the update moves it on; `gate`: where the update waits.
  const auto run = [&](uint32_t version, Gate* gate) -> Status {
    STRATA_RETURN_IF_ERROR(pipeline->BeginIteration());
    const auto device_moment = [&](uint32_t l, uint32_t v) -> Status {
      STRATA_RETURN_IF_ERROR(pipeline->BeginMoment());
      Status status = Status::Ok();
      {
        Result<ChunkAccess> access = pipeline->Access(model.layers[l]);
        status = access.status();
        if (status.ok() && version == 0 && v == 0) WriteVersion(*access, l, 0);
        if (status.ok()) status = CheckVersion(*access, l, v);
      }
      const Status ended = pipeline->EndMoment();
      return status.ok() ? ended : status;
    };
    Status status = Status::Ok();
    for (uint32_t l : {0u, 1u, 1u}) {
      if (status.ok()) status = device_moment(l, l == 0 ? 0 : version);
    }
    std::optional<std::shared_future<Status>> update;
    if (status.ok()) {
      Result<std::shared_future<Status>> begun = pipeline->RunOverlapped(
          {model.layers[1]}, std::nullopt, [&, version, gate](Tier, std::vector<ChunkAccess>& held) -> Status {
            if (gate != nullptr) STRATA_RETURN_IF_ERROR(gate->Wait(10'000));
            STRATA_RETURN_IF_ERROR(CheckVersion(held[0], 1, version));
            WriteVersion(held[0], 1, version + 1);
            return Status::Ok();
          });
      status = begun.status();
      if (begun.ok()) update = *begun;
    }
    if (status.ok()) status = device_moment(0, 0);
    // The fetch's wait runs out before the access begins to wait.
    if (gate != nullptr) std::this_thread::sleep_for(std::chrono::milliseconds(3 * kShortWaitMs));
    if (status.ok()) status = device_moment(1, version + 1);
    if (gate != nullptr) gate->Open();
    if (update) {
      const Status updated = update->get();
      if (status.ok()) status = updated;
    }
    const Status ended = pipeline->EndIteration();
    return status.ok() ? ended : status;
  };
  uint32_t version = 0;
  for (; version < 3; ++version) ASSERT_OK(run(version, nullptr));
  ASSERT_NE(pipeline->plan(), nullptr);
  ASSERT_EQ(pipeline->plan()->fetches_at[4].size(), 1u);  // layer 1's, queued as the update runs
  ASSERT_EQ(pipeline->plan()->fetches_at[4][0].chunk, model.layers[1]);
  Gate gate;
  const Status status = run(version++, &gate);
  EXPECT_EQ(status.code(), StatusCode::kTimeout) << status.ToString();
  EXPECT_TRUE(Names(status, fmt::format("prefetching chunk {}: pipeline: the last move or update of chunk {} did not "
                                        "finish within {} ms",
                                        model.layers[1].value(), model.layers[1].value(), kShortWaitMs)))
      << status.ToString();
  for (int it = 0; it < 3; ++it, ++version) ASSERT_OK(run(version, nullptr));  // the update landed
}

// A read ahead of a host moment queued behind its chunk's write-back that
// outlasts the wait (a slow drive) reads nothing, and the host moment's
// access says why; the chunk keeps its bytes.
TEST(PipelineTest, AReadBehindAWriteBackThatOutlastsTheWaitFailsItsAccessAndLosesNothing) {
  LayerModel model(10, /*device_chunks=*/2, /*host_chunks=*/8, /*nvme=*/true);
  const uint32_t x = 9;  // updated twice an iteration, on the host
  ASSERT_EQ(*model.engine->ChunkHome(model.layers[x]), Tier::kNvme);
  ASSERT_OK_AND_ASSIGN(auto pipeline, Pipeline::Create(*model.engine, {.wait_timeout_ms = kShortWaitMs}));
  constexpr uint32_t kSlowWriteMs = 5 * kShortWaitMs;
  // Moments: 0 on the device, x on the host, 1 on the device, x on the host.
  // `slow`: the write-back after the first host moment takes kSlowWriteMs.
  const auto run = [&](bool first, bool slow) -> Status {
    STRATA_RETURN_IF_ERROR(pipeline->BeginIteration());
    Status status = Status::Ok();
    uint32_t m = 0;
    for (uint32_t l : {0u, x, 1u, x}) {
      status = l == x ? pipeline->BeginHostMoment().status() : pipeline->BeginMoment();
      if (!status.ok()) break;
      {
        Result<ChunkAccess> access = pipeline->Access(model.layers[l]);
        status = access.status();
        if (status.ok()) status = WriteOrCheck(*access, l, /*write=*/first && m < 3);
      }
      const int writes = model.faults->writes();
      if (slow && m == 1) model.faults->SetDelayMs(kSlowWriteMs);
      const Status ended = pipeline->EndMoment();
      if (slow && m == 1) {
        // Only the write-back is slow: the delay is lifted once it has begun.
        while (model.faults->writes() == writes) std::this_thread::yield();
        model.faults->SetDelayMs(0);
      }
      // The read's wait runs out before the access begins to wait.
      if (slow && m == 2) std::this_thread::sleep_for(std::chrono::milliseconds(2 * kShortWaitMs));
      if (status.ok()) status = ended;
      if (!status.ok()) break;
      m++;
    }
    const Status ended = pipeline->EndIteration();
    return status.ok() ? ended : status;
  };
  ASSERT_OK(run(true, false));
  ASSERT_OK(run(false, false));
  ASSERT_NE(pipeline->plan(), nullptr);
  ASSERT_EQ(pipeline->plan()->host_reads_at[2], (std::vector<PlannedRead>{{model.layers[x], 3}}));
  const Status status = run(false, true);
  EXPECT_EQ(status.code(), StatusCode::kTimeout) << status.ToString();
  EXPECT_TRUE(Names(status, fmt::format("prefetching chunk {}: pipeline: the last move or update of chunk {} did not "
                                        "finish within {} ms",
                                        model.layers[x].value(), model.layers[x].value(), kShortWaitMs)))
      << status.ToString();
  std::this_thread::sleep_for(std::chrono::milliseconds(kSlowWriteMs));  // the write-back ends
  for (int it = 0; it < 3; ++it) ASSERT_OK(run(false, false));  // every layer intact
}

}  // namespace
}  // namespace strata::offload
