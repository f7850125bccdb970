// What every communicator shares: its collectives counted (and refused while
// another runs), the configuration check across ranks, and whether an MPI
// launcher started this process.
//
// Note [Communicators]
// Three implementations of the seam: an in-process loopback (ranks as
// threads: several ranks in one process, for tests and benchmarks), MPI over
// MPI_COMM_WORLD (mpi_comm.cc, the only file that includes <mpi.h>; host
// buffers), and NCCL over one GPU per rank (nccl_comm.cc, the only file that
// includes <nccl.h>; device buffers as they are, host buffers staged through
// the device). A collective that times out (a rank that died or never came)
// names the collective and the ranks missing where the backend knows them;
// a failed communicator stays broken so that no rank hangs on a group that
// cannot complete; a collective begun while another runs is refused, instead
// of MPI's undefined behaviour.
//
// Every communicator counts what it carried: for each collective, its calls,
// their time, and the bytes this rank sends under the bandwidth-optimal ring
// algorithm — (W-1)/W of the whole buffer for an all-gather or a
// reduce-scatter, twice that for an all-reduce, the buffer for a broadcast —
// the volume ZeRO's figures count.
//
// Note [16-bit sums]
// A bf16 or fp16 reduce-scatter forms each sum in fp32 and rounds it to
// nearest even: the loopback once (adding in rank order), MPI at each step of
// its reduction (as NCCL's ring does). So 16-bit sums of integers are exact
// only while they stay representable (256 for bf16, 2048 for fp16).
//
// CheckSameOnAllRanks exists so that a mismatch of configuration or model
// layout is found at start, not as a hang or wrong numbers later;
// AgreeOnStatus so that what the ranks do after a failure (a load falling
// back to an older checkpoint) is the same on every rank.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "src/backends/comm/raw_collectives.h"
#include "strata/comm.h"
#include "src/base/crc32c.h"

namespace strata {

template <typename Call>
Status Communicator::Counted(const char* op, CollectiveStats CommStats::*which, uint64_t bytes, Call&& call) {
  if (busy_.exchange(true)) {
    return CommError("{} on rank {}: another collective is running on this communicator (on another thread): "
                     "collectives run one at a time, in the same order on every rank (drain the gradient reducer "
                     "before the caller's own)",
                     op, rank());
  }
  const auto start = std::chrono::steady_clock::now();
  Status status = call();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  {
    std::lock_guard lock(stats_mu_);
    CollectiveStats& into = stats_.*which;
    into.calls++;
    into.bytes += bytes;
    into.seconds += seconds;
  }
  busy_ = false;
  return status;
}

CommStats Communicator::stats() const {
  std::lock_guard lock(stats_mu_);
  return stats_;
}

Status Communicator::AllGather(const void* send, void* recv, size_t bytes_per_rank) {
  const uint64_t bytes = static_cast<uint64_t>(world_size() - 1) * bytes_per_rank;
  return Counted("all-gather", &CommStats::all_gather, bytes,
                 [&] { return DoAllGather(send, recv, bytes_per_rank); });
}

Status Communicator::ReduceScatterSum(const void* send, void* recv, size_t count_per_rank, DType dtype) {
  const uint64_t bytes = static_cast<uint64_t>(world_size() - 1) * count_per_rank * DTypeSizeBytes(dtype);
  return Counted("reduce-scatter", &CommStats::reduce_scatter, bytes,
                 [&] { return DoReduceScatterSum(send, recv, count_per_rank, dtype); });
}

Status Communicator::AllReduceSum(std::span<double> values) {
  const uint64_t bytes = 2 * static_cast<uint64_t>(world_size() - 1) * values.size_bytes() / world_size();
  return Counted("all-reduce", &CommStats::all_reduce, bytes, [&] { return DoAllReduceSum(values); });
}

Status Communicator::Broadcast(void* data, size_t bytes, int root) {
  return Counted("broadcast", &CommStats::broadcast, world_size() > 1 ? bytes : 0,
                 [&] { return DoBroadcast(data, bytes, root); });
}

bool LaunchedByMpi() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(name) != nullptr) return true;
  }
  return false;
}

