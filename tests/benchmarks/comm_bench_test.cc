// `strata bench comm` on the loopback backend: every size measured for both
// collectives and their raw figures, checked results, and refusals.
#include "benchmarks/comm_bench.h"

#include <gtest/gtest.h>

#include "tests/test_util.h"

namespace strata::bench {
namespace {

TEST(CommBenchTest, LoopbackMeasuresEverySizeAgainstTheRawFigure) {
  CommBenchConfig config{.backend = "loopback", .ranks = 3, .sizes = {96 * 1024, 3 * 1024 * 1024}, .iterations = 3};
  ASSERT_OK_AND_ASSIGN(CommBenchReport report, RunCommBench(config));
  EXPECT_EQ(report.world, 3);
  ASSERT_EQ(report.rows.size(), 2u);
  EXPECT_EQ(report.rows[0].bytes, 96u * 1024);  // a multiple of 3 ranks x 4 bytes: kept as it is
  for (const CommBenchRow& row : report.rows) {
    EXPECT_GT(row.all_gather_busbw, 0);
    EXPECT_GT(row.all_gather_raw_busbw, 0);
    EXPECT_GT(row.reduce_scatter_busbw, 0);
    EXPECT_GT(row.reduce_scatter_raw_busbw, 0);
  }
  const std::string text = FormatCommBench(report);
  EXPECT_NE(text.find("loopback"), std::string::npos) << text;
  EXPECT_NE(CommBenchJson(report).find("\"reduce_scatter_raw_busbw\""), std::string::npos);
}

TEST(CommBenchTest, BadConfigurationsAreRefused) {
  EXPECT_EQ(RunCommBench({.backend = "loopback", .ranks = 1}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(RunCommBench({.backend = "carrier-pigeon"}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(RunCommBench({.backend = "loopback", .iterations = 0}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(RunCommBench({.backend = "loopback", .sizes = {}}).status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata::bench
