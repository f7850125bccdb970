// What `strata checkpoint inspect` shows of a checkpoint: its manifest, as
// JSON or described.

#include <algorithm>
#include <map>
#include <set>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "offload/persist/checkpoint_internal.h"

namespace strata::offload {
namespace {

namespace fs = std::filesystem;
using checkpoint::json;

// The manifest's files, bytes and dtypes by chunk kind, and in all (the
// moments' dtype is the states' format, optimizer.states).
std::string DescribeFiles(const json& manifest) {
  struct Kind {
    uint32_t files = 0;
    uint64_t bytes = 0;
    std::set<std::string> dtypes;
  };
  std::map<std::string, Kind> kinds;
  uint64_t total = 0;
  for (const json& file : manifest.at("files")) {
    Kind& kind = kinds[file.at("kind").get<std::string>()];
    kind.files++;
    kind.bytes += file.at("bytes").get<uint64_t>();
    kind.dtypes.insert(file.at("dtype").get<std::string>());
    total += file.at("bytes").get<uint64_t>();
  }
  std::string out = fmt::format("  {} tensors, {} files, {:.2f} MiB\n", manifest.at("tensors").size(),
                                manifest.at("files").size(), total / 1048576.0);
  for (const auto& [name, kind] : kinds) {
    out += fmt::format("    {:<12} {:>5} files {:>10.2f} MiB  {}\n", name, kind.files, kind.bytes / 1048576.0,
                       fmt::join(kind.dtypes, ", "));
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
    out += ", no loss scaler";
  } else {
    out += fmt::format(", loss scale {} ({} good steps, {} overflows)", state.at("loss_scaler").at("scale").get<float>(),
                       state.at("loss_scaler").at("good_steps").get<int64_t>(),
                       state.at("loss_scaler").at("overflows").get<int64_t>());
  }
  checkpoint::MomentsFormat states;  // optimizer.states
  for (const json& file : manifest.at("files")) {
    states.Add(file.at("kind").get<std::string>(), file.at("dtype").get<std::string>());
  }
  if (states.format()) out += fmt::format(", {} states", *states.format());
  return out + "\n" + DescribeFiles(manifest);
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
