// strata selftest [--config FILE] [--set key=value]... [--nvme-dir DIR] [--json FILE]
#include <filesystem>
#include <memory>
#include <string>

#include "tools/cli/commands.h"
#include "tools/selftest.h"

namespace strata::cli {
namespace {

struct SelftestFlags {
  CommonFlags common;
  SelftestConfig config;
  std::string nvme_dir = (std::filesystem::temp_directory_path() / "strata-selftest").string();
  std::string json_path;
};

// The self-check's defaults: an emulated device unless asked, NVMe in `nvme_dir`.
Options SelftestDefaults(const std::string& nvme_dir) {
  Options defaults;
  // A small model: chunks of 64Ki..2Mi elements, so that many chunks cycle.
  defaults.chunk.search_min_elems = size_t{1} << 16;
  defaults.chunk.search_max_elems = size_t{1} << 21;
  // Mixed precision, so that all five chunk kinds (fp32 master included) take part.
  defaults.compute_dtype = DType::kBFloat16;
  if (!nvme_dir.empty()) defaults.nvme.dirs = {nvme_dir};
  return defaults;
}

int RunSelftestCommand(const SelftestFlags& flags) {
  Result<Options> options = LoadOptions(flags.common, SelftestDefaults(flags.nvme_dir));
  if (!options.ok()) return Fail(options.status());
  for (const std::string& dir : options->nvme.dirs) {
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    if (error) {
      return Fail(IoError("nvme dir {}: cannot create it: {}", dir, error.message()));
    }
  }
  Result<SelftestReport> report = RunSelftest(flags.config, *options);
  const int printed = PrintReport(report, FormatSelftestReport, SelftestReportJson, flags.json_path);
  if (printed != 0) return printed;
  return report->mismatches == 0 ? 0 : kExitFailure;
}

}  // namespace

Command AddSelftestCommand(CLI::App& parent) {
  auto flags = std::make_shared<SelftestFlags>();
  SelftestConfig& config = flags->config;
  CLI::App* command = parent.add_subcommand(
      "selftest", "push a GPT-style set of tensors through device, host and NVMe and verify every byte");
  AddCommonFlags(command, flags->common);
  command->add_option("--layers", config.layers, "transformer layers")->capture_default_str();
  command->add_option("--hidden", config.hidden, "hidden size")->capture_default_str();
  command->add_option("--vocab", config.vocab, "vocabulary size")->capture_default_str();
  command->add_option("--iterations", config.iterations, "forward/backward/update passes")->capture_default_str();
  command->add_option("--seed", config.seed, "seed of the byte patterns")->capture_default_str();
  command->add_option("--device-fraction", config.device_fraction,
                      "device budget as a fraction of the model states (0: use device.budget)")
      ->capture_default_str();
  command->add_option("--host-fraction", config.host_fraction,
                      "host budget as a fraction of the model states (0: use host.budget)")
      ->capture_default_str();
  command->add_option("--nvme-dir", flags->nvme_dir, "directory for the NVMe tier ('' for none)")
      ->capture_default_str();
  command->add_option("--json", flags->json_path, "also write the report as JSON to this file");
  return {command, [flags] { return RunSelftestCommand(*flags); }};
}

}  // namespace strata::cli
