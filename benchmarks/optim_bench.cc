#include "benchmarks/optim_bench.h"

#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

// GCC 12 warns inside its own AVX-512 headers (see optim/cpu_avx512.cc).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "benchmarks/io_bench.h"
#include "memory/tier_pool.h"
#include "offload/training/state_stream.h"
#include "optim/cpu/cpu_kernels.h"
#include "src/base/half.h"
#include "optim/optimizer.h"
#include "optim/state_codec.h"
#include "strata/buffer.h"
#include "strata/options.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Bytes the bound moves per parameter: it reads an fp32 param, grad, m and v
// and writes param, m and v back (7 x 4).
constexpr double kBoundBytesPerParam = 28.0;
// The same blocks as the optimizer's parallel step, and the same software
// prefetch distance (optim/cpu_kernels_impl.h), so both run alike.
constexpr size_t kBlockElems = size_t{1} << 16;
constexpr size_t kPrefetchElems = 512;

// The bound for both dtypes: Adam's fp32 access pattern (read p, g, m, v;
// write p, m, v: 28 bytes per parameter) with an add per array (g squared
// into v, which stays a valid second moment for the optimizer passes that
// follow), in the widest vectors the CPU has. Every load comes before any store, as in the
// optimizer: the arrays share their offsets modulo 4 KiB, and a load behind
// a store to such an address waits on it. (A bf16-shaped loop, with 16-bit
// gradient and compute copy, ran 10-15% slower than the optimizer itself on
// the development VM: it was no bound.)
inline void PrefetchAhead(const float* p, const float* g, const float* m, const float* v, size_t i, size_t n) {
  if (i + kPrefetchElems >= n) return;
  for (const float* array : {p, g, m, v}) {
    _mm_prefetch(reinterpret_cast<const char*>(array + i + kPrefetchElems), _MM_HINT_T0);
  }
}

// Elements [i, n) one at a time: the part of a block no vector covers.
void BoundTail(float* p, const float* g, float* m, float* v, size_t i, size_t n) {
  for (; i < n; ++i) {
    m[i] += g[i];
    v[i] += g[i] * g[i];
    p[i] += g[i];
  }
}

__attribute__((target("avx512f"))) void BoundBlockAvx512(float* p, const float* g, float* m, float* v, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    PrefetchAhead(p, g, m, v, i, n);
    const __m512 gi = _mm512_loadu_ps(g + i);
    const __m512 pi = _mm512_add_ps(_mm512_loadu_ps(p + i), gi);
    const __m512 mi = _mm512_add_ps(_mm512_loadu_ps(m + i), gi);
    const __m512 vi = _mm512_add_ps(_mm512_loadu_ps(v + i), _mm512_mul_ps(gi, gi));
    _mm512_storeu_ps(m + i, mi);
    _mm512_storeu_ps(v + i, vi);
    _mm512_storeu_ps(p + i, pi);
  }
  BoundTail(p, g, m, v, i, n);
}

__attribute__((target("avx2"))) void BoundBlockAvx2(float* p, const float* g, float* m, float* v, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    PrefetchAhead(p, g, m, v, i, n);
    const __m256 gi = _mm256_loadu_ps(g + i);
    const __m256 pi = _mm256_add_ps(_mm256_loadu_ps(p + i), gi);
    const __m256 mi = _mm256_add_ps(_mm256_loadu_ps(m + i), gi);
    const __m256 vi = _mm256_add_ps(_mm256_loadu_ps(v + i), _mm256_mul_ps(gi, gi));
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    _mm256_storeu_ps(p + i, pi);
  }
  BoundTail(p, g, m, v, i, n);
}

// The bound of 8-bit states: Adam's access pattern with them (read the fp32
// param and grad and a byte of each moment; write the param and the two
// bytes back: 16 bytes a parameter, the scales' 1/16 byte aside), in the
// widest vectors the CPU has, every load before any store.
__attribute__((target("avx512f,avx512bw"))) void BoundBlock8bitAvx512(float* p, const float* g, uint8_t* m,
                                                                       uint8_t* v, size_t n) {
  for (size_t i = 0; i < n; i += 16) {
    const __m512 pi = _mm512_add_ps(_mm512_loadu_ps(p + i), _mm512_loadu_ps(g + i));
    const __m128i mi = _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + i)), _mm_set1_epi8(1));
    const __m128i vi = _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i)), _mm_set1_epi8(1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m + i), mi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v + i), vi);
    _mm512_storeu_ps(p + i, pi);
  }
}

