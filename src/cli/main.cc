// The `strata` command line: the self-check, the option table, and (in later
// work) the benchmarks and the planner.
//
//   strata selftest [--config FILE] [--set key=value]... [--nvme-dir DIR] [--json FILE]
//   strata options  [--config FILE] [--set key=value]...
//   strata version
//
// Exit status: 0 on success, 1 when a check fails or the engine reports an
// error (printed to stderr), 2 on bad command-line input.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "src/selftest.h"
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
  defaults.chunk_search_min_elems = size_t{1} << 16;
  defaults.chunk_search_max_elems = size_t{1} << 21;
  // Mixed precision, so that all five chunk kinds (fp32 master included) take part.
  defaults.compute_dtype = strata::DType::kBFloat16;
  if (!nvme_dir.empty()) defaults.nvme_dirs = {nvme_dir};
  strata::Result<strata::Options> options = LoadOptions(flags, defaults);
  if (!options.ok()) return Fail(options.status());
  for (const std::string& dir : options->nvme_dirs) {
    std::error_code error;
    std::filesystem::create_directories(dir, error);
    if (error) {
      return Fail(strata::IoError("nvme dir {}: cannot create it: {}", dir, error.message()));
    }
  }
  strata::Result<strata::SelftestReport> report = strata::RunSelftest(config, *options);
  if (!report.ok()) return Fail(report.status());
  std::fputs(strata::FormatSelftestReport(*report).c_str(), stdout);
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << strata::SelftestReportJson(*report) << "\n";
    if (!out) return Fail(strata::IoError("--json {}: cannot write it", json_path));
  }
  return report->mismatches == 0 ? 0 : kExitFailure;
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

  app.add_subcommand("version", "print the version");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error) == 0 ? 0 : kExitUsage;
  }

  if (options_command->parsed()) return RunOptions(options_flags);
  if (selftest_command->parsed()) return RunSelftestCommand(selftest_flags, selftest, nvme_dir, json_path);
  std::printf("strata 0.1.0 (CUDA backend: %s)\n",
#ifdef STRATA_WITH_CUDA
              "built"
#else
              "not built"
#endif
  );
  return 0;
}
