// Engines as ranks of one data-parallel group (loopback: threads): each
// rank's NVMe files in its own subdirectory of a shared drive, never
// colliding; options and registered tensors that differ between ranks found
// at start, on every rank.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <thread>
#include <vector>

#include "strata/comm.h"
#include "strata/engine.h"
#include "test_util.h"

namespace strata {
namespace {

Options RankOptions(const std::string& nvme_dir) {
  Options options;
  options.device.backend = DeviceBackendKind::kEmulated;
  options.device.budget_bytes = 1 << 20;
  options.host.budget_bytes = 1 << 20;  // less than the model: most chunks live on NVMe
  options.chunk.size_elems = 16384;
  options.nvme.dirs = {nvme_dir};
  options.nvme.capacity_bytes = 64 << 20;
  options.log_level = LogLevel::kWarning;
  return options;
}

// `body(rank's communicator)` on two threads; their statuses.
std::vector<Status> OnTwoRanks(const std::function<Status(Communicator&)>& body) {
  auto group = CreateLoopbackGroup(2, {.timeout_ms = 20'000});
  STRATA_CHECK(group.ok());
  std::vector<Status> results(2, Status::Ok());
  std::thread other([&] { results[1] = body(*(*group)[1]); });
  results[0] = body(*(*group)[0]);
  other.join();
  return results;
}

Status RegisterModel(Engine& engine, int layers) {
  for (int l = 0; l < layers; ++l) {
    const std::string name = "layer" + std::to_string(l);
    STRATA_RETURN_IF_ERROR(engine.RegisterTensor({name + ".w", {128, 128}, DType::kFloat32, true, name}).status());
  }
  return Status::Ok();
}

TEST(EngineRanksTest, RanksSharingADriveKeepTheirChunksApart) {
  testing::ScratchDir dir("ranks");
  const std::vector<Status> results = OnTwoRanks([&](Communicator& comm) -> Status {
    EngineSeams seams;
    seams.comm = &comm;
    STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(RankOptions(dir.path()), std::move(seams)));
    STRATA_RETURN_IF_ERROR(RegisterModel(*engine, 8));
    STRATA_RETURN_IF_ERROR(engine->Finalize());
    // Every chunk holds this rank's pattern; all go to NVMe and come back.
    const auto mark = [&](const ChunkInfo& chunk) {
      return static_cast<std::byte>(16 * comm.rank() + chunk.id.value() % 16 + 1);
    };
    for (const ChunkInfo& chunk : engine->chunks()) {
      STRATA_ASSIGN_OR_RETURN(ChunkAccess a, engine->AccessChunk(chunk.id, Tier::kHost));
      std::memset(a.data(), static_cast<int>(mark(chunk)), chunk.used_bytes);
    }
    for (const ChunkInfo& chunk : engine->chunks()) STRATA_RETURN_IF_ERROR(engine->MoveChunk(chunk.id, Tier::kNvme));
    STRATA_RETURN_IF_ERROR(comm.Barrier());  // both ranks' chunks are on the drive now
    for (const ChunkInfo& chunk : engine->chunks()) {
      STRATA_ASSIGN_OR_RETURN(ChunkAccess a, engine->AccessChunk(chunk.id, Tier::kHost));
      for (size_t i = 0; i < chunk.used_bytes; ++i) {
        if (a.data()[i] != mark(chunk)) {
          return Internal("rank {}: chunk {} byte {} is {}, not its own {}", comm.rank(), chunk.id.value(), i,
                          static_cast<int>(a.data()[i]), static_cast<int>(mark(chunk)));
        }
      }
    }
    if (engine->DescribeBackends().find(fmt::format("rank{}", comm.rank())) == std::string::npos) {
      return Internal("rank {}: its NVMe is not in its own directory: {}", comm.rank(), engine->DescribeBackends());
    }
    return Status::Ok();
  });
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].ToString();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(std::filesystem::is_directory(std::filesystem::path(dir.path()) / ("rank" + std::to_string(r))));
  }
}

// Each rank keeps half of every group's optimizer states: element ranges
// that tile the group, in chunks half the size; params and grads whole. A
// tensor whose state this rank holds only part of is refused by Access,
// one it holds whole is served.
TEST(EngineRanksTest, OptimizerStatesAreShardedAcrossTheRanks) {
  testing::ScratchDir dir("ranks-shards");
  std::vector<std::vector<ChunkInfo>> chunks(2);
  const std::vector<Status> results = OnTwoRanks([&](Communicator& comm) -> Status {
    EngineSeams seams;
    seams.comm = &comm;
    Options options = RankOptions(dir.path());
    options.chunk.size_elems = 32768;  // two 128x128 layers a group: each rank's half holds one whole
    STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(options, std::move(seams)));
    STRATA_RETURN_IF_ERROR(RegisterModel(*engine, 4));
    STRATA_RETURN_IF_ERROR(engine->Finalize());
    chunks[comm.rank()] = engine->chunks();
    // Layer 0 is the first half of group 0, layer 1 the second.
    const uint32_t mine = comm.rank() == 0 ? 0 : 1, theirs = 1 - mine;
    STRATA_ASSIGN_OR_RETURN(TensorAccess held, engine->Access(TensorId(mine), ChunkKind::kExpAvg, Tier::kHost));
    if (held.num_elements() != 128 * 128) return Internal("rank {}: {} elements", comm.rank(), held.num_elements());
    Result<TensorAccess> other = engine->Access(TensorId(theirs), ChunkKind::kExpAvgSq, Tier::kHost);
    if (other.ok() || other.status().code() != StatusCode::kInvalidArgument ||
        other.status().message().find("sharded across 2 ranks") == std::string::npos) {
      return Internal("rank {}: the other rank's tensor: {}", comm.rank(), other.status().ToString());
    }
    return Status::Ok();
  });
  for (int r = 0; r < 2; ++r) ASSERT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].ToString();
  ASSERT_EQ(chunks[0].size(), chunks[1].size());
  for (size_t c = 0; c < chunks[0].size(); ++c) {
    const ChunkInfo &a = chunks[0][c], &b = chunks[1][c];
    EXPECT_EQ(a.size_bytes, b.size_bytes) << "chunk " << c;
    if (!IsOptimizerState(a.kind)) {
      EXPECT_FALSE(a.sharded || b.sharded) << "chunk " << c;
      EXPECT_EQ(a.size_bytes, 2 * 128 * 128 * 4u) << "chunk " << c;
      continue;
    }
    ASSERT_TRUE(a.sharded && b.sharded) << "chunk " << c;
    EXPECT_EQ(a.size_bytes, 128 * 128 * 4u) << "chunk " << c;
    EXPECT_EQ(a.shard_offset_bytes, 0u);
    EXPECT_EQ(b.shard_offset_bytes, a.used_bytes) << "chunk " << c << ": the shards tile the group";
    EXPECT_EQ(a.used_bytes + b.used_bytes, 2 * 128 * 128 * 4u) << "chunk " << c;
  }
}

