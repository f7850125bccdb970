// The NCCL communicator. One GPU takes one rank (NCCL refuses two ranks on
// one device), so these run a group of one rank: every collective on host
// and on device buffers, a model trained through it like one trained with
// no communicator, and a group whose second rank never joins. Without a GPU
// they skip, except the check that asking for NCCL then is a clear error.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <numeric>
#include <thread>
#include <vector>

#include "strata/comm.h"
#include "strata/device.h"
#include "tests/offload/training/train_model.h"
#include "tests/backends/comm/comm_checks.h"
#include "tests/test_util.h"

namespace strata {
namespace {

constexpr uint32_t kWaitMs = 30'000;

TEST(NcclCommTest, WithoutAGpuItIsNotSupportedNamingTheHostBackend) {
  if (CudaDeviceAvailable()) GTEST_SKIP() << "a CUDA device is present";
  Result<std::unique_ptr<Communicator>> comm = CreateNcclCommunicator(nullptr, 0);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kNotSupported) << comm.status().ToString();
  EXPECT_NE(comm.status().message().find("comm.backend host"), std::string::npos) << comm.status().ToString();
}

TEST(NcclCommTest, ADeviceIndexThisProcessDoesNotSeeIsInvalid) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  Result<std::unique_ptr<Communicator>> comm = CreateNcclCommunicator(nullptr, 4096);
  ASSERT_FALSE(comm.ok());
  EXPECT_EQ(comm.status().code(), StatusCode::kInvalidArgument) << comm.status().ToString();
  EXPECT_NE(comm.status().message().find("device.index 4096"), std::string::npos) << comm.status().ToString();
}

TEST(NcclCommTest, OneRankCarriesHostAndDeviceBuffers) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> comm, CreateNcclCommunicator(nullptr, 0, {.timeout_ms = kWaitMs}));
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->world_size(), 1);
  EXPECT_NE(comm->Describe().find("NCCL"), std::string::npos) << comm->Describe();

  // Host buffers, staged through the device; repeated so a stale staging buffer would show.
  for (int round = 0; round < 3; ++round) {
    std::vector<float> send(1000 + round * 300), got(send.size(), -1.0f);
    std::iota(send.begin(), send.end(), static_cast<float>(round));
    ASSERT_OK(comm->AllGather(send.data(), got.data(), send.size() * sizeof(float)));
    EXPECT_EQ(got, send) << "round " << round;
    std::fill(got.begin(), got.end(), -1.0f);
    ASSERT_OK(comm->ReduceScatterSum(send.data(), got.data(), send.size()));
    EXPECT_EQ(got, send) << "round " << round;
  }
  ASSERT_OK(testing::CheckHalfReduceScatter(*comm, DType::kBFloat16));
  ASSERT_OK(testing::CheckHalfReduceScatter(*comm, DType::kFloat16));
  std::vector<double> values = {1.5, -2.25, 1e300};
  ASSERT_OK(comm->AllReduceSum(values));
  EXPECT_EQ(values, (std::vector<double>{1.5, -2.25, 1e300}));
  std::string text = "the root's bytes";
  ASSERT_OK(comm->Broadcast(text.data(), text.size(), 0));
  EXPECT_EQ(text, "the root's bytes");
  // A root that is no rank is refused before NCCL is called, breaking nothing.
  EXPECT_EQ(comm->Broadcast(text.data(), text.size(), 1).code(), StatusCode::kInvalidArgument);
  EXPECT_OK(comm->Barrier());
  EXPECT_EQ(comm->stats().all_gather.calls, 3u);
}

TEST(NcclCommTest, DeviceBuffersGoToNcclAsTheyAre) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> comm, CreateNcclCommunicator(nullptr, 0, {.timeout_ms = kWaitMs}));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, CreateCudaDevice(0, size_t{64} << 20));
  constexpr size_t kCount = 1 << 16, kBytes = kCount * sizeof(float);
  ASSERT_OK_AND_ASSIGN(Buffer send, device->Allocate(kBytes));
  ASSERT_OK_AND_ASSIGN(Buffer recv, device->Allocate(kBytes));
  std::vector<float> host(kCount), back(kCount, 0.0f);
  std::iota(host.begin(), host.end(), 7.0f);
  ASSERT_OK_AND_ASSIGN(auto up, device->CopyAsync(CopyStream::kHostToDevice, send.data(), host.data(), kBytes));
  ASSERT_OK(up->Wait(kWaitMs));
  ASSERT_OK(device->Memset(recv.data(), 0, kBytes));
  ASSERT_OK(comm->AllGather(send.data(), recv.data(), kBytes));
  ASSERT_OK_AND_ASSIGN(auto down, device->CopyAsync(CopyStream::kDeviceToHost, back.data(), recv.data(), kBytes));
  ASSERT_OK(down->Wait(kWaitMs));
  EXPECT_EQ(back, host);
  ASSERT_OK(device->Memset(recv.data(), 0, kBytes));
  ASSERT_OK(comm->ReduceScatterSum(static_cast<const float*>(send.data()), static_cast<float*>(recv.data()), kCount));
  std::fill(back.begin(), back.end(), 0.0f);
  ASSERT_OK_AND_ASSIGN(auto again, device->CopyAsync(CopyStream::kDeviceToHost, back.data(), recv.data(), kBytes));
  ASSERT_OK(again->Wait(kWaitMs));
  EXPECT_EQ(back, host);
  EXPECT_EQ(comm->stats().all_gather.calls, 1u);
  EXPECT_EQ(comm->stats().reduce_scatter.calls, 1u);
}

