// `strata bench replay`: the access pattern of a GPT-style model's forward
// and backward passes, replayed on the engine with the host-emulated device
// (its copies throttled to a PCIe-like bandwidth) and, with --dir, real NVMe
// I/O, for several iterations after the warm-up; once with the planned
// prefetch pipeline (offload/pipeline.h) and once without a plan (on demand,
// least-recently-used eviction) as the reference, each on a fresh engine.
//
// Moments: forward = the embedding, each layer, the final norm (their param
// chunks); backward = the same in reverse, with the grad chunks as well. Each
// moment computes by busy work for --compute-ms (default: 1.5 x the time its
// chunks take over the throttled link), so stalls are what remains of the
// transfers. Reported per iteration after the warm-up: stall time / step
// time, bytes per link, and the planner's time against a step.
// The optimizer step is not replayed yet.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "offload/planner.h"
#include "strata/status.h"

namespace strata::bench {

struct ReplayBenchConfig {
  uint32_t layers = 8;
  uint32_t hidden = 512;
  uint32_t vocab = 8192;
  uint32_t sequence = 512;
  uint64_t device_budget_bytes = 0;  // 0: a quarter of the model states
  uint64_t host_budget_bytes = 0;    // 0: half of the model states
  std::vector<std::string> dirs;     // NVMe directories; empty: NVMe emulated in memory
  double pcie_gbps = 2.0;            // the emulated device's copy bandwidth per direction
  double compute_ms = 0;             // per moment; 0: 1.5 x its chunks' transfer time
  uint32_t iterations = 3;           // measured, after one warm-up
  bool baseline = true;              // also run without a plan
};

struct ReplayRun {
  double step_seconds = 0;     // mean over the measured iterations
  double stall_seconds = 0;    // mean
  double stall_fraction = 0;   // stall / step
  std::array<uint64_t, offload::kNumLinks> bytes = {};  // mean per iteration
  uint64_t bytes_moved() const;
};

struct ReplayBenchReport {
  ReplayBenchConfig config;
  uint64_t model_states_bytes = 0;
  uint64_t device_budget_bytes = 0;
  uint64_t host_budget_bytes = 0;
  uint32_t chunks = 0;
  uint32_t moments = 0;
  double compute_seconds = 0;  // per iteration, all moments
  double planning_seconds = 0;
  double predicted_step_seconds = 0;
  uint64_t divergences = 0;
  std::string pipeline_json;  // the planned run's pipeline statistics (last iteration)
  ReplayRun planned;
  ReplayRun lru;  // when config.baseline
};

Result<ReplayBenchReport> RunReplayBench(const ReplayBenchConfig& config);
std::string FormatReplayBench(const ReplayBenchReport& report);
std::string ReplayBenchJson(const ReplayBenchReport& report);

}  // namespace strata::bench
