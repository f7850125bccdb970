#include "offload/training/state_stream.h"

#include <cerrno>
#include <vector>

#include "tests/optim/optim_test_util.h"

namespace strata::offload {
namespace {

using optim::testing::ChunkArrays;
using optim::testing::RandomChunk;

constexpr size_t kGroupSizes[] = {70000, 1000, 20000, 33};

// States streamed from a fault-injecting in-memory drive, next to the same
// model updated in memory as the reference.
struct StreamFixture {
  FaultInjectingStorage* faults = nullptr;
  std::unique_ptr<Storage> storage;
  std::unique_ptr<memory::NvmeTierPool> pool;
  std::unique_ptr<StateStream> stream;
  std::vector<ChunkArrays> reference;  // master, states, grads and compute copies
  std::vector<std::vector<uint16_t>> streamed_params;
  std::unique_ptr<optim::Optimizer> optimizer;

  explicit StreamFixture(uint64_t ring_bytes = uint64_t{2} << 20, uint64_t nvme_bytes = uint64_t{64} << 20,
                         uint32_t wait_timeout_ms = 120000) {
    std::mt19937_64 rng(::strata::testing::TestSeed());
    auto memory = CreateMemoryStorage(nvme_bytes);
    STRATA_CHECK(memory.ok());
    auto fault = std::make_unique<FaultInjectingStorage>(std::move(memory).value());
    faults = fault.get();
    storage = std::move(fault);
    pool = std::make_unique<memory::NvmeTierPool>(*storage);
    auto created = StateStream::Create(*pool, 2, {.ring_bytes = ring_bytes, .wait_timeout_ms = wait_timeout_ms});
    STRATA_CHECK(created.ok());
    stream = std::move(created).value();
    for (size_t n : kGroupSizes) {
      ChunkArrays a = RandomChunk(n, DType::kBFloat16, DType::kBFloat16, rng);
      std::fill(a.state0.begin(), a.state0.end(), 0.0f);  // a new group's states start at zero
      std::fill(a.state1.begin(), a.state1.end(), 0.0f);
      auto id = stream->AddGroup(a.master);
      STRATA_CHECK(id.ok());
      streamed_params.push_back(a.param16);
      reference.push_back(std::move(a));
    }
    auto made = optim::Optimizer::Create({.lr = 1e-3f, .weight_decay = 0.01f});
    STRATA_CHECK(made.ok());
    optimizer = std::move(made).value();
  }

  std::vector<GroupIo> Io() {
    std::vector<GroupIo> io;
    for (size_t i = 0; i < reference.size(); ++i) {
      io.push_back({.grad = reference[i].grad16.data(), .grad_dtype = DType::kBFloat16,
                    .param = streamed_params[i].data(), .param_dtype = DType::kBFloat16});
    }
    return io;
  }

  // One step both ways (the reference only when the streamed one succeeds).
  Status Step(int64_t step) {
    const optim::StepPlan plan{.step = step};
    std::vector<GroupIo> io = Io();
    Result<StreamStepReport> report = stream->Step(*optimizer, plan, io);
    if (!report.ok()) return report.status();
    for (ChunkArrays& a : reference) STRATA_RETURN_IF_ERROR(optimizer->UpdateChunk(plan, a.view()));
    return Status::Ok();
  }

