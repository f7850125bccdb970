// The NCCL communicator: the ranks of a bootstrap group, one CUDA device each.
//
// NCCL's unique id goes from rank 0 to the others over the bootstrap
// communicator (MPI under mpirun, torch.distributed's gloo under torchrun);
// after that only NCCL carries data. The communicator is non-blocking
// (ncclConfig_t::blocking = 0): every NCCL call that reports ncclInProgress
// is polled with ncclCommGetAsyncError, and every collective's stream with
// cudaStreamQuery, against CommOptions::timeout_ms. A rank that died or a
// link that broke is an error NCCL reports asynchronously (CommError with
// NCCL's text) or a collective that never completes (Timeout); either way the
// communicator is aborted (ncclCommAbort, which stops its kernels) and broken.
//
// Buffers in this device's memory go to NCCL as they are. Host buffers (what
// the gradient reducer passes today) are staged through two device buffers
// of the communicator's own, grown to the largest message: copied in, the
// collective run, and copied out only once it has completed, so that no copy
// into pageable memory blocks on a collective that may never end.
#include <cuda_runtime.h>
#include <nccl.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "src/backends/comm/raw_collectives.h"
#include "src/base/cuda_check.h"
#include "strata/comm.h"

namespace strata {
namespace {

using Clock = std::chrono::steady_clock;

std::string NcclVersion() {
  int version = 0;
  if (ncclGetVersion(&version) != ncclSuccess) return "?";
  return fmt::format("{}.{}.{}", version / 10000, version / 100 % 100, version % 100);
}

ncclDataType_t NcclType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat16: return ncclFloat16;
    case DType::kInt8Block: break;  // moments' codes: never summed
  }
  return ncclFloat32;
}

// Polls `comm`'s state while it is ncclInProgress (a non-blocking call
// still being carried out), until `deadline`. Returns the final state:
// ncclInProgress only when the deadline passed.
ncclResult_t SettleNccl(ncclComm_t comm, ncclResult_t state, Clock::time_point deadline) {
  for (int poll = 0; state == ncclInProgress; ++poll) {
    if (Clock::now() >= deadline) return ncclInProgress;
    if (poll < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) return ncclInternalError;
  }
  return state;
}

std::string NcclText(ncclComm_t comm, ncclResult_t result) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  return last != nullptr && *last != '\0' ? fmt::format("{} ({})", ncclGetErrorString(result), last)
                                          : std::string(ncclGetErrorString(result));
}

