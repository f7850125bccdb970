// The MPI communicator over MPI_COMM_WORLD, host buffers.
//
// Every collective is the non-blocking MPI call polled with MPI_Test (as
// fast as MPI's own blocking calls poll for 100 ms, then every millisecond)
// until it completes or the timeout passes, so a rank that died or never
// came is a Timeout here, not a hang. MPI has no way to cancel a collective: the
// communicator is broken after it, and at exit the process gives the
// abandoned collectives two seconds to complete (a late peer) and otherwise
// ends through MPI_Abort rather than wait in MPI_Finalize for a dead rank.
// MPI errors return (MPI_ERRORS_RETURN) and become CommError with MPI's text.

// The C API only: OpenMPI and MPICH would pull in their deprecated C++ bindings.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "src/base/half.h"
#include "src/backends/comm/raw_collectives.h"
#include "strata/comm.h"

namespace strata {
namespace {

// What a broken communicator leaves behind for the exit: the requests of
// collectives that timed out (a peer may be gone, so MPI_Finalize could
// wait for ever), and whether an MPI call itself failed. At exit they are
// given a moment to complete (a late peer); if they do not, the process ends
// through MPI_Abort instead of hanging in MPI_Finalize.
std::vector<MPI_Request> abandoned_requests;
std::atomic<bool> call_failed{false};

void FinalizeAtExit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  int done = abandoned_requests.empty() ? 1 : 0;
  while (!done && std::chrono::steady_clock::now() < deadline) {
    MPI_Testall(static_cast<int>(abandoned_requests.size()), abandoned_requests.data(), &done, MPI_STATUSES_IGNORE);
    if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!done || call_failed) MPI_Abort(MPI_COMM_WORLD, 1);
  MPI_Finalize();
}

std::string MpiErrorText(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(code, text, &length);
  return std::string(text, static_cast<size_t>(length));
}

// MPI has no 16-bit float types (before MPI 4.1): bf16 and fp16 travel as
// MPI_UINT16_T and are summed by these operations, in fp32 and rounded at
// each step of the reduction, as NCCL's ring does.
template <DType kDType>
void SumHalves(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) {
    optim::StoreFloat(b, kDType, i, optim::FloatAt(a, kDType, i) + optim::FloatAt(b, kDType, i));
  }
}

