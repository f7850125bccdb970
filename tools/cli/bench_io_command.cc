// strata bench io --dir DIR [--dir DIR]... [--file-size 2GiB] [--block-size 1MiB,4MiB]
//                 [--queue-depth 8,32] [--op read|write|both] [--pattern seq|rand|both]
//                 [--runs 3] [--compare-fio] [--compare-one-dir] [--sqpoll] [--no-huge-pages]
//                 [--dest host|device] [--device-backend auto|cuda|emulated] [--json FILE]
#include <memory>
#include <string>
#include <vector>

#include "benchmarks/io_bench.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

using bench::IoDestination;
using bench::IoOp;
using bench::IoPattern;

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

// --op, --pattern and --dest from their words.
Status ParseIoChoices(const BenchIoFlags& flags, bench::IoBenchConfig& config) {
  if (flags.op == "read") config.ops = {IoOp::kRead};
  else if (flags.op == "write") config.ops = {IoOp::kWrite};
  else if (flags.op == "both") config.ops = {IoOp::kWrite, IoOp::kRead};
  else return InvalidArgument("--op '{}': expected read, write or both", flags.op);
  if (flags.pattern == "seq") config.patterns = {IoPattern::kSequential};
  else if (flags.pattern == "rand") config.patterns = {IoPattern::kRandom};
  else if (flags.pattern == "both") config.patterns = {IoPattern::kSequential, IoPattern::kRandom};
  else return InvalidArgument("--pattern '{}': expected seq, rand or both", flags.pattern);
  if (flags.dest == "host") config.destination = IoDestination::kHost;
  else if (flags.dest == "device") config.destination = IoDestination::kDevice;
  else return InvalidArgument("--dest '{}': expected host or device", flags.dest);
  return Status::Ok();
}

Result<bench::IoBenchConfig> IoBenchConfigOf(const BenchIoFlags& flags) {
  bench::IoBenchConfig config;
  config.dirs = flags.dirs;
  STRATA_ASSIGN_OR_RETURN(config.file_size_bytes, ParseSizeFlag("--file-size", flags.file_size));
  config.block_sizes_bytes.clear();
  for (const std::string& text : flags.block_sizes) {
    STRATA_ASSIGN_OR_RETURN(config.block_sizes_bytes.emplace_back(), ParseSizeFlag("--block-size", text));
  }
  config.queue_depths = flags.queue_depths;
  STRATA_RETURN_IF_ERROR(ParseIoChoices(flags, config));
  config.runs = flags.runs;
  config.compare_fio = flags.compare_fio;
  config.fio_path = flags.fio_path;
  config.compare_one_dir = flags.compare_one_dir;
  config.sqpoll = flags.sqpoll;
  config.huge_pages = !flags.no_huge_pages;
  config.device_backend = flags.device_backend;
  return config;
}

int RunBenchIo(const BenchIoFlags& flags) {
  Result<bench::IoBenchConfig> config = IoBenchConfigOf(flags);
  if (!config.ok()) return Fail(config.status());
  return PrintReport(bench::RunIoBench(*config), bench::FormatIoBench, bench::IoBenchJson, flags.json_path);
}

}  // namespace

Command AddBenchIoCommand(CLI::App& parent) {
  auto flags = std::make_shared<BenchIoFlags>();
  CLI::App* command = parent.add_subcommand(
      "io", "NVMe read/write bandwidth of the io_uring engine, optionally against fio on the same file");
  command->add_option("--dir", flags->dirs, "directory of a backing file (repeat: one per drive, striped)")
      ->required();
  command->add_option("--file-size", flags->file_size, "bytes per pass, all dirs together")->capture_default_str();
  command->add_option("--block-size", flags->block_sizes, "request size(s), comma-separated: a sweep")
      ->delimiter(',')->capture_default_str();
  command->add_option("--queue-depth", flags->queue_depths, "requests in flight, comma-separated: a sweep")
      ->delimiter(',')->capture_default_str();
  command->add_option("--op", flags->op, "read, write or both")->capture_default_str();
  command->add_option("--pattern", flags->pattern, "seq, rand or both")->capture_default_str();
  command->add_option("--runs", flags->runs, "passes per row (alternating with fio)")->capture_default_str();
  command->add_flag("--compare-fio", flags->compare_fio, "run fio (io_uring, direct=1) on the same file too");
  command->add_option("--fio", flags->fio_path, "the fio program")->capture_default_str();
  command->add_flag("--compare-one-dir", flags->compare_one_dir, "with several --dir: also run on the first one alone");
  command->add_flag("--sqpoll", flags->sqpoll, "SQPOLL rings (nvme.sqpoll)");
  command->add_flag("--no-huge-pages", flags->no_huge_pages,
                    "I/O buffers on 4KiB pages, as fio's (host.huge_pages=false)");
  command->add_option("--dest", flags->dest, "host (pinned memory) or device (through pinned bounce buffers)")
      ->capture_default_str();
  command->add_option("--device-backend", flags->device_backend,
                      "with --dest device: auto, cuda or emulated (device.backend)")->capture_default_str();
  command->add_option("--json", flags->json_path, "also write the results as JSON to this file");
  return {command, [flags] { return RunBenchIo(*flags); }};
}

}  // namespace strata::cli
