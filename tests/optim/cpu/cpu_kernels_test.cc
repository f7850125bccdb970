#include "optim/cpu/cpu_kernels.h"

#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "optim/state_codec.h"
#include "src/base/half.h"
#include "tests/optim/optim_test_util.h"

namespace strata::optim {
namespace {

using testing::Bf16States;
using testing::Case;
using testing::Cases;
using testing::ChunkArrays;
using testing::ExpectBitIdentical;
using testing::ExpectParamIsRoundedMaster;
using testing::RandomChunk;

using testing::kAllDTypes;
constexpr CpuIsa kVectorIsas[] = {CpuIsa::kAvx2, CpuIsa::kAvx512};

// Runs `isa` and the reference on copies of `start`: the same bits (the
// vector versions round operation for operation as the reference does).
void CompareWithReference(CpuIsa isa, const Case& c, const ChunkArrays& start) {
  const UpdateConstants constants = MakeUpdateConstants(c.config, c.step, c.grad_multiplier);
  ChunkArrays ref = start, got = start;
  UpdateRange(CpuIsa::kScalar, constants, ref.view(), 0, ref.master.size());
  UpdateRange(isa, constants, got.view(), 0, got.master.size());
  ExpectBitIdentical(got.master, ref.master, "master");
  ExpectBitIdentical(got.state0, ref.state0, "state0");
  ExpectBitIdentical(got.state1, ref.state1, "state1");
  ExpectParamIsRoundedMaster(got);
  ExpectParamIsRoundedMaster(ref);
}

TEST(CpuKernelsTest, ScalarAdamWMatchesTheFormulaForOneElement) {
  // Worked in double for step 3, AdamW: w=0.5 g=0.2 m=0.01 v=0.002.
  OptimizerConfig config{.lr = 0.01f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f};
  float w = 0.5f, g = 0.2f, m = 0.01f, v = 0.002f;
  ChunkTensors t{.n = 1, .master = &w, .grad = &g, .state = {&m, &v}};
  UpdateRange(CpuIsa::kScalar, MakeUpdateConstants(config, 3, 1.0f), t, 0, 1);
  const double md = 0.9 * 0.01 + 0.1 * 0.2;
  const double vd = 0.999 * 0.002 + 0.001 * 0.04;
  const double wd = 0.5 * (1 - 0.01 * 0.1) -
                    (0.01 / (1 - std::pow(0.9, 3))) * md / (std::sqrt(vd) / std::sqrt(1 - std::pow(0.999, 3)) + 1e-8);
  EXPECT_NEAR(m, md, 1e-7);
  EXPECT_NEAR(v, vd, 1e-8);
  EXPECT_NEAR(w, wd, 1e-6);
}

TEST(CpuKernelsTest, ScalarAdamWithL2AddsTheDecayToTheGradient) {
  // torch.optim.Adam(weight_decay=0.1), step 2: g' = g + wd w, no decoupled decay.
  OptimizerConfig config{.kind = OptimizerKind::kAdam, .lr = 0.01, .weight_decay = 0.1};
  float w = 0.5f, g = 0.2f, m = 0.01f, v = 0.002f;
  ChunkTensors t{.n = 1, .master = &w, .grad = &g, .state = {&m, &v}};
  UpdateRange(CpuIsa::kScalar, MakeUpdateConstants(config, 2, 1.0f), t, 0, 1);
  const double gd = 0.2 + 0.1 * 0.5;
  const double md = 0.9 * 0.01 + 0.1 * gd;
  const double vd = 0.999 * 0.002 + 0.001 * gd * gd;
  const double wd = 0.5 - (0.01 / (1 - 0.81)) * md / (std::sqrt(vd) / std::sqrt(1 - 0.999 * 0.999) + 1e-8);
  EXPECT_NEAR(m, md, 1e-7);
  EXPECT_NEAR(v, vd, 1e-8);
  EXPECT_NEAR(w, wd, 1e-6);
}

TEST(CpuKernelsTest, ScalarSgdWithDampeningMatchesTorch) {
  // torch.optim.SGD(momentum=0.9, dampening=0.25): b = 0.9 b + 0.75 d after the first step.
  OptimizerConfig config{.kind = OptimizerKind::kSgd, .lr = 0.1, .momentum = 0.9, .dampening = 0.25};
  float w = 1.0f, g = 2.0f, b = 0.0f;
  ChunkTensors t{.n = 1, .master = &w, .grad = &g, .state = {&b, nullptr}};
  UpdateRange(CpuIsa::kScalar, MakeUpdateConstants(config, 1, 1.0f), t, 0, 1);
  EXPECT_FLOAT_EQ(b, 2.0f);  // the first step takes the gradient undamped
  EXPECT_FLOAT_EQ(w, 1.0f - 0.1f * 2.0f);
  UpdateRange(CpuIsa::kScalar, MakeUpdateConstants(config, 2, 1.0f), t, 0, 1);
  EXPECT_FLOAT_EQ(b, 0.9f * 2.0f + 0.75f * 2.0f);
  EXPECT_FLOAT_EQ(w, 0.8f - 0.1f * 3.3f);
}

TEST(CpuKernelsTest, ScalarSgdMatchesTorchForMomentumAndNesterov) {
  // torch.optim.SGD: d = g + wd w; b = d (first step) else mu b + (1 - damp) d;
  // nesterov: d += mu b, else d = b; w -= lr d.
  OptimizerConfig config{.kind = OptimizerKind::kSgd, .lr = 0.1f, .weight_decay = 0.5f, .momentum = 0.9f,
                         .nesterov = true};
  float w = 2.0f, g = 1.0f, b = 123.0f;  // b is overwritten on the first step
  ChunkTensors t{.n = 1, .master = &w, .grad = &g, .state = {&b, nullptr}};
  UpdateRange(CpuIsa::kScalar, MakeUpdateConstants(config, 1, 1.0f), t, 0, 1);
  EXPECT_FLOAT_EQ(b, 2.0f);                          // d = 1 + 0.5 * 2
  EXPECT_FLOAT_EQ(w, 2.0f - 0.1f * (2.0f + 0.9f * 2.0f));  // nesterov
  const float w1 = w;
  UpdateRange(CpuIsa::kScalar, MakeUpdateConstants(config, 2, 1.0f), t, 0, 1);
  const float d = 1.0f + 0.5f * w1;
  EXPECT_FLOAT_EQ(b, 0.9f * 2.0f + d);
  EXPECT_FLOAT_EQ(w, w1 - 0.1f * (d + 0.9f * b));
}

// bf16 states: the weights the fp32 states' update gives from the same
// values, and the moments it computes rounded once to bf16.
TEST(CpuKernelsTest, Bf16StatesAreTheFp32StatesUpdateWithTheMomentsRoundedOnce) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    ChunkArrays fp32 = RandomChunk(1000, DType::kBFloat16, DType::kBFloat16, rng);
    Bf16States bf16(fp32);  // fp32's states now hold the bf16 values exactly
    ChunkArrays with_bf16 = fp32;
    const UpdateConstants constants = MakeUpdateConstants(c.config, c.step, c.grad_multiplier);
    UpdateRange(CpuIsa::kScalar, constants, fp32.view(), 0, 1000);
    UpdateRange(CpuIsa::kScalar, constants, bf16.view(with_bf16), 0, 1000);
    ExpectBitIdentical(with_bf16.master, fp32.master, "master");
    ASSERT_EQ(with_bf16.param16, fp32.param16);
    size_t rounded = 0;
    for (size_t i = 0; i < 1000; ++i) {
      ASSERT_EQ(bf16.state0[i], Bf16FromFloat(fp32.state0[i])) << i;
      if (c.config.kind != OptimizerKind::kSgd) {
        ASSERT_EQ(bf16.state1[i], Bf16FromFloat(fp32.state1[i])) << i;
      }
      rounded += FloatFromBf16(bf16.state0[i]) != fp32.state0[i];
    }
    EXPECT_GT(rounded, 900u);  // the fp32 results were not bf16 values already
  }
}

