#include "benchmarks/optim_bench.h"

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
  EXPECT_DOUBLE_EQ(report.gbps, 28.0 * report.gparams_per_s);
  nlohmann::json json = nlohmann::json::parse(OptimBenchJson(report));
  for (const char* key : {"gparams_per_s", "gbps", "bound_gbps"}) EXPECT_GT(json[key].get<double>(), 0) << key;
  EXPECT_NE(FormatOptimBench(report).find("of the bandwidth bound"), std::string::npos);
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

}  // namespace
}  // namespace strata::bench
