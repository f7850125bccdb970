#include "strata/engine.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "tools/selftest.h"
#include "test_util.h"

namespace strata {
namespace {

Options SmallOptions() {
  Options options;
  options.device.backend = DeviceBackendKind::kEmulated;
  options.device.budget_bytes = 1 << 20;
  options.host.budget_bytes = 2 << 20;
  options.chunk.size_elems = 16384;  // 64 KiB fp32 chunks
  options.log_level = LogLevel::kWarning;
  return options;
}

TEST(EngineTest, BadOptionFailsCreate) {
  Options options = SmallOptions();
  options.nvme.block_size_bytes = 1000;
  Result<std::unique_ptr<Engine>> engine = Engine::Create(options);
  EXPECT_EQ(engine.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(engine.status().message().find("nvme.block_size"), std::string::npos);
}

TEST(EngineTest, DeviceThatCannotGiveTheBudgetFailsCreate) {
  EmulatedDeviceOptions small;
  small.capacity_bytes = 256 << 10;
  EngineSeams seams;
  seams.device = std::move(CreateEmulatedDevice(small)).value();
  Result<std::unique_ptr<Engine>> engine = Engine::Create(SmallOptions(), std::move(seams));
  EXPECT_EQ(engine.status().code(), StatusCode::kOutOfMemory) << engine.status().ToString();
  EXPECT_NE(engine.status().message().find("device.budget"), std::string::npos);
}

TEST(EngineTest, MissingNvmeDirFailsCreateNamingIt) {
  Options options = SmallOptions();
  options.nvme.dirs = {"/nonexistent/strata-nvme"};
  Result<std::unique_ptr<Engine>> engine = Engine::Create(options);
  EXPECT_FALSE(engine.ok());
  EXPECT_NE(engine.status().message().find("/nonexistent/strata-nvme"), std::string::npos)
      << engine.status().ToString();
}

TEST(EngineTest, ModelLargerThanHostAndNvmeFailsFinalize) {
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(SmallOptions()));
  ASSERT_OK(engine->RegisterTensor({"big", {1 << 20}, DType::kFloat32, true, "m"}).status());  // 16 MiB of states
  Status status = engine->Finalize();
  EXPECT_EQ(status.code(), StatusCode::kOutOfMemory);
  EXPECT_NE(status.message().find("host.budget"), std::string::npos) << status.ToString();
}

TEST(EngineTest, ChunkLargerThanDeviceFailsFinalize) {
  Options options = SmallOptions();
  options.host.budget_bytes = 64 << 20;
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(options));
  ASSERT_OK(engine->RegisterTensor({"big", {1 << 20}, DType::kFloat32, false, "m"}).status());  // one 4 MiB chunk
  Status status = engine->Finalize();
  EXPECT_EQ(status.code(), StatusCode::kOutOfMemory);
  EXPECT_NE(status.message().find("device.budget"), std::string::npos) << status.ToString();
}

// A small MLP: eight trainable fp32 layers of 64 x 64 and a bias (130 KiB of params).
Status RegisterSmallMlp(Engine& engine) {
  for (int l = 0; l < 8; ++l) {
    const std::string module = "fc" + std::to_string(l);
    STRATA_RETURN_IF_ERROR(engine.RegisterTensor({module + ".weight", {64, 64}, DType::kFloat32, true, module}).status());
    STRATA_RETURN_IF_ERROR(engine.RegisterTensor({module + ".bias", {64}, DType::kFloat32, true, module}).status());
  }
  return Status::Ok();
}

TEST(EngineTest, SmallModelUnderASmallDeviceBudgetGetsChunksThatFitWithoutChunkOptions) {
  Options options;
  options.device.backend = DeviceBackendKind::kEmulated;
  options.device.budget_bytes = 256 << 10;
  options.log_level = LogLevel::kWarning;
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(options));
  ASSERT_OK(RegisterSmallMlp(*engine));
  ASSERT_OK(engine->Finalize());
  // Six param and six grad chunks fit on the device.
  EXPECT_LE(12 * engine->layout().chunk_size_elems * sizeof(float), options.device.budget_bytes);
  EXPECT_TRUE(engine->layout().chunk_size_searched);
}