__attribute__((target("avx2"))) void BoundBlock8bitAvx2(float* p, const float* g, uint8_t* m, uint8_t* v, size_t n) {
  for (size_t i = 0; i < n; i += 16) {
    const __m256 p0 = _mm256_add_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(g + i));
    const __m256 p1 = _mm256_add_ps(_mm256_loadu_ps(p + i + 8), _mm256_loadu_ps(g + i + 8));
    const __m128i mi = _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + i)), _mm_set1_epi8(1));
    const __m128i vi = _mm_add_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + i)), _mm_set1_epi8(1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m + i), mi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v + i), vi);
    _mm256_storeu_ps(p + i, p0);
    _mm256_storeu_ps(p + i + 8, p1);
  }
}

// The bound of bf16 states (Note [bf16 states]): the same with 2 bytes a
// moment, 20 bytes a parameter, 16 elements a step and the rest one at a
// time. Elements [i, i + 16) of both moments:
__attribute__((target("avx2"))) inline void BumpBf16Moments(uint16_t* m, uint16_t* v, size_t i) {
  const __m256i mi = _mm256_add_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + i)),
                                      _mm256_set1_epi16(1));
  const __m256i vi = _mm256_add_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + i)),
                                      _mm256_set1_epi16(1));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(m + i), mi);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + i), vi);
}

void BoundTailBf16(float* p, const float* g, uint16_t* m, uint16_t* v, size_t i, size_t n) {
  for (; i < n; ++i) {
    p[i] += g[i];
    ++m[i];
    ++v[i];
  }
}

__attribute__((target("avx512f"))) void BoundBlockBf16Avx512(float* p, const float* g, uint16_t* m, uint16_t* v,
                                                             size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 pi = _mm512_add_ps(_mm512_loadu_ps(p + i), _mm512_loadu_ps(g + i));
    BumpBf16Moments(m, v, i);
    _mm512_storeu_ps(p + i, pi);
  }
  BoundTailBf16(p, g, m, v, i, n);
}

__attribute__((target("avx2"))) void BoundBlockBf16Avx2(float* p, const float* g, uint16_t* m, uint16_t* v,
                                                        size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 p0 = _mm256_add_ps(_mm256_loadu_ps(p + i), _mm256_loadu_ps(g + i));
    const __m256 p1 = _mm256_add_ps(_mm256_loadu_ps(p + i + 8), _mm256_loadu_ps(g + i + 8));
    BumpBf16Moments(m, v, i);
    _mm256_storeu_ps(p + i, p0);
    _mm256_storeu_ps(p + i + 8, p1);
  }
  BoundTailBf16(p, g, m, v, i, n);
}

// One pass over the chunk's fp32 master and states with `bound_grad` (fp32)
// as the gradient.
void BoundPass(const optim::ChunkTensors& t, const float* bound_grad) {
  const bool avx512 = optim::ActiveCpuIsa() == optim::CpuIsa::kAvx512;  // the width the kernel runs at
  const size_t blocks = (t.n + kBlockElems - 1) / kBlockElems;
  tbb::parallel_for(size_t{0}, blocks, [&](size_t block) {
    const size_t begin = block * kBlockElems, size = std::min(t.n - begin, kBlockElems);
    float* p = t.master + begin;
    float* m = t.state[0] + begin;
    float* v = t.state[1] + begin;
    if (avx512) {
      BoundBlockAvx512(p, bound_grad + begin, m, v, size);
    } else {
      BoundBlockAvx2(p, bound_grad + begin, m, v, size);
    }
  });
}

Result<Buffer> HostArray(size_t bytes) {
  Buffer buffer = AllocateAlignedHost(std::max<size_t>(bytes, 64), 64);
  if (!buffer) return OutOfMemory("bench optim: cannot allocate {} of host memory", FormatSize(bytes));
  std::memset(buffer.data(), 0, bytes);
  return buffer;
}

