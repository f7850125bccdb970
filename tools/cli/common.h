// What the subcommands of the `strata` CLI share: the exit codes, the
// --config/--set flags, reading a size flag, and writing a failure or a
// report. Each subcommand is a Command (commands.h) that main.cc dispatches.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "strata/options.h"
#include "strata/status.h"

namespace strata::cli {

// 0 is success; 1 a failed check or an engine error; 2 bad command-line input.
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// A subcommand as parsed (`app`), and what to run when it was the one given:
// it returns the exit status. `run` owns the flags `app` writes into.
struct Command {
  CLI::App* app = nullptr;
  std::function<int()> run;
};

// --config FILE and --set key=value (repeatable).
struct CommonFlags {
  std::string config_path;
  std::vector<std::string> sets;
};

void AddCommonFlags(CLI::App* command, CommonFlags& flags);

// `options` (the defaults unless given), then the config file, then each
// --set in order; validated.
Result<Options> LoadOptions(const CommonFlags& flags, Options options = {});

// Prints `status` to stderr; returns kExitUsage for kInvalidArgument, else kExitFailure.
int Fail(const Status& status);

// A size (ParseSize: "2GiB", "64M") given to `flag`; an error names the flag.
Result<size_t> ParseSizeFlag(const std::string& flag, const std::string& text);

// Prints a report's table to stdout and writes its JSON to `json_path` (an
// empty path writes nothing): 0, or Fail's status when the file cannot be written.
int PrintReport(const std::string& table, const std::string& json, const std::string& json_path);

// The same for a report that may be an error: Fail's status if it is.
template <typename Report>
int PrintReport(const Result<Report>& report, std::string (*format)(const Report&),
                std::string (*json)(const Report&), const std::string& json_path) {
  if (!report.ok()) return Fail(report.status());
  return PrintReport(format(*report), json(*report), json_path);
}

}  // namespace strata::cli
