// The `strata` command line: the self-check, the option table, and (in later
// work) the benchmarks and the planner.
//
//   strata selftest [--config FILE] [--set key=value]... [--nvme-dir DIR] [--json FILE]
//   strata bench io --dir DIR [--dir DIR]... [--file-size 2GiB] [--block-size 1MiB,4MiB]
//                   [--queue-depth 8,32] [--op read|write|both] [--pattern seq|rand|both]
//                   [--runs 3] [--compare-fio] [--compare-one-dir] [--sqpoll] [--no-huge-pages]
//                   [--dest host|device] [--device-backend auto|cuda|emulated] [--json FILE]
//   strata options  [--config FILE] [--set key=value]...
//   strata version
//
// Exit status: 0 on success, 1 when a check fails or the engine reports an
// error (printed to stderr), 2 on bad command-line input.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include <CLI/CLI.hpp>

#include "benchmarks/checkpoint_bench.h"
#include "benchmarks/comm_bench.h"
#include "benchmarks/io_bench.h"
#include "benchmarks/optim_bench.h"
#include "benchmarks/replay_bench.h"
#include "offload/workloads/capacity_plan.h"
#include "offload/persist/checkpoint.h"
#include "tools/selftest.h"
#include "strata/device.h"
#include "strata/options.h"

namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

struct CommonFlags {
  std::string config_path;
  std::vector<std::string> sets;
};

void AddCommonFlags(CLI::App* command, CommonFlags& flags) {
  command->add_option("--config", flags.config_path, "JSON file of options (see `strata options`)");
  command->add_option("--set", flags.sets, "override one option: --set key=value (repeatable)");
}

// Options from defaults, then the config file, then each --set in order.
strata::Result<strata::Options> LoadOptions(const CommonFlags& flags, strata::Options options = {}) {
  if (!flags.config_path.empty()) STRATA_RETURN_IF_ERROR(strata::ApplyOptionsFile(options, flags.config_path));
  for (const std::string& set : flags.sets) {
    size_t equals = set.find('=');
    if (equals == std::string::npos) {
      return strata::InvalidArgument("--set '{}': expected key=value, e.g. --set device.budget=2GiB", set);
    }
    STRATA_RETURN_IF_ERROR(strata::SetOption(options, set.substr(0, equals), set.substr(equals + 1)));
  }
  STRATA_RETURN_IF_ERROR(strata::ValidateOptions(options));
  return options;
}

int Fail(const strata::Status& status) {
  std::fprintf(stderr, "strata: %s\n", status.ToString().c_str());
  return status.code() == strata::StatusCode::kInvalidArgument ? kExitUsage : kExitFailure;
}

// Writes a report's JSON to --json PATH; an empty path writes nothing.
strata::Status WriteJsonFile(const std::string& path, const std::string& json) {
  if (path.empty()) return strata::Status::Ok();
  std::ofstream out(path);
  out << json << "\n";
  if (!out) return strata::IoError("--json {}: cannot write it", path);
  return strata::Status::Ok();
}

int RunOptions(const CommonFlags& flags) {
  strata::Result<strata::Options> options = LoadOptions(flags);
  if (!options.ok()) return Fail(options.status());
  auto values = strata::DescribeOptions(*options);
  const auto& docs = strata::OptionDocs();
  std::printf("%-32s %-12s %-12s %s\n", "key", "value", "default", "meaning");
  for (size_t i = 0; i < docs.size(); ++i) {
    std::printf("%-32s %-12s %-12s %s\n", docs[i].key.c_str(), values[i].second.c_str(),
                docs[i].default_value.c_str(), docs[i].description.c_str());
  }
  return 0;
}

