// The in-process loopback communicator: ranks are threads sharing one group.
//
// Each collective is two barriers. At the first, every rank leaves the
// addresses of its buffers; once all are there, each rank computes its own
// result from the others' buffers, into its receive buffer, or into a
// private copy when that is some rank's send buffer (in place). At the
// second, every rank has finished reading, and the copies are written back. A rank that does
// not arrive within the timeout makes the collective Timeout on the ranks
// that waited, naming the missing ranks, and breaks the group.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "src/base/half.h"
#include "strata/comm.h"

namespace strata {
namespace {

struct Group {
  Group(int world_size, CommOptions comm_options)
      : world(world_size), options(comm_options), sends(world_size), present(world_size) {}

  const int world;
  const CommOptions options;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t generation = 0;  // collectives completed
  int arrived = 0;
  int departed = 0;
  std::string op;            // the collective this generation runs, and its size
  size_t bytes = 0;
  std::vector<const std::byte*> sends;
  std::vector<bool> present;
  std::string broken;        // why the group cannot go on (empty: it can)
};

class LoopbackCommunicator final : public Communicator {
 public:
  LoopbackCommunicator(std::shared_ptr<Group> group, int rank) : group_(std::move(group)), rank_(rank) {}

  int rank() const override { return rank_; }
  int world_size() const override { return group_->world; }
  std::string Describe() const override {
    return fmt::format("loopback, rank {} of {} (threads in one process)", rank_, group_->world);
  }

  Status Barrier() override {
    return Collective("barrier", nullptr, 0, nullptr, 0, [](const std::vector<const std::byte*>&, std::byte*) {});
  }

 protected:
  Status DoAllGather(const void* send, void* recv, size_t bytes_per_rank) override {
    return Collective("all-gather", send, bytes_per_rank, recv, group_->world * bytes_per_rank,
                      [&](const std::vector<const std::byte*>& sends, std::byte* out) {
                        for (int r = 0; r < group_->world; ++r) {
                          std::memcpy(out + r * bytes_per_rank, sends[r], bytes_per_rank);
                        }
                      });
  }

  Status DoReduceScatterSum(const void* send, void* recv, size_t count_per_rank, DType dtype) override {
    const size_t width = DTypeSizeBytes(dtype);
    return Collective("reduce-scatter", send, group_->world * count_per_rank * width, recv, count_per_rank * width,
                      [&](const std::vector<const std::byte*>& sends, std::byte* out) {
                        switch (dtype) {
                          case DType::kFloat32: return Sum<DType::kFloat32>(sends, count_per_rank, out);
                          case DType::kBFloat16: return Sum<DType::kBFloat16>(sends, count_per_rank, out);
                          case DType::kFloat16: return Sum<DType::kFloat16>(sends, count_per_rank, out);
                          case DType::kInt8Block: return;  // moments' codes: never summed
                        }
                      });
  }

  Status DoAllReduceSum(std::span<double> values) override {
    const size_t bytes = values.size_bytes();
    return Collective("all-reduce", values.data(), bytes, values.data(), bytes,
                      [&](const std::vector<const std::byte*>& sends, std::byte* out) {
                        double* sum = reinterpret_cast<double*>(out);
                        std::fill(sum, sum + values.size(), 0.0);
                        for (int r = 0; r < group_->world; ++r) {
                          const double* v = reinterpret_cast<const double*>(sends[r]);
                          for (size_t i = 0; i < values.size(); ++i) sum[i] += v[i];
                        }
                      });
  }

  Status DoBroadcast(void* data, size_t bytes, int root) override {
    if (root < 0 || root >= group_->world) {
      return InvalidArgument("broadcast: root {} is not a rank of this group of {}", root, group_->world);
    }
    return Collective(fmt::format("broadcast from {}", root), data, bytes, data, bytes,
                      [&](const std::vector<const std::byte*>& sends, std::byte* out) {
                        std::memcpy(out, sends[root], bytes);
                      });
  }

