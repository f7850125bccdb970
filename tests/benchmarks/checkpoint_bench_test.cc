#include "benchmarks/checkpoint_bench.h"

#include <algorithm>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace strata::bench {
namespace {

TEST(CheckpointBenchTest, BadConfigurationsAreInvalidArgument) {
  CheckpointBenchConfig config;
  EXPECT_EQ(RunCheckpointBench(config).status().code(), StatusCode::kInvalidArgument);  // no dir
  testing::ScratchDir dir("bench");
  config.dir = dir.path();
  config.runs = 0;
  EXPECT_EQ(RunCheckpointBench(config).status().code(), StatusCode::kInvalidArgument);
  config.runs = 1;
  config.params = 1000;  // less than a chunk
  EXPECT_EQ(RunCheckpointBench(config).status().code(), StatusCode::kInvalidArgument);
}

// A small run, states on NVMe: every row measured, the files counted, the
// JSON keys written, and nothing left in the directory.
TEST(CheckpointBenchTest, ASmallRunMeasuresEveryRow) {
  testing::ScratchDir dir("bench");
  CheckpointBenchConfig config{.dir = dir.path(), .params = 1 << 20, .chunk_elems = 256 << 10,
                               .states_on_nvme = true, .runs = 2};
  ASSERT_OK_AND_ASSIGN(CheckpointBenchReport report, RunCheckpointBench(config));
  EXPECT_EQ(report.files, 12u);  // 4 chunks of params and of each moment
  EXPECT_EQ(report.checkpoint_bytes, 12u * (256 << 10) * 4);
  EXPECT_GT(report.saved_from_nvme, 0u);
  for (const auto* runs : {&report.save_gbps, &report.load_gbps, &report.async_save_gbps}) {
    ASSERT_EQ(runs->size(), 2u);
    for (double gbps : *runs) EXPECT_GT(gbps, 0);
  }
  EXPECT_GT(report.io_write_gbps, 0);
  EXPECT_EQ(report.io_write_run_gbps.size(), 2u);  // a bench io pass beside each run
  EXPECT_EQ(report.io_read_run_gbps.size(), 2u);
  EXPECT_GT(report.async_save_ratio, 0);
  EXPECT_GT(report.first_save_gbps, 0);
  // Every measured save wrote over the files of the one before the last.
  EXPECT_EQ(report.recycled_files, report.files);
  EXPECT_GT(report.async_start_max_ms, 0);
  // The headline of the async row: the training loop gets its thread back long before the save has written
  // the checkpoint (each run's StartCheckpoint within half of its whole save, its slowest against the fastest).
  const double fastest_save_ms = static_cast<double>(report.checkpoint_bytes) /
                                 *std::max_element(report.async_save_gbps.begin(), report.async_save_gbps.end()) / 1e6;
  EXPECT_LT(report.async_start_max_ms, 0.5 * fastest_save_ms);
  const std::string text = FormatCheckpointBench(report);
  EXPECT_NE(text.find("save async"), std::string::npos) << text;
  const nlohmann::json json = nlohmann::json::parse(CheckpointBenchJson(report));
  for (const char* key : {"save_ratio", "load_ratio", "async_save_ratio", "async_start_max_ms", "recycled_files",
                          "first_save_gbps", "io_write_run_gbps"}) {
    EXPECT_TRUE(json.contains(key)) << key;
  }
  std::error_code ec;
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(dir.path()) / "checkpoint", ec));
}

// A save's host memory is its buffers, however large the model: with the
// states on NVMe (read through the buffers), the peak resident set grows by
// about three chunks during a save of a 48 MiB checkpoint, not by the model.
TEST(CheckpointBenchTest, ASaveTakesItsBuffersAndNotTheModel) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer keeps freed memory resident (its quarantine): the peak says nothing here";
#endif
  testing::ScratchDir dir("bench");
  CheckpointBenchConfig config{.dir = dir.path(), .params = 4 << 20, .chunk_elems = 256 << 10,
                               .states_on_nvme = true, .runs = 1};
  ASSERT_OK_AND_ASSIGN(CheckpointBenchReport report, RunCheckpointBench(config));
  ASSERT_GT(report.saved_from_nvme, 0u);
  EXPECT_EQ(report.buffer_bytes, 3u * (256 << 10) * 4);
  EXPECT_EQ(report.checkpoint_bytes, uint64_t{48} << 20);
  EXPECT_LE(report.save_rss_growth_bytes, report.buffer_bytes + (uint64_t{8} << 20))
      << "a save of " << report.checkpoint_bytes << " bytes";
}

}  // namespace
}  // namespace strata::bench
