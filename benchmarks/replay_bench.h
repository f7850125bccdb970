// `strata bench replay`: a GPT-style model's training step, the engine's own
// (offload::RunAccumulatedStep and RunTrainStep), run with emulated compute
// on the host-emulated device (its copies throttled to a PCIe-like
// bandwidth) and, with `dirs`, real NVMe I/O; once with the planned prefetch
// pipeline (offload/schedule/pipeline.h) and once on demand with LRU
// eviction as the reference, each on a fresh engine. See Note [The replay]
// in replay_bench.cc for what is emulated and what is reported.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "offload/workloads/capacity_plan.h"
#include "offload/schedule/planner.h"
#include "strata/status.h"

namespace strata::bench {

struct ReplayBenchConfig {
  // The GPT: layers, hidden, vocab, sequence, batch, heads (0: hidden / 64).
  offload::ModelShape model{.layers = 8, .hidden = 512, .vocab = 8192, .sequence = 128, .batch = 1, .heads = 0};
  uint64_t device_budget_bytes = 0;  // 0: a quarter of the model states
  uint64_t host_budget_bytes = 0;    // 0: half of the model states
  std::vector<std::string> dirs;     // NVMe directories; empty: NVMe emulated in memory
  double pcie_gbps = 2.0;            // the emulated device's copy bandwidth per direction
  double compute_ms = 0;             // per forward/backward moment; 0: see gpu_tflops
  double gpu_tflops = 0;             // forward/backward FLOPs rate; 0: 1.5 x the moment's chunks' transfer time
  double cpu_adam_gparams = 1.0;     // an update on the host: its parameters at this rate (G/s)
  double gpu_adam_gparams = 100;     // on the device
  uint32_t iterations = 3;           // measured, after the warm-up
  // Iterations before: the first records the trace (and measures the links
  // it uses); the second follows the plan and measures the links the first
  // could not (optimizer states are first touched in memory, so nothing is
  // read from NVMe before it), re-planning if one was assumed wrong.
  uint32_t warmup = 2;
  bool baseline = true;              // also run without a plan
  std::string policy = "adaptive";   // placement.policy of the measured run: adaptive or static
  // Data parallel (see Note [The replay]): ranks as threads of a loopback
  // group over a network of net_gbps (0: the loopback's memory speed), and
  // with shard_params the parameters sharded too (comm.shard_params, ZeRO-3).
  uint32_t ranks = 1;
  double net_gbps = 0;
  bool shard_params = false;
  double device_params = 0.5;        // placement.device_params (static)
  double host_states = 1.0;          // placement.host_states (static)
  // Each update begun beside backward once its group's gradients are final
  // (offload::OverlapUpdates; data parallel, on the rank's reduced shard).
  bool overlap = false;
  // Micro-batches a step, standard or layered (--micro-batches, --accumulation).
  offload::Accumulation accumulation;
  // optimizer.states: the moments' format (fp32, bf16 or int8), their real bytes on every tier.
  std::string states = "fp32";
};

struct ReplayRun {
  double step_seconds = 0;     // mean over the measured iterations
  double stall_seconds = 0;    // mean
  double stall_fraction = 0;   // stall / step
  std::array<uint64_t, offload::kNumLinks> bytes = {};  // mean per iteration
  // Data parallel (the rank with the most): waiting for collectives, mean
  // per iteration, and its share of the step; bytes sent per iteration.
  double comm_stall_seconds = 0;
  double comm_stall_fraction = 0;
  uint64_t comm_bytes = 0;
  // Parameters sharded (rank 0), mean per iteration: param chunks gathered
  // (GradReducer::gathers), of them gathered ahead of their need, and of
  // those filled into their device slot ahead too (no copy left for the access).
  double gathers = 0, gathered_ahead = 0, filled_ahead = 0;
  // The last measured iteration's timeline, in seconds from its start: when
  // the last backward pass's compute ended, and when each update beside
  // backward began and ended.
  double backward_end_seconds = 0;
  double update_wait_seconds = 0;  // mean: the step waiting for the overlapped updates (in stall_seconds)
  std::vector<std::pair<double, double>> overlap_spans;
  uint64_t bytes_moved() const;
};

struct ReplayBenchReport {
  ReplayBenchConfig config;
  uint64_t model_states_bytes = 0;
  uint64_t device_budget_bytes = 0;
  uint64_t host_budget_bytes = 0;
  uint32_t chunks = 0;
  uint32_t moments = 0;           // the step's, as the pipeline recorded them (a module pass or an update each)
  uint32_t modelled_moments = 0;  // offload::GptStepTrace's (a layered module's passes in one)
  uint64_t activation_peak_bytes = 0;
  uint64_t boundary_bytes = 0;  // layered: the micro-batches' layer inputs held at once
  double compute_seconds = 0;  // per iteration, all moments, updates on the CPU
  uint32_t updates = 0, updates_on_device = 0;  // chunk-group updates, as the plan placed them
  // Modelled moments whose compute is at least their chunks' transfer time
  // at the measured rates (the stall goal's premise; see ComputeCoversTransfer).
  uint32_t moments_covered = 0;
  double strata_plan_step_seconds = 0;  // with gpu_tflops: `strata plan`'s prediction for this machine
  std::string strata_plan_command;
  std::string plan_error;  // the planner's refusal, when the measured run had no plan
  double planning_seconds = 0;
  double predicted_step_seconds = 0;
  std::array<uint64_t, offload::kNumLinks> predicted_bytes = {};  // per iteration, by the plan of the measured run
  uint64_t divergences = 0;
  std::string pipeline_json;  // the planned run's pipeline statistics (last iteration)
  ReplayRun planned;
  ReplayRun lru;  // when config.baseline
};

// InvalidArgument for a shape, count or rate it cannot replay; removes the
// backing files it created in `dirs`.
Result<ReplayBenchReport> RunReplayBench(const ReplayBenchConfig& config);
// The report as a table for people, and as JSON for scripts.
std::string FormatReplayBench(const ReplayBenchReport& report);
std::string ReplayBenchJson(const ReplayBenchReport& report);

}  // namespace strata::bench