Status CheckSameOnAllRanks(Communicator& comm, std::string_view what, std::string_view value) {
  // Each rank's (length, CRC32C) of the value: enough to tell them apart, and one small all-gather.
  const uint64_t mine[2] = {value.size(), Crc32c(value.data(), value.size())};
  std::vector<uint64_t> all(2 * static_cast<size_t>(comm.world_size()));
  STRATA_RETURN_IF_ERROR(comm.AllGather(mine, all.data(), sizeof(mine)).WithContext(
      fmt::format("checking that every rank has the same {}", what)));
  std::vector<int> differ;
  for (int r = 1; r < comm.world_size(); ++r) {
    if (all[2 * r] != all[0] || all[2 * r + 1] != all[1]) differ.push_back(r);
  }
  if (differ.empty()) return Status::Ok();
  return InvalidArgument("the {} of rank(s) {} differ(s) from rank 0's: every rank must start with the same {}{}", what,
                         fmt::join(differ, ", "), what,
                         comm.rank() == 0 || std::find(differ.begin(), differ.end(), comm.rank()) == differ.end()
                             ? std::string()
                             : fmt::format(" (this is rank {}: {})", comm.rank(), value));
}

Status AgreeOnStatus(Communicator* comm, const Status& status, std::string_view what, bool* any_invalid) {
  if (any_invalid != nullptr) *any_invalid = status.code() == StatusCode::kInvalidArgument;
  if (comm == nullptr || comm->world_size() == 1) return status;
  const int world = comm->world_size();
  std::vector<double> failed(2 * world, 0.0);  // failed, then failed with InvalidArgument, per rank
  failed[comm->rank()] = status.ok() ? 0.0 : 1.0;
  failed[world + comm->rank()] = status.code() == StatusCode::kInvalidArgument ? 1.0 : 0.0;
  STRATA_RETURN_IF_ERROR(comm->AllReduceSum(failed).WithContext(fmt::format("agreeing on {}", what)));
  std::vector<int> ranks;
  bool invalid = false;
  for (int r = 0; r < world; ++r) {
    if (failed[r] > 0) ranks.push_back(r);
    invalid = invalid || failed[world + r] > 0;
  }
  if (any_invalid != nullptr) *any_invalid = invalid;  // the same on every rank
  if (!status.ok()) return status;
  if (ranks.empty()) return Status::Ok();
  const std::string message =
      fmt::format("{} failed on rank(s) {} (their own errors say why)", what, fmt::join(ranks, ", "));
  return invalid ? InvalidArgument("{}", message) : IoError("{}", message);
}

#if !defined(STRATA_WITH_MPI)
Result<std::unique_ptr<Communicator>> CreateMpiCommunicator(CommOptions) {
  return NotSupported("MPI: strata was built without it (install libopenmpi-dev and rebuild)");
}
namespace comm {
Status MpiRawAllGather(const void*, void*, size_t) { return NotSupported("MPI: strata was built without it"); }
Status MpiRawReduceScatterSum(const float*, float*, size_t) { return NotSupported("MPI: strata was built without it"); }
}  // namespace comm
#endif

#if !defined(STRATA_WITH_NCCL)
Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator*, int, CommOptions) {
  return NotSupported("NCCL communicator: strata was built without CUDA and NCCL (/usr/local/cuda); use "
                      "comm.backend host (MPI or gloo)");
}
namespace comm {
Status NcclRawAllGather(Communicator&, const void*, void*, size_t) {
  return NotSupported("NCCL: strata was built without it");
}
Status NcclRawReduceScatterSum(Communicator&, const float*, float*, size_t) {
  return NotSupported("NCCL: strata was built without it");
}
}  // namespace comm
#endif

}  // namespace strata
