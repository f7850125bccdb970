// The host-emulated device: host memory with a capacity standing in for HBM,
// so that everything above the Device seam runs and is tested on machines
// without a GPU.
//
// Each copy stream is one worker thread draining a FIFO queue, which gives
// the same ordering as a CUDA stream (in order within a stream, streams in
// parallel) and real asynchrony: a caller that forgets to wait on an event
// reads stale bytes here just as it would on a GPU. An optional per-stream
// bandwidth throttle imitates a PCIe link so that overlap of copies with
// compute can be seen and tested: the planner's model of a link (LinkQueue),
// run on the clock.
//
// Lifetime: the Device must outlive its Buffers and the copies it has queued
// (the contract of every backend, since a CUDA Buffer's deleter needs the
// device). This backend tolerates a Buffer freed after it, since its capacity
// ledger is shared with the Buffers, but warns when it dies with memory still
// allocated. Its destructor runs every queued copy to completion.
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "src/backends/device/capacity_ledger.h"
#include "src/base/link_queue.h"
#include "src/base/logging.h"
#include "strata/buffer.h"
#include "strata/device.h"
#include "strata/options.h"
#include "strata/status.h"

namespace strata {
namespace {

// Device and pinned buffers are whole pages (ReserveHostRegion), aligned
// like cudaMalloc's (256 B at least, in practice 2 MiB) and as O_DIRECT needs.
// A throttled copy moves this much, then sleeps until the bandwidth allows the
// next piece: 1 MiB is 0.1 ms at 10 GB/s, fine enough that a large copy is
// paced evenly, coarse enough that the sleeps cost nothing measurable.
constexpr size_t kPacePieceBytes = size_t{1} << 20;
// GB/s here is decimal, as PCIe link rates are quoted.
constexpr double kBytesPerGigabyte = 1e9;

// Completion of one job of a copy worker.
class EmulatedEvent final : public Event {
 public:
  Status Wait(uint32_t timeout_ms) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!done_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [this] { return done_; })) {
      return Timeout("emulated device: copy not complete after the {} ms timeout (it goes on)", timeout_ms);
    }
    return status_;
  }

  bool Done() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }

  // Called once, by the worker that ran the job.
  void Complete(Status status) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      status_ = std::move(status);
      done_ = true;
    }
    done_cv_.notify_all();
  }

 private:
  std::mutex mutex_;  // guards done_ and status_
  std::condition_variable done_cv_;
  bool done_ = false;
  Status status_;
};


// One copy stream: a worker thread running queued copies in FIFO order, each
// completing its event. A copy of 0 bytes is a marker (Synchronize).
class CopyWorker {
 public:
  CopyWorker(const char* thread_name, double bandwidth_gbps)
      : thread_name_(thread_name),
        bytes_per_second_(bandwidth_gbps * kBytesPerGigabyte),
        link_(bytes_per_second_),
        epoch_(std::chrono::steady_clock::now()) {
    thread_ = std::thread([this] { Run(); });
  }

