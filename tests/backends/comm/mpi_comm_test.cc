// The MPI communicator, run by ctest under `mpirun -np 2` and `-np 4`
// (label mpi): every rank runs these cases in the same order, so their
// collectives pair up. Without mpirun it runs as one rank.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>
#include <vector>

#include "strata/comm.h"
#include "tests/backends/comm/comm_checks.h"
#include "tests/test_util.h"

namespace strata {
namespace {

Communicator& World() {
  static std::unique_ptr<Communicator> comm = [] {
    auto made = CreateMpiCommunicator({.timeout_ms = 20'000});
    STRATA_CHECK(made.ok(), "{}", made.status().ToString());
    return std::move(made).value();
  }();
  return *comm;
}

TEST(MpiCommTest, EveryCollectiveMatchesItsDefinition) {
  Communicator& comm = World();
  const int world = comm.world_size(), me = comm.rank();
  if (LaunchedByMpi()) {
    EXPECT_GE(world, 2) << "mpirun started this test with one rank";
  }
  constexpr size_t kCount = 4096;
  for (int round = 0; round < 10; ++round) {
    std::vector<int32_t> send(kCount), recv(world * kCount, -1);
    for (size_t i = 0; i < kCount; ++i) send[i] = me * 100000 + static_cast<int32_t>(i) + round;
    ASSERT_OK(comm.AllGather(send.data(), recv.data(), kCount * sizeof(int32_t)));
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(recv[r * kCount + 7], r * 100000 + 7 + round) << "slot " << r;
      ASSERT_EQ(recv[r * kCount + kCount - 1], r * 100000 + static_cast<int32_t>(kCount) - 1 + round);
    }
    std::vector<float> whole(world * kCount), mine(kCount, -1.0f);
    for (size_t j = 0; j < whole.size(); ++j) whole[j] = static_cast<float>((me + 1) * static_cast<int>(j % 31 + round));
    ASSERT_OK(comm.ReduceScatterSum(whole.data(), mine.data(), kCount));
    const float ranks_sum = static_cast<float>(world * (world + 1) / 2);
    for (size_t i = 0; i < kCount; ++i) {
      ASSERT_EQ(mine[i], ranks_sum * static_cast<float>((me * kCount + i) % 31 + round)) << "element " << i;
    }
    std::vector<double> values = {1.0 * me, 0.25};
    ASSERT_OK(comm.AllReduceSum(values));
    EXPECT_EQ(values[0], world * (world - 1) / 2.0);
    EXPECT_EQ(values[1], 0.25 * world);
    int64_t token = me == 0 ? 99 + round : -1;
    ASSERT_OK(comm.Broadcast(&token, sizeof(token), 0));
    EXPECT_EQ(token, 99 + round);
    ASSERT_OK(comm.Barrier());
  }
}

// bf16 and fp16 travel as MPI_UINT16_T, summed by strata's own operations.
TEST(MpiCommTest, SixteenBitReduceScattersSumAndRound) {
  ASSERT_OK(testing::CheckHalfReduceScatter(World(), DType::kBFloat16));
  ASSERT_OK(testing::CheckHalfReduceScatter(World(), DType::kFloat16));
}

TEST(MpiCommTest, AMismatchedConfigurationIsFoundOnEveryRank) {
  Communicator& comm = World();
  ASSERT_OK(CheckSameOnAllRanks(comm, "options", "precision=bf16"));
  if (comm.world_size() < 2) GTEST_SKIP() << "one rank: nothing to differ";
  const Status status = CheckSameOnAllRanks(comm, "options", comm.rank() == 1 ? "precision=fp32" : "precision=bf16");
  ASSERT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
  EXPECT_NE(status.message().find("rank(s) 1 differ"), std::string::npos) << status.ToString();
}

// Last: it leaves the communicator broken.
TEST(MpiCommTest, ZzARankThatDoesNotComeIsATimeoutNotAHang) {
  if (!LaunchedByMpi() || World().world_size() < 2) GTEST_SKIP() << "needs two ranks";
  auto comm = CreateMpiCommunicator({.timeout_ms = 300});  // the same world, a short timeout
  ASSERT_OK(comm.status());
  ASSERT_OK((*comm)->Barrier());
  if ((*comm)->rank() == 1) {
    // Stays away from rank 0's barrier past its timeout, then joins it, so
    // that every process ends cleanly.
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    ASSERT_OK(World().Barrier());
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  const Status status = (*comm)->Barrier();
  EXPECT_EQ(status.code(), StatusCode::kTimeout) << status.ToString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(1200));
  EXPECT_EQ((*comm)->Barrier().code(), StatusCode::kCommError);  // broken: no second wait
}

}  // namespace
}  // namespace strata
