// strata bench replay [--layers N] [--hidden N] ... [--ranks W] [--shard-params] [--micro-batches M]
//   [--accumulation standard|layered] [--overlap] [--no-baseline] [--json FILE]
#include <memory>
#include <string>

#include "benchmarks/replay_bench.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

struct BenchReplayFlags {
  std::string model = "gpt";
  bench::ReplayBenchConfig config;
  std::string device_budget = "0";
  std::string host_budget = "0";
  bool no_baseline = false;
  std::string accumulation = "standard";
  std::string json_path;
};

int RunBenchReplay(BenchReplayFlags flags) {
  if (flags.model != "gpt") return Fail(InvalidArgument("--model {}: only gpt is built", flags.model));
  Result<size_t> device = ParseSizeFlag("--device-budget", flags.device_budget);
  if (!device.ok()) return Fail(device.status());
  Result<size_t> host = ParseSizeFlag("--host-budget", flags.host_budget);
  if (!host.ok()) return Fail(host.status());
  flags.config.device_budget_bytes = *device;
  flags.config.host_budget_bytes = *host;
  flags.config.baseline = !flags.no_baseline;
  flags.config.accumulation.layered = flags.accumulation == "layered";
  return PrintReport(bench::RunReplayBench(flags.config), bench::FormatReplayBench, bench::ReplayBenchJson,
                     flags.json_path);
}

// The model, the budgets and the machine emulated: its bandwidths and rates.
void AddModelAndMachineFlags(CLI::App* command, BenchReplayFlags& flags) {
  bench::ReplayBenchConfig& config = flags.config;
  command->add_option("--model", flags.model, "model family (gpt)")->capture_default_str();
  command->add_option("--layers", config.model.layers, "transformer layers")->capture_default_str();
  command->add_option("--hidden", config.model.hidden, "hidden size")->capture_default_str();
  command->add_option("--vocab", config.model.vocab, "vocabulary")->capture_default_str();
  command->add_option("--seq", config.model.sequence, "sequence length (position embedding rows)")
      ->capture_default_str();
  command->add_option("--device-budget", flags.device_budget,
                      "device memory for chunks; 0 = a quarter of the model states")->capture_default_str();
  command->add_option("--host-budget", flags.host_budget, "host memory for chunks; 0 = half of the model states")
      ->capture_default_str();
  command->add_option("--dir", config.dirs, "NVMe directory (repeat: striped); none = NVMe emulated in memory");
  command->add_option("--pcie-gbps", config.pcie_gbps,
                      "host<->device copy bandwidth of the emulated device, GB/s per direction")
      ->capture_default_str();
  command->add_option("--compute-ms", config.compute_ms,
                      "compute per moment (busy work); 0 = 1.5 x its chunks' transfer time")
      ->capture_default_str();
  command->add_option("--batch", config.model.batch, "sequences per step (activations, FLOPs)")->capture_default_str();
  command->add_option("--heads", config.model.heads, "attention heads; 0 = hidden / 64")->capture_default_str();
  command->add_option("--gpu-tflops", config.gpu_tflops,
                      "compute forward/backward for their FLOPs at this rate; 0 = see --compute-ms")
      ->capture_default_str();
  command->add_option("--cpu-adam-gparams", config.cpu_adam_gparams,
                      "an update on the CPU takes its parameters / this (G params/s)")
      ->capture_default_str();
  command->add_option("--gpu-adam-gparams", config.gpu_adam_gparams,
                      "an update on the device takes its parameters / this (G params/s)")
      ->capture_default_str();
}

// The placement, the iterations, the data-parallel ranks and the report.
void AddRunFlags(CLI::App* command, BenchReplayFlags& flags) {
  bench::ReplayBenchConfig& config = flags.config;
  command->add_option("--policy", config.policy, "placement.policy: adaptive or static")
      ->check(CLI::IsMember({"adaptive", "static"}))
      ->capture_default_str();
  command->add_option("--device-params", config.device_params,
                      "static: share of param and grad chunks kept on the device")
      ->capture_default_str();
  command->add_option("--host-states", config.host_states, "static: share of optimizer states homed in host memory")
      ->capture_default_str();
  command->add_option("--warmup", config.warmup,
                      "iterations before the measured ones: the first records, the second calibrates")
      ->capture_default_str();
  command->add_option("--iterations", config.iterations, "measured, after the warm-up")->capture_default_str();
  command->add_option("--ranks", config.ranks, "data-parallel ranks (threads), each 1/ranks of the optimizer states")
      ->capture_default_str();
  command->add_option("--net-gbps", config.net_gbps,
                      "with --ranks: the network's bandwidth in GB/s each rank sends at; 0 = unthrottled")
      ->capture_default_str();
  command->add_flag("--shard-params", config.shard_params,
                    "with --ranks: shard the parameters too (comm.shard_params, ZeRO-3), gathered in "
                    "forward and backward");
  command->add_option("--micro-batches", config.accumulation.micro_batches,
                      "micro-batches a step (gradient accumulation)")
      ->capture_default_str();
  command->add_option("--accumulation", flags.accumulation,
                      "standard (the model once per micro-batch) or layered (each layer for every micro-batch in "
                      "turn, checkpointed)")
      ->check(CLI::IsMember({"standard", "layered"}))
      ->capture_default_str();
  command->add_option("--states", config.states, "optimizer.states: the moments' format, fp32, bf16 or int8")
      ->check(CLI::IsMember({"fp32", "bf16", "int8"}))
      ->capture_default_str();
  command->add_flag("--overlap", config.overlap,
                    "begin each update beside backward, once its group's gradients are final (optimizer.overlap)");
  command->add_flag("--no-baseline", flags.no_baseline, "skip the LRU run");
  command->add_option("--json", flags.json_path, "also write the results as JSON to this file");
}

}  // namespace

Command AddBenchReplayCommand(CLI::App& parent) {
  auto flags = std::make_shared<BenchReplayFlags>();
  CLI::App* command = parent.add_subcommand(
      "replay", "a GPT's training step replayed with the planned prefetch pipeline, against LRU on demand");
  AddModelAndMachineFlags(command, *flags);
  AddRunFlags(command, *flags);
  return {command, [flags] { return RunBenchReplay(*flags); }};
}

}  // namespace strata::cli
