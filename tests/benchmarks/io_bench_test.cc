#include "benchmarks/io_bench.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <sstream>

#include <nlohmann/json.hpp>

#include "test_util.h"

namespace strata::bench {
namespace {

// Whether `program` is an executable in a directory of $PATH.
bool OnPath(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path != nullptr ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string file = (std::filesystem::path(dir.empty() ? "." : dir) / program).string();
    if (::access(file.c_str(), X_OK) == 0) return true;
  }
  return false;
}

TEST(IoBenchTest, MedianOfOddAndEvenLists) {
  EXPECT_DOUBLE_EQ(Median({3, 1, 2}), 2);
  EXPECT_DOUBLE_EQ(Median({4, 1, 3, 2}), 2.5);
}

TEST(IoBenchTest, ParsesFioJsonAfterNotes) {
  std::string output = R"(note: both iodepth >= 1 and synchronous I/O engine are selected
{"fio version": "fio-3.33", "jobs": [{"jobname": "x", "read": {"bw_bytes": 1500000000}, "write": {"bw_bytes": 0}}]})";
  ASSERT_OK_AND_ASSIGN(double read, ParseFioBandwidthGbps(output, IoOp::kRead));
  EXPECT_DOUBLE_EQ(read, 1.5);
  EXPECT_EQ(ParseFioBandwidthGbps(output, IoOp::kWrite).status().code(), StatusCode::kIoError);
  EXPECT_EQ(ParseFioBandwidthGbps("fio: command not found", IoOp::kRead).status().code(), StatusCode::kIoError);
}

TEST(IoBenchTest, BadConfigurationsAreInvalidArgument) {
  IoBenchConfig config;
  EXPECT_EQ(RunIoBench(config).status().code(), StatusCode::kInvalidArgument);  // no dirs
  testing::ScratchDir dir("bench");
  config.dirs = {dir.path()};
  config.block_sizes_bytes = {5000};
  EXPECT_EQ(RunIoBench(config).status().code(), StatusCode::kInvalidArgument);
  config.block_sizes_bytes = {4096};
  config.queue_depths = {0};
  EXPECT_EQ(RunIoBench(config).status().code(), StatusCode::kInvalidArgument);
  config.queue_depths = {4};
  config.compare_one_dir = true;
  EXPECT_EQ(RunIoBench(config).status().code(), StatusCode::kInvalidArgument);  // needs two dirs
}

TEST(IoBenchTest, SweepMeasuresEveryRowAndWritesTheJsonKeys) {
  testing::ScratchDir a("bench-a"), b("bench-b");
  IoBenchConfig config;
  config.dirs = {a.path(), b.path()};
  config.file_size_bytes = 8 << 20;
  config.block_sizes_bytes = {64 << 10, 1 << 20};
  config.queue_depths = {1, 8};
  config.patterns = {IoPattern::kSequential, IoPattern::kRandom};
  config.runs = 2;
  config.compare_one_dir = true;
  ASSERT_OK_AND_ASSIGN(IoBenchReport report, RunIoBench(config));
  ASSERT_EQ(report.rows.size(), 2u * 2 * 2 * 2);  // blocks x depths x ops x patterns
  for (const IoBenchRow& row : report.rows) {
    ASSERT_EQ(row.strata_gbps.size(), 2u);
    EXPECT_GT(row.strata_median_gbps, 0);
    EXPECT_GT(row.one_dir_ratio_median, 0);
  }
  EXPECT_GT(report.crc.crc_gbps, 0);
  nlohmann::json json = nlohmann::json::parse(IoBenchJson(report));
  EXPECT_GT(json["read_gbps"].get<double>(), 0);
  EXPECT_GT(json["write_gbps"].get<double>(), 0);
  EXPECT_EQ(json["config"]["queue_depths"].size(), 2u);
  EXPECT_NE(FormatIoBench(report).find("striped/1-dir"), std::string::npos);
}

// The headline: strata's engine reads and writes at least at fio's order of
// magnitude, on the same file, block size and queue depth, alternating. Each
// run's ratio compares passes made back to back, and the median of three is
// kept: a tenth leaves room for a noisy disk, not for an engine that lost
// its queue depth or its direct I/O path (about 3 x fio at this size, where
// fio's start weighs on its figure).
TEST(IoBenchTest, StrataMovesTheBytesAtFiosOrderOfMagnitude) {
  if (!OnPath("fio")) GTEST_SKIP() << "fio is not installed (scripts/install_deps.sh installs it): no reference to compare with";
  testing::ScratchDir dir("bench-vs-fio");
  IoBenchConfig config;
  config.dirs = {dir.path()};
  config.file_size_bytes = 16 << 20;
  config.block_sizes_bytes = {1 << 20};
  config.queue_depths = {8};
  config.runs = 3;
  config.compare_fio = true;
  ASSERT_OK_AND_ASSIGN(IoBenchReport report, RunIoBench(config));
  ASSERT_EQ(report.rows.size(), 2u);  // write, read
  for (const IoBenchRow& row : report.rows) {
    ASSERT_EQ(row.fio_gbps.size(), 3u);
    EXPECT_GE(row.ratio_median, 0.1) << FormatIoBench(report);
  }
}

TEST(IoBenchTest, DeviceDestinationGoesThroughBounceBuffersToTheDevice) {
  testing::ScratchDir dir("bench-device");
  IoBenchConfig config;
  config.dirs = {dir.path()};
  config.file_size_bytes = 8 << 20;
  config.block_sizes_bytes = {256 << 10};
  config.queue_depths = {4};
  config.runs = 1;
  config.destination = IoDestination::kDevice;
  config.device_backend = "emulated";
  ASSERT_OK_AND_ASSIGN(IoBenchReport report, RunIoBench(config));
  EXPECT_NE(report.device.find("emulated"), std::string::npos) << report.device;
  ASSERT_EQ(report.rows.size(), 2u);
  for (const IoBenchRow& row : report.rows) EXPECT_GT(row.strata_median_gbps, 0);
  EXPECT_NE(FormatIoBench(report).find("bounce buffers"), std::string::npos);
  config.device_backend = "tpu";
  EXPECT_EQ(RunIoBench(config).status().code(), StatusCode::kInvalidArgument);
}

TEST(IoBenchTest, MissingFioIsAnErrorNamingTheCommand) {
  testing::ScratchDir dir("bench-fio");
  IoBenchConfig config;
  config.dirs = {dir.path()};
  config.file_size_bytes = 1 << 20;
  config.block_sizes_bytes = {64 << 10};
  config.runs = 1;
  config.compare_fio = true;
  config.fio_path = "/nonexistent/fio";
  Result<IoBenchReport> report = RunIoBench(config);
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.status().message().find("/nonexistent/fio"), std::string::npos) << report.status().ToString();
}

}  // namespace
}  // namespace strata::bench