// Int8 states: a weight's moments are codes and block scales, not elements,
// so element access to them is refused naming the chunk access that works;
// a bias (too small for 8-bit blocks) keeps fp32 moments, accessed as ever.
TEST(EngineTest, ElementAccessToInt8MomentsIsRefusedNamingChunkAccess) {
  Options options = SmallOptions();
  options.optimizer.state_dtype = DType::kInt8Block;
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(options));
  ASSERT_OK(RegisterSmallMlp(*engine));
  ASSERT_OK(engine->Finalize());
  const Result<TensorAccess> weight = engine->Access(TensorId(0), ChunkKind::kExpAvg, Tier::kHost);
  ASSERT_EQ(weight.status().code(), StatusCode::kInvalidArgument) << weight.status().ToString();
  EXPECT_NE(weight.status().message().find("tensor 'fc0.weight': its exp_avg copy is 8-bit codes and block scales"),
            std::string::npos)
      << weight.status().ToString();
  EXPECT_NE(weight.status().message().find("AccessChunk"), std::string::npos);
  ASSERT_OK_AND_ASSIGN(TensorAccess bias, engine->Access(TensorId(1), ChunkKind::kExpAvg, Tier::kHost));
  EXPECT_EQ(bias.num_elements(), 64u);
}

TEST(EngineTest, ExplicitChunkOptionsAreKeptAndTooLargeOnesRefusedByName) {
  Options options;
  options.device.backend = DeviceBackendKind::kEmulated;
  options.device.budget_bytes = 256 << 10;
  options.log_level = LogLevel::kWarning;
  options.chunk.search_min_elems = 4096;
  options.chunk.search_max_elems = 4096;
  ASSERT_OK_AND_ASSIGN(auto kept, Engine::Create(options));
  ASSERT_OK(RegisterSmallMlp(*kept));
  ASSERT_OK(kept->Finalize());
  EXPECT_EQ(kept->layout().chunk_size_elems, 4096u);
  options.chunk.search_min_elems = options.chunk.search_max_elems = 0;
  options.chunk.size_elems = 1 << 20;
  ASSERT_OK_AND_ASSIGN(auto refused, Engine::Create(options));
  ASSERT_OK(RegisterSmallMlp(*refused));
  Status status = refused->Finalize();
  EXPECT_EQ(status.code(), StatusCode::kOutOfMemory);
  EXPECT_NE(status.message().find("chunk.size_elems"), std::string::npos) << status.ToString();
}

// nvme.dirs without nvme.capacity: host room for the params and grads only.
Options NvmeWithoutCapacity(const std::string& dir) {
  Options options;
  options.device.backend = DeviceBackendKind::kEmulated;
  options.device.budget_bytes = 256 << 10;
  options.host.budget_bytes = 512 << 10;
  options.nvme.dirs = {dir};
  options.log_level = LogLevel::kWarning;
  return options;
}

TEST(EngineTest, NvmeCapacityDefaultsToWhatTheStatesHomedThereNeed) {
  testing::ScratchDir dir("nvme-default");
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(NvmeWithoutCapacity(dir.path())));
  ASSERT_OK(RegisterSmallMlp(*engine));
  ASSERT_OK(engine->Finalize());
  uint64_t homed = 0, largest = 0;
  for (const ChunkInfo& chunk : engine->chunks()) {
    ASSERT_OK_AND_ASSIGN(Tier home, engine->ChunkHome(chunk.id));
    if (home == Tier::kNvme) homed += chunk.size_bytes;
    largest = std::max(largest, chunk.size_bytes);
  }
  EXPECT_GT(homed, 0u);
  EXPECT_EQ(engine->stats().tiers[static_cast<int>(Tier::kNvme)].capacity_bytes,
            homed + (homed / 8 + 4095) / 4096 * 4096 + 3 * largest);  // an eighth more, in whole 4KiB slots
  // The tier works: every chunk goes home and comes back.
  ASSERT_OK(engine->OffloadAll());
  for (const ChunkInfo& chunk : engine->chunks()) ASSERT_OK(engine->AccessChunk(chunk.id, Tier::kHost).status());
}