// Device memory grown on demand; freed with the communicator.
struct Staging {
  void* data = nullptr;
  size_t bytes = 0;
};

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(CommOptions options, int rank, int world, int device, ncclComm_t comm, cudaStream_t stream)
      : options_(options), rank_(rank), world_(world), device_(device), comm_(comm), stream_(stream) {}

  ~NcclCommunicator() override {
    static_cast<void>(cudaSetDevice(device_));
    if (comm_ != nullptr && broken_.empty()) {
      // Finalize flushes what NCCL still has in flight; bounded like any collective.
      const auto deadline = Clock::now() + std::chrono::milliseconds(options_.timeout_ms);
      if (SettleNccl(comm_, ncclCommFinalize(comm_), deadline) == ncclSuccess) {
        ncclCommDestroy(comm_);
      } else {
        ncclCommAbort(comm_);
      }
      comm_ = nullptr;
    } else if (comm_ != nullptr) {
      ncclCommAbort(comm_);
      comm_ = nullptr;
    }
    // A broken communicator's stream may still hold the aborted collective:
    // its buffers are left to the process's exit rather than freed under it.
    if (!broken_.empty()) return;
    for (Staging* s : {&send_stage_, &recv_stage_}) {
      if (s->data != nullptr) cudaFreeAsync(s->data, stream_);
    }
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int world_size() const override { return world_; }
  std::string Describe() const override {
    return fmt::format("NCCL {} on cuda:{}, rank {} of {}", NcclVersion(), device_, rank_, world_);
  }

  Status Barrier() override {
    // NCCL has no barrier: a one-element all-reduce is one.
    return Run("barrier", [&](Clock::time_point deadline) -> Status {
      STRATA_RETURN_IF_ERROR(Reserve(recv_stage_, sizeof(float)));
      STRATA_RETURN_IF_ERROR(Call(
          "ncclAllReduce", ncclAllReduce(recv_stage_.data, recv_stage_.data, 1, ncclFloat32, ncclSum, comm_, stream_),
          deadline));
      return Finish(deadline, recv_stage_.data, recv_stage_.data, 0);
    });
  }

  // The bench's raw figure: NCCL's all-gather and reduce-scatter on device
  // buffers as they are (no pointer checks, no staging, not counted), waited
  // for on the stream (bounded like any collective: a dead peer is a Timeout).
  Status RawAllGather(const void* send, void* recv, size_t bytes_per_rank) {
    return Run("raw all-gather", [&](Clock::time_point deadline) -> Status {
      STRATA_RETURN_IF_ERROR(
          Call("ncclAllGather", ncclAllGather(send, recv, bytes_per_rank, ncclInt8, comm_, stream_), deadline));
      return Finish(deadline, recv, recv, 0);
    });
  }
  Status RawReduceScatterSum(const float* send, float* recv, size_t count_per_rank) {
    return Run("raw reduce-scatter", [&](Clock::time_point deadline) -> Status {
      STRATA_RETURN_IF_ERROR(Call("ncclReduceScatter",
                                  ncclReduceScatter(send, recv, count_per_rank, ncclFloat32, ncclSum, comm_, stream_),
                                  deadline));
      return Finish(deadline, recv, recv, 0);
    });
  }
  bool broken() const { return !broken_.empty(); }

 protected:
  Status DoAllGather(const void* send, void* recv, size_t bytes_per_rank) override {
    const size_t total = bytes_per_rank * static_cast<size_t>(world_);
    return Run("all-gather", [&](Clock::time_point deadline) -> Status {
      STRATA_ASSIGN_OR_RETURN(const void* in, StageIn(send, bytes_per_rank, send_stage_));
      STRATA_ASSIGN_OR_RETURN(void* out, Output(recv, total, recv_stage_));
      STRATA_RETURN_IF_ERROR(
          Call("ncclAllGather", ncclAllGather(in, out, bytes_per_rank, ncclInt8, comm_, stream_), deadline));
      return Finish(deadline, recv, out, total);
    });
  }

  Status DoReduceScatterSum(const void* send, void* recv, size_t count_per_rank, DType dtype) override {
    const size_t bytes = count_per_rank * DTypeSizeBytes(dtype);
    return Run("reduce-scatter", [&](Clock::time_point deadline) -> Status {
      STRATA_ASSIGN_OR_RETURN(const void* in, StageIn(send, bytes * static_cast<size_t>(world_), send_stage_));
      STRATA_ASSIGN_OR_RETURN(void* out, Output(recv, bytes, recv_stage_));
      STRATA_RETURN_IF_ERROR(Call("ncclReduceScatter",
                                  ncclReduceScatter(in, out, count_per_rank, NcclType(dtype), ncclSum, comm_, stream_),
                                  deadline));
      return Finish(deadline, recv, out, bytes);
    });
  }

  Status DoAllReduceSum(std::span<double> values) override {
    return Run("all-reduce", [&](Clock::time_point deadline) -> Status {
      // In place: the staged copy is both the input and the output.
      STRATA_ASSIGN_OR_RETURN(const void* in, StageIn(values.data(), values.size_bytes(), recv_stage_));
      void* out = const_cast<void*>(in);
      STRATA_RETURN_IF_ERROR(
          Call("ncclAllReduce", ncclAllReduce(in, out, values.size(), ncclFloat64, ncclSum, comm_, stream_), deadline));
      return Finish(deadline, values.data(), out, values.size_bytes());
    });
  }

  Status DoBroadcast(void* data, size_t bytes, int root) override {
    if (root < 0 || root >= world_) return InvalidArgument("broadcast: root {} is not a rank of {}", root, world_);
    return Run("broadcast", [&](Clock::time_point deadline) -> Status {
      STRATA_ASSIGN_OR_RETURN(const void* in, StageIn(data, bytes, recv_stage_));
      void* out = const_cast<void*>(in);
      STRATA_RETURN_IF_ERROR(
          Call("ncclBroadcast", ncclBroadcast(in, out, bytes, ncclInt8, root, comm_, stream_), deadline));
      return Finish(deadline, data, out, bytes);
    });
  }

 private:
  // Runs one collective: `body` queues it on the stream (and waits for it,
  // through Finish); any failure breaks the communicator, and one NCCL may
  // still be carrying out is aborted first.
  template <typename Body>
  Status Run(const char* op, Body body) {
    // Barrier and the raw calls bypass Communicator's guard, and every call shares the staging buffers.
    if (running_.exchange(true)) {
      return CommError("NCCL {} on rank {}: another collective is running on this communicator (on another thread)",
                       op, rank_);
    }
    struct Done {
      std::atomic<bool>& running;
      ~Done() { running = false; }
    } done{running_};
    if (!broken_.empty()) return CommError("NCCL {} on rank {}: the communicator is broken: {}", op, rank_, broken_);
    // The current device is per thread: the gradient reducer's is not the creator's.
    STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    const auto deadline = Clock::now() + std::chrono::milliseconds(options_.timeout_ms);
    Status status = body(deadline);
    if (status.ok()) return status;
    ncclCommAbort(comm_);
    comm_ = nullptr;
    broken_ = fmt::format("NCCL {} on rank {} of {}: {}", op, rank_, world_, status.message());
    if (status.code() == StatusCode::kTimeout) return Timeout("{}", broken_);
    if (status.code() == StatusCode::kInvalidArgument) return InvalidArgument("{}", broken_);
    return CommError("{}", broken_);
  }

  // An NCCL call's result, settled if it is still in progress.
  Status Call(const char* call, ncclResult_t result, Clock::time_point deadline) {
    result = SettleNccl(comm_, result, deadline);
    if (result == ncclSuccess) return Status::Ok();
    if (result == ncclInProgress) {
      return Timeout("{} was not queued within {} ms (comm.timeout_ms)", call, options_.timeout_ms);
    }
    return CommError("{} failed: {}", call, NcclText(comm_, result));
  }

  // Whether `p` is memory of this communicator's device (NCCL's to use as it
  // is); host memory of any kind is not.
  Result<bool> OnDevice(const void* p) const {
    cudaPointerAttributes attributes{};
    STRATA_CUDA_RETURN_IF_ERROR(cudaPointerGetAttributes(&attributes, p));
    if (attributes.type != cudaMemoryTypeDevice) return false;
    if (attributes.device != device_) {
      return InvalidArgument("a buffer on cuda:{} given to the NCCL communicator of cuda:{}", attributes.device,
                             device_);
    }
    return true;
  }

  // Stream-ordered (cudaMallocAsync/cudaFreeAsync on the idle stream): a
  // plain cudaFree would wait for the whole device, other streams' work and
  // other libraries' collectives included, with no timeout.
  Status Reserve(Staging& s, size_t bytes) {
    if (s.bytes >= bytes) return Status::Ok();
    if (s.data != nullptr) STRATA_CUDA_RETURN_IF_ERROR(cudaFreeAsync(s.data, stream_));
    s = Staging{};
    const size_t grown = std::max<size_t>(bytes, size_t{1} << 20);
    STRATA_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&s.data, grown, stream_));
    s.bytes = grown;
    return Status::Ok();
  }

  // `p` itself when on the device, else its bytes copied into `stage`.
  Result<const void*> StageIn(const void* p, size_t bytes, Staging& stage) {
    STRATA_ASSIGN_OR_RETURN(bool on_device, OnDevice(p));
    if (on_device) return p;
    STRATA_RETURN_IF_ERROR(Reserve(stage, bytes));
    if (bytes > 0) {
      STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(stage.data, p, bytes, cudaMemcpyDefault, stream_));
    }
    return const_cast<const void*>(stage.data);
  }

  // Where the collective writes: `p` when on the device, else `stage`.
  Result<void*> Output(void* p, size_t bytes, Staging& stage) {
    STRATA_ASSIGN_OR_RETURN(bool on_device, OnDevice(p));
    if (on_device) return p;
    STRATA_RETURN_IF_ERROR(Reserve(stage, bytes));
    return stage.data;
  }

  // Waits for the queued collective (or an error NCCL reports meanwhile),
  // then copies a staged result out to `dst`.
  Status Finish(Clock::time_point deadline, void* dst, const void* written, size_t bytes) {
    for (int poll = 0;; ++poll) {
      ncclResult_t async = ncclSuccess;
      if (const ncclResult_t asked = ncclCommGetAsyncError(comm_, &async); asked != ncclSuccess) {
        return CommError("ncclCommGetAsyncError failed: {}", NcclText(comm_, asked));
      }
      if (async != ncclSuccess && async != ncclInProgress) {
        return CommError("NCCL reported {} while the collective ran (a rank died or a link broke)",
                         NcclText(comm_, async));
      }
      const cudaError_t state = cudaStreamQuery(stream_);
      if (state == cudaSuccess) break;
      if (state != cudaErrorNotReady) return internal::CudaErrorToStatus(state, "cudaStreamQuery", __FILE__, __LINE__);
      if (Clock::now() >= deadline) {
        return Timeout("not complete after {} ms (comm.timeout_ms): a rank died, hangs or never joined",
                       options_.timeout_ms);
      }
      if (poll < 64) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(poll < 1000 ? 20 : 500));
      }
    }
    if (dst == written || bytes == 0) return Status::Ok();
    // The collective is done: the copy out is local, and gets a timeout of its own.
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, written, bytes, cudaMemcpyDefault, stream_));
    return internal::WaitForCudaWork([&] { return cudaStreamQuery(stream_); }, options_.timeout_ms,
                                     "copying NCCL's result out");
  }

  const CommOptions options_;
  const int rank_;
  const int world_;
  const int device_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  Staging send_stage_, recv_stage_;
  std::string broken_;
  std::atomic<bool> running_{false};
};

