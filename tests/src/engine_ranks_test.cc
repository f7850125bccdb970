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
  options.device_backend = DeviceBackendKind::kEmulated;
  options.device_budget_bytes = 1 << 20;
  options.host_budget_bytes = 1 << 20;  // less than the model: most chunks live on NVMe
  options.chunk_size_elems = 16384;
  options.nvme_dirs = {nvme_dir};
  options.nvme_capacity_bytes = 64 << 20;
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
    // Every tensor's states hold this rank's pattern; all go to NVMe and come back.
    const float mark = 1000.0f * (comm.rank() + 1);
    for (uint32_t t = 0; t < 8; ++t) {
      STRATA_ASSIGN_OR_RETURN(TensorAccess a, engine->Access(TensorId(t), ChunkKind::kExpAvg, Tier::kHost));
      float* data = static_cast<float*>(a.data());
      for (size_t i = 0; i < a.num_elements(); ++i) data[i] = mark + static_cast<float>(t);
    }
    for (const ChunkInfo& chunk : engine->chunks()) STRATA_RETURN_IF_ERROR(engine->MoveChunk(chunk.id, Tier::kNvme));
    STRATA_RETURN_IF_ERROR(comm.Barrier());  // both ranks' chunks are on the drive now
    for (uint32_t t = 0; t < 8; ++t) {
      STRATA_ASSIGN_OR_RETURN(TensorAccess a, engine->Access(TensorId(t), ChunkKind::kExpAvg, Tier::kHost));
      const float* data = static_cast<const float*>(a.data());
      for (size_t i = 0; i < a.num_elements(); ++i) {
        if (data[i] != mark + static_cast<float>(t)) {
          return Internal("rank {}: tensor {} element {} is {}, not its own {}", comm.rank(), t, i, data[i],
                          mark + static_cast<float>(t));
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

TEST(EngineRanksTest, OptionsThatDifferBetweenRanksFailCreateOnEveryRank) {
  testing::ScratchDir dir("ranks-options");
  const std::vector<Status> results = OnTwoRanks([&](Communicator& comm) -> Status {
    Options options = RankOptions(dir.path());
    if (comm.rank() == 1) options.optimizer_lr = 0.5;
    options.cuda_device_index = comm.rank();  // may differ: each rank its own GPU
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