// Each vector version on its own, skipped with its reason on a CPU that
// lacks it (STRATA_CPU_ISA forces the narrower paths on a wider CPU: see
// scripts/test.sh --isa).
class VectorKernelTest : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    if (!CpuSupports(GetParam())) GTEST_SKIP() << "this CPU lacks " << CpuIsaName(GetParam());
  }
};

INSTANTIATE_TEST_SUITE_P(Isas, VectorKernelTest, ::testing::ValuesIn(kVectorIsas),
                         [](const ::testing::TestParamInfo<CpuIsa>& isa) { return std::string(CpuIsaName(isa.param)); });

TEST_P(VectorKernelTest, MatchesTheReferenceForEveryKindDtypeAndTail) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  std::vector<size_t> sizes;
  for (size_t n = 1; n <= 33; ++n) sizes.push_back(n);  // every tail length of both widths
  sizes.push_back(1000);
  sizes.push_back(4099);
  for (const Case& c : Cases()) {
    for (DType grad_dtype : kAllDTypes) {
      for (DType param_dtype : kAllDTypes) {
        for (size_t n : sizes) {
          SCOPED_TRACE(fmt::format("{} grad {} param {} n={}", c.name, DTypeName(grad_dtype), DTypeName(param_dtype), n));
          CompareWithReference(GetParam(), c, RandomChunk(n, grad_dtype, param_dtype, rng));
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST_P(VectorKernelTest, Bf16StatesMatchTheReferenceForEveryKindAndTail) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  for (const Case& c : Cases()) {
    for (DType dtype : kAllDTypes) {
      for (size_t n : {size_t{1}, size_t{15}, size_t{17}, size_t{33}, size_t{4099}}) {
        SCOPED_TRACE(fmt::format("{} dtype {} n={}", c.name, DTypeName(dtype), n));
        ChunkArrays ref = RandomChunk(n, dtype, dtype, rng);
        Bf16States ref_states(ref);
        ChunkArrays got = ref;
        Bf16States got_states = ref_states;
        const UpdateConstants constants = MakeUpdateConstants(c.config, c.step, c.grad_multiplier);
        UpdateRange(CpuIsa::kScalar, constants, ref_states.view(ref), 0, n);
        UpdateRange(GetParam(), constants, got_states.view(got), 0, n);
        ExpectBitIdentical(got.master, ref.master, "master");
        ASSERT_EQ(got_states.state0, ref_states.state0);
        ASSERT_EQ(got_states.state1, ref_states.state1);
        ExpectParamIsRoundedMaster(got);
      }
    }
  }
}

// 8-bit states: the update and the encoding by thresholds give the
// reference's weights, codes and scales bit for bit, step after step, over
// blocks of gradients from 1e-8 to 10, a block of zeros and one with a NaN.
TEST_P(VectorKernelTest, The8BitAdamIsTheReferencesBitForBit) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr size_t kBlocks = 40;
  constexpr size_t n = kBlocks * kStateBlockElems;
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam}) {
    std::vector<float> master(n), grad(n);
    for (float& w : master) w = 0.02f * normal(rng);
    std::vector<uint8_t> codes[2][2] = {{std::vector<uint8_t>(n), std::vector<uint8_t>(n)},
                                        {std::vector<uint8_t>(n), std::vector<uint8_t>(n)}};
    std::vector<float> scales[2][2] = {{std::vector<float>(kBlocks), std::vector<float>(kBlocks)},
                                       {std::vector<float>(kBlocks), std::vector<float>(kBlocks)}};
    std::vector<float> weights[2] = {master, master};  // [0] the reference's, [1] the version's
    const OptimizerConfig config{.kind = kind, .lr = 1e-3, .weight_decay = 0.01};
    for (int step = 1; step <= 6; ++step) {
      for (size_t i = 0; i < n; ++i) {
        const size_t block = i / kStateBlockElems;
        grad[i] = block == 0 ? 0.0f : normal(rng) * std::pow(10.0f, -8.0f + 9.0f * block / kBlocks);
      }
      if (step == 4) grad[kStateBlockElems + 7] = std::numeric_limits<float>::quiet_NaN();  // block 1 from here
      const Adam8bitConstants constants = MakeAdam8bitConstants(config, step);
      for (int version = 0; version < 2; ++version) {
        uint8_t* const code_ptrs[2] = {codes[version][0].data(), codes[version][1].data()};
        float* const scale_ptrs[2] = {scales[version][0].data(), scales[version][1].data()};
        Adam8bitUpdate(version == 0 ? CpuIsa::kScalar : GetParam(), constants, weights[version].data(), grad.data(),
                       code_ptrs, scale_ptrs, n);
      }
      SCOPED_TRACE(fmt::format("{} step {}", kind == OptimizerKind::kAdamW ? "AdamW" : "Adam", step));
      ExpectBitIdentical(weights[1], weights[0], "weights");
      ExpectBitIdentical(scales[1][0], scales[0][0], "first moment's scales");
      ExpectBitIdentical(scales[1][1], scales[0][1], "second moment's scales");
      EXPECT_EQ(codes[1][0], codes[0][0]);
      EXPECT_EQ(codes[1][1], codes[0][1]);
      if (HasFailure()) return;
    }
    EXPECT_TRUE(std::isnan(scales[0][0][1]));  // the NaN reached its block's scale
  }
}