TEST(EngineTest, DefaultNvmeCapacityBeyondTheFreeSpaceIsRefusedWithTheFigures) {
  testing::ScratchDir dir("nvme-default-full");
  FaultInjectingFileSystem files(PosixFileSystem());
  files.SetFreeBytes(64 << 10);
  EngineSeams seams;
  seams.files = &files;
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(NvmeWithoutCapacity(dir.path()), std::move(seams)));
  ASSERT_OK(RegisterSmallMlp(*engine));
  Status status = engine->Finalize();
  EXPECT_EQ(status.code(), StatusCode::kOutOfMemory) << status.ToString();
  for (const char* figure : {"nvme.capacity is not set", "what the model states need there", "free 64KiB"}) {
    EXPECT_NE(status.message().find(figure), std::string::npos) << figure << " in " << status.ToString();
  }
  EXPECT_FALSE(engine->finalized());
}

// Four trainable fp32 layers of one 64 KiB chunk each: per layer a param, a
// grad, exp_avg and exp_avg_sq chunk (1 MiB in all), with an NVMe tier.
Result<std::unique_ptr<Engine>> FourLayers(Options options) {
  options.nvme.capacity_bytes = 4 << 20;
  EngineSeams seams;
  STRATA_ASSIGN_OR_RETURN(seams.storage, CreateMemoryStorage(options.nvme.capacity_bytes));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(options, std::move(seams)));
  for (int l = 0; l < 4; ++l) {
    STRATA_RETURN_IF_ERROR(
        engine->RegisterTensor({"layer" + std::to_string(l), {16384}, DType::kFloat32, true, "l" + std::to_string(l)})
            .status());
  }
  STRATA_RETURN_IF_ERROR(engine->Finalize());
  return engine;
}

// Bytes of the chunks of these kinds homed on `tier`.
uint64_t HomedBytes(const Engine& engine, Tier tier, bool states) {
  uint64_t bytes = 0;
  for (const ChunkInfo& c : engine.chunks()) {
    const bool state = IsOptimizerState(c.kind);
    if (state == states && *engine.ChunkHome(c.id) == tier) bytes += c.size_bytes;
  }
  return bytes;
}

TEST(EngineTest, ParamsAndGradsAreHomedOnTheHostBeforeOptimizerStatesWithRoomKeptForStaging) {
  Options options = SmallOptions();
  options.host.budget_bytes = 768 << 10;
  ASSERT_OK_AND_ASSIGN(auto engine, FourLayers(options));
  // Staging: four groups' states (512 KiB) capped at a quarter of the host;
  // two chunks of slack besides: 448 KiB for homes, the params and three grads.
  EXPECT_EQ(engine->host_staging_bytes(), 192u << 10);
  EXPECT_EQ(HomedBytes(*engine, Tier::kHost, /*states=*/false), 7u * (64 << 10));
  EXPECT_EQ(HomedBytes(*engine, Tier::kHost, /*states=*/true), 0u);
  EXPECT_EQ(HomedBytes(*engine, Tier::kNvme, /*states=*/true), 8u * (64 << 10));
}

TEST(EngineTest, StaticPolicyHomesItsShareOfTheStatesOnTheHostOrSaysWhyNot) {
  Options options = SmallOptions();
  options.host.budget_bytes = 4 << 20;  // room for everything
  options.placement.policy = PlacementPolicy::kStatic;
  options.placement.host_states = 0.5;
  ASSERT_OK_AND_ASSIGN(auto engine, FourLayers(options));
  EXPECT_EQ(HomedBytes(*engine, Tier::kHost, /*states=*/true), 4u * (64 << 10));
  EXPECT_EQ(HomedBytes(*engine, Tier::kNvme, /*states=*/true), 4u * (64 << 10));
  EXPECT_EQ(HomedBytes(*engine, Tier::kHost, /*states=*/false), 8u * (64 << 10));
  // All states on a host that holds none of them beside the rest: refused, naming the keys.
  options.host.budget_bytes = 768 << 10;
  options.placement.host_states = 1.0;
  Result<std::unique_ptr<Engine>> refused = FourLayers(options);
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(refused.status().message().find("placement.host_states 1"), std::string::npos) << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("host.budget"), std::string::npos);
}