template <typename Fn>
double TimeSeconds(Fn&& fn) {
  Clock::time_point start = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Bytes the update moves per parameter of `t`, from the arrays it is given:
// the gradient read, the fp32 master and each state read and written back,
// the compute copy written when there is one. Adam: fp32 4 + 8 + 16, bf16
// 2 + 8 + 16 + 2; both 28 (bf16 states: 20 with fp32 weights).
double BytesPerParam(const optim::ChunkTensors& t, int num_states) {
  double bytes = static_cast<double>(DTypeSizeBytes(t.grad_dtype)) + 2.0 * sizeof(float) +
                 2.0 * static_cast<double>(DTypeSizeBytes(t.state_dtype)) * num_states;
  if (t.param != nullptr) bytes += static_cast<double>(DTypeSizeBytes(t.param_dtype));
  return bytes;
}

// The dtype of --dtype: fp32 or bf16.
Result<DType> ParseBenchDType(const std::string& text) {
  STRATA_ASSIGN_OR_RETURN(const DType dtype, ParseDType(text));
  if (dtype == DType::kFloat16) return InvalidArgument("bench optim: --dtype {}: expected fp32 or bf16", text);
  return dtype;
}

// --threads: 0 is every core.
uint32_t ThreadsOf(uint32_t threads) {
  return threads > 0 ? threads : static_cast<uint32_t>(tbb::info::default_concurrency());
}

// Plausible values for element i: a weight, and a gradient around zero.
float WeightAt(size_t i) { return 0.01f * static_cast<float>(i % 97); }
float GradAt(size_t i) { return 0.001f * static_cast<float>(i % 89) - 0.04f; }

// The arrays of the in-memory timing, one chunk of every parameter. fp32:
// master is the parameter, the gradient fp32. bf16: fp32 master and states,
// bf16 gradient and compute copy, and the bound's fp32 gradient apart.
struct ChunkArrays {
  std::vector<Buffer> arrays;  // master, exp_avg, exp_avg_sq, grad, the compute copy, the bound's gradient
  optim::ChunkTensors chunk;
  const float* bound_grad = nullptr;
};

Result<ChunkArrays> AllocateChunk(size_t n, DType dtype) {
  const bool bf16 = dtype == DType::kBFloat16;
  const size_t half_bytes = bf16 ? n * sizeof(uint16_t) : 0;
  ChunkArrays c;
  for (size_t bytes : {n * sizeof(float), n * sizeof(float), n * sizeof(float), bf16 ? half_bytes : n * sizeof(float),
                       half_bytes, bf16 ? n * sizeof(float) : 0}) {
    c.arrays.push_back(AllocateAlignedHost(std::max<size_t>(bytes, 64), 64));
    if (!c.arrays.back()) return OutOfMemory("bench optim: cannot allocate {} for the arrays", FormatSize(bytes));
  }
  optim::ChunkTensors& chunk = c.chunk;
  chunk.n = n;
  chunk.master = static_cast<float*>(c.arrays[0].data());
  chunk.state[0] = static_cast<float*>(c.arrays[1].data());
  chunk.state[1] = static_cast<float*>(c.arrays[2].data());
  chunk.grad = c.arrays[3].data();
  chunk.grad_dtype = dtype;
  if (bf16) {
    chunk.param = c.arrays[4].data();
    chunk.param_dtype = dtype;
  }
  c.bound_grad = static_cast<const float*>(bf16 ? c.arrays[5].data() : chunk.grad);
  // Touch every page first (on the threads that will use it) with plausible values.
  tbb::parallel_for(size_t{0}, n, [&](size_t i) {
    chunk.master[i] = WeightAt(i);
    const float g = GradAt(i);
    if (bf16) {
      static_cast<uint16_t*>(c.arrays[3].data())[i] = optim::Bf16FromFloat(g);
      static_cast<uint16_t*>(chunk.param)[i] = 0;
      static_cast<float*>(c.arrays[5].data())[i] = g;
    } else {
      static_cast<float*>(c.arrays[3].data())[i] = g;
    }
    chunk.state[0][i] = 0.0f;
    chunk.state[1][i] = 0.0f;
  });
  return c;
}

// Every timed pass starts with nothing of its arrays in the caches: the
// last-level cache can be large (260 MiB on the development VM), and a pass
// right after the gradient-norm pass would read much of the gradients from
// it. Writing twice its size in between evicts them.
class CacheEvictor {
 public:
  static Result<CacheEvictor> Create() {
    const long l3_bytes = sysconf(_SC_LEVEL3_CACHE_SIZE);
    CacheEvictor evictor;
    STRATA_ASSIGN_OR_RETURN(evictor.scratch_, HostArray(std::max<size_t>(2 * static_cast<size_t>(std::max(l3_bytes, 0L)),
                                                                         size_t{64} << 20)));
    return evictor;
  }
  void Evict() {
    tbb::parallel_for(size_t{0}, scratch_.size_bytes() / 4096, [&](size_t page) {
      std::memset(scratch_.bytes() + page * 4096, static_cast<int>(page), 4096);
    });
  }

 private:
  Buffer scratch_;
};

// Medians over repetitions of the in-memory timing.
struct MemoryTimings {
  std::vector<double> step, bound, norm;
};

// One repetition: the gradient-norm pass, the update and the bound, each
// after a cache eviction.
Status TimeRepetition(optim::Optimizer& optimizer, const ChunkArrays& c, CacheEvictor& evictor,
                      MemoryTimings& timings) {
  optim::GradStats stats;
  evictor.Evict();
  timings.norm.push_back(TimeSeconds([&] { stats.Add(c.chunk); }));
  STRATA_ASSIGN_OR_RETURN(const optim::StepPlan plan, optimizer.PlanStep(stats));
  Status status;
  evictor.Evict();
  timings.step.push_back(TimeSeconds([&] { status = optimizer.UpdateChunk(plan, c.chunk); }));
  STRATA_RETURN_IF_ERROR(status);
  evictor.Evict();
  timings.bound.push_back(TimeSeconds([&] { BoundPass(c.chunk, c.bound_grad); }));
  return Status::Ok();
}

// One pass of a narrow states' bound (16 elements a step: the 8-bit or bf16
// blocks above) over the chunk's master and the moments `m` and `v`.
template <typename T, typename Block>
void BoundPassNarrow(const ChunkArrays& c, T* m, T* v, Block avx512, Block avx2) {
  const Block block_of_isa = optim::ActiveCpuIsa() == optim::CpuIsa::kAvx512 ? avx512 : avx2;
  const size_t blocks = (c.chunk.n + kBlockElems - 1) / kBlockElems;
  tbb::parallel_for(size_t{0}, blocks, [&](size_t block) {
    const size_t begin = block * kBlockElems, size = std::min(c.chunk.n - begin, kBlockElems);
    block_of_isa(c.chunk.master + begin, c.bound_grad + begin, m + begin, v + begin, size);
  });
}

// The narrow states' benches (bf16, int8): each repetition times `step(r)`
// and `bound()`, each after a cache eviction, then the fp32 states' update
// of the same parameters (`arrays`); the report has the medians, at
// `bytes_per_param` for the step and `bound_bytes_per_param` for the bound.
Result<OptimBenchReport> AlternateWithFp32(const OptimBenchConfig& config, const ChunkArrays& arrays,
                                           const std::function<Status(uint32_t)>& step,
                                           const std::function<void()>& bound, double bytes_per_param,
                                           double bound_bytes_per_param, OptimBenchReport report) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<optim::Optimizer> optimizer,
                          optim::Optimizer::Create({.lr = 1e-4f, .weight_decay = 0.01f}));
  STRATA_ASSIGN_OR_RETURN(CacheEvictor evictor, CacheEvictor::Create());
  MemoryTimings fp32;
  std::vector<double> steps, bounds;
  for (uint32_t r = 0; r < config.repetitions; ++r) {
    Status status;
    evictor.Evict();
    steps.push_back(TimeSeconds([&] { status = step(r); }));
    STRATA_RETURN_IF_ERROR(status);
    evictor.Evict();
    bounds.push_back(TimeSeconds(bound));
    STRATA_RETURN_IF_ERROR(TimeRepetition(*optimizer, arrays, evictor, fp32));
  }
  const auto n = static_cast<double>(config.params);
  report.step_seconds = Median(steps);
  report.bound_seconds = Median(bounds);
  report.grad_norm_seconds = Median(fp32.norm);
  report.gparams_per_s = n / report.step_seconds / 1e9;
  report.fp32_gparams_per_s = n / Median(fp32.step) / 1e9;
  report.bytes_per_param = bytes_per_param;
  report.gbps = bytes_per_param * n / report.step_seconds / 1e9;
  report.bound_gbps = bound_bytes_per_param * n / report.bound_seconds / 1e9;
  return report;
}