// NCCL refuses two ranks on one GPU (and would deadlock on some versions):
// every rank's host and PCI bus id are gathered over the bootstrap group and
// a GPU named twice is InvalidArgument on every rank alike, before NCCL is
// asked. A rank that cannot read its bus id says so in the same gather.
Status CheckOneGpuPerRank(Communicator& bootstrap, int device_index) {
  struct Where {
    char host[64];
    char bus[32];
    char failed;
  };
  Where mine{};
  gethostname(mine.host, sizeof mine.host - 1);
  const cudaError_t read = cudaDeviceGetPCIBusId(mine.bus, sizeof mine.bus, device_index);
  if (read != cudaSuccess) static_cast<void>(cudaGetLastError());
  mine.failed = read != cudaSuccess ? 1 : 0;
  std::vector<Where> all(static_cast<size_t>(bootstrap.world_size()));
  STRATA_RETURN_IF_ERROR(bootstrap.AllGather(&mine, all.data(), sizeof mine)
                             .WithContext("gathering every rank's GPU before forming the NCCL group"));
  for (int r = 0; r < bootstrap.world_size(); ++r) {
    if (all[r].failed) {
      return DeviceError("NCCL communicator: rank {} could not read the PCI bus id of its GPU{}", r,
                         r == bootstrap.rank() ? fmt::format(" (cuda:{}: {})", device_index, cudaGetErrorString(read))
                                               : std::string());
    }
    for (int q = 0; q < r; ++q) {
      if (std::strncmp(all[q].host, all[r].host, sizeof mine.host) == 0 &&
          std::strncmp(all[q].bus, all[r].bus, sizeof mine.bus) == 0) {
        return InvalidArgument(
            "NCCL communicator: ranks {} and {} are on the same GPU ({} on {}): NCCL needs a GPU of its own for "
            "each rank; give each rank its own device.index (or CUDA_VISIBLE_DEVICES), or use comm.backend host",
            q, r, all[r].bus, all[r].host);
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Communicator>> CreateNcclCommunicator(Communicator* bootstrap, int device_index,
                                                             CommOptions options) {
  if (options.timeout_ms == 0) return InvalidArgument("NCCL communicator: timeout_ms must be > 0");
  int devices = 0;
  if (const cudaError_t error = cudaGetDeviceCount(&devices); error != cudaSuccess || devices == 0) {
    static_cast<void>(cudaGetLastError());
    return NotSupported("NCCL communicator: no CUDA device is visible ({}): NCCL needs one GPU per rank; use "
                        "comm.backend host (MPI or gloo) without GPUs",
                        error != cudaSuccess ? cudaGetErrorString(error) : "none found");
  }
  if (device_index < 0 || device_index >= devices) {
    return InvalidArgument("NCCL communicator: device.index {} is not one of this process's {} CUDA device(s)",
                           device_index, devices);
  }
  const int rank = bootstrap != nullptr ? bootstrap->rank() : 0;
  const int world = bootstrap != nullptr ? bootstrap->world_size() : 1;
  if (world > 1) STRATA_RETURN_IF_ERROR(CheckOneGpuPerRank(*bootstrap, device_index));
  ncclUniqueId id{};
  Status got = Status::Ok();
  if (rank == 0) {
    if (const ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      got = CommError("ncclGetUniqueId on rank 0: {}", ncclGetErrorString(r));
    }
  }
  if (world > 1) {
    STRATA_RETURN_IF_ERROR(AgreeOnStatus(bootstrap, got, "creating NCCL's unique id"));
    STRATA_RETURN_IF_ERROR(
        bootstrap->Broadcast(&id, sizeof id, 0).WithContext("sending NCCL's unique id from rank 0"));
  } else {
    STRATA_RETURN_IF_ERROR(got);
  }

  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_index));
  // The stream first: once the group has formed, a failure here would have
  // to undo it (ncclCommDestroy waits for the other local ranks).
  cudaStream_t stream = nullptr;
  STRATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Non-blocking, so that creation and every call are polled against the
  // timeout. (NCCL_COMM_BLOCKING=1 in the environment would make NCCL block.)
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const auto deadline = Clock::now() + std::chrono::milliseconds(options.timeout_ms);
  ncclResult_t state = ncclCommInitRankConfig(&comm, world, id, rank, &config);
  if (comm != nullptr) state = SettleNccl(comm, state, deadline);
  if (state != ncclSuccess) {
    const std::string text = state == ncclInProgress ? std::string("timed out") : NcclText(comm, state);
    if (comm != nullptr) ncclCommAbort(comm);
    cudaStreamDestroy(stream);
    if (state == ncclInProgress) {
      return Timeout("NCCL communicator: rank {} of {} on cuda:{}: the group did not form within {} ms "
                     "(comm.timeout_ms): a rank died or never started",
                     rank, world, device_index, options.timeout_ms);
    }
    return CommError("NCCL communicator: ncclCommInitRankConfig on rank {} of {} (cuda:{}): {}", rank, world,
                     device_index, text);
  }
  return std::unique_ptr<Communicator>(
      std::make_unique<NcclCommunicator>(options, rank, world, device_index, comm, stream));
}

namespace comm {

Status NcclRawAllGather(Communicator& nccl, const void* send, void* recv, size_t bytes_per_rank) {
  auto* c = dynamic_cast<NcclCommunicator*>(&nccl);
  if (c == nullptr || c->broken()) return InvalidArgument("NcclRawAllGather: not a working NCCL communicator");
  return c->RawAllGather(send, recv, bytes_per_rank);
}

Status NcclRawReduceScatterSum(Communicator& nccl, const float* send, float* recv, size_t count_per_rank) {
  auto* c = dynamic_cast<NcclCommunicator*>(&nccl);
  if (c == nullptr || c->broken()) return InvalidArgument("NcclRawReduceScatterSum: not a working NCCL communicator");
  return c->RawReduceScatterSum(send, recv, count_per_rank);
}

}  // namespace comm
}  // namespace strata