// Every code of both maps, at every position of a block, decodes to the
// map's value by both AVX-512 decodes: VBMI's byte permutes (Note [Decoding
// by byte planes]) and the float permutes of a CPU without VBMI.
TEST(CpuKernelsTest, BothAvx512DecodesGiveEveryCodeAtEveryPositionItsValue) {
  if (!CpuSupports(CpuIsa::kAvx512)) GTEST_SKIP() << "this CPU lacks AVX-512";
  for (bool vbmi : {true, false}) {
    if (vbmi && !CpuHasVbmi()) continue;
    for (bool is_signed : {true, false}) {
      const StateCodeMap& map = CodeMap(is_signed);
      std::vector<uint8_t> codes(kStateBlockElems);
      std::vector<float> values(kStateBlockElems);
      for (size_t shift = 0; shift < 256; ++shift) {  // code (7 i + shift) % 256: each code once a block
        for (size_t i = 0; i < kStateBlockElems; ++i) codes[i] = static_cast<uint8_t>((i * 7 + shift) % 256);
        if (vbmi) {
          avx512_vbmi::MapCodes(TablesOf(is_signed).planes, codes.data(), values.data(), kStateBlockElems);
        } else {
          avx512::MapCodesByPermutes(map.data(), codes.data(), values.data(), kStateBlockElems);
        }
        for (size_t i = 0; i < kStateBlockElems; ++i) {
          ASSERT_EQ(std::bit_cast<uint32_t>(values[i]), std::bit_cast<uint32_t>(map[codes[i]]))
              << (vbmi ? "VBMI, " : "float permutes, ") << (is_signed ? "signed" : "unsigned") << " map, code "
              << int{codes[i]} << " at " << i;
        }
      }
    }
  }
}