TEST(EngineRanksTest, OptionsThatDifferBetweenRanksFailCreateOnEveryRank) {
  testing::ScratchDir dir("ranks-options");
  const std::vector<Status> results = OnTwoRanks([&](Communicator& comm) -> Status {
    Options options = RankOptions(dir.path());
    if (comm.rank() == 1) options.optimizer.lr = 0.5;
    options.device.index = comm.rank();  // may differ: each rank its own GPU
    EngineSeams seams;
    seams.comm = &comm;
    return Engine::Create(options, std::move(seams)).status();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(results[r].code(), StatusCode::kInvalidArgument) << results[r].ToString();
    EXPECT_NE(results[r].message().find("the options of rank(s) 1 differ"), std::string::npos) << results[r].ToString();
  }
  EXPECT_NE(results[1].message().find("optimizer.lr=0.5"), std::string::npos) << results[1].ToString();
}

TEST(EngineRanksTest, DifferentModelsFailFinalizeOnEveryRank) {
  testing::ScratchDir dir("ranks-model");
  const std::vector<Status> results = OnTwoRanks([&](Communicator& comm) -> Status {
    EngineSeams seams;
    seams.comm = &comm;
    STRATA_ASSIGN_OR_RETURN(auto engine, Engine::Create(RankOptions(dir.path()), std::move(seams)));
    STRATA_RETURN_IF_ERROR(RegisterModel(*engine, comm.rank() == 0 ? 8 : 7));
    return engine->Finalize();
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(results[r].code(), StatusCode::kInvalidArgument) << results[r].ToString();
    EXPECT_NE(results[r].message().find("registered tensors of rank(s) 1 differ"), std::string::npos)
        << results[r].ToString();
  }
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

TEST(EngineRanksTest, AMissingNvmeDirectoryIsAnErrorNotCreatedForTheRanks) {
  testing::ScratchDir dir("ranks-missing");
  const std::string missing = dir.path() + "/not-mounted";
  const std::vector<Status> results = OnTwoRanks([&](Communicator& comm) -> Status {
    EngineSeams seams;
    seams.comm = &comm;
    return Engine::Create(RankOptions(missing), std::move(seams)).status();
  });
  for (const Status& status : results) {
    EXPECT_EQ(status.code(), StatusCode::kIoError) << status.ToString();
    EXPECT_NE(status.message().find("not-mounted is not a directory"), std::string::npos) << status.ToString();
  }
  EXPECT_FALSE(std::filesystem::exists(missing));
}

}  // namespace
}  // namespace strata
