// `strata bench io`: the NVMe engine's read and write bandwidth, measured
// against fio (ioengine=io_uring, direct=1) on the same file, block size and
// queue depth in the same run, alternating the two; also the CRC32C check's
// cost and the striped engine against one directory. See Note [The io
// bench] in io_bench.cc. Single-threaded driver; not thread-safe.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/status.h"

namespace strata::bench {

enum class IoOp : uint8_t { kWrite, kRead };
enum class IoPattern : uint8_t { kSequential, kRandom };
// Where the bytes start (write) or end (read): pinned host memory, or device
// memory through a pair of pinned bounce buffers (reads of the next group of
// queue_depth blocks overlap the copy of the last one).
enum class IoDestination : uint8_t { kHost, kDevice };

struct IoBenchConfig {
  std::vector<std::string> dirs;
  uint64_t file_size_bytes = uint64_t{2} << 30;  // all directories together
  std::vector<uint64_t> block_sizes_bytes = {uint64_t{1} << 20};
  std::vector<uint32_t> queue_depths = {32};
  std::vector<IoOp> ops = {IoOp::kWrite, IoOp::kRead};
  std::vector<IoPattern> patterns = {IoPattern::kSequential};
  uint32_t runs = 3;
  bool compare_fio = false;
  std::string fio_path = "fio";
  bool compare_one_dir = false;  // with several dirs: also run on the first one alone
  bool sqpoll = false;
  bool huge_pages = true;  // host.huge_pages for the I/O buffers
  IoDestination destination = IoDestination::kHost;
  std::string device_backend = "auto";  // with kDevice: device.backend (auto, emulated, cuda)
  uint64_t seed = 1;
};

struct IoBenchRow {
  IoOp op = IoOp::kRead;
  IoPattern pattern = IoPattern::kSequential;
  uint64_t block_size_bytes = 0;
  uint32_t queue_depth = 0;
  std::vector<double> strata_gbps;   // per run
  std::vector<double> fio_gbps;      // per run, when compared
  std::vector<double> one_dir_gbps;  // per run, when compared
  double strata_median_gbps = 0;
  double fio_median_gbps = 0;
  double ratio_median = 0;          // median over runs of strata/fio
  double one_dir_ratio_median = 0;  // median over runs of striped/one dir
};

struct CrcCost {
  double crc_gbps = 0;         // the NVMe tier's CRC32C check of the bytes read
  double read_gbps = 0;        // the sequential read it is compared with
  double fraction_of_read = 0;  // crc time / read time
};

struct IoBenchReport {
  IoBenchConfig config;
  std::string storage;  // the backend's description
  std::string device;   // with IoDestination::kDevice: the device's description
  std::vector<IoBenchRow> rows;
  CrcCost crc;
};

// InvalidArgument for a config it cannot run (no dir, no runs, a block size
// not a multiple of 4KiB or over the file, a queue depth out of 1..4096,
// compare_one_dir with one dir). Leaves its files in the directories.
Result<IoBenchReport> RunIoBench(const IoBenchConfig& config);
// The report as a table for people, and as JSON for scripts.
std::string FormatIoBench(const IoBenchReport& report);
std::string IoBenchJson(const IoBenchReport& report);

// The median of a non-empty list.
double Median(std::vector<double> values);
// fio's bandwidth in GB/s for `op` from its JSON output.
Result<double> ParseFioBandwidthGbps(const std::string& fio_json, IoOp op);

}  // namespace strata::bench
