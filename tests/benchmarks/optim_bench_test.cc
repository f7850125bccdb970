#include "benchmarks/optim_bench.h"

#include <filesystem>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace strata::bench {
namespace {

TEST(OptimBenchTest, MeasuresStepAndBoundAndWritesTheJsonKeys) {
  OptimBenchConfig config;
  config.params = (1 << 20) + 5;
  config.threads = 1;
  config.repetitions = 3;
  ASSERT_OK_AND_ASSIGN(OptimBenchReport report, RunOptimBench(config));
  EXPECT_GT(report.gparams_per_s, 0);
  EXPECT_GT(report.bound_gbps, 0);
  // What the ratio to the bound rests on: the update is handed arrays that
  // move the bound's 28 bytes a parameter (fp32 param and grad, two states).
  EXPECT_EQ(report.bytes_per_param, 28);
  nlohmann::json json = nlohmann::json::parse(OptimBenchJson(report));
  for (const char* key : {"gparams_per_s", "gbps", "bound_gbps"}) EXPECT_GT(json[key].get<double>(), 0) << key;
  EXPECT_EQ(json["bytes_per_param"].get<double>(), 28);
  EXPECT_NE(FormatOptimBench(report).find("of the bandwidth bound"), std::string::npos);
}

// A short in-memory run of `params` parameters with states in `format`,
// each of its rates measured.
OptimBenchReport RunStates(const char* format, size_t params) {
  OptimBenchConfig config;
  config.params = params;
  config.state_format = format;
  config.threads = 2;
  config.repetitions = 2;
  Result<OptimBenchReport> report = RunOptimBench(config);
  EXPECT_OK(report.status());
  if (!report.ok()) return {};
  EXPECT_GT(report->gparams_per_s, 0);
  EXPECT_GT(report->fp32_gparams_per_s, 0);
  EXPECT_GT(report->bound_gbps, 0);
  return *report;
}

TEST(OptimBenchTest, EightBitStatesRunBesideTheFp32UpdateAgainstTheirOwnBound) {
  const OptimBenchReport report = RunStates("int8", 1 << 18);
  EXPECT_EQ(report.bytes_per_param, 16.0625);  // 12 of fp32 weight and gradient, 4 of codes, the scales
  nlohmann::json json = nlohmann::json::parse(OptimBenchJson(report));
  EXPECT_EQ(json["config"]["state_format"], "int8");
  EXPECT_GT(json["fp32_gparams_per_s"].get<double>(), 0);
  EXPECT_NE(FormatOptimBench(report).find("the fp32 states' update"), std::string::npos);
}

TEST(OptimBenchTest, Bf16StatesRunBesideTheFp32UpdateAgainstTheirOwnBound) {
  const OptimBenchReport report = RunStates("bf16", (1 << 18) + 5);  // a tail the vectors leave to the reference
  EXPECT_EQ(report.bytes_per_param, 20);  // fp32 weight read and written, gradient read, 2 bytes a moment both ways
  nlohmann::json json = nlohmann::json::parse(OptimBenchJson(report));
  EXPECT_EQ(json["config"]["state_format"], "bf16");
  EXPECT_NE(FormatOptimBench(report).find("bf16 states, 20.00 bytes a parameter"), std::string::npos);
  OptimBenchConfig config;
  config.state_format = "bf16";
  config.dtype = "bf16";
  const Status refused = RunOptimBench(config).status();
  EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("--state-format bf16 runs with --dtype fp32"), std::string::npos)
      << refused.ToString();
}

TEST(OptimBenchTest, EightBitStatesNeedFp32AndWholeBlocksAndAKnownFormat) {
  OptimBenchConfig config;
  config.params = 1 << 16;
  config.state_format = "int8";
  config.dtype = "bf16";
  {
    const Status refused = RunOptimBench(config).status();
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.message().find("--dtype fp32"), std::string::npos) << refused.ToString();
  }
  config.dtype = "fp32";
  config.params = (1 << 16) + 3;
  {
    const Status refused = RunOptimBench(config).status();
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.message().find("whole blocks of 256"), std::string::npos) << refused.ToString();
  }
  config.state_format = "int4";
  {
    const Status refused = RunOptimBench(config).status();
    EXPECT_EQ(refused.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(refused.message().find("expected fp32, bf16 or int8"), std::string::npos) << refused.ToString();
  }
}