// A gradient of each dtype times a multiplier, in fp32: the reference's bits
// for every tail length, NaN, infinities and subnormals included.
TEST_P(VectorKernelTest, WidenedGradientsAreTheReferencesBitForBit) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr size_t kMax = 70;
  std::vector<float> grad32(kMax);
  std::vector<uint16_t> grad16(kMax);
  for (size_t i = 0; i < kMax; ++i) grad32[i] = normal(rng);
  grad32[3] = std::numeric_limits<float>::quiet_NaN();
  grad32[20] = -std::numeric_limits<float>::infinity();
  grad32[41] = 1e-40f;  // subnormal in fp32
  for (DType dtype : kAllDTypes) {
    for (size_t i = 0; i < kMax; ++i) {
      grad16[i] = dtype == DType::kBFloat16 ? Bf16FromFloat(grad32[i]) : Fp16FromFloat(grad32[i]);
    }
    grad16[9] = 0x0001;  // the least subnormal of either
    const void* grad = dtype == DType::kFloat32 ? static_cast<const void*>(grad32.data()) : grad16.data();
    for (size_t n = 1; n <= kMax; ++n) {
      std::vector<float> ref(n), got(n);
      WidenGrad(CpuIsa::kScalar, grad, dtype, 0.37f, ref.data(), n);
      WidenGrad(GetParam(), grad, dtype, 0.37f, got.data(), n);
      SCOPED_TRACE(fmt::format("{} n {}", DTypeName(dtype), n));
      ExpectBitIdentical(got, ref, "widened");
      if (HasFailure()) return;
    }
  }
}