// The narrow states' kernels take fp32 weights and gradients.
Status NeedFp32(const OptimBenchConfig& config) {
  if (config.dtype == "fp32") return Status::Ok();
  return InvalidArgument("bench optim: --state-format {} runs with --dtype fp32 (its kernel and bound take fp32 "
                         "weights and gradients); got --dtype {}",
                         config.state_format, config.dtype);
}

// --state-format int8: the 8-bit update of a chunk of int8 moments (codes
// and scales interleaved: Note [8-bit states in chunks]), as the engine runs
// it, against its bound and the fp32 states' update.
Result<OptimBenchReport> RunOptim8bitBench(const OptimBenchConfig& config, OptimBenchReport report) {
  STRATA_RETURN_IF_ERROR(NeedFp32(config));
  const size_t n = config.params;
  if (n % optim::kStateBlockElems != 0) {
    return InvalidArgument("bench optim: --state-format int8 needs --params in whole blocks of {}; {} is not",
                           optim::kStateBlockElems, n);
  }
  STRATA_ASSIGN_OR_RETURN(const ChunkArrays arrays, AllocateChunk(n, DType::kFloat32));
  STRATA_ASSIGN_OR_RETURN(Buffer exp_avg, HostArray(ChunkBytes(DType::kInt8Block, n)));
  STRATA_ASSIGN_OR_RETURN(Buffer exp_avg_sq, HostArray(ChunkBytes(DType::kInt8Block, n)));
  optim::ChunkTensors int8 = arrays.chunk;
  int8.state[0] = static_cast<float*>(exp_avg.data());
  int8.state[1] = static_cast<float*>(exp_avg_sq.data());
  int8.state_dtype = DType::kInt8Block;
  const optim::OptimizerConfig adamw{.lr = 1e-4f, .weight_decay = 0.01f, .int8_states = true};
  const auto step = [&](uint32_t r) {
    optim::UpdateParallel(optim::MakeUpdateConstants(adamw, static_cast<int64_t>(r) + 1, 1.0f), int8);
    return Status::Ok();
  };
  // The bound reads and writes n bytes of each moment (the scales, 1.6% more, are left out of it).
  auto* const m = static_cast<uint8_t*>(exp_avg.data());
  auto* const v = static_cast<uint8_t*>(exp_avg_sq.data());
  const auto bound = [&] { BoundPassNarrow(arrays, m, v, BoundBlock8bitAvx512, BoundBlock8bitAvx2); };
  // Read and written: fp32 param and grad 8 + 4, a byte of each moment both ways 4, each block's two scales both ways.
  constexpr double kBytesPerParam = 16.0 + 4.0 * sizeof(float) / static_cast<double>(optim::kStateBlockElems);
  return AlternateWithFp32(config, arrays, step, bound, kBytesPerParam, 16.0, std::move(report));
}