int RunSelftestCommand(const CommonFlags& flags, strata::SelftestConfig config, const std::string& nvme_dir,
                       const std::string& json_path) {
  // The self-check's defaults: an emulated device unless asked, NVMe in `nvme_dir`.
  strata::Options defaults;
  // A small model: chunks of 64Ki..2Mi elements, so that many chunks cycle.
  defaults.chunk.search_min_elems = size_t{1} << 16;
  defaults.chunk.search_max_elems = size_t{1} << 21;
  // Mixed precision, so that all five chunk kinds (fp32 master included) take part.
  defaults.compute_dtype = strata::DType::kBFloat16;
  if (!nvme_dir.empty()) defaults.nvme.dirs = {nvme_dir};
  strata::Result<strata::Options> options = LoadOptions(flags, defaults);
  if (!options.ok()) return Fail(options.status());
  for (const std::string& dir : options->nvme.dirs) {
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    if (error) {
      return Fail(strata::IoError("nvme dir {}: cannot create it: {}", dir, error.message()));
    }
  }
  strata::Result<strata::SelftestReport> report = strata::RunSelftest(config, *options);
  if (!report.ok()) return Fail(report.status());
  std::fputs(strata::FormatSelftestReport(*report).c_str(), stdout);
  strata::Status written = WriteJsonFile(json_path, strata::SelftestReportJson(*report));
  if (!written.ok()) return Fail(written);
  return report->mismatches == 0 ? 0 : kExitFailure;
}

struct BenchIoFlags {
  std::vector<std::string> dirs;
  std::string file_size = "2GiB";
  std::vector<std::string> block_sizes = {"1MiB"};
  std::vector<uint32_t> queue_depths = {32};
  std::string op = "both";
  std::string pattern = "seq";
  uint32_t runs = 3;
  bool compare_fio = false;
  std::string fio_path = "fio";
  bool compare_one_dir = false;
  bool sqpoll = false;
  bool no_huge_pages = false;
  std::string dest = "host";
  std::string device_backend = "auto";
  std::string json_path;
};

int RunBenchIo(const BenchIoFlags& flags) {
  strata::bench::IoBenchConfig config;
  config.dirs = flags.dirs;
  strata::Result<size_t> file_size = strata::ParseSize(flags.file_size);
  if (!file_size.ok()) return Fail(strata::InvalidArgument("--file-size: {}", file_size.status().message()));
  config.file_size_bytes = *file_size;
  config.block_sizes_bytes.clear();
  for (const std::string& text : flags.block_sizes) {
    strata::Result<size_t> block = strata::ParseSize(text);
    if (!block.ok()) return Fail(strata::InvalidArgument("--block-size: {}", block.status().message()));
    config.block_sizes_bytes.push_back(*block);
  }
  config.queue_depths = flags.queue_depths;
  using strata::bench::IoOp;
  using strata::bench::IoPattern;
  if (flags.op == "read") config.ops = {IoOp::kRead};
  else if (flags.op == "write") config.ops = {IoOp::kWrite};
  else if (flags.op == "both") config.ops = {IoOp::kWrite, IoOp::kRead};
  else return Fail(strata::InvalidArgument("--op '{}': expected read, write or both", flags.op));
  if (flags.pattern == "seq") config.patterns = {IoPattern::kSequential};
  else if (flags.pattern == "rand") config.patterns = {IoPattern::kRandom};
  else if (flags.pattern == "both") config.patterns = {IoPattern::kSequential, IoPattern::kRandom};
  else return Fail(strata::InvalidArgument("--pattern '{}': expected seq, rand or both", flags.pattern));
  config.runs = flags.runs;
  config.compare_fio = flags.compare_fio;
  config.fio_path = flags.fio_path;
  config.compare_one_dir = flags.compare_one_dir;
  config.sqpoll = flags.sqpoll;
  config.huge_pages = !flags.no_huge_pages;
  if (flags.dest == "host") config.destination = strata::bench::IoDestination::kHost;
  else if (flags.dest == "device") config.destination = strata::bench::IoDestination::kDevice;
  else return Fail(strata::InvalidArgument("--dest '{}': expected host or device", flags.dest));
  config.device_backend = flags.device_backend;
  strata::Result<strata::bench::IoBenchReport> report = strata::bench::RunIoBench(config);
  if (!report.ok()) return Fail(report.status());
  std::fputs(strata::bench::FormatIoBench(*report).c_str(), stdout);
  strata::Status written = WriteJsonFile(flags.json_path, strata::bench::IoBenchJson(*report));
  if (!written.ok()) return Fail(written);
  return 0;
}

struct BenchCommFlags {
  strata::bench::CommBenchConfig config;
  std::vector<std::string> sizes = {"1MiB", "4MiB", "16MiB"};
  std::string json_path;
};

