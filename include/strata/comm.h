// The communicator seam: the collectives data parallelism needs, over one
// group of ranks.
//
// Implementations: an in-process loopback (ranks as threads; how tests and
// `strata bench comm --backend loopback` run several ranks in one process),
// MPI over MPI_COMM_WORLD (src/comm/mpi_comm.cc, the only file that
// includes <mpi.h>; host buffers), and NCCL over one GPU per rank
// (src/comm/nccl_comm.cc, the only file that includes <nccl.h>; device
// buffers as they are, host buffers staged through the device).
//
// Contract: every rank of the group calls the same collectives in the same
// order with the same sizes. A collective that does not complete within
// CommOptions::timeout_ms (a rank that died or never came) is Timeout on
// every rank that waited, naming the collective and the ranks missing where
// the backend knows them; after any failure the communicator is broken and
// every later call is CommError at once, so that no rank hangs on a group
// that cannot complete. Thread-safety: one thread at a time runs
// collectives on a communicator (a collective begun while another runs is
// CommError at once, instead of MPI's undefined behaviour); stats() from any
// thread.
//
// Every communicator counts what it carried (stats()): for each collective,
// its calls, their time, and the bytes this rank sends under the
// bandwidth-optimal ring algorithm — (W-1)/W of the whole buffer for an
// all-gather or a reduce-scatter, twice that for an all-reduce, the buffer
// for a broadcast — the volume ZeRO's figures count.
#pragma once

#include <cstddef>
#include <cstdint>
#include <atomic>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "strata/status.h"
#include "strata/types.h"

namespace strata {

struct CommOptions {
  uint32_t timeout_ms = 60'000;  // a collective waiting for its ranks
};

struct CollectiveStats {
  uint64_t calls = 0;
  uint64_t bytes = 0;  // sent by this rank (ring algorithm)
  double seconds = 0;
};

struct CommStats {
  CollectiveStats all_gather, reduce_scatter, all_reduce, broadcast;
  uint64_t total_bytes() const { return all_gather.bytes + reduce_scatter.bytes + all_reduce.bytes + broadcast.bytes; }
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual std::string Describe() const = 0;

  // `recv` (world_size * bytes_per_rank) gets rank r's `send` at r * bytes_per_rank.
  Status AllGather(const void* send, void* recv, size_t bytes_per_rank);
  // `send` holds world_size slices of `count_per_rank` elements of `dtype`;
  // `recv` gets the element-wise sum over ranks of slice rank(), in `dtype`.
  // fp32, bf16 or fp16 (16-bit values as their bits, uint16_t): a 16-bit
  // sum is formed in fp32 and rounded to nearest even, by the loopback once
  // (in rank order), by MPI at each step of its reduction (as NCCL's ring
  // does); so 16-bit sums of integers are exact only while they stay
  // representable (256 for bf16, 2048 for fp16).
  Status ReduceScatterSum(const void* send, void* recv, size_t count_per_rank, DType dtype);
  Status ReduceScatterSum(const float* send, float* recv, size_t count_per_rank) {
    return ReduceScatterSum(send, recv, count_per_rank, DType::kFloat32);
  }
  // In place: every rank ends with the element-wise sum.
  Status AllReduceSum(std::span<double> values);
  Status Broadcast(void* data, size_t bytes, int root);
  virtual Status Barrier() = 0;

  // A snapshot (safe to take while another thread runs a collective).
  CommStats stats() const;

 protected:
  virtual Status DoAllGather(const void* send, void* recv, size_t bytes_per_rank) = 0;
  virtual Status DoReduceScatterSum(const void* send, void* recv, size_t count_per_rank, DType dtype) = 0;
  virtual Status DoAllReduceSum(std::span<double> values) = 0;
  virtual Status DoBroadcast(void* data, size_t bytes, int root) = 0;

 private:
  // Times a collective and counts it; refuses one while another runs (on another thread).
  template <typename Call>
  Status Counted(const char* op, CollectiveStats CommStats::*which, uint64_t bytes, Call&& call);

  mutable std::mutex stats_mu_;
  CommStats stats_;
  std::atomic<bool> busy_{false};
};

// `world_size` communicators of one in-process group: give each to its own
// thread. InvalidArgument for world_size < 1.
Result<std::vector<std::unique_ptr<Communicator>>> CreateLoopbackGroup(int world_size, CommOptions options = {});

// `inner` (borrowed: it must outlive the result) with its collectives
// slowed to `gbps` (1e9 bytes/s): each one takes at least the bytes this
// rank sends (Communicator::stats) over that rate, sleeping out the rest —
// a network slower than the loopback, for the replay bench and tests.
// InvalidArgument unless gbps > 0.
Result<std::unique_ptr<Communicator>> CreateThrottledCommunicator(Communicator& inner, double gbps);

// MPI_COMM_WORLD (initializing MPI with thread support if nobody has).
// NotSupported when strata was built without MPI.
Result<std::unique_ptr<Communicator>> CreateMpiCommunicator(CommOptions options = {});
// NCCL over the ranks of `bootstrap`, each on its CUDA device `device_index`.
// `bootstrap` (borrowed, needed only during the call) carries NCCL's unique
// id from rank 0 to the others, one broadcast, and nothing after: MPI under
// mpirun, torch.distributed's gloo under torchrun; null for a group of one
// rank. A buffer in this device's memory goes to NCCL as it is; host memory
// is staged through device buffers the communicator keeps (grown to the
// largest message). Failures follow the seam's contract: a collective or the
// group's creation not complete within `options.timeout_ms` is a Timeout, an
// error NCCL reports meanwhile (a peer gone) a CommError with NCCL's text;
// either aborts the NCCL communicator (ncclCommAbort) and breaks this one.
// NotSupported when strata was built without CUDA or no GPU is visible;
// InvalidArgument for a device index this process does not see.
Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator* bootstrap, int device_index,
                                                             CommOptions options = {});

// Whether this process was started by an MPI launcher (mpirun sets OMPI_COMM_WORLD_SIZE or PMI_SIZE).
bool LaunchedByMpi();

// Checks that every rank passes the same `value` (a configuration, a model's
// layout): InvalidArgument on every rank naming `what` and the ranks that
// differ from rank 0, so that a mismatch is found at start, not as a hang
// or wrong numbers later.
Status CheckSameOnAllRanks(Communicator& comm, std::string_view what, std::string_view value);

// Whether every rank's `status` is OK, decided alike on every rank (one
// small all-reduce): a failing rank gets its own error back, the others an
// error naming the ranks that failed, InvalidArgument if any of theirs was,
// else IoError. `any_invalid`: whether any rank's was InvalidArgument, the
// same on every rank (so that what the ranks do next, such as a load
// falling back to an older checkpoint, is the same). A null `comm` or a
// single rank: `status` itself.
Status AgreeOnStatus(Communicator* comm, const Status& status, std::string_view what, bool* any_invalid = nullptr);

}  // namespace strata