  // Runs every job still queued, then joins: waiters on those events are
  // released, and no copy touches memory after the device is gone.
  ~CopyWorker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    work_cv_.notify_one();
    thread_.join();
  }

  CopyWorker(const CopyWorker&) = delete;
  CopyWorker& operator=(const CopyWorker&) = delete;

  std::shared_ptr<EmulatedEvent> Enqueue(void* dst, const void* src, size_t size_bytes) {
    auto event = std::make_shared<EmulatedEvent>();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(Job{dst, src, size_bytes, event});
    }
    work_cv_.notify_one();
    return event;
  }

 private:
  struct Job {
    void* dst = nullptr;
    const void* src = nullptr;
    size_t size_bytes = 0;
    std::shared_ptr<EmulatedEvent> event;
  };

  void Run() {
    ::pthread_setname_np(::pthread_self(), thread_name_);
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        // The worker's idle wait has no timeout: it ends with a job or with
        // stopping_, the abort flag the destructor sets.
        work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and drained
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      Copy(job);
      job.event->Complete(Status::Ok());
    }
  }

  void Copy(const Job& job) {
    if (job.size_bytes == 0) return;
    if (bytes_per_second_ <= 0) {
      std::memcpy(job.dst, job.src, job.size_bytes);
      return;
    }
    // Pacing: each piece is queued on the link as the copy starts, and after
    // it is copied the worker sleeps until the link says it has crossed. The
    // copy then never runs ahead of the link and takes at least
    // size/bandwidth in all; its event completes only after that.
    auto* dst = static_cast<std::byte*>(job.dst);
    const auto* src = static_cast<const std::byte*>(job.src);
    const double ready = std::chrono::duration<double>(std::chrono::steady_clock::now() - epoch_).count();
    size_t done_bytes = 0;
    while (done_bytes < job.size_bytes) {
      const size_t piece_bytes = std::min(kPacePieceBytes, job.size_bytes - done_bytes);
      std::memcpy(dst + done_bytes, src + done_bytes, piece_bytes);
      done_bytes += piece_bytes;
      const std::chrono::duration<double> crossed(link_.Transfer(ready, piece_bytes));
      std::this_thread::sleep_until(epoch_ + std::chrono::ceil<std::chrono::steady_clock::duration>(crossed));
    }
  }

  const char* const thread_name_;
  const double bytes_per_second_;  // 0: unthrottled
  LinkQueue link_;                 // the worker's alone, in seconds from epoch_
  const std::chrono::steady_clock::time_point epoch_;
  std::mutex mutex_;               // guards queue_ and stopping_
  std::condition_variable work_cv_;
  std::deque<Job> queue_;
  bool stopping_ = false;
  std::thread thread_;  // started last in the constructor, once every member above exists
};

class EmulatedDevice final : public Device {
 public:
  explicit EmulatedDevice(const EmulatedDeviceOptions& options)
      : bandwidth_gbps_(options.bandwidth_gbps),
        ledger_(std::make_shared<CapacityLedger>(options.capacity_bytes)),
        host_to_device_("strata-emu-h2d", options.bandwidth_gbps),
        device_to_host_("strata-emu-d2h", options.bandwidth_gbps) {}

  ~EmulatedDevice() override {
    // The copy workers drain and join after this body, as members.
    size_t leaked_bytes = ledger_->allocated_bytes();
    if (leaked_bytes != 0) {
      STRATA_LOG_WARNING("emulated device destroyed with {} still allocated: its Buffers must not outlive it",
                         FormatSize(leaked_bytes));
    }
  }

  std::string Describe() const override {
    std::string throttle = bandwidth_gbps_ > 0 ? fmt::format("throttle {:.1f} GB/s per stream", bandwidth_gbps_)
                                               : std::string("unthrottled");
    return fmt::format("emulated device (host memory, capacity {}, {})", FormatSize(ledger_->capacity_bytes()),
                       throttle);
  }
  bool is_emulated() const override { return true; }
  bool host_accessible() const override { return true; }

  Result<Buffer> Allocate(size_t size_bytes) override {
    if (size_bytes == 0) return InvalidArgument("device (emulated): cannot allocate 0 bytes");
    size_t allocated_before_bytes = 0;
    if (!ledger_->TryReserve(size_bytes, &allocated_before_bytes)) {
      return OutOfMemory("device (emulated): cannot allocate {}: {} allocated of {} capacity", FormatSize(size_bytes),
                         FormatSize(allocated_before_bytes), FormatSize(ledger_->capacity_bytes()));
    }
    // Reserved, not committed: the device tier's arena costs the host what
    // its slots have held (Note [Reserved regions] in src/base/buffer.cc).
    Buffer host = ReserveHostRegion(size_bytes);
    if (!host) {
      ledger_->Release(size_bytes);
      return OutOfMemory("device (emulated): host memory exhausted allocating {} ({} allocated of {} capacity)",
                         FormatSize(size_bytes), FormatSize(allocated_before_bytes),
                         FormatSize(ledger_->capacity_bytes()));
    }
    void* data = host.data();
    // std::function needs a copyable callable: the host Buffer rides in a
    // shared_ptr, freed (then accounted) when the device Buffer dies.
    auto owned = std::make_shared<Buffer>(std::move(host));
    return Buffer(data, size_bytes, [ledger = ledger_, owned, size_bytes](void*, size_t) {
      owned->Reset();
      ledger->Release(size_bytes);
    });
  }
  size_t capacity_bytes() const override { return ledger_->capacity_bytes(); }
  size_t allocated_bytes() const override { return ledger_->allocated_bytes(); }

