#include "benchmarks/optim_bench.h"

#include <tbb/global_control.h>
#include <tbb/info.h>
#include <tbb/parallel_for.h>

// GCC 12 warns inside its own AVX-512 headers (see optim/cpu_avx512.cc).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

#include "benchmarks/io_bench.h"
#include "memory/tier_pool.h"
#include "offload/state_stream.h"
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

namespace {

// Host arrays for the NVMe mode: gradients and compute copies of every group
// (they stay in host memory), and the master and states of every group for
// the update-alone timing.
struct HostModel {
  std::vector<Buffer> grads, params, masters, exp_avgs, exp_avg_sqs;
};

Result<Buffer> HostArray(size_t bytes) {
  Buffer buffer = AllocateAlignedHost(std::max<size_t>(bytes, 64), 64);
  if (!buffer) return OutOfMemory("bench optim: cannot allocate {} of host memory", FormatSize(bytes));
  std::memset(buffer.data(), 0, bytes);
  return buffer;
}

}  // namespace

Result<OptimNvmeBenchReport> RunOptimNvmeBench(const OptimNvmeBenchConfig& config) {
  const OptimBenchConfig& base = config.base;
  STRATA_ASSIGN_OR_RETURN(const DType dtype, ParseDType(base.dtype));
  if (dtype == DType::kFloat16) return InvalidArgument("bench optim: --dtype {}: expected fp32 or bf16", base.dtype);
  if (config.dirs.empty()) return InvalidArgument("bench optim: --states nvme needs --dir DIR (a directory on the drive)");
  if (base.params == 0 || config.group_params == 0) {
    return InvalidArgument("bench optim: --params and --group-params must be > 0");
  }
  if (base.repetitions == 0) return InvalidArgument("bench optim: --repetitions 0: at least one is needed");
  const uint32_t threads = base.threads > 0 ? base.threads : static_cast<uint32_t>(tbb::info::default_concurrency());
  tbb::global_control limit(tbb::global_control::max_allowed_parallelism, threads);

  std::vector<size_t> sizes;
  for (uint64_t done = 0; done < base.params; done += config.group_params) {
    sizes.push_back(std::min<uint64_t>(config.group_params, base.params - done));
  }
  // Each group: master + 2 states, padded; twice over (copy on write), plus a block per group.
  uint64_t group_bytes_total = 0;
  for (size_t n : sizes) group_bytes_total += 3 * ((n * sizeof(float) + 4095) / 4096 * 4096);
  UringStorageOptions storage_options;
  storage_options.dirs = config.dirs;
  storage_options.file_name = "strata-bench-optim.nvme";
  const uint64_t stripe = storage_options.block_size_bytes * config.dirs.size();
  storage_options.capacity_bytes = (2 * group_bytes_total + sizes.size() * stripe + stripe - 1) / stripe * stripe;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Storage> storage, CreateUringStorage(storage_options));
  // The backing files go when the benchmark does, whatever happens.
  struct RemoveFiles {
    const UringStorageOptions& options;
    ~RemoveFiles() {
      for (const std::string& dir : options.dirs) {
        std::error_code ignored;
        std::filesystem::remove(std::filesystem::path(dir) / options.file_name, ignored);
      }
    }
  } remove_files{storage_options};
  memory::NvmeTierPool pool(*storage);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<offload::StateStream> stream,
                          offload::StateStream::Create(pool, 2, {.ring_bytes = config.ring_bytes}));

  HostModel host;
  std::vector<offload::GroupIo> io;
  std::vector<optim::ChunkTensors> in_memory;
  for (size_t n : sizes) {
    STRATA_ASSIGN_OR_RETURN(Buffer master, HostArray(n * sizeof(float)));
    float* w = static_cast<float*>(master.data());
    for (size_t i = 0; i < n; ++i) w[i] = 0.01f * static_cast<float>(i % 97);
    STRATA_RETURN_IF_ERROR(stream->AddGroup({w, n}).status());
    STRATA_ASSIGN_OR_RETURN(Buffer grad, HostArray(n * DTypeSizeBytes(dtype)));
    for (size_t i = 0; i < n; ++i) {
      const float g = 0.001f * static_cast<float>(i % 89) - 0.04f;
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
    STRATA_ASSIGN_OR_RETURN(Buffer exp_avg, HostArray(n * sizeof(float)));
    STRATA_ASSIGN_OR_RETURN(Buffer exp_avg_sq, HostArray(n * sizeof(float)));
    io.push_back({.grad = grad.data(), .grad_dtype = dtype, .param = param ? param.data() : nullptr,
                  .param_dtype = dtype});
    optim::ChunkTensors t{.n = n, .master = w, .param = io.back().param, .param_dtype = dtype,
                          .grad = grad.data(), .grad_dtype = dtype};
    t.state[0] = static_cast<float*>(exp_avg.data());
    t.state[1] = static_cast<float*>(exp_avg_sq.data());
    in_memory.push_back(t);
    host.grads.push_back(std::move(grad));
    host.params.push_back(std::move(param));
    host.masters.push_back(std::move(master));
    host.exp_avgs.push_back(std::move(exp_avg));
    host.exp_avg_sqs.push_back(std::move(exp_avg_sq));
  }

  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<optim::Optimizer> optimizer,
                          optim::Optimizer::Create({.lr = 1e-4f, .weight_decay = 0.01f}));
  OptimNvmeBenchReport report;
  report.config = config;
  report.threads = threads;
  report.isa = std::string(optim::CpuIsaName(optim::BestCpuIsa()));
  report.groups = sizes.size();
  std::vector<double> step, io_only, compute, read_wait;
  for (uint32_t r = 0; r < base.repetitions; ++r) {
    const optim::StepPlan plan{.step = r + 1};
    STRATA_ASSIGN_OR_RETURN(offload::StreamStepReport streamed, stream->Step(*optimizer, plan, io));
    step.push_back(streamed.seconds);
    read_wait.push_back(streamed.read_wait_seconds);
    report.bytes_per_step = streamed.bytes_read + streamed.bytes_written;
    STRATA_ASSIGN_OR_RETURN(offload::StreamStepReport moved,
                            stream->Run(io, [](size_t, const optim::ChunkTensors&) { return Status::Ok(); }));
    io_only.push_back(moved.seconds);
    Status status;
    compute.push_back(TimeSeconds([&] {
      for (const optim::ChunkTensors& t : in_memory) {
        if (status.ok()) status = optimizer->UpdateChunk(plan, t);
      }
    }));
    STRATA_RETURN_IF_ERROR(status);
  }
  report.ring_slots = stream->ring_slots();
  report.step_seconds = Median(step);
  report.io_seconds = Median(io_only);
  report.compute_seconds = Median(compute);
  report.read_wait_seconds = Median(read_wait);
  return report;
}