  // Every group on NVMe and every compute copy equals the reference, bit for bit.
  void ExpectMatchesReference() {
    for (size_t i = 0; i < reference.size(); ++i) {
      const size_t n = reference[i].master.size();
      std::vector<float> master(n), m(n), v(n);
      const std::span<float> states[] = {m, v};
      ASSERT_OK(stream->ReadGroup(GroupId(static_cast<uint32_t>(i)), master, states));
      EXPECT_EQ(master, reference[i].master) << "group " << i;
      EXPECT_EQ(m, reference[i].state0) << "group " << i;
      EXPECT_EQ(v, reference[i].state1) << "group " << i;
      EXPECT_EQ(streamed_params[i], reference[i].param16) << "group " << i;
    }
  }
};

TEST(StateStreamTest, StreamedStepsEqualTheInMemoryUpdateBitForBit) {
  // 2 MiB of ring holds 2 of the largest group (3 x 276 KiB) for 4 groups:
  // buffers are reused.
  StreamFixture f;
  for (int64_t step = 1; step <= 3; ++step) ASSERT_OK(f.Step(step));
  EXPECT_EQ(f.stream->ring_slots(), 2u);
  f.ExpectMatchesReference();
}

TEST(StateStreamTest, RingNeverHoldsMoreThanItsBound) {
  constexpr uint64_t kRingBytes = 3 * 3 * 276 * 1024 + 1000;
  StreamFixture f(kRingBytes);
  ASSERT_OK(f.Step(1));
  EXPECT_EQ(f.stream->ring_slots(), 3u);
  EXPECT_LE(uint64_t{f.stream->ring_slots()} * f.stream->ring_slot_bytes(), kRingBytes);
  f.ExpectMatchesReference();
}

// Each fault: the step fails with its error, the states on NVMe and the
// compute copies are those of before the step, and the next step works.
void ExpectFaultLeavesStatesAlone(const std::function<void(StreamFixture&)>& inject, StatusCode code,
                                  uint32_t wait_timeout_ms = 120000) {
  StreamFixture f(uint64_t{2} << 20, uint64_t{64} << 20, wait_timeout_ms);
  ASSERT_OK(f.Step(1));
  inject(f);
  Status status = f.Step(2);
  EXPECT_EQ(status.code(), code) << status.ToString();
  f.faults->SetDelayMs(0);
  f.ExpectMatchesReference();  // the reference did not take step 2 either
  ASSERT_OK(f.Step(2));
  f.ExpectMatchesReference();
}

TEST(StateStreamTest, FailedReadEndsTheStepAndNothingIsWrittenBack) {
  ExpectFaultLeavesStatesAlone([](StreamFixture& f) { f.faults->FailReads(EIO, 1, /*after=*/2); },
                               StatusCode::kIoError);
}

TEST(StateStreamTest, FailedWriteEndsTheStepAndNothingIsLost) {
  ExpectFaultLeavesStatesAlone([](StreamFixture& f) { f.faults->FailWrites(ENOSPC, 1, /*after=*/1); },
                               StatusCode::kIoError);
}

TEST(StateStreamTest, CorruptReadIsCorruptionAndNothingIsWrittenBack) {
  ExpectFaultLeavesStatesAlone([](StreamFixture& f) { f.faults->CorruptReads(1); }, StatusCode::kCorruption);
}

TEST(StateStreamTest, SlowReadBecomesTimeoutNotAHang) {
  ExpectFaultLeavesStatesAlone([](StreamFixture& f) { f.faults->SetDelayMs(400); }, StatusCode::kTimeout,
                               /*wait_timeout_ms=*/50);
}

TEST(StateStreamTest, LastWriteFailingAfterEveryUpdatePutsEveryComputeCopyBack) {
  // Four groups: the fourth write fails once all four are updated.
  ExpectFaultLeavesStatesAlone([](StreamFixture& f) { f.faults->FailWrites(EIO, 1, /*after=*/3); },
                               StatusCode::kIoError);
}

TEST(StateStreamTest, AFailedStepIsPlannedAgainWithTheSameStepNumber) {
  StreamFixture f;
  ASSERT_OK_AND_ASSIGN(auto optimizer, optim::Optimizer::Create({.lr = 1e-3, .weight_decay = 0.01},
                                                                optim::LossScalerConfig{.init_scale = 1}));
  const auto stats = [&] {
    optim::GradStats local;
    for (ChunkArrays& a : f.reference) local.Add(a.view());
    return local;
  };
  std::vector<GroupIo> io = f.Io();
  ASSERT_OK_AND_ASSIGN(optim::StepPlan plan, optimizer->PlanStep(stats()));
  f.faults->FailReads(EIO, 1, /*after=*/1);
  EXPECT_EQ(f.stream->Step(*optimizer, plan, io).status().code(), StatusCode::kIoError);
  // Not finished: the retry is step 1 again, with the loss scaler untouched.
  ASSERT_OK_AND_ASSIGN(optim::StepPlan retry, optimizer->PlanStep(stats()));
  EXPECT_EQ(retry.step, 1);
  ASSERT_OK(f.stream->Step(*optimizer, retry, io).status());
  ASSERT_OK(optimizer->FinishStep(retry));
  EXPECT_EQ(optimizer->steps_taken(), 1);
  EXPECT_EQ(optimizer->scaler()->good_steps(), 1);
  for (ChunkArrays& a : f.reference) ASSERT_OK(optimizer->UpdateChunk(retry, a.view()));
  f.ExpectMatchesReference();
}

TEST(StateStreamTest, GroupsAddedAfterAStepGetTheirPlaceInTheRing) {
  StreamFixture f(/*ring_bytes=*/uint64_t{8} << 20);  // room for every group
  ASSERT_OK(f.Step(1));
  EXPECT_EQ(f.stream->ring_slots(), 4u);
  // A fifth group, added between steps (its states start at zero in both
  // the stream and the reference, which then take step 2 alike).
  std::mt19937_64 rng(::strata::testing::TestSeed() + 1);
  ChunkArrays added = RandomChunk(50000, DType::kBFloat16, DType::kBFloat16, rng);
  std::fill(added.state0.begin(), added.state0.end(), 0.0f);
  std::fill(added.state1.begin(), added.state1.end(), 0.0f);
  ASSERT_OK(f.stream->AddGroup(added.master).status());
  f.streamed_params.push_back(added.param16);
  f.reference.push_back(std::move(added));
  ASSERT_OK(f.Step(2));
  EXPECT_EQ(f.stream->ring_slots(), 5u);
  f.ExpectMatchesReference();
}

TEST(StateStreamTest, InputsThatDoNotFitAreRejectedBeforeAnyRead) {
  StreamFixture f;
  std::vector<GroupIo> io = f.Io();
  io[2].param = nullptr;  // bf16 parameters without a compute copy
  const int reads = f.faults->reads();
  Status status = f.stream->Step(*f.optimizer, optim::StepPlan{.step = 1}, io).status();
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("group 2"), std::string::npos) << status.ToString();
  EXPECT_EQ(f.faults->reads(), reads);
  f.ExpectMatchesReference();
}

TEST(StateStreamTest, FailedUpdateEndsTheStepAndNothingIsWrittenBack) {
  StreamFixture f;
  ASSERT_OK(f.Step(1));
  std::vector<GroupIo> io = f.Io();
  const optim::StepPlan plan{.step = 2};
  Result<StreamStepReport> report = f.stream->Run(io, [&](size_t group, const optim::ChunkTensors& t) {
    if (group == 2) return Internal("update of group 2 failed");
    return f.optimizer->UpdateChunk(plan, t);
  });
  EXPECT_EQ(report.status().code(), StatusCode::kInternal);
  f.ExpectMatchesReference();
  ASSERT_OK(f.Step(2));
  f.ExpectMatchesReference();
}

TEST(StateStreamTest, SkippedStepTouchesNothing) {
  StreamFixture f;
  const int reads = f.faults->reads(), writes = f.faults->writes();
  std::vector<GroupIo> io = f.Io();
  ASSERT_OK(f.stream->Step(*f.optimizer, optim::StepPlan{.skip = true}, io).status());
  EXPECT_EQ(f.faults->reads(), reads);
  EXPECT_EQ(f.faults->writes(), writes);
}

TEST(StateStreamTest, TooSmallARingAndAFullDriveAreClearErrors) {
  StreamFixture small(/*ring_bytes=*/uint64_t{1} << 20);
  Status status = small.Step(1);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("optimizer.stream_ring"), std::string::npos) << status.ToString();

