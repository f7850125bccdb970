#include "benchmarks/optim_bench.h"

#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>

// GCC 12 warns inside its own AVX-512 headers (see optim/cpu_avx512.cc).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <memory>
#include <chrono>
#include <vector>

#include <nlohmann/json.hpp>

#include "benchmarks/io_bench.h"
#include "optim/cpu_kernels.h"
#include "optim/half.h"
#include "optim/optimizer.h"
#include "strata/buffer.h"
#include "strata/options.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Bytes Adam moves per parameter: fp32 reads param, grad, exp_avg and
// exp_avg_sq and writes three of them back (7 x 4); bf16-mixed reads a bf16
// grad and fp32 master, exp_avg, exp_avg_sq, writes the three back and the
// bf16 param (2 + 12 + 12 + 2). Both 28.
constexpr double kBytesPerParam = 28.0;
// The same blocks as the optimizer's parallel step, so both run alike.
constexpr size_t kBlockElems = size_t{1} << 16;

// Adam's access pattern with one add per array, in the widest vectors the
// CPU has: what memory allows. fp32: read p, g, m, v; write p, m, v. bf16:
// read g16, master, m, v; write master, m, v and p16 (the top half of master).
// Elements [i, n) one at a time: the part of a block no vector covers.
void BoundTail(float* master, const void* grad, float* m, float* v, uint16_t* param16, size_t i, size_t n) {
  for (; i < n; ++i) {
    const float gi = param16 == nullptr ? static_cast<const float*>(grad)[i]
                                        : std::bit_cast<float>(uint32_t{static_cast<const uint16_t*>(grad)[i]} << 16);
    m[i] += gi;
    v[i] += gi;
    master[i] += gi;
    if (param16 != nullptr) param16[i] = static_cast<uint16_t>(std::bit_cast<uint32_t>(master[i]) >> 16);
  }
}

__attribute__((target("avx512f"))) void BoundBlockAvx512(float* master, const void* grad, float* m, float* v,
                                                         uint16_t* param16, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 gi;
    if (param16 == nullptr) {
      gi = _mm512_loadu_ps(static_cast<const float*>(grad) + i);
    } else {
      const __m256i g16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
      gi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(g16), 16));
    }
    const __m512 w = _mm512_add_ps(_mm512_loadu_ps(master + i), gi);
    _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), gi));
    _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), gi));
    _mm512_storeu_ps(master + i, w);
    if (param16 != nullptr) {
      const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(w), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(param16 + i), _mm512_cvtepi32_epi16(top));
    }
  }
  BoundTail(master, grad, m, v, param16, i, n);
}

__attribute__((target("avx2"))) void BoundBlockAvx2(float* master, const void* grad, float* m, float* v,
                                                    uint16_t* param16, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 gi;
    if (param16 == nullptr) {
      gi = _mm256_loadu_ps(static_cast<const float*>(grad) + i);
    } else {
      const __m128i g16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
      gi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(g16), 16));
    }
    const __m256 w = _mm256_add_ps(_mm256_loadu_ps(master + i), gi);
    _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), gi));
    _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), gi));
    _mm256_storeu_ps(master + i, w);
    if (param16 != nullptr) {
      const __m256i top = _mm256_srli_epi32(_mm256_castps_si256(w), 16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(param16 + i),
                       _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1)));
    }
  }
  BoundTail(master, grad, m, v, param16, i, n);
}