TEST(OptimBenchTest, Bf16MixedPrecisionRuns) {
  OptimBenchConfig config;
  config.params = (1 << 18) + 3;
  config.dtype = "bf16";
  config.threads = 2;
  config.repetitions = 2;
  ASSERT_OK_AND_ASSIGN(OptimBenchReport report, RunOptimBench(config));
  EXPECT_GT(report.gbps, 0);
  EXPECT_GT(report.bound_gbps, 0);
  // bf16 gradient read and compute copy written, fp32 master and states: 28 too.
  EXPECT_EQ(report.bytes_per_param, 28);
  EXPECT_NE(FormatOptimBench(report).find("(bf16)"), std::string::npos);
}

TEST(OptimBenchTest, BadDtypeAndEmptyRunsAreClearErrors) {
  OptimBenchConfig config;
  config.params = 1024;
  config.dtype = "fp16";
  EXPECT_EQ(RunOptimBench(config).status().code(), StatusCode::kInvalidArgument);
  config.dtype = "int8";
  EXPECT_EQ(RunOptimBench(config).status().code(), StatusCode::kInvalidArgument);
  config.dtype = "fp32";
  config.params = 0;
  EXPECT_EQ(RunOptimBench(config).status().code(), StatusCode::kInvalidArgument);
}

TEST(OptimBenchTest, NvmeStatesStreamAndReportStepIoAndUpdate) {
  testing::ScratchDir dir("optim-nvme");
  OptimNvmeBenchConfig config;
  config.base.params = (1 << 20) + 7;
  config.base.dtype = "bf16";
  config.base.threads = 2;
  config.base.repetitions = 2;
  config.dirs = {dir.path()};
  config.group_params = 1 << 18;  // 5 groups, the last of 7 parameters
  config.ring_bytes = 8 << 20;    // 2 of 3 MiB
  ASSERT_OK_AND_ASSIGN(OptimNvmeBenchReport report, RunOptimNvmeBench(config));
  EXPECT_EQ(report.groups, 5u);
  EXPECT_EQ(report.ring_slots, 2u);
  EXPECT_GT(report.step_seconds, 0);
  EXPECT_GT(report.io_seconds, 0);
  EXPECT_GT(report.compute_seconds, 0);
  EXPECT_EQ(report.bytes_per_step, 2u * (4 * (3u << 20) + 3 * 4096));  // read and written
  nlohmann::json json = nlohmann::json::parse(OptimNvmeBenchJson(report));
  for (const char* key : {"step_seconds", "io_seconds", "compute_seconds", "step_over_max_io_compute"}) {
    EXPECT_GT(json[key].get<double>(), 0) << key;
  }
  EXPECT_NE(FormatOptimNvmeBench(report).find("goal <= 1.15"), std::string::npos);
  // The backing file is gone.
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

// --state-format int8 streams the moments' real bytes (260 a block of 256
// each), groups of whole blocks only.
TEST(OptimBenchTest, NvmeStatesOfInt8StreamTheirBytes) {
  testing::ScratchDir dir("optim-nvme-int8");
  OptimNvmeBenchConfig config;
  config.base.params = 1 << 20;
  config.base.state_format = "int8";
  config.base.threads = 2;
  config.base.repetitions = 1;
  config.dirs = {dir.path()};
  config.group_params = 1 << 18;  // 4 groups
  config.ring_bytes = 8 << 20;
  ASSERT_OK_AND_ASSIGN(OptimNvmeBenchReport report, RunOptimNvmeBench(config));
  const uint64_t moment = ((1u << 18) / 256 * 260 + 4096 - 1) / 4096 * 4096;  // padded to the slot alignment
  const uint64_t group = (1u << 20) + 2 * moment;                                // the master, 2 moments
  EXPECT_EQ(report.bytes_per_step, 2u * 4 * group);
  EXPECT_EQ(nlohmann::json::parse(OptimNvmeBenchJson(report))["config"]["state_format"], "int8");
  EXPECT_NE(FormatOptimNvmeBench(report).find("int8 states"), std::string::npos);
  config.group_params = (1 << 18) + 7;
  EXPECT_EQ(RunOptimNvmeBench(config).status().code(), StatusCode::kInvalidArgument);
  config.base.state_format = "fp16";
  EXPECT_EQ(RunOptimNvmeBench(config).status().code(), StatusCode::kInvalidArgument);
}

TEST(OptimBenchTest, NvmeModeNeedsADirectory) {
  OptimNvmeBenchConfig config;
  config.base.params = 1024;
  Result<OptimNvmeBenchReport> report = RunOptimNvmeBench(config);
  EXPECT_EQ(report.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(report.status().message().find("--dir"), std::string::npos);
}

}  // namespace
}  // namespace strata::bench