// --state-format bf16: the update with bf16 moments (Note [bf16 states])
// against its bound and the fp32 states' update.
Result<OptimBenchReport> RunOptimBf16StatesBench(const OptimBenchConfig& config, OptimBenchReport report) {
  STRATA_RETURN_IF_ERROR(NeedFp32(config));
  const size_t n = config.params;
  STRATA_ASSIGN_OR_RETURN(const ChunkArrays arrays, AllocateChunk(n, DType::kFloat32));
  STRATA_ASSIGN_OR_RETURN(Buffer exp_avg, HostArray(n * sizeof(uint16_t)));
  STRATA_ASSIGN_OR_RETURN(Buffer exp_avg_sq, HostArray(n * sizeof(uint16_t)));
  optim::ChunkTensors bf16 = arrays.chunk;
  bf16.state[0] = static_cast<float*>(exp_avg.data());
  bf16.state[1] = static_cast<float*>(exp_avg_sq.data());
  bf16.state_dtype = DType::kBFloat16;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<optim::Optimizer> optimizer,
                          optim::Optimizer::Create({.lr = 1e-4f, .weight_decay = 0.01f}));
  const auto step = [&](uint32_t) -> Status {
    STRATA_ASSIGN_OR_RETURN(const optim::StepPlan plan, optimizer->PlanStep({}));
    return optimizer->UpdateChunk(plan, bf16);
  };
  const auto bound = [&] {
    BoundPassNarrow(arrays, static_cast<uint16_t*>(exp_avg.data()), static_cast<uint16_t*>(exp_avg_sq.data()),
                    BoundBlockBf16Avx512, BoundBlockBf16Avx2);
  };
  const double bytes = BytesPerParam(bf16, optimizer->num_states());
  return AlternateWithFp32(config, arrays, step, bound, bytes, bytes, std::move(report));
}

}  // namespace

// Note [The optim bench]
// Adam touches 28 bytes per parameter per step. fp32: it reads param, grad,
// exp_avg and exp_avg_sq and writes param, exp_avg and exp_avg_sq. bf16
// (mixed precision): it reads a bf16 grad and the fp32 master, exp_avg and
// exp_avg_sq, writes those three back and the bf16 compute copy. The bound
// is a streaming loop with exactly that access pattern (trivial arithmetic),
// on the same threads; the optimizer's bandwidth divided by it says how close
// to the machine's limit the kernel runs. The update pass is what is timed;
// the gradient-norm pass that precedes it in a step (4 or 2 bytes per
// parameter, read only) is timed apart. Medians over repetitions.
Result<OptimBenchReport> RunOptimBench(const OptimBenchConfig& config) {
  STRATA_ASSIGN_OR_RETURN(const DType dtype, ParseBenchDType(config.dtype));
  if (config.params == 0) return InvalidArgument("bench optim: --params 0: at least one parameter is needed");
  if (config.repetitions == 0) return InvalidArgument("bench optim: --repetitions 0: at least one is needed");
  if (!optim::CpuSupports(optim::CpuIsa::kAvx2)) {
    return NotSupported("bench optim: the bandwidth bound is written for AVX2 or AVX-512, which this CPU lacks");
  }
  const Result<DType> states = ParseStatesDType(config.state_format);
  if (!states.ok()) return states.status().WithContext("bench optim: --state-format");
  const uint32_t threads = ThreadsOf(config.threads);
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);
  OptimBenchReport report;
  report.config = config;
  report.threads = threads;
  report.isa = std::string(optim::CpuIsaName(optim::ActiveCpuIsa()));
  if (*states == DType::kInt8Block) return RunOptim8bitBench(config, report);
  if (*states == DType::kBFloat16) return RunOptimBf16StatesBench(config, report);
  const size_t n = config.params;
  STRATA_ASSIGN_OR_RETURN(const ChunkArrays arrays, AllocateChunk(n, dtype));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<optim::Optimizer> optimizer,
                          optim::Optimizer::Create({.lr = 1e-4f, .weight_decay = 0.01f}));
  STRATA_ASSIGN_OR_RETURN(CacheEvictor evictor, CacheEvictor::Create());
  // Alternate the passes, so that none always runs on a warmer machine.
  MemoryTimings timings;
  for (uint32_t r = 0; r < config.repetitions; ++r) {
    STRATA_RETURN_IF_ERROR(TimeRepetition(*optimizer, arrays, evictor, timings));
  }
  report.step_seconds = Median(timings.step);
  report.bound_seconds = Median(timings.bound);
  report.grad_norm_seconds = Median(timings.norm);
  report.gparams_per_s = static_cast<double>(n) / report.step_seconds / 1e9;
  report.bytes_per_param = BytesPerParam(arrays.chunk, optimizer->num_states());
  report.gbps = report.bytes_per_param * static_cast<double>(n) / report.step_seconds / 1e9;
  report.bound_gbps = kBoundBytesPerParam * static_cast<double>(n) / report.bound_seconds / 1e9;
  return report;
}