// A chunk of int8 moments (Note [8-bit states in chunks]): blocks of codes
// and their scale interleaved, updated as the kernel updates separate
// arrays given fp32 gradients multiplied by the step's multiplier, with the
// compute copy rounded from the weights; in parallel as on one thread.
TEST_P(VectorKernelTest, AChunkOfInt8StatesIsThe8BitUpdateOfItsBlocks) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr size_t kBlocks = 300;  // more than one parallel block of 64 Ki elements
  constexpr size_t n = kBlocks * kStateBlockElems;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
    std::vector<float> master(n);
    for (float& w : master) w = 0.02f * normal(rng);
    std::vector<uint16_t> grad16(n), param(n);
    std::vector<float> grad32(n), widened(n);
    std::vector<std::byte> chunk_states[2] = {std::vector<std::byte>(ChunkBytes(DType::kInt8Block, n)),
                                              std::vector<std::byte>(ChunkBytes(DType::kInt8Block, n))};
    std::vector<uint8_t> codes[2] = {std::vector<uint8_t>(n), std::vector<uint8_t>(n)};
    std::vector<float> scales[2] = {std::vector<float>(kBlocks), std::vector<float>(kBlocks)};
    std::vector<float> expected = master, ours = master;
    const OptimizerConfig config{.kind = OptimizerKind::kAdamW, .lr = 1e-3, .weight_decay = 0.01};
    for (int step = 1; step <= 3; ++step) {
      const float multiplier = step == 2 ? 0.37f : 1.0f;  // a clip in step 2
      for (size_t i = 0; i < n; ++i) {
        grad32[i] = normal(rng) * 1e-3f;
        grad16[i] = Bf16FromFloat(grad32[i]);
        const float g = dtype == DType::kFloat32 ? grad32[i] : FloatFromBf16(grad16[i]);
        widened[i] = g * multiplier;
      }
      uint8_t* const code_ptrs[2] = {codes[0].data(), codes[1].data()};
      float* const scale_ptrs[2] = {scales[0].data(), scales[1].data()};
      Adam8bitUpdate(CpuIsa::kScalar, MakeAdam8bitConstants(config, step), expected.data(), widened.data(), code_ptrs,
                     scale_ptrs, n);
      ChunkTensors chunk{.n = n, .master = ours.data()};
      chunk.param = dtype == DType::kFloat32 ? nullptr : param.data();
      chunk.param_dtype = dtype;
      chunk.grad = dtype == DType::kFloat32 ? static_cast<const void*>(grad32.data()) : grad16.data();
      chunk.grad_dtype = dtype;
      chunk.state[0] = reinterpret_cast<float*>(chunk_states[0].data());
      chunk.state[1] = reinterpret_cast<float*>(chunk_states[1].data());
      chunk.state_dtype = DType::kInt8Block;
      const UpdateConstants constants = MakeUpdateConstants(config, step, multiplier);
      if (step == 3) {
        UpdateParallel(constants, chunk);
      } else {
        UpdateRange(GetParam(), constants, chunk, 0, n);
      }
      SCOPED_TRACE(fmt::format("grads {} step {}", DTypeName(dtype), step));
      ExpectBitIdentical(ours, expected, "weights");
      for (int k = 0; k < 2; ++k) {
        for (size_t b = 0; b < kBlocks; ++b) {
          const std::byte* block = chunk_states[k].data() + b * kInt8BlockBytes;
          ASSERT_EQ(std::memcmp(block, codes[k].data() + b * kStateBlockElems, kStateBlockElems), 0) << k << " " << b;
          float scale;
          std::memcpy(&scale, block + kStateBlockElems, sizeof(scale));
          ASSERT_EQ(scale, scales[k][b]) << k << " " << b;
        }
      }
      if (dtype != DType::kFloat32) {
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(param[i], Bf16FromFloat(ours[i])) << i;
      }
    }
  }
}

TEST_P(VectorKernelTest, NanAndInfGradientsPropagateLikeTheReference) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  for (DType grad_dtype : kAllDTypes) {
    ChunkArrays start = RandomChunk(67, grad_dtype, DType::kBFloat16, rng);
    start.set_grad(3, std::numeric_limits<float>::quiet_NaN());
    start.set_grad(20, std::numeric_limits<float>::infinity());
    start.set_grad(66, -std::numeric_limits<float>::infinity());  // in the tail of both vector versions
    SCOPED_TRACE(fmt::format("grad {}", DTypeName(grad_dtype)));
    for (const Case& c : Cases()) CompareWithReference(GetParam(), c, start);
  }
}

TEST(CpuKernelsTest, NanAndInfGradientsPropagate) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  for (DType grad_dtype : kAllDTypes) {
    ChunkArrays after = RandomChunk(67, grad_dtype, DType::kBFloat16, rng);
    after.set_grad(3, std::numeric_limits<float>::quiet_NaN());
    UpdateRange(CpuIsa::kScalar, MakeUpdateConstants(Cases()[0].config, 2, 1.0f), after.view(), 0, 67);
    EXPECT_TRUE(std::isnan(after.master[3]));
    EXPECT_EQ(after.param16[3], 0xFFFF);  // bf16's NaN, as PyTorch writes it
    EXPECT_FALSE(std::isnan(after.master[4]));
  }
}

