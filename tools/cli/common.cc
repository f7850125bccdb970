#include "tools/cli/common.h"

#include <cstdio>
#include <fstream>

namespace strata::cli {

void AddCommonFlags(CLI::App* command, CommonFlags& flags) {
  command->add_option("--config", flags.config_path, "JSON file of options (see `strata options`)");
  command->add_option("--set", flags.sets, "override one option: --set key=value (repeatable)");
}

Result<Options> LoadOptions(const CommonFlags& flags, Options options) {
  if (!flags.config_path.empty()) STRATA_RETURN_IF_ERROR(ApplyOptionsFile(options, flags.config_path));
  for (const std::string& set : flags.sets) {
    size_t equals = set.find('=');
    if (equals == std::string::npos) {
      return InvalidArgument("--set '{}': expected key=value, e.g. --set device.budget=2GiB", set);
    }
    STRATA_RETURN_IF_ERROR(SetOption(options, set.substr(0, equals), set.substr(equals + 1)));
  }
  STRATA_RETURN_IF_ERROR(ValidateOptions(options));
  return options;
}

int Fail(const Status& status) {
  std::fprintf(stderr, "strata: %s\n", status.ToString().c_str());
  return status.code() == StatusCode::kInvalidArgument ? kExitUsage : kExitFailure;
}

Result<size_t> ParseSizeFlag(const std::string& flag, const std::string& text) {
  Result<size_t> size = ParseSize(text);
  if (!size.ok()) return InvalidArgument("{}: {}", flag, size.status().message());
  return size;
}

namespace {

Status WriteJsonFile(const std::string& path, const std::string& json) {
  if (path.empty()) return Status::Ok();
  std::ofstream out(path);
  out << json << "\n";
  if (!out) return IoError("--json {}: cannot write it", path);
  return Status::Ok();
}

}  // namespace

int PrintReport(const std::string& table, const std::string& json, const std::string& json_path) {
  std::fputs(table.c_str(), stdout);
  Status written = WriteJsonFile(json_path, json);
  return written.ok() ? 0 : Fail(written);
}

}  // namespace strata::cli
