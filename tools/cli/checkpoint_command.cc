// strata checkpoint inspect DIR [--json]
// strata checkpoint verify DIR
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "strata/checkpoint.h"
#include "tools/cli/commands.h"

namespace strata::cli {
namespace {

struct CheckpointFlags {
  std::string path;
  bool json = false;
};

int RunCheckpointInspect(const CheckpointFlags& flags) {
  if (flags.json) {
    Result<offload::CheckpointManifest> manifest = offload::ReadCheckpointManifest(flags.path);
    if (!manifest.ok()) return Fail(manifest.status());
    std::printf("%s\n", manifest->json.c_str());
    return 0;
  }
  Result<std::string> described = offload::DescribeCheckpoint(flags.path);
  if (!described.ok()) return Fail(described.status());
  std::fputs(described->c_str(), stdout);
  return 0;
}

int RunCheckpointVerify(const CheckpointFlags& flags) {
  const auto start = std::chrono::steady_clock::now();
  Result<offload::CheckpointSummary> verified = offload::VerifyCheckpoint(flags.path);
  if (!verified.ok()) return Fail(verified.status());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("OK %s: step %lld, %u files, %.2f MiB, sizes and CRC32C checked in %.3f s (%.2f GB/s)\n",
              verified->path.c_str(), static_cast<long long>(verified->step), verified->files,
              verified->bytes / 1048576.0, seconds, seconds > 0 ? verified->bytes / seconds / 1e9 : 0.0);
  return 0;
}

}  // namespace

std::vector<Command> AddCheckpointCommands(CLI::App& parent) {
  auto flags = std::make_shared<CheckpointFlags>();
  CLI::App* checkpoint = parent.add_subcommand("checkpoint", "look into a checkpoint (strata/checkpoint.h)");
  checkpoint->require_subcommand(1);
  CLI::App* inspect = checkpoint->add_subcommand(
      "inspect", "what a checkpoint holds: step, ranks, optimizer state, tensors, bytes by chunk kind");
  inspect->add_option("dir", flags->path, "a checkpoint root (its latest) or one checkpoint")->required();
  inspect->add_flag("--json", flags->json, "print the manifest itself");
  CLI::App* verify = checkpoint->add_subcommand(
      "verify", "check every file's size and CRC32C against the manifest; exit 1 naming the first damaged file");
  verify->add_option("dir", flags->path, "a checkpoint root (its latest) or one checkpoint")->required();
  return {{inspect, [flags] { return RunCheckpointInspect(*flags); }},
          {verify, [flags] { return RunCheckpointVerify(*flags); }}};
}

}  // namespace strata::cli