std::string FormatOptimBench(const OptimBenchReport& r) {
  const std::string against_fp32 =
      r.config.state_format != "fp32"
          ? fmt::format("{} states, {:.2f} bytes a parameter: {:.2f}x the fp32 states' update ({:.3f} G params/s)\n",
                        r.config.state_format == "int8" ? "8-bit" : "bf16", r.bytes_per_param,
                        r.gparams_per_s / r.fp32_gparams_per_s, r.fp32_gparams_per_s)
          : "";
  return against_fp32 + fmt::format(
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
                 {"state_format", r.config.state_format},
                 {"threads", r.threads},
                 {"repetitions", r.config.repetitions},
                 {"isa", r.isa}};
  j["gparams_per_s"] = r.gparams_per_s;
  j["bytes_per_param"] = r.bytes_per_param;
  j["gbps"] = r.gbps;
  j["bound_gbps"] = r.bound_gbps;
  j["ratio_to_bound"] = r.ratio();
  j["step_seconds"] = r.step_seconds;
  j["bound_seconds"] = r.bound_seconds;
  j["grad_norm_seconds"] = r.grad_norm_seconds;
  if (r.config.state_format != "fp32") j["fp32_gparams_per_s"] = r.fp32_gparams_per_s;
  return j.dump(2);
}

