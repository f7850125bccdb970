// The loopback communicator (ranks as threads): every collective against its
// definition, repeated so that one generation's state cannot leak into the
// next; a rank that never comes; mismatched calls; the configuration check.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <future>
#include <numeric>
#include <thread>
#include <vector>

#include "strata/comm.h"
#include "tests/test_util.h"
#include "tests/backends/comm/comm_checks.h"

namespace strata {
namespace {

// Runs `body(comm)` on every rank of a loopback group, each on its own thread.
std::vector<Status> OnEveryRank(int world, const std::function<Status(Communicator&)>& body,
                                CommOptions options = {.timeout_ms = 10'000}) {
  auto group = CreateLoopbackGroup(world, options);
  STRATA_CHECK(group.ok(), "{}", group.status().ToString());
  std::vector<Status> results(world, Status::Ok());
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) threads.emplace_back([&, r] { results[r] = body(*(*group)[r]); });
  for (std::thread& t : threads) t.join();
  return results;
}

void ExpectAllOk(const std::vector<Status>& results) {
  for (size_t r = 0; r < results.size(); ++r) EXPECT_TRUE(results[r].ok()) << "rank " << r << ": " << results[r].ToString();
}

class LoopbackTest : public ::testing::TestWithParam<int> {};

TEST_P(LoopbackTest, EveryCollectiveMatchesItsDefinitionManyTimesOver) {
  const int world = GetParam();
  constexpr size_t kCount = 1000;
  ExpectAllOk(OnEveryRank(world, [&](Communicator& comm) -> Status {
    const int me = comm.rank();
    for (int round = 0; round < 50; ++round) {
      // All-gather: rank r sends r*1000 + i + round.
      std::vector<int32_t> send(kCount), recv(world * kCount, -1);
      for (size_t i = 0; i < kCount; ++i) send[i] = me * 1000 + static_cast<int32_t>(i) + round;
      STRATA_RETURN_IF_ERROR(comm.AllGather(send.data(), recv.data(), kCount * sizeof(int32_t)));
      for (int r = 0; r < world; ++r) {
        for (size_t i = 0; i < kCount; ++i) {
          if (recv[r * kCount + i] != r * 1000 + static_cast<int32_t>(i) + round) {
            return Internal("all-gather: rank {} slot {} element {}", me, r, i);
          }
        }
      }
      // Reduce-scatter: rank r sends (r + 1) * (j + round) at element j of the whole vector.
      std::vector<float> whole(world * kCount), mine(kCount, -1.0f);
      for (size_t j = 0; j < whole.size(); ++j) whole[j] = static_cast<float>((me + 1) * static_cast<int>(j % 97 + round));
      STRATA_RETURN_IF_ERROR(comm.ReduceScatterSum(whole.data(), mine.data(), kCount));
      const float ranks_sum = static_cast<float>(world * (world + 1) / 2);
      for (size_t i = 0; i < kCount; ++i) {
        const size_t j = me * kCount + i;
        if (mine[i] != ranks_sum * static_cast<float>(j % 97 + round)) {
          return Internal("reduce-scatter: rank {} element {}: {}", me, i, mine[i]);
        }
      }
      // All-reduce in place.
      std::vector<double> values = {1.0 * me, 0.5, static_cast<double>(round)};
      STRATA_RETURN_IF_ERROR(comm.AllReduceSum(values));
      if (values[0] != world * (world - 1) / 2.0 || values[1] != 0.5 * world || values[2] != round * world) {
        return Internal("all-reduce: rank {} got {} {} {}", me, values[0], values[1], values[2]);
      }
      // Broadcast from the last rank.
      int64_t token = me == world - 1 ? 4242 + round : -1;
      STRATA_RETURN_IF_ERROR(comm.Broadcast(&token, sizeof(token), world - 1));
      if (token != 4242 + round) return Internal("broadcast: rank {} got {}", me, token);
      STRATA_RETURN_IF_ERROR(comm.Barrier());
    }
    return Status::Ok();
  }));
}

TEST_P(LoopbackTest, SixteenBitReduceScattersSumAndRound) {
  ExpectAllOk(OnEveryRank(GetParam(), [](Communicator& comm) -> Status {
    STRATA_RETURN_IF_ERROR(testing::CheckHalfReduceScatter(comm, DType::kBFloat16));
    return testing::CheckHalfReduceScatter(comm, DType::kFloat16);
  }));
}

TEST_P(LoopbackTest, AnAllGatherIntoTheBufferItSendsFromWorks) {
  const int world = GetParam();
  ExpectAllOk(OnEveryRank(world, [&](Communicator& comm) -> Status {
    std::vector<float> full(world * 64, 0.0f);
    float* shard = full.data() + comm.rank() * 64;  // ZeRO's layout: each rank's shard inside the full chunk
    for (int i = 0; i < 64; ++i) shard[i] = static_cast<float>(comm.rank() * 100 + i);
    STRATA_RETURN_IF_ERROR(comm.AllGather(shard, full.data(), 64 * sizeof(float)));
    for (int r = 0; r < world; ++r) {
      for (int i = 0; i < 64; ++i) {
        if (full[r * 64 + i] != static_cast<float>(r * 100 + i)) return Internal("rank {}: slot {} {}", comm.rank(), r, i);
      }
    }
    return Status::Ok();
  }));
}

INSTANTIATE_TEST_SUITE_P(Worlds, LoopbackTest, ::testing::Values(1, 2, 4));

// What each rank sends under the ring algorithm: (W-1)/W of the whole
// buffer for a gather or a reduce-scatter, twice that for an all-reduce.
TEST_P(LoopbackTest, StatsCountCallsAndTheBytesEachRankSends) {
  const int world = GetParam();
  std::vector<CommStats> stats(world);
  ExpectAllOk(OnEveryRank(world, [&](Communicator& comm) -> Status {
    std::vector<std::byte> mine(100), all(100 * world);
    std::vector<float> send(8 * world, 1.0f), recv(8);
    std::vector<double> values(6 * world, 1.0);
    for (int i = 0; i < 3; ++i) STRATA_RETURN_IF_ERROR(comm.AllGather(mine.data(), all.data(), mine.size()));
    STRATA_RETURN_IF_ERROR(comm.ReduceScatterSum(send.data(), recv.data(), recv.size()));
    STRATA_RETURN_IF_ERROR(comm.AllReduceSum(values));
    STRATA_RETURN_IF_ERROR(comm.Broadcast(mine.data(), mine.size(), 0));
    STRATA_RETURN_IF_ERROR(comm.Barrier());
    stats[comm.rank()] = comm.stats();
    return Status::Ok();
  }));
  const uint64_t others = static_cast<uint64_t>(world - 1);
  for (int r = 0; r < world; ++r) {
    const CommStats& s = stats[r];
    EXPECT_EQ(s.all_gather.calls, 3u);
    EXPECT_EQ(s.all_gather.bytes, 3 * others * 100);
    EXPECT_EQ(s.reduce_scatter.calls, 1u);
    EXPECT_EQ(s.reduce_scatter.bytes, others * 8 * sizeof(float));
    EXPECT_EQ(s.all_reduce.bytes, 2 * others * 6 * sizeof(double));
    EXPECT_EQ(s.broadcast.bytes, world > 1 ? 100u : 0u);
    EXPECT_EQ(s.total_bytes(), s.all_gather.bytes + s.reduce_scatter.bytes + s.all_reduce.bytes + s.broadcast.bytes);
    EXPECT_GT(s.all_gather.seconds, 0.0);  // three calls were timed
  }
}

// A communicator whose all-gather waits until released: to hold one
// collective open while another thread tries a second.
class HeldOpen final : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 2; }
  std::string Describe() const override { return "held open"; }
  Status Barrier() override { return Status::Ok(); }
  std::promise<void> entered, release;

