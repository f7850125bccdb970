// Fuzz target: a checkpoint's files. A small model's checkpoint is saved
// once; each input's first byte picks the file it replaces — the manifest
// (manifest.json), the root's `latest` pointer, or one chunk file — and
// the checkpoint is then described (`strata checkpoint inspect`), verified
// and loaded into the engine. Seeds: corpus/checkpoint (the saved
// manifest, written by running this target with STRATA_FUZZ_SEED=PATH).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "strata/checkpoint.h"
#include "tests/fuzz/fuzz_util.h"
#include "tests/offload/training/train_model.h"

namespace {

namespace fs = std::filesystem;
using namespace strata;

std::string ReadAll(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The model trained a step and saved under ScratchDir()/root, and every
// file of its checkpoint as saved (restored before each input).
struct Saved {
  offload::Model model;
  fs::path root, dir;
  std::vector<std::pair<fs::path, std::string>> files;  // the manifest first, then `latest`, then chunk files

  Saved() {
    std::mt19937 rng(3);
    for (int l = 0; l < offload::kLayers; ++l) model.Write(l, ChunkKind::kParam, offload::Random(rng, 0.5f));
    for (int l = 0; l < offload::kLayers; ++l) model.Write(l, ChunkKind::kGrad, offload::Random(rng, 0.1f));
    STRATA_CHECK(model.Iteration().ok());
    root = fs::path(fuzz::ScratchDir()) / "root";
    auto saved = offload::SaveCheckpoint(*model.engine, *model.optimizer, root.string());
    STRATA_CHECK(saved.ok(), "{}", saved.status().ToString());
    dir = saved->path;
    files.emplace_back(dir / "manifest.json", ReadAll(dir / "manifest.json"));
    files.emplace_back(root / "latest", ReadAll(root / "latest"));
    for (const fs::directory_entry& entry : fs::recursive_directory_iterator(dir)) {
      if (entry.is_regular_file() && entry.path() != dir / "manifest.json") {
        files.emplace_back(entry.path(), ReadAll(entry.path()));
      }
    }
    std::sort(files.begin() + 2, files.end());  // an input picks the same file in every run
    if (const char* seed = std::getenv("STRATA_FUZZ_SEED")) {
      const std::string manifest = std::string(1, '\0') + files[0].second;
      fuzz::WriteFileOrDie(seed, manifest.data(), manifest.size());
    }
  }
};

Saved& TheCheckpoint() {
  static auto* saved = new Saved();
  return *saved;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Saved& saved = TheCheckpoint();
  if (size == 0) return 0;
  for (const auto& [path, bytes] : saved.files) fuzz::WriteFileOrDie(path.string(), bytes.data(), bytes.size());
  const size_t which = data[0] % saved.files.size();
  const fs::path& replaced = saved.files[which].first;
  fuzz::WriteFileOrDie(replaced.string(), data + 1, size - 1);
  // A refusal names the file it found wrong, or the checkpoint.
  const std::string named = which == 1 ? saved.root.string() : saved.dir.string();
  fuzz::ExpectRefusalNames(offload::DescribeCheckpoint(saved.root.string()).status(), named);
  fuzz::ExpectRefusalNames(offload::VerifyCheckpoint(saved.root.string()).status(), named);
  fuzz::ExpectRefusalNames(
      offload::LoadCheckpoint(*saved.model.engine, *saved.model.optimizer, saved.root.string()).status(), named);
  return 0;
}
