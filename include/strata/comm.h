// The communicator seam: the collectives data parallelism needs, over one
// group of ranks: in-process loopback (ranks as threads), MPI (host buffers)
// or NCCL (one GPU per rank). See Note [Communicators] in comm.cc.
//
// Contract: every rank of the group calls the same collectives in the same
// order with the same sizes. A collective not complete within
// CommOptions::timeout_ms is Timeout on every rank that waited; after any
// failure the communicator is broken and every later call is CommError at
// once. Thread-safety: one thread at a time runs collectives on a
// communicator (a second one is CommError at once); stats() from any thread.
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
  // `send` holds world_size slices of `count_per_rank` elements of `dtype`
  // (fp32, bf16 or fp16, 16-bit values as their bits); `recv` gets the
  // element-wise sum over ranks of slice rank(), in `dtype`. See Note
  // [16-bit sums] in comm.cc.
  Status ReduceScatterSum(const void* send, void* recv, size_t count_per_rank, DType dtype);
  Status ReduceScatterSum(const float* send, float* recv, size_t count_per_rank) {
    return ReduceScatterSum(send, recv, count_per_rank, DType::kFloat32);
  }
  // In place: every rank ends with the element-wise sum.
  Status AllReduceSum(std::span<double> values);
  Status Broadcast(void* data, size_t bytes, int root);
  virtual Status Barrier() = 0;

  // Calls, time and bytes sent per collective (Note [Communicators]); a
  // snapshot, safe to take while another thread runs a collective.
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
// rank sends (Communicator::stats) over that rate. InvalidArgument unless
// gbps > 0.
Result<std::unique_ptr<Communicator>> CreateThrottledCommunicator(Communicator& inner, double gbps);

// MPI_COMM_WORLD (initializing MPI with thread support if nobody has).
// NotSupported when strata was built without MPI.
Result<std::unique_ptr<Communicator>> CreateMpiCommunicator(CommOptions options = {});
// NCCL over the ranks of `bootstrap`, each on its CUDA device `device_index`.
// `bootstrap` (borrowed, used only during the call, null for one rank)
// carries NCCL's unique id from rank 0. Device buffers go to NCCL as they
// are, host buffers through device staging. Creation follows the seam's
// timeout contract. NotSupported without CUDA or a visible GPU;
// InvalidArgument for a device index this process does not see. See the
// file comment of nccl_comm.cc.
Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator* bootstrap, int device_index,
                                                             CommOptions options = {});

// Whether this process was started by an MPI launcher (mpirun sets OMPI_COMM_WORLD_SIZE or PMI_SIZE).
bool LaunchedByMpi();

// Checks that every rank passes the same `value`: InvalidArgument on every
// rank naming `what` and the ranks that differ from rank 0.
Status CheckSameOnAllRanks(Communicator& comm, std::string_view what, std::string_view value);

// Whether every rank's `status` is OK, decided alike on every rank (one
// small all-reduce): a failing rank gets its own error back, the others an
// error naming the ranks that failed, InvalidArgument if any of theirs was,
// else IoError. `any_invalid`: whether any rank's was InvalidArgument, the
// same on every rank. A null `comm` or a single rank: `status` itself.
Status AgreeOnStatus(Communicator* comm, const Status& status, std::string_view what, bool* any_invalid = nullptr);

}  // namespace strata