 private:
  template <typename Compute>
  Status Collective(const std::string& op, const void* send, size_t send_bytes, void* recv, size_t recv_bytes,
                    Compute compute) {
    Group& g = *group_;
    std::unique_lock lock(g.mu);
    if (!g.broken.empty()) return CommError("{} on rank {}: the group is broken: {}", op, rank_, g.broken);
    if (g.arrived == 0) {
      g.op = op;
      g.bytes = send_bytes;
    } else if (g.op != op || g.bytes != send_bytes) {
      Break(g, fmt::format("rank {} called {} of {} bytes where the others called {} of {} bytes", rank_, op,
                           send_bytes, g.op, g.bytes));
      return CommError("{}", g.broken);
    }
    g.sends[rank_] = static_cast<const std::byte*>(send);
    g.present[rank_] = true;
    g.arrived++;
    const uint64_t generation = g.generation;
    g.cv.notify_all();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(g.options.timeout_ms);
    if (!g.cv.wait_until(lock, deadline, [&] { return g.arrived == g.world || !g.broken.empty(); })) {
      std::vector<int> missing;
      for (int r = 0; r < g.world; ++r) {
        if (!g.present[r]) missing.push_back(r);
      }
      Break(g, fmt::format("{} timed out after {} ms on rank {}: rank(s) {} never joined", op, g.options.timeout_ms,
                           rank_, fmt::join(missing, ", ")));
      return Timeout("{}", g.broken);
    }
    if (!g.broken.empty()) return CommError("{} on rank {}: {}", op, rank_, g.broken);
    lock.unlock();
    // The others' buffers stay untouched until everyone departs: the result
    // goes straight into `recv` unless `recv` is some rank's send buffer (in
    // place), where it waits in a copy until then.
    std::byte* out = static_cast<std::byte*>(recv);
    std::unique_ptr<std::byte[]> copy;
    const auto overlaps = [&](const std::byte* s) {
      return s != nullptr && recv_bytes > 0 && s < out + recv_bytes && out < s + std::max<size_t>(send_bytes, 1);
    };
    if (std::any_of(g.sends.begin(), g.sends.end(), overlaps)) {
      copy.reset(new std::byte[recv_bytes]);
      out = copy.get();
    }
    compute(g.sends, out);
    lock.lock();
    g.departed++;
    if (g.departed == g.world) {
      g.arrived = g.departed = 0;
      std::fill(g.present.begin(), g.present.end(), false);
      g.generation++;
      g.cv.notify_all();
    } else if (!g.cv.wait_until(lock, deadline, [&] { return g.generation != generation || !g.broken.empty(); })) {
      Break(g, fmt::format("{} timed out after {} ms on rank {} while the others read its buffers", op,
                           g.options.timeout_ms, rank_));
      return Timeout("{}", g.broken);
    }
    if (g.generation == generation) return CommError("{} on rank {}: {}", op, rank_, g.broken);
    lock.unlock();
    if (copy != nullptr && recv != nullptr) std::memcpy(recv, copy.get(), recv_bytes);
    return Status::Ok();
  }

  // This rank's slice of every rank's `sends`, summed in rank order in fp32
  // and rounded once: the same sum on every rank.
  template <DType kDType>
  void Sum(const std::vector<const std::byte*>& sends, size_t count, std::byte* out) const {
    constexpr size_t kWidth = DTypeSizeBytes(kDType);
    float* sum = reinterpret_cast<float*>(out);
    thread_local std::vector<float> scratch;
    if constexpr (kDType != DType::kFloat32) {
      scratch.assign(count, 0.0f);
      sum = scratch.data();
    } else {
      std::fill(sum, sum + count, 0.0f);
    }
    for (int r = 0; r < group_->world; ++r) {
      const std::byte* slice = sends[r] + rank_ * count * kWidth;
      for (size_t i = 0; i < count; ++i) sum[i] += optim::FloatAt(slice, kDType, i);
    }
    if constexpr (kDType != DType::kFloat32) {
      for (size_t i = 0; i < count; ++i) optim::StoreFloat(out, kDType, i, sum[i]);
    }
  }

  static void Break(Group& g, std::string why) {
    if (g.broken.empty()) g.broken = std::move(why);
    g.cv.notify_all();
  }

  std::shared_ptr<Group> group_;
  const int rank_;
};

}  // namespace

Result<std::vector<std::unique_ptr<Communicator>>> CreateLoopbackGroup(int world_size, CommOptions options) {
  if (world_size < 1) return InvalidArgument("loopback group: world size {} must be >= 1", world_size);
  if (options.timeout_ms == 0) return InvalidArgument("loopback group: timeout_ms must be > 0");
  auto group = std::make_shared<Group>(world_size, options);
  std::vector<std::unique_ptr<Communicator>> ranks;
  for (int r = 0; r < world_size; ++r) ranks.push_back(std::make_unique<LoopbackCommunicator>(group, r));
  return ranks;
}

}  // namespace strata