// host.budget auto (Note [Host budget auto] in memory/engine.cc), with the
// machine's available memory given.
Options AutoHostOptions() {
  Options options = SmallOptions();
  options.host.budget_bytes = 0;
  return options;
}

EngineSeams AvailableHost(uint64_t bytes) {
  EngineSeams seams;
  seams.available_host_bytes = bytes;
  return seams;
}

TEST(EngineTest, HostBudgetAutoIsWhatTheModelsChunksNeed) {
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(AutoHostOptions(), AvailableHost(uint64_t{1} << 30)));
  EXPECT_NE(engine->DescribeBackends().find("host: auto, sized at Finalize"), std::string::npos)
      << engine->DescribeBackends();
  ASSERT_OK(RegisterSmallMlp(*engine));
  ASSERT_OK(engine->Finalize());
  uint64_t states = 0, largest = 0;
  for (const ChunkInfo& chunk : engine->chunks()) {
    EXPECT_EQ(*engine->ChunkHome(chunk.id), Tier::kHost);
    states += chunk.size_bytes;
    largest = std::max(largest, chunk.size_bytes);
  }
  // Every chunk, an eighth more in whole 4KiB slots, two of the largest: about 1.4 MiB, of the 512 MiB allowed.
  const uint64_t expected = states + (states / 8 + 4095) / 4096 * 4096 + 2 * largest;
  EXPECT_EQ(engine->stats().tiers[static_cast<int>(Tier::kHost)].capacity_bytes, expected);
  EXPECT_EQ(engine->options().host.budget_bytes, expected);
  EXPECT_LT(expected, 2 * states);
  // The tier holds them: every chunk on the host, then each on the device and back.
  for (const ChunkInfo& chunk : engine->chunks()) ASSERT_OK(engine->AccessChunk(chunk.id, Tier::kHost).status());
  for (const ChunkInfo& chunk : engine->chunks()) ASSERT_OK(engine->MoveChunk(chunk.id, Tier::kDevice));
  ASSERT_OK(engine->OffloadAll());
}

TEST(EngineTest, HostBudgetAutoTakesAtMostHalfTheAvailableMemoryAndSaysSo) {
  // Four layers' chunks are 1 MiB; with 1 MiB available auto takes 512 KiB.
  Options options = AutoHostOptions();
  options.chunk.size_elems = 0;
  ASSERT_OK_AND_ASSIGN(auto alone, Engine::Create(options, AvailableHost(1 << 20)));
  for (int l = 0; l < 4; ++l) {
    ASSERT_OK(alone->RegisterTensor({"layer" + std::to_string(l), {16384}, DType::kFloat32, true, "l" + std::to_string(l)})
                  .status());
  }
  Status refused = alone->Finalize();
  EXPECT_EQ(refused.code(), StatusCode::kOutOfMemory) << refused.ToString();
  for (const char* figure : {"host.budget auto takes at most half the memory available now, 512KiB",
                             "set host.budget to a size", "model states need 1MiB", "add nvme.dirs"}) {
    EXPECT_NE(refused.message().find(figure), std::string::npos) << figure << " in " << refused.ToString();
  }
  EXPECT_FALSE(alone->finalized());

  // With an NVMe tier the states beyond the half go there, and the host tier is the half.
  options.nvme.capacity_bytes = 4 << 20;
  EngineSeams seams = AvailableHost(1 << 20);
  ASSERT_OK_AND_ASSIGN(seams.storage, CreateMemoryStorage(options.nvme.capacity_bytes));
  ASSERT_OK_AND_ASSIGN(auto spilled, Engine::Create(options, std::move(seams)));
  for (int l = 0; l < 4; ++l) {
    ASSERT_OK(spilled->RegisterTensor({"layer" + std::to_string(l), {16384}, DType::kFloat32, true, "l" + std::to_string(l)})
                  .status());
  }
  ASSERT_OK(spilled->Finalize());
  EXPECT_EQ(spilled->stats().tiers[static_cast<int>(Tier::kHost)].capacity_bytes, 512u << 10);
  EXPECT_GT(HomedBytes(*spilled, Tier::kNvme, /*states=*/true), 0u);
  ASSERT_OK(spilled->OffloadAll());
  for (const ChunkInfo& chunk : spilled->chunks()) ASSERT_OK(spilled->AccessChunk(chunk.id, Tier::kHost).status());
}