  // 2 MiB of NVMe holds the groups (1.1 MiB) once but not twice.
  StreamFixture full(uint64_t{2} << 20, /*nvme_bytes=*/uint64_t{2} << 20);
  status = full.Step(1);
  EXPECT_EQ(status.code(), StatusCode::kOutOfMemory);
  EXPECT_NE(status.message().find("copy on write"), std::string::npos) << status.ToString();
  full.ExpectMatchesReference();
}

TEST(StateStreamTest, OptionsGiveTheRingAndTheWait) {
  Options options;
  ASSERT_OK(SetOption(options, "optimizer.stream_ring", "96MiB"));
  ASSERT_OK(SetOption(options, "nvme.io_timeout_ms", "5000"));
  const StateStreamOptions stream = StateStreamOptionsOf(options);
  EXPECT_EQ(stream.ring_bytes, uint64_t{96} << 20);
  EXPECT_EQ(stream.wait_timeout_ms, 10000u);
}

TEST(StateStreamTest, MismatchedInputsAreRejected) {
  StreamFixture f;
  std::vector<GroupIo> io = f.Io();
  io.pop_back();
  EXPECT_EQ(f.stream->Step(*f.optimizer, optim::StepPlan{.step = 1}, io).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_OK_AND_ASSIGN(auto sgd, optim::Optimizer::Create({.kind = optim::OptimizerKind::kSgd}));
  io = f.Io();
  EXPECT_EQ(f.stream->Step(*sgd, optim::StepPlan{.step = 1}, io).status().code(), StatusCode::kInvalidArgument);
  std::vector<float> master(3);
  EXPECT_EQ(f.stream->ReadGroup(GroupId(0), master, {}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(f.stream->ReadGroup(GroupId(99), master, {}).code(), StatusCode::kInvalidArgument);
}

// Int8 states (optimizer.states int8): groups of whole blocks streamed as
// the in-memory update of the same blocks gives them, bit for bit, moving
// about half the bytes of fp32 states (4 bytes of master and 2 x 260/256 of
// moments a parameter, against 12); a group not in whole blocks is refused.
TEST(StateStreamTest, Int8StatesStreamAsTheyUpdateInMemoryAtHalfTheBytes) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  ASSERT_OK_AND_ASSIGN(auto storage, CreateMemoryStorage(uint64_t{16} << 20));
  memory::NvmeTierPool pool(*storage);
  ASSERT_OK_AND_ASSIGN(auto stream, StateStream::Create(pool, 2, {.ring_bytes = uint64_t{2} << 20,
                                                                  .state_dtype = DType::kInt8Block}));
  ASSERT_OK_AND_ASSIGN(auto fp32_stream, StateStream::Create(pool, 2, {.ring_bytes = uint64_t{2} << 20}));
  constexpr size_t kSizes[] = {256 * 300, 256 * 3};
  std::vector<ChunkArrays> reference;
  std::vector<std::vector<std::byte>> moments;  // each group's two state arrays of 8-bit blocks
  for (size_t n : kSizes) {
    reference.push_back(RandomChunk(n, DType::kFloat32, DType::kFloat32, rng));
    ASSERT_OK(stream->AddGroup(reference.back().master).status());
    ASSERT_OK(fp32_stream->AddGroup(reference.back().master).status());
    moments.emplace_back(ChunkBytes(DType::kInt8Block, n));
    moments.emplace_back(ChunkBytes(DType::kInt8Block, n));
  }
  ASSERT_OK_AND_ASSIGN(auto optimizer, optim::Optimizer::Create({.lr = 1e-3f, .weight_decay = 0.01f}));
  std::vector<GroupIo> io;
  for (const ChunkArrays& a : reference) io.push_back({.grad = a.grad32.data(), .grad_dtype = DType::kFloat32});
  uint64_t bytes = 0, fp32_bytes = 0;
  for (int64_t step = 1; step <= 3; ++step) {
    const optim::StepPlan plan{.step = step};
    ASSERT_OK_AND_ASSIGN(StreamStepReport report, stream->Step(*optimizer, plan, io));
    ASSERT_OK_AND_ASSIGN(StreamStepReport fp32_report, fp32_stream->Step(*optimizer, plan, io));
    bytes = report.bytes_read + report.bytes_written;
    fp32_bytes = fp32_report.bytes_read + fp32_report.bytes_written;
    for (size_t i = 0; i < reference.size(); ++i) {
      optim::ChunkTensors t{.n = kSizes[i], .master = reference[i].master.data(), .grad = reference[i].grad32.data()};
      t.state[0] = reinterpret_cast<float*>(moments[2 * i].data());
      t.state[1] = reinterpret_cast<float*>(moments[2 * i + 1].data());
      t.state_dtype = DType::kInt8Block;
      ASSERT_OK(optimizer->UpdateChunk(plan, t));
    }
  }
  for (size_t i = 0; i < reference.size(); ++i) {
    std::vector<float> master(kSizes[i]);
    ASSERT_OK(stream->ReadGroup(GroupId(static_cast<uint32_t>(i)), master, {}));
    EXPECT_EQ(master, reference[i].master) << "group " << i;
  }
  std::vector<float> master(kSizes[1]), m(kSizes[1]), v(kSizes[1]);  // 8-bit states do not read back as floats
  const std::span<float> as_floats[] = {m, v};
  const Status read = stream->ReadGroup(GroupId(1), master, as_floats);
  EXPECT_EQ(read.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(read.message().find("2 int8 states of 768 elements (0 read back as floats)"), std::string::npos)
      << read.ToString();
  EXPECT_LT(static_cast<double>(bytes), 0.55 * static_cast<double>(fp32_bytes)) << bytes << " " << fp32_bytes;
  const std::vector<float> partial(1000, 0.0f);
  Result<GroupId> refused = stream->AddGroup(partial);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("1000 elements with int8 states"), std::string::npos);
}

}  // namespace
}  // namespace strata::offload