namespace {

// Host arrays for the NVMe mode: gradients and compute copies of every group
// (they stay in host memory), and the master and states of every group for
// the update-alone timing; what the stream reads of each group (`io`), and
// each group held in memory (`in_memory`).
struct HostModel {
  std::vector<Buffer> grads, params, masters, exp_avgs, exp_avg_sqs;
  std::vector<offload::GroupIo> io;
  std::vector<optim::ChunkTensors> in_memory;
};

// Groups of group_params parameters, the last one the rest.
std::vector<size_t> GroupSizes(uint64_t params, uint64_t group_params) {
  std::vector<size_t> sizes;
  for (uint64_t done = 0; done < params; done += group_params) {
    sizes.push_back(std::min<uint64_t>(group_params, params - done));
  }
  return sizes;
}

// The drive's space: each group's master and 2 states of `states`, padded;
// twice over (copy on write), plus a block per group.
UringStorageOptions NvmeStorageOptions(const OptimNvmeBenchConfig& config, const std::vector<size_t>& sizes,
                                       DType states) {
  uint64_t group_bytes_total = 0;
  for (size_t n : sizes) {
    group_bytes_total += RoundUp(n * sizeof(float), 4096) + 2 * RoundUp(ChunkBytes(states, n), 4096);
  }
  UringStorageOptions storage_options;
  storage_options.dirs = config.dirs;
  storage_options.file_name = "strata-bench-optim.nvme";
  const uint64_t stripe = storage_options.block_size_bytes * config.dirs.size();
  storage_options.capacity_bytes = (2 * group_bytes_total + sizes.size() * stripe + stripe - 1) / stripe * stripe;
  return storage_options;
}

// Removes the backing files when it goes, whatever happened (a failed
// creation included).
struct RemoveFiles {
  const UringStorageOptions& options;
  ~RemoveFiles() {
    for (const std::string& dir : options.dirs) {
      std::error_code ignored;
      std::filesystem::remove(std::filesystem::path(dir) / options.file_name, ignored);
    }
  }
};

// One group of n parameters: its master added to the stream (which homes it
// and its states on NVMe), its gradient and compute copy in host memory, and
// a copy of it all in host memory for the update alone.
Status AddGroup(size_t n, DType dtype, DType states, offload::StateStream& stream, HostModel& host) {
  STRATA_ASSIGN_OR_RETURN(Buffer master, HostArray(n * sizeof(float)));
  float* w = static_cast<float*>(master.data());
  for (size_t i = 0; i < n; ++i) w[i] = WeightAt(i);
  STRATA_RETURN_IF_ERROR(stream.AddGroup({w, n}).status());
  STRATA_ASSIGN_OR_RETURN(Buffer grad, HostArray(n * DTypeSizeBytes(dtype)));
  for (size_t i = 0; i < n; ++i) {
    const float g = GradAt(i);
    if (dtype == DType::kBFloat16) {
      static_cast<uint16_t*>(grad.data())[i] = optim::Bf16FromFloat(g);
    } else {
      static_cast<float*>(grad.data())[i] = g;
    }
  }
  Buffer param;
  if (dtype == DType::kBFloat16) {
    STRATA_ASSIGN_OR_RETURN(param, HostArray(n * sizeof(uint16_t)));
  }
  STRATA_ASSIGN_OR_RETURN(Buffer exp_avg, HostArray(ChunkBytes(states, n)));
  STRATA_ASSIGN_OR_RETURN(Buffer exp_avg_sq, HostArray(ChunkBytes(states, n)));
  host.io.push_back({.grad = grad.data(), .grad_dtype = dtype, .param = param ? param.data() : nullptr,
                     .param_dtype = dtype});
  optim::ChunkTensors t{.n = n, .master = w, .param = host.io.back().param, .param_dtype = dtype,
                        .grad = grad.data(), .grad_dtype = dtype};
  t.state[0] = static_cast<float*>(exp_avg.data());
  t.state[1] = static_cast<float*>(exp_avg_sq.data());
  t.state_dtype = states;
  host.in_memory.push_back(t);
  host.grads.push_back(std::move(grad));
  host.params.push_back(std::move(param));
  host.masters.push_back(std::move(master));
  host.exp_avgs.push_back(std::move(exp_avg));
  host.exp_avg_sqs.push_back(std::move(exp_avg_sq));
  return Status::Ok();
}

// What the NVMe mode times, per repetition; their medians are reported.
struct NvmeTimings {
  std::vector<double> step, io_only, compute, read_wait, ratio;
};

// Repetition r: the step and the I/O alone back to back (in turns first,
// as the drive's speed drifts over seconds: each pair gives one ratio), then
// the update alone on the threads the streamed update gets.
Status TimeNvmeRepetition(uint32_t r, offload::StateStream& stream, optim::Optimizer& optimizer,
                          const HostModel& host, tbb::task_arena& update_arena, NvmeTimings& timings,
                          OptimNvmeBenchReport& report) {
  const optim::StepPlan plan{.step = r + 1};
  const auto run_step = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(offload::StreamStepReport streamed, stream.Step(optimizer, plan, host.io));
    timings.step.push_back(streamed.seconds);
    timings.read_wait.push_back(streamed.read_wait_seconds);
    report.bytes_per_step = streamed.bytes_read + streamed.bytes_written;
    return Status::Ok();
  };
  const auto run_io = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(offload::StreamStepReport moved,
                            stream.Run(host.io, [](size_t, const optim::ChunkTensors&) { return Status::Ok(); }));
    timings.io_only.push_back(moved.seconds);
    return Status::Ok();
  };
  if (r % 2 == 0) {
    STRATA_RETURN_IF_ERROR(run_step());
    STRATA_RETURN_IF_ERROR(run_io());
  } else {
    STRATA_RETURN_IF_ERROR(run_io());
    STRATA_RETURN_IF_ERROR(run_step());
  }
  Status status;
  timings.compute.push_back(TimeSeconds([&] {
    update_arena.execute([&] {
      for (const optim::ChunkTensors& t : host.in_memory) {
        if (status.ok()) status = optimizer.UpdateChunk(plan, t);
      }
    });
  }));
  STRATA_RETURN_IF_ERROR(status);
  timings.ratio.push_back(timings.step.back() / std::max(timings.io_only.back(), timings.compute.back()));
  return Status::Ok();
}

}  // namespace

