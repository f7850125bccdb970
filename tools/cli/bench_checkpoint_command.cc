// strata bench checkpoint --dir DIR [--params 32M] [--chunk-elems N] [--states-on-nvme] [--no-recycle]
//                         [--runs N] [--json FILE]
#include <memory>
#include <string>

#include "benchmarks/checkpoint_bench.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

struct BenchCheckpointFlags {
  bench::CheckpointBenchConfig config;
  std::string params = "32M";
  std::string json_path;
};

int RunBenchCheckpoint(BenchCheckpointFlags flags) {
  Result<size_t> params = ParseSizeFlag("--params", flags.params);  // "32M": a count, as bench optim reads it
  if (!params.ok()) return Fail(params.status());
  flags.config.params = *params;
  return PrintReport(bench::RunCheckpointBench(flags.config), bench::FormatCheckpointBench,
                     bench::CheckpointBenchJson, flags.json_path);
}

}  // namespace

Command AddBenchCheckpointCommand(CLI::App& parent) {
  auto flags = std::make_shared<BenchCheckpointFlags>();
  bench::CheckpointBenchConfig& config = flags->config;
  CLI::App* command = parent.add_subcommand(
      "checkpoint", "a checkpoint's save and load bandwidth against bench io's NVMe write and read in the same run");
  command->add_option("--dir", config.dir, "where to save (and the NVMe tier)")->required();
  command->add_option("--params", flags->params, "fp32 parameters (12 bytes each saved)")->capture_default_str();
  command->add_option("--chunk-elems", config.chunk_elems, "elements a chunk")->capture_default_str();
  command->add_flag("--states-on-nvme", config.states_on_nvme,
                    "keep the optimizer states in the NVMe tier (saved from there)");
  command->add_flag(
      "--no-recycle", [&config](int64_t) { config.recycle = false; },
      "every save into new files (CheckpointOptions::recycle off)");
  command->add_option("--runs", config.runs, "saves and loads, and bench io runs")->capture_default_str();
  command->add_option("--json", flags->json_path, "also write the results as JSON");
  return {command, [flags] { return RunBenchCheckpoint(*flags); }};
}

}  // namespace strata::cli
