// strata bench optim [--params 64M] [--dtype fp32|bf16] [--threads N] [--repetitions N]
//                    [--states memory|nvme] [--dir DIR]... [--group-params 8M] [--ring 512MiB] [--json FILE]
#include <memory>
#include <string>
#include <vector>

#include "benchmarks/optim_bench.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

struct BenchOptimFlags {
  std::string params = "64M";
  std::string dtype = "fp32";
  std::string state_format = "fp32";
  uint32_t threads = 0;
  uint32_t repetitions = 7;
  std::string states = "memory";
  std::vector<std::string> dirs;
  std::string group_params = "8M";
  std::string ring = "512MiB";
  std::string json_path;
};

// --states nvme: master and states streamed from NVMe.
int RunBenchOptimNvme(const BenchOptimFlags& flags, const bench::OptimBenchConfig& config) {
  bench::OptimNvmeBenchConfig nvme{.base = config, .dirs = flags.dirs};
  Result<size_t> group_params = ParseSizeFlag("--group-params", flags.group_params);
  if (!group_params.ok()) return Fail(group_params.status());
  Result<size_t> ring = ParseSizeFlag("--ring", flags.ring);
  if (!ring.ok()) return Fail(ring.status());
  nvme.group_params = *group_params;
  nvme.ring_bytes = *ring;
  return PrintReport(bench::RunOptimNvmeBench(nvme), bench::FormatOptimNvmeBench, bench::OptimNvmeBenchJson,
                     flags.json_path);
}

int RunBenchOptim(const BenchOptimFlags& flags) {
  bench::OptimBenchConfig config;
  // "64M" parameters: the size suffixes count elements here (M = 2^20).
  Result<size_t> params = ParseSizeFlag("--params", flags.params);
  if (!params.ok()) return Fail(params.status());
  config.params = *params;
  config.dtype = flags.dtype;
  config.state_format = flags.state_format;
  config.threads = flags.threads;
  config.repetitions = flags.repetitions;
  if (flags.states == "nvme") return RunBenchOptimNvme(flags, config);
  if (flags.states != "memory") {
    return Fail(InvalidArgument("--states {}: expected memory or nvme", flags.states));
  }
  if (!flags.dirs.empty()) return Fail(InvalidArgument("--dir is for --states nvme"));
  return PrintReport(bench::RunOptimBench(config), bench::FormatOptimBench, bench::OptimBenchJson, flags.json_path);
}

}  // namespace

Command AddBenchOptimCommand(CLI::App& parent) {
  auto flags = std::make_shared<BenchOptimFlags>();
  CLI::App* command = parent.add_subcommand(
      "optim", "CPU AdamW step against the memory-bandwidth bound, or with its states streamed from NVMe");
  command->add_option("--params", flags->params, "parameters (64M = 64 x 2^20)")->capture_default_str();
  command->add_option("--dtype", flags->dtype, "fp32, or bf16 (bf16 params and grads, fp32 master and states)")
      ->capture_default_str();
  command->add_option("--state-format", flags->state_format,
                      "fp32, bf16 (both moments in bf16) or int8 (both block-wise 8-bit); with --states memory "
                      "(and --dtype fp32) bf16 and int8 are timed beside the fp32 states' update, with --states "
                      "nvme the states streamed are of this format")
      ->capture_default_str();
  command->add_option("--threads", flags->threads, "threads; 0 = every core")->capture_default_str();
  command->add_option("--repetitions", flags->repetitions, "steps timed (median)")->capture_default_str();
  command->add_option("--states", flags->states,
                      "memory (states in host memory, against a bandwidth bound) or nvme (master and "
                      "states on NVMe, streamed; against I/O alone and the update alone)")
      ->capture_default_str();
  command->add_option("--dir", flags->dirs, "with --states nvme: a directory on the drive (repeat: striped)");
  command->add_option("--group-params", flags->group_params, "with --states nvme: parameters per chunk group")
      ->capture_default_str();
  command->add_option("--ring", flags->ring, "with --states nvme: host memory for groups in flight")
      ->capture_default_str();
  command->add_option("--json", flags->json_path, "also write the results as JSON to this file");
  return {command, [flags] { return RunBenchOptim(*flags); }};
}

}  // namespace strata::cli
