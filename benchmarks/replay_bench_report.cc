// `strata bench replay`'s report: the table for people and the JSON for
// scripts (replay_bench.h).
#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "benchmarks/replay_bench.h"
#include "strata/types.h"

namespace strata::bench {
namespace {

// Each span as "begin-end", in ms.
std::vector<std::string> TimelineText(const std::vector<std::pair<double, double>>& spans) {
  std::vector<std::string> out;
  for (const auto& [begin, end] : spans) out.push_back(fmt::format("{:.2f}-{:.2f}", 1e3 * begin, 1e3 * end));
  return out;
}

}  // namespace

std::string FormatReplayBench(const ReplayBenchReport& r) {
  std::string out = fmt::format(
      "strata bench replay: GPT, {} layers, hidden {}, vocab {}, seq {}, batch {}{}: {} of model states ({} "
      "moments) in {} chunks, {} moments, activations up to {}{}\n"
      "device budget {}, host budget {}, NVMe {}; links {} GB/s; compute {:.1f} ms per iteration (updates on the "
      "CPU); {} measured iterations after {} of warm-up\n",
      r.config.model.layers, r.config.model.hidden, r.config.model.vocab, r.config.model.sequence, r.config.model.batch,
      r.config.accumulation.micro_batches > 1
          ? fmt::format(" x {} micro-batches ({})", r.config.accumulation.micro_batches,
                        r.config.accumulation.order_name())
          : std::string(),
      FormatSize(r.model_states_bytes), r.config.states, r.chunks, r.moments, FormatSize(r.activation_peak_bytes),
      r.boundary_bytes > 0 ? fmt::format(" ({} of them the micro-batches' layer inputs)", FormatSize(r.boundary_bytes))
                           : std::string(),
      FormatSize(r.device_budget_bytes), FormatSize(r.host_budget_bytes),
      r.config.dirs.empty() ? std::string("emulated in memory") : fmt::format("{}", fmt::join(r.config.dirs, ",")),
      r.config.pcie_gbps, 1e3 * r.compute_seconds, r.config.iterations, r.config.warmup);
  out += fmt::format("{:<22} {:>10} {:>10} {:>8} {:>12} {:>12} {:>12} {:>12}\n", "", "step ms", "stall ms", "stall",
                     "host->dev", "dev->host", "nvme read", "nvme write");
  const auto row = [&](const char* name, const ReplayRun& run) {
    out += fmt::format("{:<22} {:>10.2f} {:>10.2f} {:>7.1f}% {:>12} {:>12} {:>12} {:>12}\n", name,
                       1e3 * run.step_seconds, 1e3 * run.stall_seconds, 100 * run.stall_fraction,
                       FormatSize(run.bytes[0]), FormatSize(run.bytes[1]), FormatSize(run.bytes[2]),
                       FormatSize(run.bytes[3]));
  };
  row(r.config.policy == "static" ? "static placement" : "planned prefetch", r.planned);
  if (r.config.baseline) row("LRU, on demand", r.lru);
  if (!r.plan_error.empty()) {
    out += fmt::format("no plan: the planner refused the trace ({}); the run above was on demand\n", r.plan_error);
  }
  if (r.predicted_step_seconds > 0) {
    out += fmt::format(
        "planning {:.2f} ms ({:.2f}% of a step); predicted step {:.2f} ms ({:+.1f}% from the replay); {} divergences\n",
        1e3 * r.planning_seconds, 100 * r.planning_seconds / std::max(r.planned.step_seconds, 1e-12),
        1e3 * r.predicted_step_seconds, 100 * (r.predicted_step_seconds / std::max(r.planned.step_seconds, 1e-12) - 1),
        r.divergences);
  }
  if (r.config.ranks > 1) {
    const double network_ms =
        r.config.net_gbps > 0 ? 1e3 * static_cast<double>(r.planned.comm_bytes) / (r.config.net_gbps * 1e9) : 0;
    out += fmt::format(
        "data parallel, {} ranks{} over {}: each sends {} a step ({:.2f} ms on that network); communication "
        "stall {:.2f} ms ({:.1f}% of the step, the most of any rank){}\n",
        r.config.ranks, r.config.shard_params ? " (parameters sharded)" : "",
        r.config.net_gbps > 0 ? fmt::format("a {} GB/s network", r.config.net_gbps) : std::string("the loopback"),
        FormatSize(r.planned.comm_bytes), network_ms, 1e3 * r.planned.comm_stall_seconds,
        100 * r.planned.comm_stall_fraction,
        r.config.baseline ? fmt::format("; LRU run {:.1f}%", 100 * r.lru.comm_stall_fraction) : std::string());
    if (r.config.shard_params) {
      out += fmt::format(
          "param chunks gathered a step: {:.0f}, {:.0f} of them ahead of their need, {:.0f} of those filled into "
          "their device slot ahead too\n",
          r.planned.gathers, r.planned.gathered_ahead, r.planned.filled_ahead);
    }
  }
  out += fmt::format("{} of {} chunk-group updates on the device, the rest on the CPU; compute at least its chunks' "
                     "transfer time in {} of the step's {} moments as modelled (a module's passes in one)\n",
                     r.updates_on_device, r.updates, r.moments_covered, r.modelled_moments);
  if (r.config.overlap) {
    const std::vector<std::pair<double, double>>& spans = r.planned.overlap_spans;
    const auto during = std::count_if(spans.begin(), spans.end(), [&](const auto& s) {
      return s.first < r.planned.backward_end_seconds;
    });
    out += fmt::format("overlapped updates: {} of {} began while backward went on (the step ran the other {} "
                       "updates: those backward's last pass made final, or whose copy did not fit); the step waited "
                       "{:.2f} ms for them (in the stall); timeline of the last iteration (ms from its start): "
                       "backward ended at {:.2f}; updates {}\n",
                       during, spans.size(), r.updates - std::min<size_t>(r.updates, spans.size()),
                       1e3 * r.planned.update_wait_seconds, 1e3 * r.planned.backward_end_seconds,
                       fmt::join(TimelineText(spans), " "));
  }
  if (r.strata_plan_step_seconds > 0) {
    out += fmt::format("strata plan predicts {:.2f} ms ({:+.1f}% from the replay): {}\n",
                       1e3 * r.strata_plan_step_seconds,
                       100 * (r.strata_plan_step_seconds / std::max(r.planned.step_seconds, 1e-12) - 1),
                       r.strata_plan_command);
  }
  return out;
}

std::string ReplayBenchJson(const ReplayBenchReport& r) {
  nlohmann::json j;
  j["config"] = {{"model", "gpt"},
                 {"layers", r.config.model.layers},
                 {"hidden", r.config.model.hidden},
                 {"vocab", r.config.model.vocab},
                 {"seq", r.config.model.sequence},
                 {"batch", r.config.model.batch},
                 {"gpu_tflops", r.config.gpu_tflops},
                 {"cpu_adam_gparams", r.config.cpu_adam_gparams},
                 {"gpu_adam_gparams", r.config.gpu_adam_gparams},
                 {"device_budget_bytes", r.device_budget_bytes},
                 {"host_budget_bytes", r.host_budget_bytes},
                 {"dirs", r.config.dirs},
                 {"pcie_gbps", r.config.pcie_gbps},
                 {"iterations", r.config.iterations},
                 {"warmup", r.config.warmup},
                 {"policy", r.config.policy},
                 {"device_params", r.config.device_params},
                 {"host_states", r.config.host_states},
                 {"ranks", r.config.ranks},
                 {"shard_params", r.config.shard_params},
                 {"net_gbps", r.config.net_gbps},
                 {"overlap", r.config.overlap},
                 {"states", r.config.states},
                 {"micro_batches", r.config.accumulation.micro_batches},
                 {"accumulation", r.config.accumulation.order_name()}};
  j["model_states_bytes"] = r.model_states_bytes;
  j["chunks"] = r.chunks;
  j["moments"] = r.moments;
  j["compute_seconds"] = r.compute_seconds;
  const auto links = [](const ReplayRun& run) {
    nlohmann::json b;
    for (int l = 0; l < offload::kNumLinks; ++l) b[std::string(offload::LinkName(static_cast<offload::Link>(l)))] = run.bytes[l];
    return b;
  };
  j["step_seconds"] = r.planned.step_seconds;
  j["stall_fraction"] = r.planned.stall_fraction;
  if (r.config.ranks > 1) {
    j["comm_bytes_per_rank"] = r.planned.comm_bytes;
    j["comm_stall_seconds"] = r.planned.comm_stall_seconds;
    j["comm_stall_fraction"] = r.planned.comm_stall_fraction;
    if (r.config.shard_params) {
      j["param_gathers"] = r.planned.gathers;
      j["param_gathers_ahead"] = r.planned.gathered_ahead;
      j["param_gathers_filled_ahead"] = r.planned.filled_ahead;
    }
  }
  j["bytes_moved"] = links(r.planned);
  j["bytes_moved_total"] = r.planned.bytes_moved();
  j["planning_seconds"] = r.planning_seconds;
  j["planning_fraction_of_step"] = r.planning_seconds / std::max(r.planned.step_seconds, 1e-12);
  j["predicted_step_seconds"] = r.predicted_step_seconds;
  j["divergences"] = r.divergences;
  j["activation_peak_bytes"] = r.activation_peak_bytes;
  j["boundary_bytes"] = r.boundary_bytes;
  j["updates"] = r.updates;
  j["updates_on_device"] = r.updates_on_device;
  j["moments_compute_covers_transfer"] = r.moments_covered;
  j["modelled_moments"] = r.modelled_moments;
  if (r.strata_plan_step_seconds > 0) {
    j["strata_plan_step_seconds"] = r.strata_plan_step_seconds;
    j["strata_plan_command"] = r.strata_plan_command;
  }
  j["pipeline"] = nlohmann::json::parse(r.pipeline_json);  // the last iteration, stalls per moment
  if (r.config.overlap) {
    j["backward_end_seconds"] = r.planned.backward_end_seconds;
    j["update_wait_seconds"] = r.planned.update_wait_seconds;
    j["overlap_spans_seconds"] = r.planned.overlap_spans;
  }
  if (r.config.baseline) {
    j["lru_step_seconds"] = r.lru.step_seconds;
    j["lru_stall_fraction"] = r.lru.stall_fraction;
    j["lru_bytes_moved"] = links(r.lru);
    j["lru_bytes_moved_total"] = r.lru.bytes_moved();
  }
  return j.dump(2);
}

}  // namespace strata::bench
