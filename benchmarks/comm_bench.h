// `strata bench comm`: all-gather and reduce-scatter of chunk-sized messages
// on a communicator backend, beside that backend's raw figure for the same
// sizes, measured in the same run. Under mpirun every rank runs it and rank
// 0 reports. See Note [The comm bench] in comm_bench.cc for the figures.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/status.h"

namespace strata::bench {

struct CommBenchConfig {
  std::string backend = "auto";  // auto (mpi under mpirun, else loopback), loopback, mpi or nccl
  int ranks = 2;                 // loopback: ranks as threads
  std::vector<uint64_t> sizes = {uint64_t{1} << 20, uint64_t{4} << 20, uint64_t{16} << 20};
  uint32_t iterations = 20;
  uint32_t timeout_ms = 60'000;
  bool host_buffers = false;  // nccl: strata's communicator given host buffers
  int device_index = -1;      // nccl: the GPU; -1 = the local rank under mpirun, else 0
};

struct CommBenchRow {
  uint64_t bytes = 0;
  double all_gather_busbw = 0, all_gather_raw_busbw = 0;  // bytes/s
  double reduce_scatter_busbw = 0, reduce_scatter_raw_busbw = 0;
};

struct CommBenchReport {
  CommBenchConfig config;
  std::string backend;  // the communicator's description
  int world = 0;
  int rank = 0;
  std::vector<CommBenchRow> rows;
};

// InvalidArgument for no iterations or sizes, an unknown backend, or
// host_buffers off nccl; NotSupported for a backend this build lacks.
Result<CommBenchReport> RunCommBench(const CommBenchConfig& config);
// The report as a table for people, and as JSON for scripts.
std::string FormatCommBench(const CommBenchReport& report);
std::string CommBenchJson(const CommBenchReport& report);

}  // namespace strata::bench