TEST(CpuKernelsTest, ParallelUpdateEqualsOneThreadBitForBit) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  ChunkArrays start = RandomChunk((size_t{1} << 18) + 13, DType::kBFloat16, DType::kBFloat16, rng);
  ChunkArrays serial = start, parallel = start;
  const UpdateConstants c = MakeUpdateConstants({.weight_decay = 0.01f}, 10, 0.25f);
  UpdateRange(ActiveCpuIsa(), c, serial.view(), 0, serial.master.size());  // UpdateParallel's version
  UpdateParallel(c, parallel.view());
  EXPECT_EQ(parallel.master, serial.master);  // same version, same elements: bit-identical
  EXPECT_EQ(parallel.state1, serial.state1);
  EXPECT_EQ(parallel.param16, serial.param16);
}

// fp32 AdamW over 100 steps with fresh gradients each step against the same
// recurrence in fp64: the relative error of the weights, normwise, <= 2.5e-6,
// and of the moments <= 1e-6. torch.optim.AdamW's arithmetic, which the
// kernels follow, rounds w * (1 - lr wd) the same way every step: torch
// itself ends 1.8e-6 from fp64 in this setting (4099 weights, 3 seeds).
TEST(CpuKernelsTest, Fp32AdamWTracksAnFp64ReferenceOver100Steps) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  constexpr size_t kN = 4099;
  const OptimizerConfig config{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f};
  ChunkArrays a = RandomChunk(kN, DType::kFloat32, DType::kFloat32, rng);
  std::vector<double> w(a.master.begin(), a.master.end()), m(a.state0.begin(), a.state0.end()),
      v(a.state1.begin(), a.state1.end());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t step = 1; step <= 100; ++step) {
    for (size_t i = 0; i < kN; ++i) a.grad32[i] = normal(rng);
    UpdateParallel(MakeUpdateConstants(config, step, 1.0f), a.view());
    const double c1 = 1 - std::pow(0.9, static_cast<double>(step)), c2 = 1 - std::pow(0.999, static_cast<double>(step));
    const double lr = config.lr, b1 = config.beta1, b2 = config.beta2, eps = config.eps, decay = config.weight_decay;
    for (size_t i = 0; i < kN; ++i) {
      const double g = a.grad32[i];
      w[i] *= 1 - lr * decay;
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      w[i] -= lr / c1 * m[i] / (std::sqrt(v[i]) / std::sqrt(c2) + eps);
    }
  }
  const auto relative_error = [](const std::vector<float>& got, const std::vector<double>& ref) {
    double diff = 0, norm = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      diff += (got[i] - ref[i]) * (got[i] - ref[i]);
      norm += ref[i] * ref[i];
    }
    return std::sqrt(diff / norm);
  };
  EXPECT_LE(relative_error(a.master, w), 2.5e-6);
  EXPECT_LE(relative_error(a.state0, m), 1e-6);
  EXPECT_LE(relative_error(a.state1, v), 1e-6);
  RecordProperty("master_relative_error", std::to_string(relative_error(a.master, w)));
}

// --- conversions ---------------------------------------------------------

