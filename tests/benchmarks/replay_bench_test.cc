#include "benchmarks/replay_bench.h"

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace strata::bench {
namespace {

TEST(ReplayBenchTest, ReplaysWithAPlanAndWithoutAndWritesTheJsonKeys) {
  ReplayBenchConfig config;
  config.model.layers = 3;
  config.model.hidden = 256;
  config.model.vocab = 1024;
  config.model.sequence = 64;
  config.iterations = 2;
  config.pcie_gbps = 8;
  ASSERT_OK_AND_ASSIGN(ReplayBenchReport report, RunReplayBench(config));
  EXPECT_GT(report.updates, 0u);
  EXPECT_EQ(report.moments, 2u * (config.model.layers + 2) + report.updates);
  EXPECT_GT(report.planned.step_seconds, 0);
  EXPECT_GT(report.lru.step_seconds, 0);
  EXPECT_GE(report.planned.step_seconds, report.compute_seconds * 0.99);
  EXPECT_EQ(report.divergences, 0u);
  EXPECT_GT(report.predicted_step_seconds, 0);
  EXPECT_LE(report.device_budget_bytes, report.model_states_bytes);
  nlohmann::json json = nlohmann::json::parse(ReplayBenchJson(report));
  for (const char* key : {"stall_fraction", "lru_stall_fraction", "planning_seconds", "step_seconds"}) {
    EXPECT_TRUE(json.contains(key)) << key;
  }
  for (const char* key : {"bytes_moved", "lru_bytes_moved"}) {
    ASSERT_TRUE(json.contains(key)) << key;
    EXPECT_TRUE(json[key].contains("host->device")) << key;
  }
  EXPECT_EQ(json["pipeline"]["planned_iterations"].get<uint64_t>(), 3u);  // the second warm-up iteration and two more
  EXPECT_NE(FormatReplayBench(report).find("LRU, on demand"), std::string::npos);
}

TEST(ReplayBenchTest, BadShapesAreInvalidArgument) {
  ReplayBenchConfig config;
  config.model.layers = 0;
  EXPECT_EQ(RunReplayBench(config).status().code(), StatusCode::kInvalidArgument);
  config.model.layers = 2;
  config.pcie_gbps = 0;
  EXPECT_EQ(RunReplayBench(config).status().code(), StatusCode::kInvalidArgument);
  config.pcie_gbps = 2;
  config.iterations = 0;
  EXPECT_EQ(RunReplayBench(config).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::bench
