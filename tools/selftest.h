// The self-check behind `strata selftest`: a GPT-style stack of tensors
// pushed through all three tiers under small budgets, every byte verified
// (see Note [The self-check] in selftest.cc).
#pragma once

#include <cstdint>
#include <string>

#include "offload/workloads/gpt_model.h"
#include "strata/engine.h"
#include "strata/options.h"
#include "strata/status.h"

namespace strata {

struct SelftestConfig {
  uint32_t layers = 8;
  uint32_t hidden = 512;
  uint32_t vocab = 8192;
  uint32_t sequence = 512;  // rows of the frozen position embedding
  uint32_t iterations = 2;
  uint64_t seed = 1234;
  // Budgets as fractions of all model states; 0 keeps the value in Options.
  double device_fraction = 0.15;
  double host_fraction = 0.35;
  double nvme_fraction = 1.5;
};

struct SelftestReport {
  uint64_t tensors = 0;
  uint64_t copies_checked = 0;  // tensor copies (tensor x kind) verified
  uint64_t bytes_checked = 0;
  uint64_t mismatches = 0;      // copies whose bytes differed
  double seconds = 0;
  LayoutSummary layout;
  MemoryStats stats;
  std::string backends;
  std::string first_mismatch;  // empty when none
};

// Fills in `options` budgets from the model size (per the fractions) unless
// they are 0, builds an engine and runs the check. An error is a failure of
// the engine (I/O, memory); mismatches are reported in the report.
Result<SelftestReport> RunSelftest(const SelftestConfig& config, Options options, EngineSeams seams = {});

// The shape of the model the self-check registers.
inline offload::ModelShape GptShapeOf(const SelftestConfig& config) {
  return {.layers = config.layers, .hidden = config.hidden, .vocab = config.vocab, .sequence = config.sequence};
}

// A human-readable table of a report; and the same as JSON.
std::string FormatSelftestReport(const SelftestReport& report);
std::string SelftestReportJson(const SelftestReport& report);

}  // namespace strata