std::string FormatOptimNvmeBench(const OptimNvmeBenchReport& r) {
  const double gib = static_cast<double>(r.bytes_per_step) / (1 << 30);
  return fmt::format(
      "strata bench optim --states nvme: AdamW, {} params ({}), {} groups, ring {} x {}, {}, {} thread{}, median "
      "of {}\n"
      "{:<28} {:>10} {:>10}\n{:<28} {:>10.3f} {:>10.2f}\n{:<28} {:>10.3f} {:>10.2f}\n{:<28} {:>10.3f}\n"
      "step / max(I/O, update) = {:.3f} (goal <= 1.15); the update waited {:.3f} s for reads\n",
      r.config.base.params, r.config.base.dtype, r.groups, r.ring_slots,
      FormatSize(r.config.ring_bytes / std::max<uint32_t>(r.ring_slots, 1)), r.isa, r.threads,
      r.threads == 1 ? "" : "s", r.config.base.repetitions, "", "seconds", "GiB/s", "step (states on NVMe)",
      r.step_seconds, gib / r.step_seconds, "I/O alone (read + write)", r.io_seconds, gib / r.io_seconds,
      "update alone (host memory)", r.compute_seconds, r.step_over_bound(), r.read_wait_seconds);
}

std::string OptimNvmeBenchJson(const OptimNvmeBenchReport& r) {
  nlohmann::json j;
  j["config"] = {{"params", r.config.base.params},     {"dtype", r.config.base.dtype},
                 {"threads", r.threads},              {"repetitions", r.config.base.repetitions},
                 {"isa", r.isa},                      {"states", "nvme"},
                 {"dirs", r.config.dirs},             {"group_params", r.config.group_params},
                 {"ring_bytes", r.config.ring_bytes}, {"ring_slots", r.ring_slots},
                 {"groups", r.groups}};
  j["step_seconds"] = r.step_seconds;
  j["io_seconds"] = r.io_seconds;
  j["compute_seconds"] = r.compute_seconds;
  j["read_wait_seconds"] = r.read_wait_seconds;
  j["bytes_per_step"] = r.bytes_per_step;
  j["step_over_max_io_compute"] = r.step_over_bound();
  j["gparams_per_s"] = static_cast<double>(r.config.base.params) / r.step_seconds / 1e9;
  return j.dump(2);
}

}  // namespace strata::bench
