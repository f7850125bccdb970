// What `strata checkpoint inspect` shows of a checkpoint: its manifest, as
// JSON or described.

#include <algorithm>
#include <map>
#include <vector>

#include <fmt/format.h>

#include "offload/persist/checkpoint_internal.h"

namespace strata::offload {
namespace {

namespace fs = std::filesystem;
using checkpoint::json;

// The manifest's files and bytes by chunk kind, and in all.
std::string DescribeFiles(const json& manifest) {
  std::map<std::string, std::pair<uint32_t, uint64_t>> kinds;  // files and bytes
  uint64_t total = 0;
  for (const json& file : manifest.at("files")) {
    auto& [files, bytes] = kinds[file.at("kind").get<std::string>()];
    files++;
    bytes += file.at("bytes").get<uint64_t>();
    total += file.at("bytes").get<uint64_t>();
  }
  std::string out = fmt::format("  {} tensors, {} files, {:.2f} MiB\n", manifest.at("tensors").size(),
                                manifest.at("files").size(), total / 1048576.0);
  for (const auto& [kind, counted] : kinds) {
    out += fmt::format("    {:<12} {:>5} files {:>10.2f} MiB\n", kind, counted.first, counted.second / 1048576.0);
  }
  return out;
}

std::string Describe(const fs::path& dir, const json& manifest) {
  const json& state = manifest.at("optimizer");
  std::string out = fmt::format("checkpoint {}\n", dir.string());
  out += fmt::format("  step {}, saved by {} rank(s), {} of version {}\n", manifest.at("step").get<int64_t>(),
                     manifest.at("world_size").get<int>(), checkpoint::kFormat, checkpoint::kVersion);
  const int64_t taken = state.at("steps_taken").get<int64_t>();
  out += fmt::format("  optimizer: {} steps taken", taken);
  if (state.contains("tensor_steps")) {
    const auto counts = state.at("tensor_steps").get<std::vector<int64_t>>();
    const auto behind = std::count_if(counts.begin(), counts.end(), [&](int64_t c) { return c < taken; });
    if (behind > 0) out += fmt::format(" ({} tensor(s) left out of some)", behind);
  }
  if (state.at("loss_scaler").is_null()) {
    out += ", no loss scaler\n";
  } else {
    out += fmt::format(", loss scale {} ({} good steps, {} overflows)\n",
                       state.at("loss_scaler").at("scale").get<float>(),
                       state.at("loss_scaler").at("good_steps").get<int64_t>(),
                       state.at("loss_scaler").at("overflows").get<int64_t>());
  }
  return out + DescribeFiles(manifest);
}

}  // namespace

Result<CheckpointManifest> ReadCheckpointManifest(const std::string& path, FileSystem& files) {
  STRATA_ASSIGN_OR_RETURN(fs::path dir, checkpoint::Resolve(files, path, nullptr));
  return checkpoint::Guarded(dir, [&]() -> Result<CheckpointManifest> {
    STRATA_ASSIGN_OR_RETURN(json manifest, checkpoint::ReadManifest(files, dir));
    return CheckpointManifest{dir.string(), manifest.dump(1)};
  });
}

Result<std::string> DescribeCheckpoint(const std::string& path, FileSystem& files) {
  STRATA_ASSIGN_OR_RETURN(fs::path dir, checkpoint::Resolve(files, path, nullptr));
  return checkpoint::Guarded(dir, [&]() -> Result<std::string> {
    STRATA_ASSIGN_OR_RETURN(json manifest, checkpoint::ReadManifest(files, dir));
    return Describe(dir, manifest);
  });
}

}  // namespace strata::offload
