#include "optim/adamw_cpu.h"

#include <cmath>
#include <limits>
#include <vector>

#include "test_util.h"

namespace strata::optim {
namespace {

struct State {
  std::vector<float> p, g, m, v;
};

State RandomState(size_t n, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> positive(0.0f, 0.1f);
  State s{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)};
  for (size_t i = 0; i < n; ++i) {
    s.p[i] = normal(rng);
    s.g[i] = normal(rng) * 10.0f;
    s.m[i] = normal(rng) * 0.1f;
    s.v[i] = positive(rng);
  }
  return s;
}

// |x - ref| <= atol + rtol * |ref|, NaN where the reference has NaN, and the
// same infinities.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& ref, const char* what) {
  constexpr float kAtol = 1e-6f, kRtol = 1e-5f;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (std::isnan(ref[i])) {
      ASSERT_TRUE(std::isnan(got[i])) << what << "[" << i << "]: expected NaN, got " << got[i];
    } else if (std::isinf(ref[i])) {
      ASSERT_EQ(got[i], ref[i]) << what << "[" << i << "]";
    } else {
      ASSERT_LE(std::fabs(got[i] - ref[i]), kAtol + kRtol * std::fabs(ref[i]))
          << what << "[" << i << "]: got " << got[i] << ", reference " << ref[i];
    }
  }
}

void CompareWithReference(CpuIsa isa, const AdamHyper& hyper, const State& start) {
  State ref = start, got = start;
  AdamStep(CpuIsa::kScalar, hyper, ref.p.data(), ref.g.data(), ref.m.data(), ref.v.data(), ref.p.size());
  AdamStep(isa, hyper, got.p.data(), got.g.data(), got.m.data(), got.v.data(), got.p.size());
  ExpectClose(got.p, ref.p, "param");
  ExpectClose(got.m, ref.m, "exp_avg");
  ExpectClose(got.v, ref.v, "exp_avg_sq");
}

TEST(AdamCpuTest, ScalarReferenceMatchesTheFormulaForOneElement) {
  // Worked by hand (in double) for step 3, AdamW: p=0.5 g=0.2 m=0.01 v=0.002.
  AdamHyper h{.lr = 0.01f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.1f, .step = 3};
  float p = 0.5f, g = 0.2f, m = 0.01f, v = 0.002f;
  AdamStep(CpuIsa::kScalar, h, &p, &g, &m, &v, 1);
  double md = 0.9 * 0.01 + 0.1 * 0.2;
  double vd = 0.999 * 0.002 + 0.001 * 0.04;
  double pd = 0.5 * (1 - 0.01 * 0.1) - (0.01 / (1 - std::pow(0.9, 3))) * md / (std::sqrt(vd) / std::sqrt(1 - std::pow(0.999, 3)) + 1e-8);
  EXPECT_NEAR(m, md, 1e-7);
  EXPECT_NEAR(v, vd, 1e-8);
  EXPECT_NEAR(p, pd, 1e-6);
}

TEST(AdamCpuTest, VectorVersionsMatchTheReferenceWithTails) {
  std::mt19937_64 rng(testing::TestSeed());
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!CpuSupports(isa)) continue;
    for (size_t n : {size_t{1}, size_t{7}, size_t{15}, size_t{17}, size_t{1000}, size_t{4099}}) {
      SCOPED_TRACE(std::string(CpuIsaName(isa)) + " n=" + std::to_string(n));
      State start = RandomState(n, rng);
      CompareWithReference(isa, AdamHyper{.lr = 1e-3f, .weight_decay = 0.01f, .step = 5}, start);
      CompareWithReference(isa, AdamHyper{.lr = 3e-4f, .weight_decay = 0.1f, .decoupled_weight_decay = false,
                                          .step = 1, .grad_scale = 1.0f / 1024},
                           start);
    }
  }
}

TEST(AdamCpuTest, NanAndInfInGradientsPropagateLikeTheReference) {
  std::mt19937_64 rng(testing::TestSeed());
  State start = RandomState(67, rng);
  start.g[3] = std::numeric_limits<float>::quiet_NaN();
  start.g[20] = std::numeric_limits<float>::infinity();
  start.g[66] = -std::numeric_limits<float>::infinity();  // in the tail of both vector versions
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!CpuSupports(isa)) continue;
    SCOPED_TRACE(std::string(CpuIsaName(isa)));
    CompareWithReference(isa, AdamHyper{.step = 2}, start);
  }
  State after = start;
  AdamStep(CpuIsa::kScalar, AdamHyper{.step = 2}, after.p.data(), after.g.data(), after.m.data(), after.v.data(), 67);
  EXPECT_TRUE(std::isnan(after.p[3]));
  EXPECT_FALSE(std::isnan(after.p[4]));
}

TEST(AdamCpuTest, ParallelStepEqualsOneThread) {
  std::mt19937_64 rng(testing::TestSeed());
  State start = RandomState((size_t{1} << 18) + 13, rng);
  State serial = start, parallel = start;
  AdamHyper h{.weight_decay = 0.01f, .step = 10};
  AdamStep(BestCpuIsa(), h, serial.p.data(), serial.g.data(), serial.m.data(), serial.v.data(), serial.p.size());
  AdamStepParallel(h, parallel.p.data(), parallel.g.data(), parallel.m.data(), parallel.v.data(), parallel.p.size());
  EXPECT_EQ(parallel.p, serial.p);  // same version, same elements: bit-identical
  EXPECT_EQ(parallel.v, serial.v);
}

}  // namespace
}  // namespace strata::optim