// The MPI type and sum operation of `dtype` (the 16-bit operations created
// once, after MPI_Init; MPI_Finalize frees them).
std::pair<MPI_Datatype, MPI_Op> SumOf(DType dtype) {
  static const std::pair<MPI_Op, MPI_Op> halves = [] {
    MPI_Op bf16 = MPI_OP_NULL, fp16 = MPI_OP_NULL;
    MPI_Op_create(&SumHalves<DType::kBFloat16>, /*commute=*/1, &bf16);
    MPI_Op_create(&SumHalves<DType::kFloat16>, /*commute=*/1, &fp16);
    return std::pair{bf16, fp16};
  }();
  switch (dtype) {
    case DType::kFloat32: return {MPI_FLOAT, MPI_SUM};
    case DType::kBFloat16: return {MPI_UINT16_T, halves.first};
    case DType::kFloat16: return {MPI_UINT16_T, halves.second};
    case DType::kInt8Block: break;  // moments' codes: never summed
  }
  return {MPI_FLOAT, MPI_SUM};
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(CommOptions options, int rank, int world) : options_(options), rank_(rank), world_(world) {}

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string Describe() const override {
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int length = 0;
    MPI_Get_library_version(version, &length);
    std::string name(version, static_cast<size_t>(length));
    if (const size_t end = name.find_first_of(",\n"); end != std::string::npos) name.resize(end);
    return fmt::format("MPI ({}), rank {} of {}", name, rank_, world_);
  }

  Status Barrier() override {
    return Run("barrier", [&](MPI_Request* request) { return MPI_Ibarrier(MPI_COMM_WORLD, request); });
  }

 protected:
  Status DoAllGather(const void* send, void* recv, size_t bytes_per_rank) override {
    return Run("all-gather", [&](MPI_Request* request) {
      return MPI_Iallgather(send, Count(bytes_per_rank), MPI_BYTE, recv, Count(bytes_per_rank), MPI_BYTE,
                            MPI_COMM_WORLD, request);
    });
  }

  Status DoReduceScatterSum(const void* send, void* recv, size_t count_per_rank, DType dtype) override {
    const std::pair<MPI_Datatype, MPI_Op> sum = SumOf(dtype);  // not a structured binding: Clang 14 cannot capture one
    return Run("reduce-scatter", [&](MPI_Request* request) {
      return MPI_Ireduce_scatter_block(send, recv, Count(count_per_rank), sum.first, sum.second, MPI_COMM_WORLD,
                                       request);
    });
  }

  Status DoAllReduceSum(std::span<double> values) override {
    return Run("all-reduce", [&](MPI_Request* request) {
      return MPI_Iallreduce(MPI_IN_PLACE, values.data(), Count(values.size()), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD,
                            request);
    });
  }

  Status DoBroadcast(void* data, size_t bytes, int root) override {
    if (root < 0 || root >= world_) return InvalidArgument("broadcast: root {} is not a rank of {}", root, world_);
    return Run("broadcast", [&](MPI_Request* request) {
      return MPI_Ibcast(data, Count(bytes), MPI_BYTE, root, MPI_COMM_WORLD, request);
    });
  }

 private:
  // MPI counts are ints: sizes beyond 2^31 - 1 are split by the callers (a chunk never is that large).
  static int Count(size_t n) {
    STRATA_CHECK(n <= static_cast<size_t>(std::numeric_limits<int>::max()), "MPI message of {} elements", n);
    return static_cast<int>(n);
  }

  template <typename Start>
  Status Run(const char* op, Start start) {
    if (!broken_.empty()) return CommError("MPI {} on rank {}: the communicator is broken: {}", op, rank_, broken_);
    MPI_Request request = MPI_REQUEST_NULL;
    if (const int code = start(&request); code != MPI_SUCCESS) {
      call_failed = true;
      Break(fmt::format("MPI {} failed on rank {}: {}", op, rank_, MpiErrorText(code)));
      return CommError("{}", broken_);
    }
    const auto began = std::chrono::steady_clock::now();
    const auto deadline = began + std::chrono::milliseconds(options_.timeout_ms);
    for (;;) {
      int done = 0;
      if (const int code = MPI_Test(&request, &done, MPI_STATUS_IGNORE); code != MPI_SUCCESS) {
        call_failed = true;
        Break(fmt::format("MPI {} failed on rank {}: {}", op, rank_, MpiErrorText(code)));
        return CommError("{}", broken_);
      }
      if (done) return Status::Ok();
      if (std::chrono::steady_clock::now() > deadline) {
        abandoned_requests.push_back(request);
        Break(fmt::format("MPI {} timed out after {} ms on rank {} of {}: a rank died or never joined", op,
                          options_.timeout_ms, rank_, world_));
        return Timeout("{}", broken_);
      }
      // Polled as MPI's blocking calls poll for the first 100 ms (a chunk's
      // collective takes less), then every millisecond until the deadline.
      if (std::chrono::steady_clock::now() - began < std::chrono::milliseconds(100)) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }

  void Break(std::string why) { broken_ = std::move(why); }

  const CommOptions options_;
  const int rank_;
  const int world_;
  std::string broken_;
};

}  // namespace

namespace comm {

Status MpiRawAllGather(const void* send, void* recv, size_t bytes_per_rank) {
  const int count = static_cast<int>(bytes_per_rank);
  const int code = MPI_Allgather(send, count, MPI_BYTE, recv, count, MPI_BYTE, MPI_COMM_WORLD);
  return code == MPI_SUCCESS ? Status::Ok() : CommError("MPI_Allgather: {}", MpiErrorText(code));
}

Status MpiRawReduceScatterSum(const float* send, float* recv, size_t count_per_rank) {
  const int code =
      MPI_Reduce_scatter_block(send, recv, static_cast<int>(count_per_rank), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  return code == MPI_SUCCESS ? Status::Ok() : CommError("MPI_Reduce_scatter_block: {}", MpiErrorText(code));
}

}  // namespace comm

Result<std::unique_ptr<Communicator>> CreateMpiCommunicator(CommOptions options) {
  if (options.timeout_ms == 0) return InvalidArgument("MPI communicator: timeout_ms must be > 0");
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    if (const int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &provided); code != MPI_SUCCESS) {
      return CommError("MPI_Init_thread: {}", MpiErrorText(code));
    }
    // Finalized at exit (or aborted: see abandoned_requests).
    std::atexit(FinalizeAtExit);
  }
  // The gradient reducer runs collectives on a thread of its own (never two
  // at once): MPI must provide that, whoever initialized it.
  int level = MPI_THREAD_SINGLE;
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_SERIALIZED) {
    return NotSupported(
        "MPI communicator: MPI provides thread level {}, below MPI_THREAD_SERIALIZED ({}): strata reduces "
        "gradients on a thread of its own; initialize MPI with MPI_Init_thread(..., MPI_THREAD_SERIALIZED or "
        "MPI_THREAD_MULTIPLE, ...) or let strata do it, with an MPI built with thread support",
        level, MPI_THREAD_SERIALIZED);
  }
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  int rank = 0, world = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  return std::unique_ptr<Communicator>(std::make_unique<MpiCommunicator>(options, rank, world));
}

}  // namespace strata