 protected:
  Status DoAllGather(const void*, void*, size_t) override {
    entered.set_value();
    release.get_future().wait();
    return Status::Ok();
  }
  Status DoReduceScatterSum(const void*, void*, size_t, DType) override { return Status::Ok(); }
  Status DoAllReduceSum(std::span<double>) override { return Status::Ok(); }
  Status DoBroadcast(void*, size_t, int) override { return Status::Ok(); }
};

// Two collectives at once on one communicator (MPI: undefined behaviour,
// and an order the other ranks cannot match) is a CommError for the second;
// the first completes, and the communicator is usable after.
TEST(CommunicatorTest, ASecondCollectiveWhileOneRunsIsRefused) {
  HeldOpen comm;
  std::byte send[4], recv[8];
  Status first = InvalidArgument("not run");
  std::thread holder([&] { first = comm.AllGather(send, recv, 4); });
  comm.entered.get_future().wait();
  std::vector<double> values = {1.0};
  const Status second = comm.AllReduceSum(values);
  comm.release.set_value();
  holder.join();
  ASSERT_OK(first);
  EXPECT_EQ(second.code(), StatusCode::kCommError) << second.ToString();
  EXPECT_NE(second.message().find("another collective is running"), std::string::npos) << second.ToString();
  EXPECT_OK(comm.AllReduceSum(values));
  EXPECT_EQ(comm.stats().all_gather.calls, 1u);
  EXPECT_EQ(comm.stats().all_reduce.calls, 1u);  // the refused one is not counted
}