int RunBenchComm(BenchCommFlags flags) {
  flags.config.sizes.clear();
  for (const std::string& text : flags.sizes) {
    strata::Result<size_t> size = strata::ParseSize(text);
    if (!size.ok()) return Fail(strata::InvalidArgument("--sizes: {}", size.status().message()));
    flags.config.sizes.push_back(*size);
  }
  strata::Result<strata::bench::CommBenchReport> report = strata::bench::RunCommBench(flags.config);
  if (!report.ok()) return Fail(report.status());
  if (report->rank != 0) return 0;  // under mpirun: rank 0 reports
  std::fputs(strata::bench::FormatCommBench(*report).c_str(), stdout);
  strata::Status written = WriteJsonFile(flags.json_path, strata::bench::CommBenchJson(*report));
  return written.ok() ? 0 : Fail(written);
}

struct BenchOptimFlags {
  std::string params = "64M";
  std::string dtype = "fp32";
  uint32_t threads = 0;
  uint32_t repetitions = 7;
  std::string states = "memory";
  std::vector<std::string> dirs;
  std::string group_params = "8M";
  std::string ring = "512MiB";
  std::string json_path;
};

int RunBenchOptim(const BenchOptimFlags& flags) {
  strata::bench::OptimBenchConfig config;
  // "64M" parameters: the size suffixes count elements here (M = 2^20).
  strata::Result<size_t> params = strata::ParseSize(flags.params);
  if (!params.ok()) return Fail(strata::InvalidArgument("--params: {}", params.status().message()));
  config.params = *params;
  config.dtype = flags.dtype;
  config.threads = flags.threads;
  config.repetitions = flags.repetitions;
  if (flags.states == "nvme") {
    strata::bench::OptimNvmeBenchConfig nvme{.base = config, .dirs = flags.dirs};
    strata::Result<size_t> group_params = strata::ParseSize(flags.group_params);
    if (!group_params.ok()) return Fail(strata::InvalidArgument("--group-params: {}", group_params.status().message()));
    strata::Result<size_t> ring = strata::ParseSize(flags.ring);
    if (!ring.ok()) return Fail(strata::InvalidArgument("--ring: {}", ring.status().message()));
    nvme.group_params = *group_params;
    nvme.ring_bytes = *ring;
    strata::Result<strata::bench::OptimNvmeBenchReport> report = strata::bench::RunOptimNvmeBench(nvme);
    if (!report.ok()) return Fail(report.status());
    std::fputs(strata::bench::FormatOptimNvmeBench(*report).c_str(), stdout);
    strata::Status written = WriteJsonFile(flags.json_path, strata::bench::OptimNvmeBenchJson(*report));
    return written.ok() ? 0 : Fail(written);
  }
  if (flags.states != "memory") {
    return Fail(strata::InvalidArgument("--states {}: expected memory or nvme", flags.states));
  }
  if (!flags.dirs.empty()) return Fail(strata::InvalidArgument("--dir is for --states nvme"));
  strata::Result<strata::bench::OptimBenchReport> report = strata::bench::RunOptimBench(config);
  if (!report.ok()) return Fail(report.status());
  std::fputs(strata::bench::FormatOptimBench(*report).c_str(), stdout);
  strata::Status written = WriteJsonFile(flags.json_path, strata::bench::OptimBenchJson(*report));
  if (!written.ok()) return Fail(written);
  return 0;
}

struct BenchReplayFlags {
  std::string model = "gpt";
  strata::bench::ReplayBenchConfig config;
  std::string device_budget = "0";
  std::string host_budget = "0";
  bool no_baseline = false;
  std::string json_path;
};

int RunBenchReplay(BenchReplayFlags flags) {
  if (flags.model != "gpt") return Fail(strata::InvalidArgument("--model {}: only gpt is built", flags.model));
  strata::Result<size_t> device = strata::ParseSize(flags.device_budget);
  if (!device.ok()) return Fail(strata::InvalidArgument("--device-budget: {}", device.status().message()));
  strata::Result<size_t> host = strata::ParseSize(flags.host_budget);
  if (!host.ok()) return Fail(strata::InvalidArgument("--host-budget: {}", host.status().message()));
  flags.config.device_budget_bytes = *device;
  flags.config.host_budget_bytes = *host;
  flags.config.baseline = !flags.no_baseline;
  strata::Result<strata::bench::ReplayBenchReport> report = strata::bench::RunReplayBench(flags.config);
  if (!report.ok()) return Fail(report.status());
  std::fputs(strata::bench::FormatReplayBench(*report).c_str(), stdout);
  strata::Status written = WriteJsonFile(flags.json_path, strata::bench::ReplayBenchJson(*report));
  return written.ok() ? 0 : Fail(written);
}

