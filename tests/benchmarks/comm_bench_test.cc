// `strata bench comm` on the loopback backend: every size measured for both
// collectives and their raw figures, checked results, and refusals.
#include "benchmarks/comm_bench.h"

#include <gtest/gtest.h>

#include "strata/device.h"
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
  EXPECT_EQ(RunCommBench({.backend = "loopback", .host_buffers = true}).status().code(), StatusCode::kInvalidArgument);
}

// NCCL on one GPU (a group of one rank): its figures are the algorithm
// bandwidth, for device buffers and for host buffers staged through the GPU.
TEST(CommBenchTest, NcclMeasuresOneRankOnTheGpuOrSaysWhyNot) {
  for (bool host_buffers : {false, true}) {
    CommBenchConfig config{.backend = "nccl", .sizes = {1 << 20, 16 << 20}, .iterations = 3, .host_buffers = host_buffers};
    Result<CommBenchReport> report = RunCommBench(config);
    if (!CudaDeviceAvailable()) {
      EXPECT_EQ(report.status().code(), StatusCode::kNotSupported) << report.status().ToString();
      continue;
    }
    ASSERT_OK(report.status());
    EXPECT_EQ(report->world, 1);
    ASSERT_EQ(report->rows.size(), 2u);
    for (const CommBenchRow& row : report->rows) {
      EXPECT_GT(row.all_gather_busbw, 0);
      EXPECT_GT(row.all_gather_raw_busbw, 0);
      EXPECT_GT(row.reduce_scatter_busbw, 0);
      EXPECT_GT(row.reduce_scatter_raw_busbw, 0);
    }
    const std::string text = FormatCommBench(*report);
    EXPECT_NE(text.find("NCCL"), std::string::npos) << text;
    EXPECT_NE(text.find("algorithm bandwidth"), std::string::npos) << text;
    std::fputs(text.c_str(), stdout);
  }
}

}  // namespace
}  // namespace strata::bench