  Result<Buffer> AllocatePinnedHost(size_t size_bytes, int numa_node) override {
    if (size_bytes == 0) return InvalidArgument("pinned host (emulated): cannot allocate 0 bytes");
    // No page-locking: nothing here does DMA, so plain pages behave the same,
    // committed as they are first written.
    Buffer buffer = ReserveHostRegion(size_bytes, numa_node);
    if (!buffer) return OutOfMemory("pinned host (emulated): cannot allocate {}", FormatSize(size_bytes));
    return buffer;
  }

  Result<std::shared_ptr<Event>> CopyAsync(CopyStream stream, void* dst, const void* src, size_t size_bytes) override {
    if (dst == nullptr || src == nullptr || size_bytes == 0) {
      return InvalidArgument(
          "emulated device: CopyAsync needs non-null pointers and a size > 0 (dst {}, src {}, {} bytes)", dst, src,
          size_bytes);
    }
    switch (stream) {
      case CopyStream::kHostToDevice:
        return std::shared_ptr<Event>(host_to_device_.Enqueue(dst, src, size_bytes));
      case CopyStream::kDeviceToHost:
        return std::shared_ptr<Event>(device_to_host_.Enqueue(dst, src, size_bytes));
    }
    return InvalidArgument("emulated device: unknown copy stream {}", static_cast<int>(stream));
  }

  // Not ordered with queued copies, like cudaMemset against other streams.
  Status Memset(void* device_dst, int value, size_t size_bytes) override {
    if (size_bytes == 0) return Status::Ok();
    if (device_dst == nullptr) return InvalidArgument("emulated device: Memset of {} bytes at null", size_bytes);
    std::memset(device_dst, value, size_bytes);
    return Status::Ok();
  }

  Status CopyWithinDevice(void* device_dst, const void* device_src, size_t size_bytes) override {
    if (size_bytes == 0) return Status::Ok();
    if (device_dst == nullptr || device_src == nullptr) {
      return InvalidArgument("emulated device: CopyWithinDevice of {} bytes needs non-null pointers (dst {}, src {})",
                             size_bytes, device_dst, device_src);
    }
    std::memcpy(device_dst, device_src, size_bytes);
    return Status::Ok();
  }

  Result<std::shared_ptr<Event>> RecordFence(uintptr_t /*stream*/) override {
    auto fence = std::make_shared<EmulatedEvent>();
    fence->Complete(Status::Ok());
    return std::shared_ptr<Event>(std::move(fence));
  }

  Status SynchronizeStream(uintptr_t /*stream*/, uint32_t /*timeout_ms*/) override { return Status::Ok(); }

  Status Synchronize(uint32_t timeout_ms) override {
    // A marker on each stream completes after everything queued before it.
    std::shared_ptr<EmulatedEvent> markers[] = {host_to_device_.Enqueue(nullptr, nullptr, 0),
                                                device_to_host_.Enqueue(nullptr, nullptr, 0)};
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (const auto& marker : markers) {
      auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      auto left_ms = static_cast<uint32_t>(std::max<int64_t>(0, left.count()));
      Status status = marker->Wait(left_ms);
      if (status.code() == StatusCode::kTimeout) {
        return Timeout("emulated device: queued copies not finished within the {} ms timeout of Synchronize",
                       timeout_ms);
      }
      STRATA_RETURN_IF_ERROR(status);
    }
    return Status::Ok();
  }

 private:
  const double bandwidth_gbps_;
  std::shared_ptr<CapacityLedger> ledger_;
  // Declared last: destroyed first, so they drain while the rest still exists.
  CopyWorker host_to_device_;
  CopyWorker device_to_host_;
};

}  // namespace

Result<std::unique_ptr<Device>> CreateEmulatedDevice(const EmulatedDeviceOptions& options) {
  if (options.capacity_bytes == 0) return InvalidArgument("emulated device: capacity must be > 0 bytes");
  if (!std::isfinite(options.bandwidth_gbps) || options.bandwidth_gbps < 0) {
    return InvalidArgument("emulated device: bandwidth_gbps is {}; expected >= 0 (0 = unthrottled)",
                           options.bandwidth_gbps);
  }
  return std::unique_ptr<Device>(std::make_unique<EmulatedDevice>(options));
}

}  // namespace strata
