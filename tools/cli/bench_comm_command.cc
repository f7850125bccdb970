// strata bench comm [--backend auto|loopback|mpi|nccl] [--sizes 1MiB,4MiB] [--iterations N] [--json FILE]
#include <memory>
#include <string>
#include <vector>

#include "benchmarks/comm_bench.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

struct BenchCommFlags {
  bench::CommBenchConfig config;
  std::vector<std::string> sizes = {"1MiB", "4MiB", "16MiB"};
  std::string json_path;
};

int RunBenchComm(BenchCommFlags flags) {
  flags.config.sizes.clear();
  for (const std::string& text : flags.sizes) {
    Result<size_t> size = ParseSizeFlag("--sizes", text);
    if (!size.ok()) return Fail(size.status());
    flags.config.sizes.push_back(*size);
  }
  Result<bench::CommBenchReport> report = bench::RunCommBench(flags.config);
  if (report.ok() && report->rank != 0) return 0;  // under mpirun: rank 0 reports
  return PrintReport(report, bench::FormatCommBench, bench::CommBenchJson, flags.json_path);
}

}  // namespace

Command AddBenchCommCommand(CLI::App& parent) {
  auto flags = std::make_shared<BenchCommFlags>();
  bench::CommBenchConfig& config = flags->config;
  CLI::App* command = parent.add_subcommand(
      "comm", "all-gather and reduce-scatter of chunk-sized messages against the backend's raw collectives");
  command->add_option("--backend", config.backend,
                      "auto (mpi under mpirun, else loopback), loopback, mpi or nccl (a GPU per rank)")
      ->capture_default_str();
  command->add_flag("--host-buffers", config.host_buffers,
                    "nccl: give strata's communicator host buffers (staged through the GPU)");
  command->add_option("--device-index", config.device_index, "nccl: the GPU (-1: the local rank under mpirun, else 0)")
      ->capture_default_str();
  command->add_option("--ranks", config.ranks, "loopback: ranks (threads)")->capture_default_str();
  command->add_option("--sizes", flags->sizes, "whole-chunk sizes (fp32), comma separated")
      ->delimiter(',')
      ->capture_default_str();
  command->add_option("--iterations", config.iterations, "timed calls per figure")->capture_default_str();
  command->add_option("--json", flags->json_path, "also write the results as JSON to this file");
  return {command, [flags] { return RunBenchComm(*flags); }};
}

}  // namespace strata::cli