struct PlanFlags {
  std::string model = "gpt";
  strata::offload::ModelShape shape;
  strata::offload::MachineSpec machine;
  std::string hbm = "80GiB";
  std::string dram = "128GiB";
  std::vector<std::string> nvme_dirs;
  std::string nvme_capacity = "0";
  std::string json_path;
};

int RunPlan(PlanFlags flags) {
  if (flags.model != "gpt") return Fail(strata::InvalidArgument("--model {}: only gpt is built", flags.model));
  for (auto [text, out, name] : {std::tuple{&flags.hbm, &flags.machine.hbm_bytes, "--hbm"},
                                 std::tuple{&flags.dram, &flags.machine.dram_bytes, "--dram"},
                                 std::tuple{&flags.nvme_capacity, &flags.machine.nvme_bytes, "--nvme-capacity"}}) {
    strata::Result<size_t> bytes = strata::ParseSize(*text);
    if (!bytes.ok()) return Fail(strata::InvalidArgument("{}: {}", name, bytes.status().message()));
    *out = *bytes;
  }
  // NVMe space: what the directories have free, unless --nvme-capacity says.
  if (flags.machine.nvme_bytes == 0) {
    for (const std::string& dir : flags.nvme_dirs) {
      std::error_code error;
      const std::filesystem::space_info space = std::filesystem::space(dir, error);
      if (error) return Fail(strata::IoError("--nvme {}: {}", dir, error.message()));
      flags.machine.nvme_bytes += space.available;
    }
  }
  strata::Result<strata::offload::CapacityPlan> plan = strata::offload::PlanCapacity(flags.shape, flags.machine);
  if (!plan.ok()) return Fail(plan.status());
  std::fputs(strata::offload::FormatCapacityPlan(*plan).c_str(), stdout);
  strata::Status written = WriteJsonFile(flags.json_path, strata::offload::CapacityPlanJson(*plan));
  return written.ok() ? 0 : Fail(written);
}

struct BenchCheckpointFlags {
  strata::bench::CheckpointBenchConfig config;
  std::string params = "32M";
  std::string json_path;
};

int RunBenchCheckpoint(BenchCheckpointFlags flags) {
  strata::Result<size_t> params = strata::ParseSize(flags.params);  // "32M": a count, as bench optim reads it
  if (!params.ok()) return Fail(strata::InvalidArgument("--params: {}", params.status().message()));
  flags.config.params = *params;
  strata::Result<strata::bench::CheckpointBenchReport> report = strata::bench::RunCheckpointBench(flags.config);
  if (!report.ok()) return Fail(report.status());
  std::fputs(strata::bench::FormatCheckpointBench(*report).c_str(), stdout);
  strata::Status written = WriteJsonFile(flags.json_path, strata::bench::CheckpointBenchJson(*report));
  return written.ok() ? 0 : Fail(written);
}

struct CheckpointFlags {
  std::string path;
  bool json = false;
};

int RunCheckpointInspect(const CheckpointFlags& flags) {
  if (flags.json) {
    strata::Result<strata::offload::CheckpointManifest> manifest = strata::offload::ReadCheckpointManifest(flags.path);
    if (!manifest.ok()) return Fail(manifest.status());
    std::printf("%s\n", manifest->json.c_str());
    return 0;
  }
  strata::Result<std::string> described = strata::offload::DescribeCheckpoint(flags.path);
  if (!described.ok()) return Fail(described.status());
  std::fputs(described->c_str(), stdout);
  return 0;
}

