// `strata bench comm`: all-gather and reduce-scatter of chunk-sized messages
// on a communicator backend, beside that backend's raw figure for the same
// sizes, measured in the same run.
//
// A size is the bytes of one whole fp32 chunk; each of W ranks holds 1/W of
// it (ZeRO-3's shard). Bus bandwidth follows nccl-tests: bytes / seconds x
// (W - 1) / W, what each rank's links carry. The raw figure:
//   mpi       — the MPI library's own blocking MPI_Allgather and
//               MPI_Reduce_scatter_block (strata's communicator runs the
//               non-blocking calls polled against its timeout);
//   nccl      — ncclAllGather and ncclReduceScatter on device buffers,
//               waited for with cudaStreamSynchronize (nccl-tests' way);
//               strata's communicator gets device buffers too, or host
//               buffers with `host_buffers` (staged through the device, as
//               the gradient reducer's are today). One rank without mpirun
//               (bus bandwidth is then 0: the algorithm bandwidth is shown);
//   loopback  — the same bytes moved (all-gather: copied from the other
//               ranks' buffers; reduce-scatter: summed from them) by the same
//               threads at the same time, without the group's barriers.
// Each figure is the mean over `iterations` after two warm-up rounds; the
// backends alternate per size. Under mpirun every rank runs it and rank 0
// reports.
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

Result<CommBenchReport> RunCommBench(const CommBenchConfig& config);
std::string FormatCommBench(const CommBenchReport& report);
std::string CommBenchJson(const CommBenchReport& report);

}  // namespace strata::bench
