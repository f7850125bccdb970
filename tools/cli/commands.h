// The subcommands of the `strata` CLI, one file each. Every Add* registers a
// subcommand (its flags, help text and defaults) under `parent` and returns
// it with what to run; main.cc parses and runs the one given.
#pragma once

#include <vector>

#include "tools/cli/common.h"

namespace strata::cli {

// strata options: every option with its value, default and meaning.
Command AddOptionsCommand(CLI::App& parent);
// strata selftest: tools/selftest.h over device, host and NVMe.
Command AddSelftestCommand(CLI::App& parent);
// strata bench io|comm|optim|replay|checkpoint: the programs of benchmarks/.
Command AddBenchIoCommand(CLI::App& parent);
Command AddBenchCommCommand(CLI::App& parent);
Command AddBenchOptimCommand(CLI::App& parent);
Command AddBenchReplayCommand(CLI::App& parent);
Command AddBenchCheckpointCommand(CLI::App& parent);
// strata plan: offload/workloads/capacity_plan.h for a GPT on a machine.
Command AddPlanCommand(CLI::App& parent);
// strata checkpoint inspect|verify: the `checkpoint` group and its two commands.
std::vector<Command> AddCheckpointCommands(CLI::App& parent);

}  // namespace strata::cli