// Note [The NVMe optimizer bench]
// The three timings of --states nvme, alternated, medians: the step; the
// same pipeline with a no-op update (the I/O alone: every group read and
// written back); and the update alone over the same groups held in host
// memory, on the threads the streamed update gets. The goal: step <= 1.15 x
// max(I/O, update).
Result<OptimNvmeBenchReport> RunOptimNvmeBench(const OptimNvmeBenchConfig& config) {
  const OptimBenchConfig& base = config.base;
  STRATA_ASSIGN_OR_RETURN(const DType dtype, ParseBenchDType(base.dtype));
  if (config.dirs.empty()) return InvalidArgument("bench optim: --states nvme needs --dir DIR (a directory on the drive)");
  if (base.params == 0 || config.group_params == 0) {
    return InvalidArgument("bench optim: --params and --group-params must be > 0");
  }
  if (base.repetitions == 0) return InvalidArgument("bench optim: --repetitions 0: at least one is needed");
  const uint32_t threads = ThreadsOf(base.threads);
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);

  const Result<DType> parsed = ParseStatesDType(base.state_format);
  if (!parsed.ok()) return parsed.status().WithContext("bench optim: --state-format");
  const DType states = *parsed;
  if (states == DType::kInt8Block &&
      (base.params % kInt8BlockElems != 0 || config.group_params % kInt8BlockElems != 0)) {
    return InvalidArgument("bench optim: --state-format int8 needs --params and --group-params in whole blocks of {}",
                           kInt8BlockElems);
  }
  const std::vector<size_t> sizes = GroupSizes(base.params, config.group_params);
  const UringStorageOptions storage_options = NvmeStorageOptions(config, sizes, states);
  // Declared before the storage and the stream, so it runs after they are gone.
  const RemoveFiles remove_files{storage_options};
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage, CreateUringStorage(storage_options));
  memory::NvmeTierPool pool(*storage);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<offload::StateStream> stream,
                          offload::StateStream::Create(pool, 2,
                                                       {.ring_bytes = config.ring_bytes, .state_dtype = states}));
  HostModel host;
  for (size_t n : sizes) STRATA_RETURN_IF_ERROR(AddGroup(n, dtype, states, *stream, host));

  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<optim::Optimizer> optimizer,
                          optim::Optimizer::Create({.lr = 1e-4f, .weight_decay = 0.01f}));
  OptimNvmeBenchReport report;
  report.config = config;
  report.threads = threads;
  report.isa = std::string(optim::CpuIsaName(optim::ActiveCpuIsa()));
  report.groups = sizes.size();
  tbb::task_arena update_arena(static_cast<int>(stream->update_threads()));
  report.update_threads = stream->update_threads();
  NvmeTimings timings;
  for (uint32_t r = 0; r < base.repetitions; ++r) {
    STRATA_RETURN_IF_ERROR(TimeNvmeRepetition(r, *stream, *optimizer, host, update_arena, timings, report));
  }
  report.ring_slots = stream->ring_slots();
  report.ring_slot_bytes = stream->ring_slot_bytes();
  report.step_seconds = Median(timings.step);
  report.io_seconds = Median(timings.io_only);
  report.compute_seconds = Median(timings.compute);
  report.read_wait_seconds = Median(timings.read_wait);
  report.step_over_bound = Median(timings.ratio);
  return report;
}

std::string FormatOptimNvmeBench(const OptimNvmeBenchReport& r) {
  const double gib = static_cast<double>(r.bytes_per_step) / (1 << 30);
  return fmt::format(
      "strata bench optim --states nvme: AdamW, {} params ({}, {} states), {} groups, ring {} x {}, {}, {} thread{} "
      "({} for the update), median of {}\n"
      "{:<28} {:>10} {:>10}\n{:<28} {:>10.3f} {:>10.2f}\n{:<28} {:>10.3f} {:>10.2f}\n{:<28} {:>10.3f}\n"
      "step / max(I/O, update) = {:.3f} (median over pairs run back to back; goal <= 1.15); the update waited "
      "{:.3f} s for reads\n",
      r.config.base.params, r.config.base.dtype, r.config.base.state_format, r.groups, r.ring_slots,
      FormatSize(r.ring_slot_bytes), r.isa,
      r.threads, r.threads == 1 ? "" : "s", r.update_threads, r.config.base.repetitions, "", "seconds", "GiB/s", "step (states on NVMe)",
      r.step_seconds, gib / r.step_seconds, "I/O alone (read + write)", r.io_seconds, gib / r.io_seconds,
      "update alone (host memory)", r.compute_seconds, r.step_over_bound, r.read_wait_seconds);
}

std::string OptimNvmeBenchJson(const OptimNvmeBenchReport& r) {
  nlohmann::json j;
  j["config"] = {{"params", r.config.base.params},     {"dtype", r.config.base.dtype},
                 {"threads", r.threads},              {"repetitions", r.config.base.repetitions},
                 {"isa", r.isa},                      {"states", "nvme"},
                 {"state_format", r.config.base.state_format},
                 {"dirs", r.config.dirs},             {"group_params", r.config.group_params},
                 {"ring_bytes", r.config.ring_bytes}, {"ring_slots", r.ring_slots},
                 {"ring_slot_bytes", r.ring_slot_bytes}, {"update_threads", r.update_threads},
                 {"groups", r.groups}};
  j["step_seconds"] = r.step_seconds;
  j["io_seconds"] = r.io_seconds;
  j["compute_seconds"] = r.compute_seconds;
  j["read_wait_seconds"] = r.read_wait_seconds;
  j["bytes_per_step"] = r.bytes_per_step;
  j["step_over_max_io_compute"] = r.step_over_bound;
  j["gparams_per_s"] = static_cast<double>(r.config.base.params) / r.step_seconds / 1e9;
  return j.dump(2);
}

}  // namespace strata::bench