TEST(HalfTest, ReferenceConversionsRoundToNearestEven) {
  const auto bits = [](uint32_t b) { return std::bit_cast<float>(b); };
  EXPECT_EQ(Bf16FromFloat(1.0f), 0x3F80);
  EXPECT_EQ(Bf16FromFloat(bits(0x3F808000)), 0x3F80);  // tie, kept bit even: down
  EXPECT_EQ(Bf16FromFloat(bits(0x3F818000)), 0x3F82);  // tie, kept bit odd: up
  EXPECT_EQ(Bf16FromFloat(bits(0x3F808001)), 0x3F81);  // above the tie: up
  EXPECT_EQ(Bf16FromFloat(bits(0x7F7FFFFF)), 0x7F80);  // the largest float rounds to inf
  EXPECT_EQ(Bf16FromFloat(bits(0x00000001)), 0x0000);  // subnormals are rounded, not flushed
  EXPECT_EQ(Bf16FromFloat(bits(0x00018000)), 0x0002);
  EXPECT_EQ(Bf16FromFloat(-std::numeric_limits<float>::quiet_NaN()), 0xFFFF);
  EXPECT_EQ(Bf16FromFloat(std::bit_cast<float>(0x7F800001u)), 0xFFFF);  // a signalling NaN too
  EXPECT_EQ(Fp16FromFloat(1.0f), 0x3C00);
  EXPECT_EQ(Fp16FromFloat(-2.0f), 0xC000);
  EXPECT_EQ(Fp16FromFloat(65504.0f), 0x7BFF);
  EXPECT_EQ(Fp16FromFloat(std::nextafter(65520.0f, 0.0f)), 0x7BFF);
  EXPECT_EQ(Fp16FromFloat(65520.0f), 0x7C00);  // the tie goes to the even side: inf
  EXPECT_EQ(Fp16FromFloat(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(Fp16FromFloat(std::ldexp(1.0f, -25)), 0x0000);       // half a unit: tie to even 0
  EXPECT_EQ(Fp16FromFloat(std::ldexp(3.0f, -25)), 0x0002);       // 1.5 units: tie to even 2
  EXPECT_EQ(Fp16FromFloat(std::ldexp(1023.5f, -24)), 0x0400);    // rounds up into the normals
  EXPECT_EQ(Fp16FromFloat(1.0f + std::ldexp(1.0f, -11)), 0x3C00);  // tie: even
  EXPECT_EQ(Fp16FromFloat(1.0f + std::ldexp(3.0f, -11)), 0x3C02);
  EXPECT_EQ(Fp16FromFloat(std::numeric_limits<float>::quiet_NaN()), 0x7E00);
  EXPECT_EQ(Fp16FromFloat(-std::numeric_limits<float>::quiet_NaN()), 0xFE00);
}

TEST(HalfTest, EverySixteenBitValueSurvivesTheRoundTrip) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const uint16_t value = static_cast<uint16_t>(h);
    const float as_bf16 = FloatFromBf16(value), as_fp16 = FloatFromFp16(value);
    if (!std::isnan(as_bf16)) {
      ASSERT_EQ(Bf16FromFloat(as_bf16), value) << std::hex << h;
    }
    if (std::isnan(as_fp16)) {
      ASSERT_EQ(Fp16FromFloat(as_fp16) & 0x7FFF, 0x7E00) << std::hex << h;
    } else {
      ASSERT_EQ(Fp16FromFloat(as_fp16), value) << std::hex << h;
    }
  }
}

TEST_P(VectorKernelTest, ConversionsAreBitIdenticalToTheReference) {
  // Every upper half (all signs, exponents, kept mantissas, NaNs and
  // infinities) with the lower halves that decide rounding: zero, just above
  // zero, just below the tie, the tie, just above, all ones, and random.
  std::mt19937_64 rng(::strata::testing::TestSeed());
  std::vector<float> src;
  for (uint32_t upper = 0; upper <= 0xFFFF; ++upper) {
    for (uint32_t lower : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu, static_cast<uint32_t>(rng() & 0xFFFF)}) {
      src.push_back(std::bit_cast<float>(upper << 16 | lower));
    }
  }
  // And every float that rounds into the fp16 subnormals and the top of its range.
  for (uint32_t b = 0x33000000u; b < 0x38800000u; b += 97) src.push_back(std::bit_cast<float>(b));
  for (uint32_t b = 0x477FE000u; b < 0x47800000u; ++b) src.push_back(std::bit_cast<float>(b));
  src.push_back(1.0f);  // an odd count: a tail as well
  std::vector<uint16_t> want(src.size()), got(src.size());
  const CpuIsa isa = GetParam();
  ConvertToBf16(CpuIsa::kScalar, src.data(), want.data(), src.size());
  ConvertToBf16(isa, src.data(), got.data(), src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << "bf16 of bits " << std::hex << std::bit_cast<uint32_t>(src[i]);
  }
  ConvertToFp16(CpuIsa::kScalar, src.data(), want.data(), src.size());
  ConvertToFp16(isa, src.data(), got.data(), src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    ASSERT_EQ(got[i], want[i]) << "fp16 of bits " << std::hex << std::bit_cast<uint32_t>(src[i]);
  }
}

// --- gradient sum of squares ------------------------------------------------