// `layers` trainable fp32 tensors of `elems` elements, each its own module.
Status RegisterLayers(Engine& engine, int layers, int64_t elems) {
  for (int l = 0; l < layers; ++l) {
    STRATA_RETURN_IF_ERROR(
        engine.RegisterTensor({"layer" + std::to_string(l), {elems}, DType::kFloat32, true, "l" + std::to_string(l)})
            .status());
  }
  return Status::Ok();
}

TEST(EngineTest, HostBudgetAutoWithStatesOnNvmeIsWhatTheHostHomedChunksAndTheirStagingNeed) {
  // The static policy with no states on the host: a small model spills them
  // to NVMe, and the host tier is still sized to the model, not to the cap.
  Options options = AutoHostOptions();
  options.placement.policy = PlacementPolicy::kStatic;
  options.placement.host_states = 0;
  options.nvme.capacity_bytes = 4 << 20;
  EngineSeams seams = AvailableHost(uint64_t{1} << 30);
  ASSERT_OK_AND_ASSIGN(seams.storage, CreateMemoryStorage(options.nvme.capacity_bytes));
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(options, std::move(seams)));
  ASSERT_OK(RegisterLayers(*engine, 4, 16384));
  ASSERT_OK(engine->Finalize());
  EXPECT_EQ(HomedBytes(*engine, Tier::kNvme, /*states=*/true), 8u * (64 << 10));
  EXPECT_EQ(HomedBytes(*engine, Tier::kHost, /*states=*/false), 8u * (64 << 10));
  // Staging: all the NVMe-homed states (512 KiB), less than the placement's
  // share of the cap. Host: the params and grads, an eighth more, two of the
  // largest chunks, and the staging: 1216 KiB of the 512 MiB allowed.
  EXPECT_EQ(engine->host_staging_bytes(), 512u << 10);
  EXPECT_EQ(engine->stats().tiers[static_cast<int>(Tier::kHost)].capacity_bytes, 1216u << 10);
  ASSERT_OK(engine->OffloadAll());
  for (const ChunkInfo& chunk : engine->chunks()) ASSERT_OK(engine->AccessChunk(chunk.id, Tier::kHost).status());
}

TEST(EngineTest, HostBudgetAutoChoosesTheSameChunkSizeWhateverMemoryIsAvailable) {
  // The chunk size a checkpoint is bound to, and every rank must share, may
  // not follow the machine's free memory (Note [Chunk size bounds]).
  Options options = AutoHostOptions();
  options.chunk.size_elems = 0;
  options.device.budget_bytes = 4 << 20;
  options.nvme.capacity_bytes = 32 << 20;
  std::vector<uint64_t> chosen;
  for (uint64_t available : {uint64_t{2} << 20, uint64_t{1} << 30, uint64_t{64} << 30}) {
    EngineSeams seams = AvailableHost(available);
    ASSERT_OK_AND_ASSIGN(seams.storage, CreateMemoryStorage(options.nvme.capacity_bytes));
    ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(options, std::move(seams)));
    ASSERT_OK(RegisterLayers(*engine, 8, 65536));  // 8 MiB of states in all
    ASSERT_OK(engine->Finalize());
    chosen.push_back(engine->layout().chunk_size_elems);
  }
  EXPECT_EQ(chosen[0], chosen[1]);
  EXPECT_EQ(chosen[1], chosen[2]);
}

