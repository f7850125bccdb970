// A checkpoint's names on disk and its manifest: written as a save begins,
// read and checked by a load, a verification or an inspection.

#include <algorithm>

#include <fmt/format.h>

#include "offload/persist/checkpoint_internal.h"
#include "strata/options.h"

namespace strata::offload::checkpoint {

// Note [Checkpoint layout on disk]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under a root directory:
//   step-00000010/manifest.json      what the checkpoint holds (below)
//   step-00000010/rank0/chunk-7.bin  chunk 7's bytes (ChunkInfo::used_bytes), as the engine holds them
//   step-00000010/rank1/chunk-9.bin  data parallel: rank 1's shard of a group's master or moments
//   latest                           "step-00000010": the newest complete checkpoint
//   .spare/                          chunk files of removed checkpoints (Note [Recycled chunk files])
// A checkpoint holds every chunk but the gradients and the transient
// (gathered) param chunks: the parameters, the fp32 masters and the
// optimizer moments, with the optimizer's step counts and the loss scaler's
// state. Data parallel, each rank writes its shards into rank<r>/, rank 0
// the whole chunks too (every rank holds the same). The manifest (JSON)
// names the format and version, the step, the world size, the optimizer
// state (steps taken, each tensor's own count by tensor id -- Note [Step
// counts per tensor] in optim/optimizer.cc; a manifest saved before counts
// were per tensor has none, and loads every tensor at the steps taken -- and
// the loss scaler, and each param group's hyperparameters -- absent from
// older manifests, which load with the config's), the options, the layout's chunk size (searched from the
// budgets unless chunk.size_elems is set; absent from older manifests), the
// registered tensors (name, shape, dtype, trainable, and the param group
// when not 0, so that older manifests read as all in group 0), and for every file its chunk (id, kind, dtype, group, rank,
// shard offset), size and CRC32C. Every file it lists lies in a rank's
// directory of the checkpoint: a manifest that names another path is
// Corruption. Hidden names (a leading dot) are a save's temporaries:
// .step-<N>.tmp-<token> (a save in progress), .step-<N>.old-<pid> (Note
// [Publishing a checkpoint]), .step-<N>.pruned-<pid>, .latest.tmp-<pid>.

std::string StepName(int64_t step) { return fmt::format("step-{:08}", step); }

std::optional<int64_t> StepOf(const std::string& name) {
  if (name.size() < 13 || name.size() > 23 || name.rfind("step-", 0) != 0) return std::nullopt;  // 8 to 18 digits
  if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
  return std::stoll(name.substr(5));
}

bool Saved(const ChunkInfo& chunk) { return chunk.kind != ChunkKind::kGrad && !chunk.transient; }

json TensorsJson(const std::vector<TensorSpec>& tensors) {
  json out = json::array();
  for (const TensorSpec& t : tensors) {
    json tensor = {{"name", t.name}, {"shape", t.shape}, {"dtype", DTypeName(t.dtype)}, {"trainable", t.trainable}};
    if (t.trainable && t.param_group != 0) tensor["param_group"] = t.param_group;  // absent: group 0
    out.push_back(std::move(tensor));
  }
  return out;
}

json GroupJson(const optim::GroupHyperparams& g) {
  return {{"lr", g.lr},
          {"beta1", g.beta1},
          {"beta2", g.beta2},
          {"eps", g.eps},
          {"weight_decay", g.weight_decay},
          {"momentum", g.momentum},
          {"dampening", g.dampening},
          {"nesterov", g.nesterov}};
}

optim::GroupHyperparams GroupOf(const json& saved) {
  return {.lr = saved.at("lr").get<double>(),
          .beta1 = saved.at("beta1").get<double>(),
          .beta2 = saved.at("beta2").get<double>(),
          .eps = saved.at("eps").get<double>(),
          .weight_decay = saved.at("weight_decay").get<double>(),
          .momentum = saved.at("momentum").get<double>(),
          .dampening = saved.at("dampening").get<double>(),
          .nesterov = saved.at("nesterov").get<bool>()};
}

json ManifestHead(const Engine& engine, const optim::Optimizer& optimizer) {
  json scaler = nullptr;
  if (const optim::LossScaler* s = optimizer.scaler()) {
    scaler = {{"scale", s->scale()}, {"good_steps", s->good_steps()}, {"overflows", s->overflows()}};
  }
  json groups = json::array();
  for (uint32_t g = 0; g < optimizer.num_groups(); ++g) groups.push_back(GroupJson(optimizer.group(g)));
  json described = json::object();
  for (const auto& [key, value] : DescribeOptions(engine.options())) described[key] = value;
  return {{"format", kFormat},
          {"version", kVersion},
          {"step", optimizer.steps_taken()},
          {"world_size", engine.world_size()},
          {"optimizer",
           {{"steps_taken", optimizer.steps_taken()},
            {"tensor_steps", optimizer.AllTensorSteps(engine.tensors().size())},
            {"param_groups", groups},
            {"loss_scaler", scaler}}},
          {"options", described},
          {"layout", {{"chunk_size_elems", engine.layout().chunk_size_elems}}},
          {"tensors", TensorsJson(engine.tensors())}};
}

namespace {

// Corruption unless every file `manifest` lists lies inside the checkpoint, under its rank's directory.
Status CheckFilePaths(const json& manifest, const std::string& where) {
  for (const json& file : manifest.at("files")) {
    const std::string path = file.at("path").get<std::string>();
    const size_t slash = path.find('/');
    if (slash == std::string::npos || path.rfind("rank", 0) != 0 || path.find("..") != std::string::npos ||
        path.find('/', slash + 1) != std::string::npos) {
      return Corruption("checkpoint: {} lists '{}', not a file of a rank's directory", where, path);
    }
  }
  return Status::Ok();
}

}  // namespace

Result<json> ReadManifest(FileSystem& files, const fs::path& dir) {
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(files, dir / kManifest));
  json manifest = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (manifest.is_discarded() || !manifest.is_object()) {
    return Corruption("checkpoint: {} is not a JSON object", (dir / kManifest).string());
  }
  const std::string where = (dir / kManifest).string();
  for (const char* key : {"format", "version", "step", "world_size", "files", "tensors", "optimizer"}) {
    if (!manifest.contains(key)) return Corruption("checkpoint: {} lacks '{}'", where, key);
  }
  if (manifest.at("format") != kFormat || manifest.at("version") != kVersion) {
    return InvalidArgument("checkpoint: {} is not a {} of version {} (format {}, version {})", where, kFormat, kVersion,
                           manifest.at("format").dump(), manifest.at("version").dump());
  }
  STRATA_RETURN_IF_ERROR(CheckFilePaths(manifest, where));
  return manifest;
}

