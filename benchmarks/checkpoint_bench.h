// `strata bench checkpoint`: a checkpoint's save and load bandwidth
// (strata/checkpoint.h) against the NVMe write and read bandwidth
// that `strata bench io` measures on the same directory in the same run, and
// the host memory a save takes beyond what it held before. See Note [The
// checkpoint bench] in checkpoint_bench.cc for the model and the runs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/status.h"

namespace strata::bench {

struct CheckpointBenchConfig {
  std::string dir;
  uint64_t params = uint64_t{32} << 20;
  uint64_t chunk_elems = uint64_t{4} << 20;
  bool states_on_nvme = false;
  bool recycle = true;  // CheckpointOptions::recycle
  uint32_t runs = 3;
};

struct CheckpointBenchReport {
  CheckpointBenchConfig config;
  uint64_t checkpoint_bytes = 0;
  uint32_t files = 0;
  uint32_t saved_from_nvme = 0;              // chunks homed in the NVMe tier, read from there by a save
  std::vector<double> save_gbps, load_gbps;  // per run
  double save_median_gbps = 0, load_median_gbps = 0;
  // Asynchronous saves (StartCheckpoint, then Wait, nothing training
  // between): their bandwidth per run, and the longest StartCheckpoint took
  // to return (what the training loop waits).
  std::vector<double> async_save_gbps;
  double async_save_median_gbps = 0, async_save_ratio = 0;  // (the ratio: as save_ratio)
  double async_start_max_ms = 0;
  // The first save, into new files; and the fewest files a measured save
  // wrote over those of a removed checkpoint (recycle).
  double first_save_gbps = 0, first_save_ratio = 0;
  uint32_t recycled_files = 0;
  // strata bench io, sequential, 1 MiB x 32: a pass each way per run, and their medians.
  std::vector<double> io_write_run_gbps, io_read_run_gbps;
  double io_write_gbps = 0, io_read_gbps = 0;
  double save_ratio = 0, load_ratio = 0;  // the medians of each run's ratio to its own bench io pass
  uint64_t buffer_bytes = 0;                   // the save's three chunk-sized buffers
  uint64_t save_rss_growth_bytes = 0;          // the peak resident set during a save, above its start
};

// InvalidArgument without a dir, with no runs, or with params under a chunk;
// removes the checkpoint and the bench io file it wrote.
Result<CheckpointBenchReport> RunCheckpointBench(const CheckpointBenchConfig& config);
// The report as a table for people, and as JSON for scripts.
std::string FormatCheckpointBench(const CheckpointBenchReport& report);
std::string CheckpointBenchJson(const CheckpointBenchReport& report);

}  // namespace strata::bench