TEST(EngineTest, CloseGivesEveryTiersMemoryAndFilesBackAndLaterCallsSaySo) {
  testing::ScratchDir dir("close");
  Options options = AutoHostOptions();
  options.nvme.dirs = {dir.path()};
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(options));
  ASSERT_OK(RegisterSmallMlp(*engine));
  ASSERT_OK(engine->Finalize());
  ASSERT_OK(engine->OffloadAll());
  EXPECT_GT(engine->device().allocated_bytes(), 0u);  // the device tier's arena
  EXPECT_FALSE(std::filesystem::is_empty(dir.path()));  // the NVMe tier's file

  // A pinned chunk holds everything back.
  ASSERT_OK_AND_ASSIGN(ChunkAccess pinned, engine->AccessChunk(ChunkId(0), Tier::kDevice));
  Status held = engine->Close();
  EXPECT_EQ(held.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(held.message().find("1 chunks are still pinned (chunk 0)"), std::string::npos) << held.ToString();
  EXPECT_FALSE(engine->closed());
  ASSERT_OK(engine->AccessChunk(ChunkId(1), Tier::kHost).status());
  pinned.Release();

  ASSERT_OK(engine->Close());
  EXPECT_TRUE(engine->closed());
  EXPECT_EQ(engine->device().allocated_bytes(), 0u);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  ASSERT_OK(engine->Close());  // again: nothing to do
  for (const Status& after : {engine->AccessChunk(ChunkId(0), Tier::kHost).status(), engine->OffloadAll(),
                              engine->Finalize(), engine->RegisterTensor({"late", {4}}).status()}) {
    EXPECT_EQ(after.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(after.message().find("the engine is closed"), std::string::npos) << after.ToString();
  }
  EXPECT_FALSE(engine->stats().tier_present[static_cast<int>(Tier::kHost)]);
  EXPECT_FALSE(engine->device_arena());
  EXPECT_NE(engine->DescribeBackends().find("closed"), std::string::npos);
}

TEST(EngineTest, TensorsWithoutANameWithTheSameNameOrAnEmptyDimensionAreRefused) {
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(SmallOptions()));
  ASSERT_OK(engine->RegisterTensor({"w", {4, 4}}).status());
  Status twice = engine->RegisterTensor({"w", {4}}).status();
  EXPECT_EQ(twice.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(twice.message().find("'w' is registered already"), std::string::npos) << twice.ToString();
  EXPECT_EQ(engine->RegisterTensor({"", {4}}).status().code(), StatusCode::kInvalidArgument);
  Status empty = engine->RegisterTensor({"v", {4, 0}}).status();
  EXPECT_NE(empty.message().find("dimension 1 is 0"), std::string::npos) << empty.ToString();
  EXPECT_EQ(engine->tensors().size(), 1u);  // nothing refused was kept
}

TEST(EngineTest, LifecycleErrorsAreInvalidArgument) {
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(SmallOptions()));
  ASSERT_OK_AND_ASSIGN(TensorId frozen, engine->RegisterTensor({"frozen", {100}, DType::kFloat32, false, "m"}));
  EXPECT_EQ(engine->Access(frozen, ChunkKind::kParam, Tier::kHost).status().code(), StatusCode::kInvalidArgument);
  ASSERT_OK(engine->Finalize());
  EXPECT_EQ(engine->Finalize().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->RegisterTensor({"late", {1}}).status().code(), StatusCode::kInvalidArgument);
  Status grad = engine->Access(frozen, ChunkKind::kGrad, Tier::kHost).status();
  EXPECT_NE(grad.message().find("frozen"), std::string::npos) << grad.ToString();
  EXPECT_EQ(engine->Access(TensorId(7), ChunkKind::kParam, Tier::kHost).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->ChunkTier(ChunkId(0)).status().code(), StatusCode::kInvalidArgument);  // free
}