void BoundPass(const optim::ChunkTensors& t) {
  const bool avx512 = optim::CpuSupports(optim::CpuIsa::kAvx512);
  const size_t blocks = (t.n + kBlockElems - 1) / kBlockElems;
  uint16_t* param16 = static_cast<uint16_t*>(t.param);
  tbb::parallel_for(size_t{0}, blocks, [&](size_t block) {
    const size_t begin = block * kBlockElems, size = std::min(t.n - begin, kBlockElems);
    const size_t grad_offset = begin * DTypeSizeBytes(t.grad_dtype);
    const void* grad = static_cast<const std::byte*>(t.grad) + grad_offset;
    uint16_t* p16 = param16 == nullptr ? nullptr : param16 + begin;
    if (avx512) {
      BoundBlockAvx512(t.master + begin, grad, t.state[0] + begin, t.state[1] + begin, p16, size);
    } else {
      BoundBlockAvx2(t.master + begin, grad, t.state[0] + begin, t.state[1] + begin, p16, size);
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
  STRATA_ASSIGN_OR_RETURN(const DType dtype, ParseDType(config.dtype));
  if (dtype == DType::kFloat16) {
    return InvalidArgument("bench optim: --dtype {}: expected fp32 or bf16", config.dtype);
  }
  if (config.params == 0) return InvalidArgument("bench optim: --params 0: at least one parameter is needed");
  if (config.repetitions == 0) return InvalidArgument("bench optim: --repetitions 0: at least one is needed");
  const uint32_t threads = config.threads > 0 ? config.threads : static_cast<uint32_t>(tbb::info::default_concurrency());
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);

  // fp32: master is the parameter, the gradient fp32. bf16: fp32 master and
  // states, bf16 gradient and compute copy.
  const size_t n = config.params;
  const size_t half_bytes = dtype == DType::kBFloat16 ? n * sizeof(uint16_t) : 0;
  std::vector<Buffer> arrays;
  for (size_t bytes : {n * sizeof(float), n * sizeof(float), n * sizeof(float),
                       dtype == DType::kBFloat16 ? half_bytes : n * sizeof(float), half_bytes}) {
    arrays.push_back(AllocateAlignedHost(std::max<size_t>(bytes, 64), 64));
    if (!arrays.back()) return OutOfMemory("bench optim: cannot allocate {} for the arrays", FormatSize(bytes));
  }
  optim::ChunkTensors chunk;
  chunk.n = n;
  chunk.master = static_cast<float*>(arrays[0].data());
  chunk.state[0] = static_cast<float*>(arrays[1].data());
  chunk.state[1] = static_cast<float*>(arrays[2].data());
  chunk.grad = arrays[3].data();
  chunk.grad_dtype = dtype;
  if (dtype == DType::kBFloat16) {
    chunk.param = arrays[4].data();
    chunk.param_dtype = dtype;
  }
  // Touch every page first (on the threads that will use it) with plausible values.
  tbb::parallel_for(size_t{0}, n, [&](size_t i) {
    chunk.master[i] = 0.01f * static_cast<float>(i % 97);
    const float g = 0.001f * static_cast<float>(i % 89) - 0.04f;
    if (dtype == DType::kBFloat16) {
      static_cast<uint16_t*>(arrays[3].data())[i] = optim::Bf16FromFloat(g);
      static_cast<uint16_t*>(chunk.param)[i] = 0;
    } else {
      static_cast<float*>(arrays[3].data())[i] = g;
    }
    chunk.state[0][i] = 0.0f;
    chunk.state[1][i] = 0.0f;
  });

  OptimBenchReport report;
  report.config = config;
  report.threads = threads;
  report.isa = std::string(optim::CpuIsaName(optim::BestCpuIsa()));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<optim::Optimizer> optimizer,
                          optim::Optimizer::Create({.lr = 1e-4f, .weight_decay = 0.01f}));
  // Alternate the two, so that neither always runs on a warmer machine.
  std::vector<double> step, bound, norm;
  for (uint32_t r = 0; r < config.repetitions; ++r) {
    optim::GradStats stats;
    norm.push_back(TimeSeconds([&] { stats.Add(chunk); }));
    STRATA_ASSIGN_OR_RETURN(const optim::StepPlan plan, optimizer->PlanStep(stats));
    Status status;
    step.push_back(TimeSeconds([&] { status = optimizer->UpdateChunk(plan, chunk); }));
    STRATA_RETURN_IF_ERROR(status);
    bound.push_back(TimeSeconds([&] { BoundPass(chunk); }));
  }
  report.step_seconds = Median(step);
  report.bound_seconds = Median(bound);
  report.grad_norm_seconds = Median(norm);
  report.gparams_per_s = static_cast<double>(n) / report.step_seconds / 1e9;
  report.gbps = kBytesPerParam * static_cast<double>(n) / report.step_seconds / 1e9;
  report.bound_gbps = kBytesPerParam * static_cast<double>(n) / report.bound_seconds / 1e9;
  return report;
}

std::string FormatOptimBench(const OptimBenchReport& r) {
  return fmt::format(
      "strata bench optim: AdamW, {} params ({}), {}, {} thread{}, median of {}\n"
      "{:<22} {:>12} {:>10}\n{:<22} {:>12.4f} {:>10.2f}\n{:<22} {:>12.4f} {:>10.2f}\n{:<22} {:>12.4f}\n"
      "{:.3f} G params/s; {:.1f}% of the bandwidth bound\n",
      r.config.params, r.config.dtype, r.isa, r.threads, r.threads == 1 ? "" : "s", r.config.repetitions, "",
      "seconds", "GB/s", "optimizer update", r.step_seconds, r.gbps, "bound (same pattern)", r.bound_seconds,
      r.bound_gbps, "gradient norm pass", r.grad_norm_seconds, r.gparams_per_s, 100 * r.ratio());
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
  j["grad_norm_seconds"] = r.grad_norm_seconds;
  return j.dump(2);
}

}  // namespace strata::bench
