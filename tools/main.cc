// The `strata` command line: the self-check, the option table, the
// benchmarks, the capacity planner and the checkpoint tools, one file per
// subcommand in tools/cli/ (`strata --help` lists them, `strata X --help`
// their flags).
//
// Exit status: 0 on success, 1 when a check fails or the engine reports an
// error (printed to stderr), 2 on bad command-line input.
#include <cstdio>
#include <vector>

#include <CLI/CLI.hpp>

#include "tools/cli/commands.h"

namespace {

using strata::cli::Command;

int PrintVersion() {
  std::printf("strata %s (CUDA backend: %s)\n", STRATA_VERSION,
#ifdef STRATA_WITH_CUDA
              "built"
#else
              "not built"
#endif
  );
  return 0;
}

// Every subcommand, in the order `strata --help` lists them.
std::vector<Command> AddCommands(CLI::App& app) {
  using namespace strata::cli;
  std::vector<Command> commands = {AddOptionsCommand(app), AddSelftestCommand(app)};
  CLI::App* bench = app.add_subcommand("bench", "measure strata against a reference in the same run");
  bench->require_subcommand(1);
  for (auto add : {AddBenchIoCommand, AddBenchCommCommand, AddBenchOptimCommand, AddBenchReplayCommand,
                   AddBenchCheckpointCommand}) {
    commands.push_back(add(*bench));
  }
  commands.push_back(AddPlanCommand(app));
  for (Command& command : AddCheckpointCommands(app)) commands.push_back(std::move(command));
  commands.push_back({app.add_subcommand("version", "print the version"), PrintVersion});
  return commands;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"strata: heterogeneous-memory offload engine for training large models"};
  app.require_subcommand(1);
  const std::vector<Command> commands = AddCommands(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    return app.exit(error) == 0 ? 0 : strata::cli::kExitUsage;
  }
  for (const Command& command : commands) {
    if (command.app->parsed()) return command.run();
  }
  return 0;
}