std::vector<fs::path> CheckpointsUnder(FileSystem& files, const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> found;
  for (const DirectoryEntry& entry : ListOrNone(files, root)) {
    if (std::optional<int64_t> step = StepOf(entry.name); step && entry.directory) {
      found.emplace_back(*step, root / entry.name);
    }
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<fs::path> paths;
  for (auto& [step, path] : found) paths.push_back(std::move(path));
  return paths;
}

std::string AsidePrefix(const std::string& name) { return fmt::format(".{}.old-", name); }

std::optional<fs::path> FindAside(FileSystem& files, const fs::path& root, const std::string& name) {
  if (files.Exists((root / name).string())) return std::nullopt;
  for (const DirectoryEntry& entry : ListOrNone(files, root)) {
    if (entry.name.rfind(AsidePrefix(name), 0) == 0 && files.Exists((root / entry.name / kManifest).string())) {
      return root / entry.name;
    }
  }
  return std::nullopt;
}

Result<fs::path> Resolve(FileSystem& files, const fs::path& path, std::optional<fs::path>* root) {
  if (files.Exists((path / kManifest).string())) return path;
  if (!files.Exists((path / kLatest).string())) {
    return IoError("checkpoint: {} holds neither a checkpoint ({}) nor a root's pointer to one ({})", path.string(),
                   kManifest, kLatest);
  }
  STRATA_ASSIGN_OR_RETURN(std::string name, ReadText(files, path / kLatest));
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  if (!StepOf(name)) return Corruption("checkpoint: {} names '{}', not a checkpoint", (path / kLatest).string(), name);
  if (root != nullptr) *root = path;
  // A re-save that crashed between its two renames (no RENAME_EXCHANGE) left the old one aside.
  if (std::optional<fs::path> aside = FindAside(files, path, name)) return *aside;
  return path / name;
}

}  // namespace strata::offload::checkpoint