TEST_P(VectorKernelTest, SumOfSquaresMatchesTheReference) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  for (DType dtype : kAllDTypes) {
    for (size_t n : {size_t{1}, size_t{15}, size_t{17}, size_t{4099}}) {
      ChunkArrays a = RandomChunk(n, dtype, DType::kFloat32, rng);
      const void* grad = a.view().grad;
      const double ref = SumSquaresRange(CpuIsa::kScalar, grad, dtype, 0, n);
      EXPECT_NEAR(SumSquaresRange(GetParam(), grad, dtype, 0, n), ref, 1e-12 * ref) << DTypeName(dtype) << " n=" << n;
    }
  }
}

TEST(CpuKernelsTest, SumOfSquaresSeesInfAndNan) {
  std::mt19937_64 rng(::strata::testing::TestSeed());
  for (DType dtype : kAllDTypes) {
    for (size_t n : {size_t{1}, size_t{15}, size_t{17}, size_t{4099}}) {
      ChunkArrays a = RandomChunk(n, dtype, DType::kFloat32, rng);
      a.set_grad(n - 1, std::numeric_limits<float>::infinity());
      GradStats inf_stats;
      inf_stats.Add(a.view());
      EXPECT_FALSE(inf_stats.finite());
      a.set_grad(n / 2, std::numeric_limits<float>::quiet_NaN());
      GradStats nan_stats;
      nan_stats.Add(a.view());
      EXPECT_FALSE(nan_stats.finite());
    }
  }
  // The largest finite fp32 gradients do not overflow the fp64 sum.
  std::vector<float> huge(100, std::numeric_limits<float>::max());
  GradStats stats;
  stats.Add(huge.data(), DType::kFloat32, huge.size());
  EXPECT_TRUE(stats.finite());
}

TEST(CpuKernelsTest, ZeroParallelZeroesExactlyItsBytes) {
  constexpr size_t kGuard = 64;
  const size_t mib = size_t{1} << 20;
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{4095}, mib, mib + 3, 3 * mib + 7}) {
    std::vector<uint8_t> buffer(bytes + 2 * kGuard, 0xA5);
    ZeroParallel(buffer.data() + kGuard, bytes);
    for (size_t i = 0; i < buffer.size(); ++i) {
      const bool inside = i >= kGuard && i < kGuard + bytes;
      ASSERT_EQ(buffer[i], inside ? 0 : 0xA5) << "byte " << i << " of " << bytes << " zeroed";
    }
  }
}

// --- the version STRATA_CPU_ISA selects ---------------------------------------

TEST(CpuIsaSettingTest, UnsetOrEmptyIsTheWidestVersion) {
  EXPECT_EQ(*CpuIsaFromSetting(nullptr), BestCpuIsa());
  EXPECT_EQ(*CpuIsaFromSetting(""), BestCpuIsa());
}

TEST(CpuIsaSettingTest, NamesAVersionTheCpuRunsOrSaysItLacksIt) {
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    const std::string name(CpuIsaName(isa));
    Result<CpuIsa> chosen = CpuIsaFromSetting(name.c_str());
    if (CpuSupports(isa)) {
      ASSERT_TRUE(chosen.ok()) << chosen.status().ToString();
      EXPECT_EQ(*chosen, isa);
    } else {
      EXPECT_EQ(chosen.status().code(), StatusCode::kNotSupported) << name;
      EXPECT_NE(chosen.status().message().find("lacks"), std::string::npos) << name;
    }
  }
}

TEST(CpuIsaSettingTest, AnUnknownNameIsRefusedWithTheChoices) {
  Result<CpuIsa> chosen = CpuIsaFromSetting("avx1024");
  EXPECT_EQ(chosen.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(chosen.status().message().find("STRATA_CPU_ISA=avx1024"), std::string::npos);
  EXPECT_NE(chosen.status().message().find("scalar, avx2, avx512"), std::string::npos);
}

TEST(CpuIsaSettingTest, TheKernelsRunTheVersionTheEnvironmentNames) {
  // Whatever this process was started with (scripts/test.sh --isa sets it).
  Result<CpuIsa> named = CpuIsaFromSetting(std::getenv(kCpuIsaVariable));
  ASSERT_TRUE(named.ok()) << named.status().ToString();
  EXPECT_EQ(ActiveCpuIsa(), *named);
}

}  // namespace
}  // namespace strata::optim
