#include "benchmarks/comm_bench.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "src/backends/comm/raw_collectives.h"
#include "strata/comm.h"
#include "strata/device.h"
#include "strata/options.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

// The backend's own collectives for one rank (see Note [The comm bench]).
struct RawOps {
  std::function<Status(const float* shard, float* full, size_t shard_count)> all_gather;
  std::function<Status(const float* full, float* shard, size_t shard_count)> reduce_scatter;
};

// Seconds per call of `op`: two warm-ups, then `iterations` calls closed by a barrier.
Result<double> Time(Communicator& comm, uint32_t iterations, const std::function<Status()>& op) {
  for (int i = 0; i < 2; ++i) STRATA_RETURN_IF_ERROR(op());
  STRATA_RETURN_IF_ERROR(comm.Barrier());
  const Clock::time_point start = Clock::now();
  for (uint32_t i = 0; i < iterations; ++i) STRATA_RETURN_IF_ERROR(op());
  STRATA_RETURN_IF_ERROR(comm.Barrier());
  return std::chrono::duration<double>(Clock::now() - start).count() / iterations;
}

// Copies `bytes` between host and device memory and waits.
Status CopyAndWait(Device& device, CopyStream stream, void* dst, const void* src, size_t bytes, uint32_t timeout_ms) {
  STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Event> done, device.CopyAsync(stream, dst, src, bytes));
  return done->Wait(timeout_ms);
}

// Every size on one rank; `shards[r]` and `fulls[r]` are rank r's send
// buffers (constant during the run, so the loopback's raw ops may read them).
// With `device` (NCCL), the raw ops run on device copies of the buffers, and
// strata's communicator too unless `host_buffers`.
Result<std::vector<CommBenchRow>> RunRank(Communicator& comm, const CommBenchConfig& config, const RawOps& raw,
                                          std::vector<std::vector<float>>& shards,
                                          std::vector<std::vector<float>>& fulls, Device* device = nullptr) {
  const int world = comm.world_size(), me = comm.rank();
  std::vector<CommBenchRow> rows;
  for (uint64_t bytes : config.sizes) {
    const size_t shard = bytes / sizeof(float) / world;
    CommBenchRow row;
    row.bytes = shard * sizeof(float) * world;
    shards[me].assign(shard, static_cast<float>(me));
    fulls[me].assign(shard * world, 1.0f);
    std::vector<float> gathered(shard * world), reduced(shard);
    // The buffers each side is given: host vectors, or their device copies.
    float *shard_at = shards[me].data(), *full_at = fulls[me].data(), *gathered_at = gathered.data(),
          *reduced_at = reduced.data();
    float *raw_shard = shard_at, *raw_full = full_at, *raw_gathered = gathered_at, *raw_reduced = reduced_at;
    std::vector<Buffer> on_device;
    if (device != nullptr) {
      for (size_t n : {shard, shard * world, shard * world, shard}) {
        STRATA_ASSIGN_OR_RETURN(Buffer b, device->Allocate(n * sizeof(float)));
        on_device.push_back(std::move(b));
      }
      raw_shard = static_cast<float*>(on_device[0].data());
      raw_full = static_cast<float*>(on_device[1].data());
      raw_gathered = static_cast<float*>(on_device[2].data());
      raw_reduced = static_cast<float*>(on_device[3].data());
      STRATA_RETURN_IF_ERROR(CopyAndWait(*device, CopyStream::kHostToDevice, raw_shard, shard_at,
                                         shard * sizeof(float), config.timeout_ms));
      STRATA_RETURN_IF_ERROR(CopyAndWait(*device, CopyStream::kHostToDevice, raw_full, full_at,
                                         shard * world * sizeof(float), config.timeout_ms));
      if (!config.host_buffers) {
        shard_at = raw_shard, full_at = raw_full, gathered_at = raw_gathered, reduced_at = raw_reduced;
      }
    }
    STRATA_RETURN_IF_ERROR(comm.Barrier());  // every rank's buffers are in place
    // Bus bandwidth; a group of one moves nothing between ranks, so its figure is the algorithm bandwidth.
    const auto bus = [&](double seconds) {
      return static_cast<double>(row.bytes) / seconds * (world > 1 ? (world - 1.0) / world : 1.0);
    };
    STRATA_ASSIGN_OR_RETURN(double ag, Time(comm, config.iterations, [&] {
      return comm.AllGather(shard_at, gathered_at, shard * sizeof(float));
    }));
    STRATA_ASSIGN_OR_RETURN(double ag_raw, Time(comm, config.iterations, [&] {
      return raw.all_gather(raw_shard, raw_gathered, shard);
    }));
    STRATA_ASSIGN_OR_RETURN(double rs, Time(comm, config.iterations, [&] {
      return comm.ReduceScatterSum(full_at, reduced_at, shard);
    }));
    STRATA_ASSIGN_OR_RETURN(double rs_raw, Time(comm, config.iterations, [&] {
      return raw.reduce_scatter(raw_full, raw_reduced, shard);
    }));
    if (device != nullptr) {  // the raw ops wrote last; strata's results are the same bytes
      STRATA_RETURN_IF_ERROR(CopyAndWait(*device, CopyStream::kDeviceToHost, gathered.data(), raw_gathered,
                                         gathered.size() * sizeof(float), config.timeout_ms));
      STRATA_RETURN_IF_ERROR(CopyAndWait(*device, CopyStream::kDeviceToHost, reduced.data(), raw_reduced,
                                         reduced.size() * sizeof(float), config.timeout_ms));
    }
    if (gathered[shard * (world - 1)] != static_cast<float>(world - 1) || reduced[0] != static_cast<float>(world)) {
      return Internal("bench comm: rank {} got wrong results ({} and {})", me, gathered[shard * (world - 1)],
                      reduced[0]);
    }
    row.all_gather_busbw = bus(ag);
    row.all_gather_raw_busbw = bus(ag_raw);
    row.reduce_scatter_busbw = bus(rs);
    row.reduce_scatter_raw_busbw = bus(rs_raw);
    rows.push_back(row);
    STRATA_RETURN_IF_ERROR(comm.Barrier());  // nobody reads a buffer about to be reassigned
  }
  return rows;
}

