#include "benchmarks/optim_bench.h"

#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>

// GCC 12 warns inside its own AVX-512 headers (see optim/adamw_cpu.cc).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include <nlohmann/json.hpp>

#include "benchmarks/io_bench.h"
#include "optim/adamw_cpu.h"
#include "strata/buffer.h"
#include "strata/options.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Bytes Adam moves per fp32 parameter: 4 arrays read, 3 written, 4 bytes each.
constexpr double kBytesPerParam = 28.0;
// The same blocks as the optimizer's parallel step, so both run alike.
constexpr size_t kBlockElems = size_t{1} << 16;

// Adam's access pattern (read p, g, m, v; write p, m, v) with one add per
// array, in the widest vectors the CPU has: what memory allows.
__attribute__((target("avx512f"))) void BoundBlockAvx512(float* p, const float* g, float* m, float* v, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 gi = _mm512_loadu_ps(g + i);
    _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), gi));
    _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), gi));
    _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_loadu_ps(p + i), gi));
  }
  for (; i < n; ++i) {
    m[i] += g[i];
    v[i] += g[i];
    p[i] += g[i];
  }
}

__attribute__((target("avx2"))) void BoundBlockAvx2(float* p, const float* g, float* m, float* v, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 gi = _mm256_loadu_ps(g + i);
    _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), gi));
    _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), gi));
    _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_loadu_ps(p + i), gi));
  }
  for (; i < n; ++i) {
    m[i] += g[i];
    v[i] += g[i];
    p[i] += g[i];
  }
}

void BoundPass(float* p, const float* g, float* m, float* v, size_t n) {
  const bool avx512 = optim::CpuSupports(optim::CpuIsa::kAvx512);
  const size_t blocks = (n + kBlockElems - 1) / kBlockElems;
  tbb::parallel_for(size_t{0}, blocks, [&](size_t block) {
    const size_t begin = block * kBlockElems, size = std::min(n - begin, kBlockElems);
    if (avx512) {
      BoundBlockAvx512(p + begin, g + begin, m + begin, v + begin, size);
    } else {
      BoundBlockAvx2(p + begin, g + begin, m + begin, v + begin, size);
    }
  });
}

template <typename Fn>
double TimeSeconds(Fn&& fn) {
  Clock::time_point start = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

Result<OptimBenchReport> RunOptimBench(const OptimBenchConfig& config) {
  if (config.dtype != "fp32") {
    return NotSupported("bench optim: --dtype {}: only fp32 is built so far (bf16 comes with the mixed-precision "
                        "kernels)",
                        config.dtype);
  }
  if (config.params == 0) return InvalidArgument("bench optim: --params 0: at least one parameter is needed");
  if (config.repetitions == 0) return InvalidArgument("bench optim: --repetitions 0: at least one is needed");
  const uint32_t threads = config.threads > 0 ? config.threads : static_cast<uint32_t>(tbb::info::default_concurrency());
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);

  const size_t n = config.params;
  std::vector<Buffer> arrays;
  for (int a = 0; a < 4; ++a) {
    arrays.push_back(AllocateAlignedHost(n * sizeof(float), 64));
    if (!arrays.back()) return OutOfMemory("bench optim: cannot allocate 4 x {}", FormatSize(n * sizeof(float)));
  }
  float* p = static_cast<float*>(arrays[0].data());
  float* g = static_cast<float*>(arrays[1].data());
  float* m = static_cast<float*>(arrays[2].data());
  float* v = static_cast<float*>(arrays[3].data());
  // Touch every page first (on the threads that will use it) with plausible values.
  tbb::parallel_for(size_t{0}, n, [&](size_t i) {
    p[i] = 0.01f * static_cast<float>(i % 97);
    g[i] = 0.001f * static_cast<float>(i % 89) - 0.04f;
    m[i] = 0.0f;
    v[i] = 0.0f;
  });

  OptimBenchReport report;
  report.config = config;
  report.threads = threads;
  report.isa = std::string(optim::CpuIsaName(optim::BestCpuIsa()));
  optim::AdamHyper hyper{.lr = 1e-4f, .weight_decay = 0.01f};
  // Alternate the two, so that neither always runs on a warmer machine.
  std::vector<double> step, bound;
  for (uint32_t r = 0; r < config.repetitions; ++r) {
    hyper.step = r + 1;
    step.push_back(TimeSeconds([&] { optim::AdamStepParallel(hyper, p, g, m, v, n); }));
    bound.push_back(TimeSeconds([&] { BoundPass(p, g, m, v, n); }));
  }
  report.step_seconds = Median(step);
  report.bound_seconds = Median(bound);
  report.gparams_per_s = static_cast<double>(n) / report.step_seconds / 1e9;
  report.gbps = kBytesPerParam * static_cast<double>(n) / report.step_seconds / 1e9;
  report.bound_gbps = kBytesPerParam * static_cast<double>(n) / report.bound_seconds / 1e9;
  return report;
}

std::string FormatOptimBench(const OptimBenchReport& r) {
  return fmt::format(
      "strata bench optim: AdamW, {} params ({}), {}, {} thread{}, median of {}\n"
      "{:<22} {:>12} {:>10}\n{:<22} {:>12.4f} {:>10.2f}\n{:<22} {:>12.4f} {:>10.2f}\n"
      "{:.3f} G params/s; {:.1f}% of the bandwidth bound\n",
      r.config.params, r.config.dtype, r.isa, r.threads, r.threads == 1 ? "" : "s", r.config.repetitions, "",
      "seconds", "GB/s", "optimizer step", r.step_seconds, r.gbps, "bound (same pattern)", r.bound_seconds,
      r.bound_gbps, r.gparams_per_s, 100 * r.ratio());
}

std::string OptimBenchJson(const OptimBenchReport& r) {
  nlohmann::json j;
  j["config"] = {{"params", r.config.params},
                 {"dtype", r.config.dtype},
                 {"threads", r.threads},
                 {"repetitions", r.config.repetitions},
                 {"isa", r.isa}};
  j["gparams_per_s"] = r.gparams_per_s;
  j["gbps"] = r.gbps;
  j["bound_gbps"] = r.bound_gbps;
  j["ratio_to_bound"] = r.ratio();
  j["step_seconds"] = r.step_seconds;
  j["bound_seconds"] = r.bound_seconds;
  return j.dump(2);
}

}  // namespace strata::bench