TEST(EngineTest, TensorAccessPointsAtTheTensorInsideItsChunk) {
  ASSERT_OK_AND_ASSIGN(auto engine, Engine::Create(SmallOptions()));
  ASSERT_OK_AND_ASSIGN(TensorId a, engine->RegisterTensor({"a", {10, 10}, DType::kBFloat16, true, "m"}));
  ASSERT_OK_AND_ASSIGN(TensorId b, engine->RegisterTensor({"b", {50}, DType::kBFloat16, true, "m"}));
  ASSERT_OK(engine->Finalize());
  ASSERT_OK_AND_ASSIGN(TensorAccess pa, engine->Access(a, ChunkKind::kParam, Tier::kDevice));
  ASSERT_OK_AND_ASSIGN(TensorAccess pb, engine->Access(b, ChunkKind::kParam, Tier::kDevice));
  EXPECT_EQ(pa.size_bytes(), 200u);
  EXPECT_EQ(pa.num_elements(), 100u);
  EXPECT_EQ(pa.chunk_id(), pb.chunk_id());
  EXPECT_GE(static_cast<std::byte*>(pb.data()), static_cast<std::byte*>(pa.data()) + 200);
  ASSERT_OK_AND_ASSIGN(TensorAccess master, engine->Access(a, ChunkKind::kMaster, Tier::kHost));
  EXPECT_EQ(master.dtype(), DType::kFloat32);
  EXPECT_EQ(master.size_bytes(), 400u);
}

class SelftestTest : public ::testing::Test {
 protected:
  SelftestConfig SmallModel() {
    SelftestConfig config;
    config.layers = 3;
    config.hidden = 64;
    config.vocab = 512;
    config.sequence = 64;
    return config;
  }
  Options SelftestOptions() {
    Options options;
    options.device.backend = DeviceBackendKind::kEmulated;
    options.chunk.search_min_elems = 1 << 10;
    options.chunk.search_max_elems = 1 << 15;
    options.nvme.dirs = {dir_.path()};
    options.log_level = LogLevel::kWarning;
    return options;
  }
  testing::ScratchDir dir_{"selftest"};
};

// Int8 states too: their moments (codes and scales, not elements) are left
// out of the pattern, and every other copy is checked.
TEST_F(SelftestTest, GptStackCyclesThroughAllTiersAndVerifies) {
  for (auto [dtype, states] : {std::pair{DType::kFloat32, DType::kFloat32}, {DType::kBFloat16, DType::kFloat32},
                               {DType::kBFloat16, DType::kInt8Block}}) {
    Options options = SelftestOptions();
    options.compute_dtype = dtype;
    options.optimizer.state_dtype = states;
    ASSERT_OK_AND_ASSIGN(SelftestReport report, RunSelftest(SmallModel(), options));
    EXPECT_EQ(report.mismatches, 0u) << report.first_mismatch;
    EXPECT_GT(report.copies_checked, report.tensors);
    for (auto [from, to] : {std::pair{0, 1}, {1, 0}, {1, 2}, {2, 1}}) {
      EXPECT_GT(report.stats.links[from][to].moves, 0u) << TierName(static_cast<Tier>(from)) << "->"
                                                        << TierName(static_cast<Tier>(to));
    }
    std::string text = FormatSelftestReport(report);
    EXPECT_NE(text.find("selftest PASSED"), std::string::npos) << text;
    EXPECT_NE(SelftestReportJson(report).find("\"passed\": true"), std::string::npos);
  }
}

TEST_F(SelftestTest, CorruptionOnTheDriveIsReportedNotVerified) {
  EngineSeams seams;
  auto faults = std::make_unique<FaultInjectingStorage>(std::move(CreateMemoryStorage(64 << 20)).value());
  faults->CorruptWrites(1000);
  seams.storage = std::move(faults);
  Options options = SelftestOptions();
  options.nvme.dirs.clear();
  Result<SelftestReport> report = RunSelftest(SmallModel(), options, std::move(seams));
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kCorruption) << report.status().ToString();
}

TEST_F(SelftestTest, FullDriveIsAnIoErrorNotLostData) {
  EngineSeams seams;
  auto faults = std::make_unique<FaultInjectingStorage>(std::move(CreateMemoryStorage(64 << 20)).value());
  faults->FailWrites(ENOSPC, 1000);
  seams.storage = std::move(faults);
  Options options = SelftestOptions();
  options.nvme.dirs.clear();
  Result<SelftestReport> report = RunSelftest(SmallModel(), options, std::move(seams));
  ASSERT_FALSE(report.ok());
  EXPECT_EQ(report.status().code(), StatusCode::kIoError);
  EXPECT_NE(report.status().message().find("No space left"), std::string::npos) << report.status().ToString();
}

}  // namespace
}  // namespace strata