Result<CommBenchReport> RunLoopback(const CommBenchConfig& config) {
  if (config.ranks < 2) return InvalidArgument("bench comm: --ranks {} must be >= 2", config.ranks);
  STRATA_ASSIGN_OR_RETURN(auto group, CreateLoopbackGroup(config.ranks, {.timeout_ms = config.timeout_ms}));
  const int world = config.ranks;
  std::vector<std::vector<float>> shards(world), fulls(world);
  std::vector<Result<std::vector<CommBenchRow>>> results(world, std::vector<CommBenchRow>{});
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      RawOps raw;
      raw.all_gather = [&](const float*, float* full, size_t n) {
        for (int q = 0; q < world; ++q) std::memcpy(full + q * n, shards[q].data(), n * sizeof(float));
        return Status::Ok();
      };
      raw.reduce_scatter = [&, r](const float*, float* out, size_t n) {
        std::fill(out, out + n, 0.0f);
        for (int q = 0; q < world; ++q) {
          const float* slice = fulls[q].data() + r * n;
          for (size_t i = 0; i < n; ++i) out[i] += slice[i];
        }
        return Status::Ok();
      };
      results[r] = RunRank(*group[r], config, raw, shards, fulls);
    });
  }
  for (std::thread& t : threads) t.join();
  for (auto& result : results) STRATA_RETURN_IF_ERROR(result.status());
  CommBenchReport report{.config = config, .backend = group[0]->Describe(), .world = world, .rank = 0,
                         .rows = std::move(results[0]).value()};
  return report;
}

Result<CommBenchReport> RunMpi(const CommBenchConfig& config) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm, CreateMpiCommunicator({.timeout_ms = config.timeout_ms}));
  if (comm->world_size() < 2) {
    return InvalidArgument("bench comm --backend mpi: one rank; run it under mpirun -np N with N >= 2");
  }
  RawOps raw;
  raw.all_gather = [](const float* shard, float* full, size_t n) {
    return comm::MpiRawAllGather(shard, full, n * sizeof(float));
  };
  raw.reduce_scatter = [](const float* full, float* shard, size_t n) {
    return comm::MpiRawReduceScatterSum(full, shard, n);
  };
  // Only this rank's buffers exist here; the vectors are indexed by rank.
  std::vector<std::vector<float>> shards(comm->world_size()), fulls(comm->world_size());
  STRATA_ASSIGN_OR_RETURN(std::vector<CommBenchRow> rows, RunRank(*comm, config, raw, shards, fulls));
  return CommBenchReport{.config = config, .backend = comm->Describe(), .world = comm->world_size(),
                         .rank = comm->rank(), .rows = std::move(rows)};
}

