// A communicator slowed to a network's bandwidth: each collective of the
// inner one, then a sleep until the bytes this rank sent would have crossed
// a link of the given rate.
#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "strata/comm.h"

namespace strata {
namespace {

class ThrottledCommunicator final : public Communicator {
 public:
  ThrottledCommunicator(Communicator& inner, double gbps) : inner_(inner), bytes_per_second_(gbps * 1e9) {}

  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  std::string Describe() const override {
    return fmt::format("{}, throttled to {} GB/s", inner_.Describe(), bytes_per_second_ / 1e9);
  }
  Status Barrier() override { return inner_.Barrier(); }

 protected:
  Status DoAllGather(const void* send, void* recv, size_t bytes_per_rank) override {
    return Throttled([&] { return inner_.AllGather(send, recv, bytes_per_rank); });
  }
  Status DoReduceScatterSum(const void* send, void* recv, size_t count_per_rank, DType dtype) override {
    return Throttled([&] { return inner_.ReduceScatterSum(send, recv, count_per_rank, dtype); });
  }
  Status DoAllReduceSum(std::span<double> values) override {
    return Throttled([&] { return inner_.AllReduceSum(values); });
  }
  Status DoBroadcast(void* data, size_t bytes, int root) override {
    return Throttled([&] { return inner_.Broadcast(data, bytes, root); });
  }

 private:
  template <typename Call>
  Status Throttled(Call call) {
    const auto start = std::chrono::steady_clock::now();
    const uint64_t before = inner_.stats().total_bytes();
    Status status = call();
    const double seconds = static_cast<double>(inner_.stats().total_bytes() - before) / bytes_per_second_;
    std::this_thread::sleep_until(start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                              std::chrono::duration<double>(seconds)));
    return status;
  }

  Communicator& inner_;
  const double bytes_per_second_;
};

}  // namespace

Result<std::unique_ptr<Communicator>> CreateThrottledCommunicator(Communicator& inner, double gbps) {
  if (!(gbps > 0)) return InvalidArgument("throttled communicator: {} GB/s is not allowed: expected > 0", gbps);
  return std::unique_ptr<Communicator>(std::make_unique<ThrottledCommunicator>(inner, gbps));
}

}  // namespace strata