int RunCheckpointVerify(const CheckpointFlags& flags) {
  const auto start = std::chrono::steady_clock::now();
  strata::Result<strata::offload::CheckpointSummary> verified = strata::offload::VerifyCheckpoint(flags.path);
  if (!verified.ok()) return Fail(verified.status());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("OK %s: step %lld, %u files, %.2f MiB, sizes and CRC32C checked in %.3f s (%.2f GB/s)\n",
              verified->path.c_str(), static_cast<long long>(verified->step), verified->files,
              verified->bytes / 1048576.0, seconds, seconds > 0 ? verified->bytes / seconds / 1e9 : 0.0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"strata: heterogeneous-memory offload engine for training large models"};
  app.require_subcommand(1);

  CommonFlags options_flags;
  CLI::App* options_command = app.add_subcommand("options", "print every option with its value, default and meaning");
  AddCommonFlags(options_command, options_flags);

  CommonFlags selftest_flags;
  strata::SelftestConfig selftest;
  std::string nvme_dir = (std::filesystem::temp_directory_path() / "strata-selftest").string();
  std::string json_path;
  CLI::App* selftest_command =
      app.add_subcommand("selftest", "push a GPT-style set of tensors through device, host and NVMe and verify every byte");
  AddCommonFlags(selftest_command, selftest_flags);
  selftest_command->add_option("--layers", selftest.layers, "transformer layers")->capture_default_str();
  selftest_command->add_option("--hidden", selftest.hidden, "hidden size")->capture_default_str();
  selftest_command->add_option("--vocab", selftest.vocab, "vocabulary size")->capture_default_str();
  selftest_command->add_option("--iterations", selftest.iterations, "forward/backward/update passes")->capture_default_str();
  selftest_command->add_option("--seed", selftest.seed, "seed of the byte patterns")->capture_default_str();
  selftest_command->add_option("--device-fraction", selftest.device_fraction,
                               "device budget as a fraction of the model states (0: use device.budget)")->capture_default_str();
  selftest_command->add_option("--host-fraction", selftest.host_fraction,
                               "host budget as a fraction of the model states (0: use host.budget)")->capture_default_str();
  selftest_command->add_option("--nvme-dir", nvme_dir, "directory for the NVMe tier ('' for none)")->capture_default_str();
  selftest_command->add_option("--json", json_path, "also write the report as JSON to this file");

  CLI::App* bench_command = app.add_subcommand("bench", "measure strata against a reference in the same run");
  bench_command->require_subcommand(1);
  BenchIoFlags bench_io;
  CLI::App* bench_io_command = bench_command->add_subcommand(
      "io", "NVMe read/write bandwidth of the io_uring engine, optionally against fio on the same file");
  bench_io_command->add_option("--dir", bench_io.dirs, "directory of a backing file (repeat: one per drive, striped)")
      ->required();
  bench_io_command->add_option("--file-size", bench_io.file_size, "bytes per pass, all dirs together")->capture_default_str();
  bench_io_command->add_option("--block-size", bench_io.block_sizes, "request size(s), comma-separated: a sweep")
      ->delimiter(',')->capture_default_str();
  bench_io_command->add_option("--queue-depth", bench_io.queue_depths, "requests in flight, comma-separated: a sweep")
      ->delimiter(',')->capture_default_str();
  bench_io_command->add_option("--op", bench_io.op, "read, write or both")->capture_default_str();
  bench_io_command->add_option("--pattern", bench_io.pattern, "seq, rand or both")->capture_default_str();
  bench_io_command->add_option("--runs", bench_io.runs, "passes per row (alternating with fio)")->capture_default_str();
  bench_io_command->add_flag("--compare-fio", bench_io.compare_fio, "run fio (io_uring, direct=1) on the same file too");
  bench_io_command->add_option("--fio", bench_io.fio_path, "the fio program")->capture_default_str();
  bench_io_command->add_flag("--compare-one-dir", bench_io.compare_one_dir,
                             "with several --dir: also run on the first one alone");
  bench_io_command->add_flag("--sqpoll", bench_io.sqpoll, "SQPOLL rings (nvme.sqpoll)");
  bench_io_command->add_flag("--no-huge-pages", bench_io.no_huge_pages,
                             "I/O buffers on 4KiB pages, as fio's (host.huge_pages=false)");
  bench_io_command->add_option("--dest", bench_io.dest,
                               "host (pinned memory) or device (through pinned bounce buffers)")->capture_default_str();
  bench_io_command->add_option("--device-backend", bench_io.device_backend,
                               "with --dest device: auto, cuda or emulated (device.backend)")->capture_default_str();
  bench_io_command->add_option("--json", bench_io.json_path, "also write the results as JSON to this file");

  BenchCommFlags bench_comm;
  CLI::App* bench_comm_command = bench_command->add_subcommand(
      "comm", "all-gather and reduce-scatter of chunk-sized messages against the backend's raw collectives");
  bench_comm_command->add_option("--backend", bench_comm.config.backend,
                                 "auto (mpi under mpirun, else loopback), loopback, mpi or nccl (a GPU per rank)")
      ->capture_default_str();
  bench_comm_command->add_flag("--host-buffers", bench_comm.config.host_buffers,
                               "nccl: give strata's communicator host buffers (staged through the GPU)");
  bench_comm_command->add_option("--device-index", bench_comm.config.device_index,
                                 "nccl: the GPU (-1: the local rank under mpirun, else 0)")
      ->capture_default_str();
  bench_comm_command->add_option("--ranks", bench_comm.config.ranks, "loopback: ranks (threads)")->capture_default_str();
  bench_comm_command->add_option("--sizes", bench_comm.sizes, "whole-chunk sizes (fp32), comma separated")
      ->delimiter(',')
      ->capture_default_str();
  bench_comm_command->add_option("--iterations", bench_comm.config.iterations, "timed calls per figure")
      ->capture_default_str();
  bench_comm_command->add_option("--json", bench_comm.json_path, "also write the results as JSON to this file");

  BenchOptimFlags bench_optim;
  CLI::App* bench_optim_command = bench_command->add_subcommand(
      "optim", "CPU AdamW step against the memory-bandwidth bound, or with its states streamed from NVMe");
  bench_optim_command->add_option("--params", bench_optim.params, "parameters (64M = 64 x 2^20)")->capture_default_str();
  bench_optim_command->add_option("--dtype", bench_optim.dtype, "fp32, or bf16 (bf16 params and grads, fp32 master and states)")->capture_default_str();
  bench_optim_command->add_option("--threads", bench_optim.threads, "threads; 0 = every core")->capture_default_str();
  bench_optim_command->add_option("--repetitions", bench_optim.repetitions, "steps timed (median)")->capture_default_str();
  bench_optim_command->add_option("--states", bench_optim.states,
                                  "memory (states in host memory, against a bandwidth bound) or nvme (master and "
                                  "states on NVMe, streamed; against I/O alone and the update alone)")
      ->capture_default_str();
  bench_optim_command->add_option("--dir", bench_optim.dirs, "with --states nvme: a directory on the drive (repeat: striped)");
  bench_optim_command->add_option("--group-params", bench_optim.group_params, "with --states nvme: parameters per chunk group")
      ->capture_default_str();
  bench_optim_command->add_option("--ring", bench_optim.ring, "with --states nvme: host memory for groups in flight")
      ->capture_default_str();
  bench_optim_command->add_option("--json", bench_optim.json_path, "also write the results as JSON to this file");

  BenchReplayFlags bench_replay;
  CLI::App* bench_replay_command = bench_command->add_subcommand(
      "replay", "a GPT's training step replayed with the planned prefetch pipeline, against LRU on demand");
  bench_replay_command->add_option("--model", bench_replay.model, "model family (gpt)")->capture_default_str();
  bench_replay_command->add_option("--layers", bench_replay.config.model.layers, "transformer layers")->capture_default_str();
  bench_replay_command->add_option("--hidden", bench_replay.config.model.hidden, "hidden size")->capture_default_str();
  bench_replay_command->add_option("--vocab", bench_replay.config.model.vocab, "vocabulary")->capture_default_str();
  bench_replay_command->add_option("--seq", bench_replay.config.model.sequence, "sequence length (position embedding rows)")
      ->capture_default_str();
  bench_replay_command->add_option("--device-budget", bench_replay.device_budget,
                                   "device memory for chunks; 0 = a quarter of the model states")->capture_default_str();
  bench_replay_command->add_option("--host-budget", bench_replay.host_budget,
                                   "host memory for chunks; 0 = half of the model states")->capture_default_str();
  bench_replay_command->add_option("--dir", bench_replay.config.dirs,
                                   "NVMe directory (repeat: striped); none = NVMe emulated in memory");
  bench_replay_command->add_option("--pcie-gbps", bench_replay.config.pcie_gbps,
                                   "host<->device copy bandwidth of the emulated device, GB/s per direction")
      ->capture_default_str();
  bench_replay_command->add_option("--compute-ms", bench_replay.config.compute_ms,
                                   "compute per moment (busy work); 0 = 1.5 x its chunks' transfer time")
      ->capture_default_str();
  bench_replay_command->add_option("--batch", bench_replay.config.model.batch, "sequences per step (activations, FLOPs)")
      ->capture_default_str();
  bench_replay_command->add_option("--heads", bench_replay.config.model.heads, "attention heads; 0 = hidden / 64")
      ->capture_default_str();
  bench_replay_command->add_option("--gpu-tflops", bench_replay.config.gpu_tflops,
                                   "compute forward/backward for their FLOPs at this rate; 0 = see --compute-ms")
      ->capture_default_str();
  bench_replay_command->add_option("--cpu-adam-gparams", bench_replay.config.cpu_adam_gparams,
                                   "an update on the CPU takes its parameters / this (G params/s)")
      ->capture_default_str();
  bench_replay_command->add_option("--gpu-adam-gparams", bench_replay.config.gpu_adam_gparams,
                                   "an update on the device takes its parameters / this (G params/s)")
      ->capture_default_str();
  bench_replay_command->add_option("--policy", bench_replay.config.policy, "placement.policy: adaptive or static")
      ->check(CLI::IsMember({"adaptive", "static"}))
      ->capture_default_str();
  bench_replay_command->add_option("--device-params", bench_replay.config.device_params,
                                   "static: share of param and grad chunks kept on the device")
      ->capture_default_str();
  bench_replay_command->add_option("--host-states", bench_replay.config.host_states,
                                   "static: share of optimizer states homed in host memory")
      ->capture_default_str();
  bench_replay_command->add_option("--warmup", bench_replay.config.warmup,
                                   "iterations before the measured ones: the first records, the second calibrates")
      ->capture_default_str();
  bench_replay_command->add_option("--iterations", bench_replay.config.iterations, "measured, after the warm-up")
      ->capture_default_str();
  bench_replay_command->add_option("--ranks", bench_replay.config.ranks,
                                   "data-parallel ranks (threads), each 1/ranks of the optimizer states")
      ->capture_default_str();
  bench_replay_command->add_option("--net-gbps", bench_replay.config.net_gbps,
                                   "with --ranks: the network's bandwidth in GB/s each rank sends at; 0 = unthrottled")
      ->capture_default_str();
  bench_replay_command->add_flag("--shard-params", bench_replay.config.shard_params,
                                 "with --ranks: shard the parameters too (comm.shard_params, ZeRO-3), gathered in "
                                 "forward and backward");
  bench_replay_command->add_flag("--no-baseline", bench_replay.no_baseline, "skip the LRU run");
  bench_replay_command->add_option("--json", bench_replay.json_path, "also write the results as JSON to this file");

  BenchCheckpointFlags bench_checkpoint;
  CLI::App* bench_checkpoint_command = bench_command->add_subcommand(
      "checkpoint", "a checkpoint's save and load bandwidth against bench io's NVMe write and read in the same run");
  bench_checkpoint_command->add_option("--dir", bench_checkpoint.config.dir, "where to save (and the NVMe tier)")
      ->required();
  bench_checkpoint_command->add_option("--params", bench_checkpoint.params, "fp32 parameters (12 bytes each saved)")
      ->capture_default_str();
  bench_checkpoint_command->add_option("--chunk-elems", bench_checkpoint.config.chunk_elems, "elements a chunk")
      ->capture_default_str();
  bench_checkpoint_command->add_flag("--states-on-nvme", bench_checkpoint.config.states_on_nvme,
                                     "keep the optimizer states in the NVMe tier (saved from there)");
  bench_checkpoint_command->add_flag(
      "--no-recycle", [&](int64_t) { bench_checkpoint.config.recycle = false; },
      "every save into new files (CheckpointOptions::recycle off)");
  bench_checkpoint_command->add_option("--runs", bench_checkpoint.config.runs, "saves and loads, and bench io runs")
      ->capture_default_str();
  bench_checkpoint_command->add_option("--json", bench_checkpoint.json_path, "also write the results as JSON");

  PlanFlags plan_flags;
  CLI::App* plan_command =
      app.add_subcommand("plan", "what fits where for a GPT on a machine, the step time to expect and the bottleneck");
  plan_command->add_option("--model", plan_flags.model, "model family (gpt)")->capture_default_str();
  plan_command->add_option("--layers", plan_flags.shape.layers, "transformer layers")->capture_default_str();
  plan_command->add_option("--hidden", plan_flags.shape.hidden, "hidden size")->capture_default_str();
  plan_command->add_option("--vocab", plan_flags.shape.vocab, "vocabulary")->capture_default_str();
  plan_command->add_option("--seq", plan_flags.shape.sequence, "sequence length")->capture_default_str();
  plan_command->add_option("--batch", plan_flags.shape.batch, "micro-batch")->capture_default_str();
  plan_command->add_option("--heads", plan_flags.shape.heads, "attention heads; 0 = hidden / 64")->capture_default_str();
  plan_command->add_option("--hbm", plan_flags.hbm, "GPU memory")->capture_default_str();
  plan_command->add_option("--hbm-reserve", plan_flags.machine.hbm_reserve_fraction,
                           "fraction of HBM kept for the CUDA context and workspace")->capture_default_str();
  plan_command->add_option("--dram", plan_flags.dram, "host memory strata may use for chunks")->capture_default_str();
  plan_command->add_option("--nvme", plan_flags.nvme_dirs, "NVMe directory (repeat); its free space counts");
  plan_command->add_option("--nvme-capacity", plan_flags.nvme_capacity, "NVMe space instead of the free space; 0 = measure")
      ->capture_default_str();
  plan_command->add_option("--pcie-gbps", plan_flags.machine.pcie_gbps, "host<->device GB/s per direction")
      ->capture_default_str();
  plan_command->add_option("--nvme-read-gbps", plan_flags.machine.nvme_read_gbps, "NVMe read GB/s (all drives)")
      ->capture_default_str();
  plan_command->add_option("--nvme-write-gbps", plan_flags.machine.nvme_write_gbps, "NVMe write GB/s (all drives)")
      ->capture_default_str();
  plan_command->add_option("--gpu-tflops", plan_flags.machine.gpu_tflops, "sustained bf16 matmul TFLOPS")
      ->capture_default_str();
  plan_command->add_option("--cpu-adam-gparams", plan_flags.machine.cpu_adam_gparams,
                           "CPU AdamW rate, G params/s (see strata bench optim)")->capture_default_str();
  plan_command->add_option("--gpu-adam-gparams", plan_flags.machine.gpu_adam_gparams, "GPU AdamW rate, G params/s")
      ->capture_default_str();
  plan_command->add_option("--json", plan_flags.json_path, "also write the plan as JSON to this file");

  CheckpointFlags checkpoint_flags;
  CLI::App* checkpoint_command = app.add_subcommand("checkpoint", "look into a checkpoint (offload/checkpoint.h)");
  checkpoint_command->require_subcommand(1);
  CLI::App* checkpoint_inspect = checkpoint_command->add_subcommand(
      "inspect", "what a checkpoint holds: step, ranks, optimizer state, tensors, bytes by chunk kind");
  checkpoint_inspect->add_option("dir", checkpoint_flags.path, "a checkpoint root (its latest) or one checkpoint")
      ->required();
  checkpoint_inspect->add_flag("--json", checkpoint_flags.json, "print the manifest itself");
  CLI::App* checkpoint_verify = checkpoint_command->add_subcommand(
      "verify", "check every file's size and CRC32C against the manifest; exit 1 naming the first damaged file");
  checkpoint_verify->add_option("dir", checkpoint_flags.path, "a checkpoint root (its latest) or one checkpoint")
      ->required();

  app.add_subcommand("version", "print the version");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error) == 0 ? 0 : kExitUsage;
  }

  if (options_command->parsed()) return RunOptions(options_flags);
  if (selftest_command->parsed()) return RunSelftestCommand(selftest_flags, selftest, nvme_dir, json_path);
  if (bench_io_command->parsed()) return RunBenchIo(bench_io);
  if (bench_comm_command->parsed()) return RunBenchComm(bench_comm);
  if (bench_optim_command->parsed()) return RunBenchOptim(bench_optim);
  if (bench_replay_command->parsed()) return RunBenchReplay(bench_replay);
  if (bench_checkpoint_command->parsed()) return RunBenchCheckpoint(bench_checkpoint);
  if (plan_command->parsed()) return RunPlan(plan_flags);
  if (checkpoint_inspect->parsed()) return RunCheckpointInspect(checkpoint_flags);
  if (checkpoint_verify->parsed()) return RunCheckpointVerify(checkpoint_flags);
  std::printf("strata 0.1.0 (CUDA backend: %s)\n",
#ifdef STRATA_WITH_CUDA
              "built"
#else
              "not built"
#endif
  );
  return 0;
}