// NCCL on this process's GPU (--device-index, else the local rank under mpirun or SLURM),
// bootstrapped by MPI under mpirun, else a group of one rank.
Result<CommBenchReport> RunNccl(const CommBenchConfig& config) {
  std::unique_ptr<Communicator> bootstrap;
  if (LaunchedByMpi()) {
    STRATA_ASSIGN_OR_RETURN(bootstrap, CreateMpiCommunicator({.timeout_ms = config.timeout_ms}));
  }
  int device_index = config.device_index;
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}) {
    const char* local = std::getenv(name);
    if (device_index < 0 && local != nullptr) device_index = std::atoi(local);
  }
  device_index = std::max(device_index, 0);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> comm,
                          CreateNcclCommunicator(bootstrap.get(), device_index, {.timeout_ms = config.timeout_ms}));
  const uint64_t largest = *std::max_element(config.sizes.begin(), config.sizes.end());
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Device> device, CreateCudaDevice(device_index, 4 * largest + (8 << 20)));
  RawOps raw;
  raw.all_gather = [&](const float* shard, float* full, size_t n) {
    return comm::NcclRawAllGather(*comm, shard, full, n * sizeof(float));
  };
  raw.reduce_scatter = [&](const float* full, float* shard, size_t n) {
    return comm::NcclRawReduceScatterSum(*comm, full, shard, n);
  };
  std::vector<std::vector<float>> shards(comm->world_size()), fulls(comm->world_size());
  STRATA_ASSIGN_OR_RETURN(std::vector<CommBenchRow> rows, RunRank(*comm, config, raw, shards, fulls, device.get()));
  return CommBenchReport{.config = config,
                         .backend = comm->Describe() + (config.host_buffers ? ", strata given host buffers" : ""),
                         .world = comm->world_size(),
                         .rank = comm->rank(),
                         .rows = std::move(rows)};
}

}  // namespace

// Note [The comm bench]
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
Result<CommBenchReport> RunCommBench(const CommBenchConfig& config) {
  if (config.iterations == 0) return InvalidArgument("bench comm: --iterations must be > 0");
  if (config.sizes.empty()) return InvalidArgument("bench comm: --sizes is empty");
  std::string backend = config.backend;
  if (backend == "auto") backend = LaunchedByMpi() ? "mpi" : "loopback";
  if (config.host_buffers && backend != "nccl") {
    return InvalidArgument("bench comm: --host-buffers is for --backend nccl (the others carry host buffers only)");
  }
  if (backend == "loopback") return RunLoopback(config);
  if (backend == "mpi") return RunMpi(config);
  if (backend == "nccl") return RunNccl(config);
  return InvalidArgument("bench comm: --backend {}: expected auto, loopback, mpi or nccl", config.backend);
}

std::string FormatCommBench(const CommBenchReport& r) {
  std::string out = fmt::format(
      "strata bench comm: {}; {} ranks; {}, mean of {}\n"
      "{:>10} {:>12} {:>12} {:>7} {:>14} {:>12} {:>7}\n",
      r.backend, r.world,
      r.world > 1 ? "bus bandwidth GB/s (bytes x (W-1)/W / seconds)" : "algorithm bandwidth GB/s (bytes / seconds)",
      r.config.iterations, "chunk", "all-gather", "raw", "ratio", "reduce-scatter", "raw",
      "ratio");
  for (const CommBenchRow& row : r.rows) {
    out += fmt::format("{:>10} {:>12.2f} {:>12.2f} {:>7.2f} {:>14.2f} {:>12.2f} {:>7.2f}\n", FormatSize(row.bytes),
                       row.all_gather_busbw / 1e9, row.all_gather_raw_busbw / 1e9,
                       row.all_gather_busbw / row.all_gather_raw_busbw, row.reduce_scatter_busbw / 1e9,
                       row.reduce_scatter_raw_busbw / 1e9, row.reduce_scatter_busbw / row.reduce_scatter_raw_busbw);
  }
  return out;
}

std::string CommBenchJson(const CommBenchReport& r) {
  nlohmann::json j;
  j["backend"] = r.backend;
  j["world"] = r.world;
  j["iterations"] = r.config.iterations;
  for (const CommBenchRow& row : r.rows) {
    j["rows"].push_back({{"bytes", row.bytes},
                         {"all_gather_busbw", row.all_gather_busbw},
                         {"all_gather_raw_busbw", row.all_gather_raw_busbw},
                         {"reduce_scatter_busbw", row.reduce_scatter_busbw},
                         {"reduce_scatter_raw_busbw", row.reduce_scatter_raw_busbw}});
  }
  return j.dump(2);
}

}  // namespace strata::bench
