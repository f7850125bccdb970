// `strata bench optim`: the CPU optimizer step against the memory-bandwidth
// bound of the same machine, measured in the same run (see Note [The optim
// bench] in optim_bench.cc); with its states on NVMe, against the I/O alone
// and the update alone. Single-threaded driver.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "strata/status.h"

namespace strata::bench {

struct OptimBenchConfig {
  uint64_t params = uint64_t{64} << 20;
  std::string dtype = "fp32";  // or bf16: bf16 params and grads, fp32 master and states
  // fp32, or int8: both moments block-wise 8-bit (optim/state_codec.h), fp32
  // weights and gradients, timed beside the fp32 states' update
  std::string state_format = "fp32";
  uint32_t threads = 0;        // 0: every core
  uint32_t repetitions = 7;
};

struct OptimBenchReport {
  OptimBenchConfig config;
  std::string isa;
  uint32_t threads = 0;
  double step_seconds = 0;   // median
  double bound_seconds = 0;  // median
  double grad_norm_seconds = 0;  // median
  double gparams_per_s = 0;
  double bytes_per_param = 0;  // the update's reads and writes, from the arrays it is given
  double gbps = 0;             // bytes_per_param / step time
  double bound_gbps = 0;       // the bound's bytes per parameter (28; int8 states 16) / bound time
  double fp32_gparams_per_s = 0;  // int8 states: the fp32 states' update of the same parameters, same run
  double ratio() const { return bound_gbps > 0 ? gbps / bound_gbps : 0; }
};

// InvalidArgument for fp16, no params or no repetitions, an unknown state
// format, or int8 states with bf16 or params not in whole blocks of 256;
// NotSupported without AVX2. Runs on `threads` oneTBB threads.
Result<OptimBenchReport> RunOptimBench(const OptimBenchConfig& config);
// The report as a table for people, and as JSON for scripts.
std::string FormatOptimBench(const OptimBenchReport& report);
std::string OptimBenchJson(const OptimBenchReport& report);

// `--states nvme`: fp32 master weights and both Adam states live on NVMe in
// `dirs` and stream through the ring (offload/training/state_stream.h);
// gradients and the compute copy stay in host memory. See Note [The NVMe
// optimizer bench] in optim_bench.cc.
struct OptimNvmeBenchConfig {
  OptimBenchConfig base;  // params, dtype, threads, repetitions
  std::vector<std::string> dirs;
  uint64_t group_params = uint64_t{8} << 20;  // parameters per chunk group
  uint64_t ring_bytes = uint64_t{512} << 20;
};

struct OptimNvmeBenchReport {
  OptimNvmeBenchConfig config;
  std::string isa;
  uint32_t threads = 0;
  size_t groups = 0;
  uint32_t ring_slots = 0;
  uint64_t ring_slot_bytes = 0;
  uint32_t update_threads = 0;  // of the streamed update, and of the update alone
  uint64_t bytes_per_step = 0;  // read + written
  double step_seconds = 0;      // medians
  double io_seconds = 0;
  double compute_seconds = 0;
  double read_wait_seconds = 0;  // in the step: the update waiting for reads
  // step / max(I/O, update) of each repetition (its step and I/O alone run
  // back to back), median.
  double step_over_bound = 0;
};

// InvalidArgument for fp16, no dirs, no params or groups, or no
// repetitions; removes its backing files however it ends.
Result<OptimNvmeBenchReport> RunOptimNvmeBench(const OptimNvmeBenchConfig& config);
// The report as a table for people, and as JSON for scripts.
std::string FormatOptimNvmeBench(const OptimNvmeBenchReport& report);
std::string OptimNvmeBenchJson(const OptimNvmeBenchReport& report);

}  // namespace strata::bench