// The data-parallel path on one rank through NCCL (gradients reduce-scattered
// during backward): the same parameters, bit for bit, as no communicator.
TEST(NcclCommTest, AModelTrainedThroughOneNcclRankMatchesOneWithout) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Communicator> comm, CreateNcclCommunicator(nullptr, 0, {.timeout_ms = kWaitMs}));
  using offload::kChunkElems;
  using offload::kLayers;
  offload::Model alone, through(0.0, comm.get());
  offload::GradReducer reducer(*through.engine, *comm);
  std::mt19937 rng(5);
  for (int l = 0; l < kLayers; ++l) {
    const std::vector<float> w = offload::Random(rng, 1.0f);
    alone.Write(l, ChunkKind::kParam, w);
    through.Write(l, ChunkKind::kParam, w);
  }
  for (int step = 0; step < 3; ++step) {
    for (int l = 0; l < kLayers; ++l) {
      const std::vector<float> g = offload::Random(rng, 0.1f);
      alone.Write(l, ChunkKind::kGrad, g);
      through.Write(l, ChunkKind::kGrad, g);
    }
    ASSERT_OK(alone.Iteration().status());
    ASSERT_OK(through.Iteration(comm.get(), &reducer).status());
  }
  ASSERT_OK(reducer.Drain());
  for (int l = 0; l < kLayers; ++l) {
    EXPECT_EQ(through.Read(l, ChunkKind::kParam), alone.Read(l, ChunkKind::kParam)) << "layer " << l;
  }
  EXPECT_GE(comm->stats().reduce_scatter.calls, static_cast<uint64_t>(3 * kLayers));
}

// Two ranks on one GPU: refused on both, alike, before NCCL is asked.
TEST(NcclCommTest, TwoRanksOnOneGpuAreRefusedOnBoth) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  ASSERT_OK_AND_ASSIGN(auto bootstrap, CreateLoopbackGroup(2, {.timeout_ms = kWaitMs}));
  std::vector<Status> results(2, Status::Ok());
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] { results[r] = CreateNcclCommunicator(bootstrap[r].get(), 0).status(); });
  }
  for (std::thread& t : threads) t.join();
  for (const Status& status : results) {
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
    EXPECT_NE(status.message().find("ranks 0 and 1 are on the same GPU"), std::string::npos) << status.ToString();
  }
}

// Rank 1 of the bootstrap group does what CreateNcclCommunicator does
// before NCCL (its GPU's host and bus id gathered, a status vote, NCCL's id
// broadcast) but never joins the NCCL group: rank 0 gets a Timeout within
// its timeout, not a hang.
TEST(NcclCommTest, ARankThatNeverJoinsIsATimeoutNotAHang) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  ASSERT_OK_AND_ASSIGN(auto bootstrap, CreateLoopbackGroup(2, {.timeout_ms = kWaitMs}));
  constexpr uint32_t kTimeoutMs = 3'000;
  Status joined = Status::Ok();
  double seconds = 0;
  std::thread rank0([&] {
    const auto start = std::chrono::steady_clock::now();
    joined = CreateNcclCommunicator(bootstrap[0].get(), 0, {.timeout_ms = kTimeoutMs}).status();
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  });
  std::vector<char> where(64 + 32 + 1, 0), all(2 * where.size());  // host, bus id, failed: another GPU
  std::memcpy(where.data(), "another-host", 12);
  EXPECT_OK(bootstrap[1]->AllGather(where.data(), all.data(), where.size()));
  std::vector<char> id(128);  // NCCL_UNIQUE_ID_BYTES
  EXPECT_OK(AgreeOnStatus(bootstrap[1].get(), Status::Ok(), "creating NCCL's unique id"));
  EXPECT_OK(bootstrap[1]->Broadcast(id.data(), id.size(), 0));
  rank0.join();
  EXPECT_EQ(joined.code(), StatusCode::kTimeout) << joined.ToString();
  EXPECT_NE(joined.message().find("did not form"), std::string::npos) << joined.ToString();
  EXPECT_LT(seconds, 3 * kTimeoutMs / 1000.0);
}

}  // namespace
}  // namespace strata