// A throttled communicator gives the inner one's results, and each
// collective lasts at least the bytes this rank sends over its rate.
TEST(ThrottledCommTest, CollectivesTakeTheirBytesOverTheRateAndStayCorrect) {
  auto group = CreateLoopbackGroup(2, {.timeout_ms = 10'000});
  ASSERT_OK(group.status());
  std::vector<double> seconds(2);
  std::vector<Status> results(2, Status::Ok());
  std::vector<std::vector<int>> gathered(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto slow = CreateThrottledCommunicator(*(*group)[r], 0.1);  // 100 MB/s
      if (!slow.ok()) {
        results[r] = slow.status();
        return;
      }
      std::vector<int> mine(250'000, r + 1), all(500'000);  // 1 MB sent by each rank
      const auto start = std::chrono::steady_clock::now();
      results[r] = (*slow)->AllGather(mine.data(), all.data(), mine.size() * sizeof(int));
      seconds[r] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      gathered[r] = {all.front(), all[249'999], all[250'000], all.back()};
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_OK(results[r]);
    EXPECT_GE(seconds[r], 0.01) << "1 MB at 100 MB/s";
    EXPECT_EQ(gathered[r], (std::vector<int>{1, 1, 2, 2}));
  }
  EXPECT_EQ(CreateThrottledCommunicator(*(*group)[0], 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(LoopbackCommTest, ARankThatNeverComesIsATimeoutNamingItAndBreaksTheGroup) {
  const std::vector<Status> results = OnEveryRank(
      3,
      [](Communicator& comm) -> Status {
        STRATA_RETURN_IF_ERROR(comm.Barrier());
        if (comm.rank() == 2) return Status::Ok();  // dies: never reaches the all-reduce
        std::vector<double> v = {1.0};
        Status first = comm.AllReduceSum(v);
        if (first.ok()) return Internal("the all-reduce completed without rank 2");
        // Broken for good: the next call fails at once instead of waiting again.
        const auto start = std::chrono::steady_clock::now();
        Status second = comm.Barrier();
        if (second.code() != StatusCode::kCommError) return Internal("second call: {}", second.ToString());
        if (std::chrono::steady_clock::now() - start > std::chrono::milliseconds(50)) {
          return Internal("the second call waited");
        }
        return first;
      },
      {.timeout_ms = 200});
  EXPECT_OK(results[2]);
  bool timed_out = false;
  for (int r : {0, 1}) {
    // The first rank to time out names rank 2; the other sees the group broken (CommError) or times out too.
    ASSERT_TRUE(results[r].code() == StatusCode::kTimeout || results[r].code() == StatusCode::kCommError)
        << results[r].ToString();
    if (results[r].code() == StatusCode::kTimeout) {
      timed_out = true;
      EXPECT_NE(results[r].message().find("rank(s) 2 never joined"), std::string::npos) << results[r].ToString();
    }
  }
  EXPECT_TRUE(timed_out);
}

TEST(LoopbackCommTest, RanksCallingDifferentCollectivesBreakTheGroupInsteadOfMixingThem) {
  const std::vector<Status> results = OnEveryRank(2, [](Communicator& comm) -> Status {
    if (comm.rank() == 0) return comm.Barrier();
    std::vector<double> v = {1.0};
    return comm.AllReduceSum(v);
  }, {.timeout_ms = 500});
  for (const Status& s : results) EXPECT_FALSE(s.ok());
  const std::string both = results[0].ToString() + results[1].ToString();
  EXPECT_NE(both.find("where the others called"), std::string::npos) << both;
}

TEST(LoopbackCommTest, TheConfigurationCheckNamesTheRanksThatDiffer) {
  ExpectAllOk(OnEveryRank(4, [](Communicator& comm) { return CheckSameOnAllRanks(comm, "options", "lr=0.1"); }));
  const std::vector<Status> results = OnEveryRank(4, [](Communicator& comm) {
    return CheckSameOnAllRanks(comm, "options", comm.rank() == 2 ? "lr=0.2" : "lr=0.1");
  });
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(results[r].code(), StatusCode::kInvalidArgument) << "rank " << r;  // every rank learns it
    EXPECT_NE(results[r].message().find("the options of rank(s) 2 differ"), std::string::npos) << results[r].ToString();
  }
  EXPECT_NE(results[2].message().find("this is rank 2: lr=0.2"), std::string::npos) << results[2].ToString();
}

TEST(LoopbackCommTest, BadArgumentsAreRefused) {
  EXPECT_EQ(CreateLoopbackGroup(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateLoopbackGroup(2, {.timeout_ms = 0}).status().code(), StatusCode::kInvalidArgument);
  auto group = CreateLoopbackGroup(1);
  ASSERT_OK(group.status());
  int x = 0;
  EXPECT_EQ((*group)[0]->Broadcast(&x, sizeof(x), 1).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace strata
