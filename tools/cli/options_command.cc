// strata options [--config FILE] [--set key=value]...
#include <cstdio>
#include <memory>

#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

int RunOptions(const CommonFlags& flags) {
  Result<Options> options = LoadOptions(flags);
  if (!options.ok()) return Fail(options.status());
  auto values = DescribeOptions(*options);
  const auto& docs = OptionDocs();
  std::printf("%-32s %-12s %-12s %s\n", "key", "value", "default", "meaning");
  for (size_t i = 0; i < docs.size(); ++i) {
    std::printf("%-32s %-12s %-12s %s\n", docs[i].key.c_str(), values[i].second.c_str(),
                docs[i].default_value.c_str(), docs[i].description.c_str());
  }
  return 0;
}

}  // namespace

Command AddOptionsCommand(CLI::App& parent) {
  auto flags = std::make_shared<CommonFlags>();
  CLI::App* command = parent.add_subcommand("options", "print every option with its value, default and meaning");
  AddCommonFlags(command, *flags);
  return {command, [flags] { return RunOptions(*flags); }};
}

}  // namespace strata::cli
