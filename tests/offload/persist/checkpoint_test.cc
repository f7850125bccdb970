// Checkpoints: save and load through the whole stack, crash safety, damage.
#include "strata/checkpoint.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <future>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "tests/offload/training/train_model.h"
#include "tests/test_util.h"

namespace strata::offload {
namespace {

namespace fs = std::filesystem;
using testing::ScratchDir;

std::vector<float> Grad(int layer, int step) {
  std::mt19937 rng(static_cast<uint32_t>(100 * layer + step));
  return Random(rng, 0.1f);
}

// Every layer's initial parameters, the same for every model.
void Initialize(Model& model) {
  std::mt19937 rng(11);
  for (int l = 0; l < kLayers; ++l) model.Write(l, ChunkKind::kParam, Random(rng, 0.5f));
}

// Steps [from, to) with each step's own gradients.
void Train(Model& model, int from, int to) {
  for (int step = from; step < to; ++step) {
    for (int l = 0; l < kLayers; ++l) model.Write(l, ChunkKind::kGrad, Grad(l, step));
    ASSERT_OK(model.Iteration().status());
  }
}

// Every layer's parameters and moments.
std::vector<std::vector<float>> State(Model& model) {
  std::vector<std::vector<float>> state;
  for (int l = 0; l < kLayers; ++l) {
    for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kExpAvg, ChunkKind::kExpAvgSq}) {
      state.push_back(model.Read(l, kind));
    }
  }
  return state;
}

// Initializes `model`, trains a step, saves it under `root` (`at_one`: the
// state saved), and trains a second step.
void SaveStepOneThenTrainTwo(Model& model, const std::string& root, std::vector<std::vector<float>>& at_one) {
  Initialize(model);
  Train(model, 0, 1);
  ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, root).status());
  at_one = State(model);
  Train(model, 1, 2);
}

std::vector<std::string> Entries(const std::string& root) {
  std::vector<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(root)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

std::string Latest(const std::string& root) {
  std::ifstream in(fs::path(root) / "latest");
  std::string name;
  in >> name;
  return name;
}

// 4 steps, save, 4 more: the same as a fresh engine that loads the
// checkpoint and runs the 4 more, bit for bit (fp32, AdamW, optimizer
// states partly on NVMe when saved).
TEST(CheckpointTest, ResumingIsBitExactWithStatesOnNvme) {
  ScratchDir dir("ckpt");
  Model first;
  Initialize(first);
  Train(first, 0, 4);
  bool on_nvme = false;
  for (const ChunkInfo& c : first.engine->chunks()) {
    on_nvme = on_nvme || (IsOptimizerState(c.kind) && *first.engine->ChunkTier(c.id) == Tier::kNvme);
  }
  ASSERT_TRUE(on_nvme) << "the test means to save states from NVMe";
  ASSERT_OK_AND_ASSIGN(CheckpointSummary saved, SaveCheckpoint(*first.engine, *first.optimizer, dir.path()));
  EXPECT_EQ(saved.step, 4);
  EXPECT_EQ(saved.path, (fs::path(dir.path()) / "step-00000004").string());
  EXPECT_EQ(Latest(dir.path()), "step-00000004");
  // Six layers' params and two moments, and the frozen layer's params.
  EXPECT_EQ(saved.files, 3u * kLayers + 1);
  ASSERT_OK_AND_ASSIGN(std::string described, DescribeCheckpoint(dir.path()));  // strata checkpoint inspect
  for (const char* expected : {"step 4, saved by 1 rank(s)", "4 steps taken, no loss scaler", "7 tensors, 19 files",
                               "exp_avg_sq       6 files", "MiB  fp32\n"}) {
    EXPECT_NE(described.find(expected), std::string::npos) << expected << " in\n" << described;
  }
  ASSERT_OK_AND_ASSIGN(CheckpointManifest manifest, ReadCheckpointManifest(dir.path()));
  EXPECT_EQ(manifest.path, saved.path);
  EXPECT_NE(manifest.json.find("\"crc32c\""), std::string::npos);
  ASSERT_OK_AND_ASSIGN(CheckpointSummary verified, VerifyCheckpoint(dir.path()));  // strata checkpoint verify
  EXPECT_EQ(verified.bytes, saved.bytes);
  Train(first, 4, 8);

  Model second;
  ASSERT_OK_AND_ASSIGN(CheckpointSummary loaded, LoadCheckpoint(*second.engine, *second.optimizer, dir.path()));
  EXPECT_EQ(loaded.step, 4);
  EXPECT_EQ(loaded.bytes, saved.bytes);
  EXPECT_EQ(second.optimizer->steps_taken(), 4);
  Train(second, 4, 8);
  EXPECT_EQ(second.optimizer->steps_taken(), 8);
  EXPECT_EQ(State(second), State(first));
}

// A flipped byte or a cut file is Corruption naming the file; asked to, the
// loader falls back to the checkpoint before, and says what it skipped.
TEST(CheckpointTest, DamageIsCorruptionNamingTheFileAndFallBackLoadsTheOneBefore) {
  ScratchDir dir("ckpt");
  Model model;
  std::vector<std::vector<float>> at_one;
  ASSERT_NO_FATAL_FAILURE(SaveStepOneThenTrainTwo(model, dir.path(), at_one));
  ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, dir.path()).status());
  const fs::path damaged = fs::path(dir.path()) / "step-00000002" / "rank0" / "chunk-0.bin";
  {
    std::fstream file(damaged, std::ios::in | std::ios::out | std::ios::binary);
    file.seekp(100);
    file.put('\x5a');
  }
  EXPECT_EQ(VerifyCheckpoint(dir.path()).status().code(), StatusCode::kCorruption);
  Model fresh;
  Result<CheckpointSummary> strict = LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir.path());
  ASSERT_EQ(strict.status().code(), StatusCode::kCorruption) << strict.status().ToString();
  EXPECT_NE(strict.status().message().find(damaged.string()), std::string::npos) << strict.status().ToString();
  EXPECT_NE(strict.status().message().find("CRC32C"), std::string::npos) << strict.status().ToString();

  ASSERT_OK_AND_ASSIGN(CheckpointSummary fell_back,
                       LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir.path(), {.fall_back = true}));
  EXPECT_EQ(fell_back.step, 1);
  ASSERT_EQ(fell_back.skipped.size(), 1u);
  EXPECT_NE(fell_back.skipped[0].find("chunk-0.bin"), std::string::npos) << fell_back.skipped[0];
  EXPECT_EQ(fresh.optimizer->steps_taken(), 1);
  EXPECT_EQ(State(fresh), at_one);

  fs::resize_file(damaged, 1000);  // cut short
  const Status cut = VerifyCheckpoint((fs::path(dir.path()) / "step-00000002").string()).status();
  EXPECT_EQ(cut.code(), StatusCode::kCorruption) << cut.ToString();
  EXPECT_NE(cut.message().find("is 1000 bytes"), std::string::npos) << cut.ToString();
  ASSERT_OK(VerifyCheckpoint((fs::path(dir.path()) / "step-00000001").string()).status());
}

// A save that fails part way (an NVMe read, a full disk, a failed flush) leaves the last
// published checkpoint as it was, `latest` naming it, and no temporary.
TEST(CheckpointTest, AFailedSaveLeavesThePreviousCheckpointIntact) {
  ScratchDir dir("ckpt");
  Model model;
  std::vector<std::vector<float>> at_one;
  ASSERT_NO_FATAL_FAILURE(SaveStepOneThenTrainTwo(model, dir.path(), at_one));

  model.faults->FailReads(EIO);  // the first state read from NVMe
  const Status unreadable = SaveCheckpoint(*model.engine, *model.optimizer, dir.path()).status();
  EXPECT_EQ(unreadable.code(), StatusCode::kIoError) << unreadable.ToString();

  // A file-size limit below a chunk file: the write fails as on a full disk
  // (EFBIG).
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  rlimit small = before;
  small.rlim_cur = 8192;
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const Status full = SaveCheckpoint(*model.engine, *model.optimizer, dir.path()).status();
  ::setrlimit(RLIMIT_FSIZE, &before);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(full.code(), StatusCode::kIoError) << full.ToString();
  EXPECT_NE(full.message().find("chunk-"), std::string::npos) << full.ToString();

  // A disk that fills (ENOSPC), and a flush that fails (EIO), through the file system seam.
  FaultInjectingFileSystem files(PosixFileSystem());
  files.FailWrites(ENOSPC, 1, /*after=*/1);
  const Status no_space = SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {}, nullptr, files).status();
  EXPECT_EQ(no_space.code(), StatusCode::kIoError) << no_space.ToString();
  EXPECT_NE(no_space.message().find("No space left on device"), std::string::npos) << no_space.ToString();
  EXPECT_NE(no_space.message().find("chunk-"), std::string::npos) << no_space.ToString();
  files.FailSyncs(EIO);
  const Status unflushed = SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {}, nullptr, files).status();
  EXPECT_EQ(unflushed.code(), StatusCode::kIoError) << unflushed.ToString();
  EXPECT_NE(unflushed.message().find("flushing"), std::string::npos) << unflushed.ToString();

  EXPECT_EQ(Entries(dir.path()), (std::vector<std::string>{"latest", "step-00000001"}));
  EXPECT_EQ(Latest(dir.path()), "step-00000001");
  Model fresh;
  ASSERT_OK(LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir.path()).status());
  EXPECT_EQ(State(fresh), at_one);
}

// A model saved at step 1 and trained on, and a file system to inject faults through.
class CheckpointFaultTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_NO_FATAL_FAILURE(SaveStepOneThenTrainTwo(model_, dir_.path(), at_one_)); }

  ScratchDir dir_{"ckpt"};
  Model model_;
  std::vector<std::vector<float>> at_one_;  // the state saved
  FaultInjectingFileSystem files_{PosixFileSystem()};
};

// A write the drive cut short or corrupted without saying so is published,
// and found by its CRC32C: VerifyCheckpoint says Corruption, and a load
// that falls back takes the checkpoint before.
TEST_F(CheckpointFaultTest, AWriteCutShortOrCorruptedIsFoundAndALoadFallsBack) {
  for (bool cut : {true, false}) {
    if (cut) {
      files_.ShortWrites(1, /*after=*/1);
    } else {
      files_.CorruptWrites(1, /*after=*/1);
    }
    ASSERT_OK(SaveCheckpoint(*model_.engine, *model_.optimizer, dir_.path(), {}, nullptr, files_).status());
    const Status verified = VerifyCheckpoint(dir_.path()).status();
    EXPECT_EQ(verified.code(), StatusCode::kCorruption) << verified.ToString();
    EXPECT_NE(verified.message().find("CRC32C"), std::string::npos) << verified.ToString();
    Model fresh;
    ASSERT_OK_AND_ASSIGN(CheckpointSummary loaded,
                         LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir_.path(), {.fall_back = true}));
    EXPECT_EQ(loaded.step, 1) << "cut " << cut;
    EXPECT_EQ(State(fresh), at_one_);
  }
}

// A load whose chunk file read fails, comes back corrupted or ends early
// fails: IoError naming the cause, or Corruption.
TEST_F(CheckpointFaultTest, AChunkFileThatCannotBeReadWholeFailsTheLoad) {
  Model fresh;
  const auto load = [&] { return LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir_.path(), {}, nullptr, files_); };
  files_.FailReads(EIO, 1, /*after=*/2);  // after `latest` and the manifest
  const Status unreadable = load().status();
  EXPECT_EQ(unreadable.code(), StatusCode::kIoError) << unreadable.ToString();
  EXPECT_NE(unreadable.message().find("Input/output error"), std::string::npos) << unreadable.ToString();
  files_.CorruptReads(1, /*after=*/2);
  const Status corrupted = load().status();
  EXPECT_EQ(corrupted.code(), StatusCode::kCorruption) << corrupted.ToString();
  EXPECT_NE(corrupted.message().find("CRC32C"), std::string::npos) << corrupted.ToString();
  files_.ShortReads(1, /*after=*/2);
  const Status cut = load().status();
  EXPECT_EQ(cut.code(), StatusCode::kCorruption) << cut.ToString();
  EXPECT_NE(cut.message().find("ended at byte"), std::string::npos) << cut.ToString();
  ASSERT_OK(load().status());
  EXPECT_EQ(State(fresh), at_one_);
}

// keep_last removes the oldest once the new one is published (its files
// kept as spares for the next save); a step saved again replaces its
// checkpoint; temporaries a crashed save left are cleared.
TEST(CheckpointTest, KeepLastAndResavingAStep) {
  ScratchDir dir("ckpt");
  Model model;
  Initialize(model);
  fs::create_directories(fs::path(dir.path()) / ".step-00000009.tmp-12345" / "rank0");  // a crashed save's
  for (int step = 0; step < 3; ++step) {
    Train(model, step, step + 1);
    ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {.keep_last = 2}).status());
  }
  EXPECT_EQ(Entries(dir.path()), (std::vector<std::string>{".spare", "latest", "step-00000002", "step-00000003"}));
  EXPECT_EQ(Latest(dir.path()), "step-00000003");

  // The same step again, with other parameters: the new ones load, written
  // over step 1's files.
  model.Write(0, ChunkKind::kParam, std::vector<float>(kChunkElems, 0.25f));
  ASSERT_OK_AND_ASSIGN(CheckpointSummary resaved,
                       SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {.keep_last = 2}));
  EXPECT_EQ(resaved.recycled, resaved.files);
  EXPECT_EQ(Entries(dir.path()), (std::vector<std::string>{".spare", "latest", "step-00000002", "step-00000003"}));
  Model fresh;
  ASSERT_OK(LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir.path()).status());
  EXPECT_EQ(fresh.Read(0, ChunkKind::kParam), std::vector<float>(kChunkElems, 0.25f));

  // Again as on a file system without RENAME_EXCHANGE (NFS): the old one
  // moved aside and removed, the new one in its place.
  model.Write(0, ChunkKind::kParam, std::vector<float>(kChunkElems, 0.5f));
  FaultInjectingFileSystem nfs(PosixFileSystem());
  nfs.RefuseExchange();
  ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {.keep_last = 2}, nullptr, nfs).status());
  EXPECT_EQ(Entries(dir.path()), (std::vector<std::string>{".spare", "latest", "step-00000002", "step-00000003"}));
  Model again;
  ASSERT_OK(LoadCheckpoint(*again.engine, *again.optimizer, dir.path()).status());
  EXPECT_EQ(again.Read(0, ChunkKind::kParam), std::vector<float>(kChunkElems, 0.5f));

  // What a crash between that path's two renames leaves: step 3 moved
  // aside, `latest` naming it. It verifies and loads from where it lies,
  // and the next save puts it back.
  const fs::path root(dir.path());
  fs::rename(root / "step-00000003", root / ".step-00000003.old-4242");
  ASSERT_OK(VerifyCheckpoint(dir.path()).status());
  Model crashed;
  ASSERT_OK_AND_ASSIGN(CheckpointSummary loaded, LoadCheckpoint(*crashed.engine, *crashed.optimizer, dir.path()));
  EXPECT_EQ(loaded.step, 3);
  EXPECT_EQ(crashed.Read(0, ChunkKind::kParam), std::vector<float>(kChunkElems, 0.5f));
  Train(model, 3, 4);
  ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, dir.path()).status());
  EXPECT_EQ(Entries(dir.path()),
            (std::vector<std::string>{".spare", "latest", "step-00000002", "step-00000003", "step-00000004"}));
}

// The inode numbers of the chunk files under `dir`, and their bytes.
std::set<ino_t> Inodes(const fs::path& dir) {
  std::set<ino_t> found;
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(dir)) {
    struct stat st{};
    if (entry.path().extension() == ".bin" && ::stat(entry.path().c_str(), &st) == 0) found.insert(st.st_ino);
  }
  return found;
}
uint64_t FileBytes(const fs::path& dir) {
  uint64_t bytes = 0;
  for (const fs::directory_entry& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) bytes += entry.file_size();
  }
  return bytes;
}

// With keep_last, a pruned checkpoint's files wait under .spare and the
// next save writes over them (the same files), each cut to its size; the
// spares never hold more than the last save wrote; with recycle off there
// are none.
TEST(CheckpointTest, ASaveWritesOverTheFilesOfACheckpointItRemoved) {
  ScratchDir dir("ckpt");
  const fs::path root(dir.path());
  Model model;
  Initialize(model);
  Train(model, 0, 1);
  ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {.keep_last = 1}).status());
  const std::set<ino_t> first = Inodes(root / "step-00000001");
  Train(model, 1, 2);
  ASSERT_OK_AND_ASSIGN(CheckpointSummary second,
                       SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {.keep_last = 1}));
  EXPECT_EQ(second.recycled, 0u);
  EXPECT_EQ(Inodes(root / ".spare"), first);  // step 1's files, pruned
  const std::set<ino_t> second_files = Inodes(root / "step-00000002");
  Train(model, 2, 3);
  ASSERT_OK_AND_ASSIGN(CheckpointSummary third,
                       SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {.keep_last = 1}));
  EXPECT_EQ(third.recycled, third.files);
  EXPECT_EQ(Inodes(root / "step-00000003"), first);
  EXPECT_EQ(Inodes(root / ".spare"), second_files);
  EXPECT_LE(FileBytes(root / ".spare"), third.bytes);

  // Spares longer than any file, full of other bytes: cut to size, they verify and load.
  fs::remove_all(root / ".spare");
  fs::create_directory(root / ".spare");
  for (uint32_t i = 0; i < third.files; ++i) {
    std::ofstream(root / ".spare" / fmt::format("old-{}.bin", i), std::ios::binary)
        << std::string(kChunkElems * sizeof(float) + 8192, '\xab');
  }
  Train(model, 3, 4);
  ASSERT_OK_AND_ASSIGN(CheckpointSummary fourth,
                       SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {.keep_last = 1}));
  EXPECT_EQ(fourth.recycled, fourth.files);
  ASSERT_OK(VerifyCheckpoint(dir.path()).status());
  Model fresh;
  ASSERT_OK(LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir.path()).status());
  EXPECT_EQ(State(fresh), State(model));
  EXPECT_LE(FileBytes(root / ".spare"), fourth.bytes);  // the extra room went back

  Train(model, 4, 5);
  ASSERT_OK_AND_ASSIGN(CheckpointSummary unrecycled,
                       SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {.keep_last = 1, .recycle = false}));
  EXPECT_EQ(unrecycled.recycled, 0u);
  EXPECT_EQ(Entries(dir.path()), (std::vector<std::string>{"latest", "step-00000005"}));
}

// A chunk written from where it lies in host memory that moves before its
// file is done (its slot free for another chunk) is written again from where
// it went; the checkpoint loads as the model was.
TEST(CheckpointTest, AChunkThatMovesWhileItsFileIsWrittenIsWrittenAgain) {
  ScratchDir dir("ckpt");
  Model model;
  Initialize(model);
  Train(model, 0, 2);
  std::optional<ChunkId> previous;
  uint32_t moved = 0;
  FaultInjectingFileSystem moving(PosixFileSystem());
  moving.SetOpenHook([&](const std::string& path) {
    // As a chunk's file is opened, the chunk taken before it is still being written.
    const std::string name = fs::path(path).filename().string();
    if (name.rfind("chunk-", 0) != 0) return Status::Ok();
    if (previous && *model.engine->ChunkTier(*previous) == Tier::kHost) {
      STRATA_RETURN_IF_ERROR(model.engine->MoveChunk(*previous, Tier::kNvme));
      moved++;
    }
    previous = ChunkId(static_cast<uint32_t>(std::stoul(name.substr(6))));
    return Status::Ok();
  });
  const std::vector<std::vector<float>> before = State(model);
  ASSERT_OK(model.engine->OffloadAll());
  ASSERT_OK_AND_ASSIGN(CheckpointSummary saved,
                       SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {}, nullptr, moving));
  EXPECT_GT(moved, 0u);
  EXPECT_EQ(saved.rewritten, moved);
  Model fresh;
  ASSERT_OK(LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir.path()).status());
  EXPECT_EQ(State(fresh), before);
}

// A checkpoint of another model, or of an optimizer with a loss scaler into
// one without, is refused before anything is loaded; a root without a
// checkpoint names what it lacks.
TEST(CheckpointTest, AnotherModelOrOptimizerIsRefused) {
  ScratchDir dir("ckpt");
  Model model;
  Initialize(model);
  Train(model, 0, 1);
  ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, dir.path()).status());

  Options options;
  options.device.backend = DeviceBackendKind::kEmulated;
  options.chunk.size_elems = kChunkElems;
  options.log_level = LogLevel::kWarning;
  ASSERT_OK_AND_ASSIGN(auto other, Engine::Create(options));
  ASSERT_OK(
      other->RegisterTensor({"layer0", {static_cast<int64_t>(kChunkElems)}, DType::kFloat32, true, "layer0"}).status());
  ASSERT_OK(other->Finalize());
  Result<CheckpointSummary> loaded = LoadCheckpoint(*other, *model.optimizer, dir.path());
  ASSERT_EQ(loaded.status().code(), StatusCode::kInvalidArgument) << loaded.status().ToString();
  EXPECT_NE(loaded.status().message().find("another model"), std::string::npos) << loaded.status().ToString();

  ASSERT_OK_AND_ASSIGN(auto scaled, optim::Optimizer::Create(model.optimizer->config(), optim::LossScalerConfig{}));
  Model fresh;
  const Status scaler = LoadCheckpoint(*fresh.engine, *scaled, dir.path()).status();
  EXPECT_EQ(scaler.code(), StatusCode::kInvalidArgument) << scaler.ToString();
  EXPECT_EQ(scaled->steps_taken(), 0);

  ScratchDir empty("ckpt");
  const Status nothing = LoadCheckpoint(*fresh.engine, *fresh.optimizer, empty.path()).status();
  EXPECT_EQ(nothing.code(), StatusCode::kIoError) << nothing.ToString();
  EXPECT_NE(nothing.message().find("latest"), std::string::npos) << nothing.ToString();
}

// The loss scaler's state travels with the checkpoint.
TEST(CheckpointTest, TheLossScalerStateIsRestored) {
  ScratchDir dir("ckpt");
  Model model;
  Initialize(model);
  ASSERT_OK_AND_ASSIGN(auto saving, optim::Optimizer::Create(model.optimizer->config(), optim::LossScalerConfig{}));
  ASSERT_OK(saving->Restore(7, optim::Optimizer::ScalerState{1024.0f, 3, 2}));
  ASSERT_OK(SaveCheckpoint(*model.engine, *saving, dir.path()).status());
  ASSERT_OK_AND_ASSIGN(auto loading, optim::Optimizer::Create(model.optimizer->config(), optim::LossScalerConfig{}));
  Model fresh;
  ASSERT_OK_AND_ASSIGN(CheckpointSummary loaded, LoadCheckpoint(*fresh.engine, *loading, dir.path()));
  EXPECT_EQ(loaded.step, 7);
  EXPECT_EQ(loading->steps_taken(), 7);
  EXPECT_EQ(loading->loss_scale(), 1024.0f);
  EXPECT_EQ(loading->scaler()->good_steps(), 3);
  EXPECT_EQ(loading->scaler()->overflows(), 2);
  EXPECT_EQ(loading->Restore(-1, std::nullopt).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(loading->Restore(1, optim::Optimizer::ScalerState{-1.0f, 0, 0}).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(loading->steps_taken(), 7);
}

// Steps [from, to) of `world` ranks' training: on a rank of a group, its
// own gradients reduced by `reducer`; alone (`rank` -1), the mean of the
// `world` ranks' gradients, formed as the reducer forms it.
void TrainRanks(Model& model, int rank, int world, int from, int to, Communicator* comm = nullptr,
                GradReducer* reducer = nullptr) {
  for (int step = from; step < to; ++step) {
    for (int l = 0; l < kLayers; ++l) {
      if (rank >= 0) {
        model.Write(l, ChunkKind::kGrad, RankGrad(rank, l, step));
        continue;
      }
      std::vector<float> sum(kChunkElems, 0.0f);
      for (int r = 0; r < world; ++r) {
        const std::vector<float> g = RankGrad(r, l, step);
        for (size_t i = 0; i < kChunkElems; ++i) sum[i] += g[i];
      }
      for (float& x : sum) x *= 1.0f / static_cast<float>(world);
      model.Write(l, ChunkKind::kGrad, sum);
    }
    ASSERT_OK(model.Iteration(comm, reducer).status());
  }
}

std::vector<std::vector<float>> Params(Model& model) {
  std::vector<std::vector<float>> params;
  for (int l = 0; l < kLayers; ++l) params.push_back(model.Read(l, ChunkKind::kParam));
  return params;
}

// Two fresh ranks load the checkpoint at `path` (saved at step 3) and train
// steps 3 to 6: each ends with `expected[rank]`'s parameters.
void ExpectTwoRanksResume(const std::string& path, const std::vector<std::vector<std::vector<float>>>& expected) {
  OnRanks(2, [&](int r, Communicator& comm) {
    Model model(0.0, &comm);
    GradReducer reducer(*model.engine, comm);
    ASSERT_OK(LoadCheckpoint(*model.engine, *model.optimizer, path, {}, &comm).status());
    TrainRanks(model, r, 2, 3, 6, &comm, &reducer);
    EXPECT_EQ(Params(model), expected[r]) << "rank " << r;
  });
}

// Two ranks save (each its shard of the moments, rank 0 the parameters):
// two fresh ranks that load it, and one rank alone, train on exactly as the
// two would have; and one rank's checkpoint loads on two.
TEST(CheckpointTest, DataParallelCheckpointsResumeExactlyOnAnyNumberOfRanks) {
  ScratchDir two("ckpt"), one("ckpt");
  std::vector<std::vector<std::vector<float>>> expected(2);
  OnRanks(2, [&](int r, Communicator& comm) {
    Model model(0.0, &comm);
    GradReducer reducer(*model.engine, comm);
    Initialize(model);
    TrainRanks(model, r, 2, 0, 3, &comm, &reducer);
    ASSERT_OK_AND_ASSIGN(CheckpointSummary saved,
                         SaveCheckpoint(*model.engine, *model.optimizer, two.path(), {}, &comm));
    EXPECT_EQ(saved.step, 3);
    TrainRanks(model, r, 2, 3, 6, &comm, &reducer);
    expected[r] = Params(model);
  });
  ASSERT_EQ(expected[0], expected[1]);
  // Rank 1 saved its shards only.
  for (const fs::directory_entry& file : fs::directory_iterator(fs::path(two.path()) / "step-00000003" / "rank1")) {
    if (file.path().filename() == "files.json") continue;
    EXPECT_EQ(fs::file_size(file.path()), kChunkElems / 2 * sizeof(float)) << file.path();
  }
  ASSERT_OK(VerifyCheckpoint(two.path()).status());

  OnRanks(2, [&](int r, Communicator& comm) {
    Model model(0.0, &comm);
    GradReducer reducer(*model.engine, comm);
    ASSERT_OK_AND_ASSIGN(CheckpointSummary loaded,
                         LoadCheckpoint(*model.engine, *model.optimizer, two.path(), {}, &comm));
    EXPECT_EQ(loaded.step, 3);
    TrainRanks(model, r, 2, 3, 6, &comm, &reducer);
    EXPECT_EQ(Params(model), expected[r]) << "rank " << r;
  });

  Model alone;  // the two ranks' shards of the moments, joined
  ASSERT_OK(LoadCheckpoint(*alone.engine, *alone.optimizer, two.path()).status());
  TrainRanks(alone, -1, 2, 3, 6);
  EXPECT_EQ(Params(alone), expected[0]);

  Model single;  // and one rank's checkpoint split across two
  Initialize(single);
  TrainRanks(single, -1, 2, 0, 3);
  ASSERT_OK(SaveCheckpoint(*single.engine, *single.optimizer, one.path()).status());
  ExpectTwoRanksResume(one.path(), expected);
}

// A rank whose part of the checkpoint is damaged fails the load on every
// rank, and with fall_back every rank goes on to the same older one.
TEST(CheckpointTest, ADamagedShardFailsTheLoadOnEveryRankAlike) {
  ScratchDir dir("ckpt");
  std::vector<std::vector<std::vector<float>>> at_one(2);
  OnRanks(2, [&](int r, Communicator& comm) {
    Model model(0.0, &comm);
    GradReducer reducer(*model.engine, comm);
    Initialize(model);
    TrainRanks(model, r, 2, 0, 1, &comm, &reducer);
    ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {}, &comm).status());
    at_one[r] = Params(model);
    TrainRanks(model, r, 2, 1, 2, &comm, &reducer);
    ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {}, &comm).status());
  });
  fs::path damaged;
  for (const fs::directory_entry& file : fs::directory_iterator(fs::path(dir.path()) / "step-00000002" / "rank1")) {
    if (file.path().extension() == ".bin") damaged = file.path();
  }
  fs::resize_file(damaged, 100);
  std::vector<Status> strict(2, Status::Ok());
  std::vector<int64_t> fell_back(2, -1);
  OnRanks(2, [&](int r, Communicator& comm) {
    Model model(0.0, &comm);
    strict[r] = LoadCheckpoint(*model.engine, *model.optimizer, dir.path(), {}, &comm).status();
    ASSERT_OK_AND_ASSIGN(CheckpointSummary loaded,
                         LoadCheckpoint(*model.engine, *model.optimizer, dir.path(), {.fall_back = true}, &comm));
    fell_back[r] = loaded.step;
    EXPECT_EQ(Params(model), at_one[r]);
  });
  EXPECT_EQ(strict[1].code(), StatusCode::kCorruption) << strict[1].ToString();
  EXPECT_EQ(strict[0].code(), StatusCode::kIoError) << strict[0].ToString();
  EXPECT_NE(strict[0].message().find("failed on rank(s) 1"), std::string::npos) << strict[0].ToString();
  EXPECT_EQ(fell_back, (std::vector<int64_t>{1, 1}));
}

// A checkpoint saved at steps 1, 2, 3, then rewound: step 1 loaded, one
// step trained and saved as step 2 again. keep_last prunes among this step
// and earlier ones only (step 3 belongs to the abandoned run), and falling
// back from a damaged step 2 takes step 1, never the later step 3.
TEST(CheckpointTest, AfterARewindKeepLastAndFallBackGoOnlyToEarlierSteps) {
  ScratchDir dir("ckpt");
  Model model;
  Initialize(model);
  std::vector<std::vector<float>> at_one;
  for (int step = 0; step < 3; ++step) {
    Train(model, step, step + 1);
    ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, dir.path()).status());
    if (step == 0) at_one = State(model);
  }
  Model rewound;
  ASSERT_OK(
      LoadCheckpoint(*rewound.engine, *rewound.optimizer, (fs::path(dir.path()) / "step-00000001").string()).status());
  Train(rewound, 1, 2);
  ASSERT_OK(SaveCheckpoint(*rewound.engine, *rewound.optimizer, dir.path(), {.keep_last = 2}).status());
  EXPECT_EQ(Entries(dir.path()),
            (std::vector<std::string>{".spare", "latest", "step-00000001", "step-00000002", "step-00000003"}));
  EXPECT_EQ(Latest(dir.path()), "step-00000002");
  fs::resize_file(fs::path(dir.path()) / "step-00000002" / "rank0" / "chunk-0.bin", 10);
  Model fresh;
  ASSERT_OK_AND_ASSIGN(CheckpointSummary loaded,
                       LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir.path(), {.fall_back = true}));
  EXPECT_EQ(loaded.step, 1);
  EXPECT_EQ(State(fresh), at_one);
}

// A first save killed before `latest` was written leaves a complete
// checkpoint without a pointer: a load with fall_back finds it.
TEST(CheckpointTest, WithoutLatestFallBackFindsTheCheckpoints) {
  ScratchDir dir("ckpt");
  Model model;
  std::vector<std::vector<float>> at_one;
  ASSERT_NO_FATAL_FAILURE(SaveStepOneThenTrainTwo(model, dir.path(), at_one));
  fs::remove(fs::path(dir.path()) / "latest");
  Model fresh;
  EXPECT_EQ(LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir.path()).status().code(), StatusCode::kIoError);
  ASSERT_OK_AND_ASSIGN(CheckpointSummary loaded,
                       LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir.path(), {.fall_back = true}));
  EXPECT_EQ(loaded.step, 1);
  EXPECT_EQ(State(fresh), at_one);
}

// A manifest entry that lacks a field is Corruption, not a read of
// nothing; a file's size overstated is Corruption before any buffer is
// sized by it (it was OutOfMemory, a buffer of the manifest's size asked
// for); one listed twice (or a range covered twice) is refused before
// anything is loaded.
TEST(CheckpointTest, AManifestWithAFieldMissingASizeOverstatedOrAFileTwiceIsRefused) {
  ScratchDir dir("ckpt");
  Model model;
  Initialize(model);
  ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, dir.path()).status());
  const fs::path manifest_path = fs::path(dir.path()) / "step-00000000" / "manifest.json";
  std::ifstream in(manifest_path);
  const nlohmann::json manifest = nlohmann::json::parse(in);
  const auto rewrite = [&](const nlohmann::json& changed) { std::ofstream(manifest_path) << changed.dump(); };

  nlohmann::json missing = manifest;
  missing["files"][3].erase("bytes");
  rewrite(missing);
  const Status verified = VerifyCheckpoint(dir.path()).status();
  EXPECT_EQ(verified.code(), StatusCode::kCorruption) << verified.ToString();
  EXPECT_NE(verified.message().find("bytes"), std::string::npos) << verified.ToString();

  nlohmann::json outside = manifest;  // a file outside its rank's directory
  outside["files"][3]["path"] = "rank0/../../escaped.bin";
  rewrite(outside);
  const Status escaped = VerifyCheckpoint(dir.path()).status();
  EXPECT_EQ(escaped.code(), StatusCode::kCorruption) << escaped.ToString();
  EXPECT_NE(escaped.message().find("not a file of a rank's directory"), std::string::npos) << escaped.ToString();

  nlohmann::json newer = manifest;  // a format this build does not know
  newer["version"] = 2;
  rewrite(newer);
  EXPECT_EQ(VerifyCheckpoint(dir.path()).status().code(), StatusCode::kInvalidArgument);

  Model fresh;
  nlohmann::json overstated = manifest;
  overstated["files"][3]["bytes"] = uint64_t{1} << 50;
  rewrite(overstated);
  for (const Status& status : {VerifyCheckpoint(dir.path()).status(),
                               LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir.path()).status()}) {
    EXPECT_EQ(status.code(), StatusCode::kCorruption) << status.ToString();
    EXPECT_NE(status.message().find("bytes, its manifest says 1125899906842624"), std::string::npos)
        << status.ToString();
  }

  nlohmann::json twice = manifest;
  twice["files"].push_back(twice["files"][3]);
  rewrite(twice);
  const Status loaded = LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir.path()).status();
  EXPECT_EQ(loaded.code(), StatusCode::kInvalidArgument) << loaded.ToString();
  EXPECT_NE(loaded.message().find("exactly once"), std::string::npos) << loaded.ToString();
}

// A group so small that rank 1's shard of its states is empty: saved as an
// empty file, and loaded on two ranks and on one.
TEST(CheckpointTest, AnEmptyShardIsSavedAndLoaded) {
  ScratchDir dir("ckpt");
  const auto make = [](Communicator* comm) {
    Options options;
    options.device.backend = DeviceBackendKind::kEmulated;
    options.chunk.size_elems = kChunkElems;
    options.log_level = LogLevel::kWarning;
    auto engine = Engine::Create(options, {.comm = comm});
    STRATA_CHECK(engine.ok(), "{}", engine.status().ToString());
    STRATA_CHECK(
        (*engine)->RegisterTensor({"w", {static_cast<int64_t>(kChunkElems)}, DType::kFloat32, true, "w"}).ok());
    STRATA_CHECK((*engine)->RegisterTensor({"tiny", {8}, DType::kFloat32, true, "tiny"}).ok());
    STRATA_CHECK((*engine)->Finalize().ok());
    return std::move(engine).value();
  };
  auto optimizer_config = optim::OptimizerConfigFromOptions(Options{});
  ASSERT_OK(optimizer_config.status());
  std::vector<uint32_t> empty_shards(2, 0);
  OnRanks(2, [&](int r, Communicator& comm) {
    std::unique_ptr<Engine> engine = make(&comm);
    for (const ChunkInfo& c : engine->chunks()) empty_shards[r] += c.sharded && c.used_bytes == 0 ? 1 : 0;
    auto optimizer = optim::Optimizer::Create(*optimizer_config);
    ASSERT_OK(optimizer.status());
    // A rank's engine saved without its communicator: refused, naming what to pass.
    const Status alone = SaveCheckpoint(*engine, **optimizer, dir.path()).status();
    EXPECT_EQ(alone.code(), StatusCode::kInvalidArgument) << alone.ToString();
    EXPECT_NE(alone.message().find("pass its communicator"), std::string::npos) << alone.ToString();
    ASSERT_OK(SaveCheckpoint(*engine, **optimizer, dir.path(), {}, &comm).status());
    ASSERT_OK(LoadCheckpoint(*engine, **optimizer, dir.path(), {}, &comm).status());
  });
  EXPECT_EQ(empty_shards, (std::vector<uint32_t>{0, 2})) << "the test means rank 1 to hold empty shards";
  std::unique_ptr<Engine> alone = make(nullptr);
  auto optimizer = optim::Optimizer::Create(*optimizer_config);
  ASSERT_OK(optimizer.status());
  ASSERT_OK(LoadCheckpoint(*alone, **optimizer, dir.path()).status());
}

// One rank's part refused (its coverage) and another's damaged: both ranks
// stop at the same checkpoint with fall_back, instead of one going on to an
// older one alone (a collective its peer never joins).
TEST(CheckpointTest, RanksFailingDifferentlyStopAlike) {
  ScratchDir dir("ckpt");
  OnRanks(2, [&](int r, Communicator& comm) {
    Model model(0.0, &comm);
    GradReducer reducer(*model.engine, comm);
    Initialize(model);
    for (int step = 0; step < 2; ++step) {
      TrainRanks(model, r, 2, step, step + 1, &comm, &reducer);
      ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {}, &comm).status());
    }
  });
  const fs::path step_two = fs::path(dir.path()) / "step-00000002";
  nlohmann::json manifest = nlohmann::json::parse(std::ifstream(step_two / "manifest.json"));
  auto& files = manifest["files"];
  for (size_t i = 0; i < files.size(); ++i) {
    if (files[i]["rank"] == 1) {  // rank 1's chunk uncovered
      files.erase(i);
      break;
    }
  }
  std::ofstream(step_two / "manifest.json") << manifest.dump();
  fs::resize_file(step_two / "rank0" / "chunk-0.bin", 10);  // rank 0's damaged
  std::vector<Status> results(2, Status::Ok());
  OnRanks(2, [&](int r, Communicator& comm) {
    Model model(0.0, &comm);
    results[r] = LoadCheckpoint(*model.engine, *model.optimizer, dir.path(), {.fall_back = true}, &comm).status();
  });
  EXPECT_EQ(results[1].code(), StatusCode::kInvalidArgument) << results[1].ToString();
  EXPECT_EQ(results[0].code(), StatusCode::kCorruption) << results[0].ToString();  // its own error, not a Timeout
}

// A file system on which every file write takes `ms` (a slow drive), so
// that training goes on well past a save's start.
std::unique_ptr<FaultInjectingFileSystem> Slow(uint32_t ms) {
  auto files = std::make_unique<FaultInjectingFileSystem>(PosixFileSystem());
  files->SetDelayMs(ms);
  return files;
}

// One on which the third file write fails (EIO).
std::unique_ptr<FaultInjectingFileSystem> FailingThirdWrite() {
  auto files = std::make_unique<FaultInjectingFileSystem>(PosixFileSystem());
  files->FailWrites(EIO, 1, /*after=*/2);
  return files;
}

// An asynchronous save at step 4, written while 4 more steps run, holds
// step 4's state: a fresh engine that loads it and runs the 4 steps ends
// bit for bit where the first did (states partly on NVMe). The updates
// waited for the save (without the fence the later groups are saved as
// updated by step 5 and this fails).
TEST(CheckpointTest, AnAsynchronousSaveHoldsTheStateOfItsStartWhileTrainingGoesOn) {
  ScratchDir dir("ckpt");
  Model first;
  Initialize(first);
  Train(first, 0, 4);
  const std::unique_ptr<FaultInjectingFileSystem> slow = Slow(40);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PendingCheckpoint> pending,
                       StartCheckpoint(*first.engine, *first.optimizer, dir.path(), {}, nullptr, *slow));
  EXPECT_FALSE(pending->done());  // 19 chunk files at 40 ms each, 3 at a time
  first.fence = pending.get();
  Train(first, 4, 8);
  first.fence = nullptr;
  ASSERT_OK_AND_ASSIGN(CheckpointSummary saved, pending->Wait());
  EXPECT_TRUE(pending->done());
  EXPECT_EQ(saved.step, 4);
  EXPECT_EQ(saved.files, 3u * kLayers + 1);
  EXPECT_EQ(Latest(dir.path()), "step-00000004");
  ASSERT_OK_AND_ASSIGN(CheckpointSummary again, pending->Wait());  // the same outcome
  EXPECT_EQ(again.path, saved.path);
  ASSERT_OK(VerifyCheckpoint(dir.path()).status());

  Model second;
  ASSERT_OK(LoadCheckpoint(*second.engine, *second.optimizer, dir.path()).status());
  Train(second, 4, 8);
  EXPECT_EQ(State(second), State(first));
}

// An asynchronous save that fails (a chunk it cannot read) reports it from
// Wait; the updates it held back go on, and the last checkpoint stays.
TEST(CheckpointTest, AFailedAsynchronousSaveReportsAtWaitAndTrainingGoesOn) {
  ScratchDir dir("ckpt");
  Model model;
  std::vector<std::vector<float>> at_one;
  ASSERT_NO_FATAL_FAILURE(SaveStepOneThenTrainTwo(model, dir.path(), at_one));
  const std::unique_ptr<FaultInjectingFileSystem> failing = FailingThirdWrite();
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PendingCheckpoint> pending,
                       StartCheckpoint(*model.engine, *model.optimizer, dir.path(), {}, nullptr, *failing));
  model.fence = pending.get();
  Train(model, 2, 3);
  model.fence = nullptr;
  const Status failed = pending->Wait().status();
  EXPECT_EQ(failed.code(), StatusCode::kIoError) << failed.ToString();
  EXPECT_EQ(model.optimizer->steps_taken(), 3);
  EXPECT_EQ(Entries(dir.path()), (std::vector<std::string>{"latest", "step-00000001"}));
  Model fresh;
  ASSERT_OK(LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir.path()).status());
  EXPECT_EQ(State(fresh), at_one);
}

// A save that stalls (its third file write hung, as on a stalled drive) is abandoned once a step's update has waited
// update_wait_ms for it: the step ends while the save is still held, its
// Wait is a Timeout saying so, nothing is published, and training went on
// exactly as without a save.
TEST(CheckpointTest, AStalledAsynchronousSaveIsAbandonedAndTrainingGoesOn) {
  ScratchDir dir("ckpt");
  Model model, unsaved;
  std::vector<std::vector<float>> at_one;
  ASSERT_NO_FATAL_FAILURE(SaveStepOneThenTrainTwo(model, dir.path(), at_one));
  Initialize(unsaved);
  Train(unsaved, 0, 3);
  FaultInjectingFileSystem stalls(PosixFileSystem());
  stalls.StallWrites(/*after=*/2);  // bounded, so that a fence that waits for ever fails the test instead of hanging it
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PendingCheckpoint> pending,
                       StartCheckpoint(*model.engine, *model.optimizer, dir.path(), {.update_wait_ms = 200}, nullptr,
                                       stalls));
  model.fence = pending.get();
  Train(model, 2, 3);
  EXPECT_FALSE(pending->done()) << "the step waited for the stalled save";
  stalls.Unstall();
  model.fence = nullptr;
  const Status abandoned = pending->Wait().status();
  EXPECT_EQ(abandoned.code(), StatusCode::kTimeout) << abandoned.ToString();
  EXPECT_NE(abandoned.message().find("abandoned"), std::string::npos) << abandoned.ToString();
  EXPECT_EQ(Entries(dir.path()), (std::vector<std::string>{"latest", "step-00000001"}));
  EXPECT_EQ(State(model), State(unsaved));
  Model fresh;
  ASSERT_OK(LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir.path()).status());
  EXPECT_EQ(State(fresh), at_one);
}

// Two ranks save asynchronously while both train on (their collectives on
// the communicator the save leaves alone): two fresh ranks that load it
// train on exactly as the two did.
TEST(CheckpointTest, DataParallelAsynchronousSavesResumeExactly) {
  ScratchDir dir("ckpt");
  std::vector<std::vector<std::vector<float>>> expected(2);
  OnRanks(2, [&](int r, Communicator& comm) {
    Model model(0.0, &comm);
    GradReducer reducer(*model.engine, comm);
    Initialize(model);
    TrainRanks(model, r, 2, 0, 3, &comm, &reducer);
    const std::unique_ptr<FaultInjectingFileSystem> slow = Slow(10 * (r + 1));
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<PendingCheckpoint> pending,
                         StartCheckpoint(*model.engine, *model.optimizer, dir.path(), {}, &comm, *slow));
    model.fence = pending.get();
    TrainRanks(model, r, 2, 3, 6, &comm, &reducer);
    model.fence = nullptr;
    ASSERT_OK_AND_ASSIGN(CheckpointSummary saved, pending->Wait());
    EXPECT_EQ(saved.step, 3);
    expected[r] = Params(model);
  });
  ASSERT_OK(VerifyCheckpoint(dir.path()).status());
  ExpectTwoRanksResume(dir.path(), expected);
}

// Data parallel, a rank whose save stalls gives up within half of
// comm.timeout_ms (not the 60 s of update_wait_ms), so that the other
// rank's collective after its update completes: both train on, and the
// save fails on both, nothing published.
TEST(CheckpointTest, ARankWhoseSaveStallsGivesUpBeforeItsPeersCollectiveTimesOut) {
  ScratchDir dir("ckpt");
  constexpr uint32_t kTimeoutMs = 3'000;
  ASSERT_OK_AND_ASSIGN(auto group, CreateLoopbackGroup(2, {.timeout_ms = kTimeoutMs}));
  FaultInjectingFileSystem stalls(PosixFileSystem());
  stalls.StallWrites(/*after=*/1);  // rank 1's; bounded: a failing test ends
  std::vector<Status> trained(2, Status::Ok()), saved(2, Status::Ok());
  std::vector<std::unique_ptr<PendingCheckpoint>> pending(2);
  std::vector<std::unique_ptr<Model>> models(2);
  std::vector<std::unique_ptr<GradReducer>> reducers(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Communicator& comm = *group[r];
      models[r] = std::make_unique<Model>(0.0, &comm, false, kTimeoutMs);
      Model& model = *models[r];
      reducers[r] = std::make_unique<GradReducer>(*model.engine, comm);
      Initialize(model);
      TrainRanks(model, r, 2, 0, 1, &comm, reducers[r].get());
      ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {}, &comm).status());
      // update_wait_ms left at 60 s: the communicator's timeout caps it.
      Result<std::unique_ptr<PendingCheckpoint>> started = StartCheckpoint(
          *model.engine, *model.optimizer, dir.path(), {}, &comm, r == 1 ? stalls : PosixFileSystem());
      ASSERT_OK(started.status());
      pending[r] = std::move(started).value();
      model.fence = pending[r].get();
      for (int l = 0; l < kLayers; ++l) model.Write(l, ChunkKind::kGrad, RankGrad(r, l, 1));
      trained[r] = model.Iteration(&comm, reducers[r].get()).status();
      model.fence = nullptr;
    });
  }
  for (std::thread& t : threads) t.join();
  stalls.Unstall();
  threads.clear();
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      if (pending[r]) saved[r] = pending[r]->Wait().status();
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(trained[r].ok()) << "rank " << r << ": " << trained[r].ToString();
    EXPECT_FALSE(saved[r].ok()) << "rank " << r;
  }
  EXPECT_EQ(saved[1].code(), StatusCode::kTimeout) << saved[1].ToString();
  EXPECT_NE(saved[1].message().find("abandoned"), std::string::npos) << saved[1].ToString();
  EXPECT_EQ(Entries(dir.path()), (std::vector<std::string>{"latest", "step-00000001"}));
  pending.clear();
  reducers.clear();
}

// A rank whose files fail, and a rank that never reports to an
// asynchronous save (dead, or far behind): rank 0 names it, every rank's
// save fails, nothing is published.
TEST(CheckpointTest, ARankThatFailsOrNeverReportsFailsTheSaveOnEveryRank) {
  ScratchDir dir("ckpt");
  std::vector<Status> failed(2, Status::Ok()), late(2, Status::Ok());
  OnRanks(2, [&](int r, Communicator& comm) {
    Model model(0.0, &comm, false, /*comm_timeout_ms=*/300);
    GradReducer reducer(*model.engine, comm);
    Initialize(model);
    TrainRanks(model, r, 2, 0, 1, &comm, &reducer);
    ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {}, &comm).status());
    TrainRanks(model, r, 2, 1, 2, &comm, &reducer);
    const std::unique_ptr<FaultInjectingFileSystem> failing = FailingThirdWrite(), slow = Slow(1500);
    failed[r] = SaveCheckpoint(*model.engine, *model.optimizer, dir.path(), {}, &comm,
                               r == 1 ? *failing : PosixFileSystem())
                    .status();
    // Rank 1 writes its first chunk files 1.5 s late, beyond rank 0's 300 ms.
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<PendingCheckpoint> pending,
                         StartCheckpoint(*model.engine, *model.optimizer, dir.path(), {}, &comm,
                                         r == 1 ? *slow : PosixFileSystem()));
    late[r] = pending->Wait().status();
  });
  EXPECT_EQ(failed[1].code(), StatusCode::kIoError) << failed[1].ToString();
  EXPECT_EQ(failed[0].code(), StatusCode::kIoError) << failed[0].ToString();
  EXPECT_NE(failed[0].message().find("failed on rank(s) 1"), std::string::npos) << failed[0].ToString();
  EXPECT_EQ(late[0].code(), StatusCode::kTimeout) << late[0].ToString();
  EXPECT_NE(late[0].message().find("rank 1 had not written its files"), std::string::npos) << late[0].ToString();
  EXPECT_FALSE(late[1].ok());
  EXPECT_EQ(Entries(dir.path()), (std::vector<std::string>{"latest", "step-00000001"}));
  ASSERT_OK(VerifyCheckpoint(dir.path()).status());
}

// While an asynchronous save is in flight, another save or a load of the
// same engine is refused (the load would change what the save reads).
TEST(CheckpointTest, ASaveOrLoadWhileASaveIsInFlightIsRefused) {
  ScratchDir dir("ckpt");
  Model model;
  std::vector<std::vector<float>> at_one;
  ASSERT_NO_FATAL_FAILURE(SaveStepOneThenTrainTwo(model, dir.path(), at_one));
  const std::unique_ptr<FaultInjectingFileSystem> slow = Slow(10);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<PendingCheckpoint> pending,
                       StartCheckpoint(*model.engine, *model.optimizer, dir.path(), {}, nullptr, *slow));
  const Status load = LoadCheckpoint(*model.engine, *model.optimizer, dir.path()).status();
  EXPECT_EQ(load.code(), StatusCode::kInvalidArgument) << load.ToString();
  EXPECT_NE(load.message().find("in flight"), std::string::npos) << load.ToString();
  EXPECT_EQ(SaveCheckpoint(*model.engine, *model.optimizer, dir.path()).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(StartCheckpoint(*model.engine, *model.optimizer, dir.path()).status().code(),
            StatusCode::kInvalidArgument);
  ASSERT_OK(pending->Wait().status());
  EXPECT_EQ(Latest(dir.path()), "step-00000002");
  ASSERT_OK(LoadCheckpoint(*model.engine, *model.optimizer, dir.path()).status());
}

// Parameters sharded (comm.shard_params: masters, no params saved) or not
// (fp32: params, no masters saved): a checkpoint of either loads into the
// other, and training goes on bit for bit as it would have.
TEST(CheckpointTest, ACheckpointWithParamsShardedOrNotLoadsEitherWay) {
  ScratchDir sharded("ckpt"), whole("ckpt");
  std::vector<std::vector<float>> initial;
  std::mt19937 rng(11);
  for (int l = 0; l < kLayers; ++l) initial.push_back(Random(rng, 0.5f));
  std::vector<std::vector<std::vector<float>>> expected(2), theirs(2);
  const auto params = [](Model& model, bool shard_params, GradReducer& reducer) {
    std::vector<std::vector<float>> out;
    for (int l = 0; l < kLayers; ++l) {
      out.push_back(shard_params ? model.Gathered(l, reducer) : model.Read(l, ChunkKind::kParam));
    }
    EXPECT_OK(reducer.Drain());
    return out;
  };
  for (bool shard_params : {false, true}) {
    OnRanks(2, [&](int r, Communicator& comm) {
      Model model(0.0, &comm, shard_params);
      GradReducer reducer(*model.engine, comm);
      for (int l = 0; l < kLayers; ++l) {
        if (shard_params) {
          model.WriteShard(l, initial[l]);
        } else {
          model.Write(l, ChunkKind::kParam, initial[l]);
        }
      }
      TrainRanks(model, r, 2, 0, 3, &comm, &reducer);
      ASSERT_OK(reducer.Drain());  // the gathers queued ahead: the save's collectives come after them
      ASSERT_OK(SaveCheckpoint(*model.engine, *model.optimizer, shard_params ? sharded.path() : whole.path(), {},
                               &comm)
                    .status());
      TrainRanks(model, r, 2, 3, 6, &comm, &reducer);
      (shard_params ? theirs : expected)[r] = params(model, shard_params, reducer);
    });
  }
  ASSERT_EQ(theirs, expected);  // the same training either way
  for (bool shard_params : {false, true}) {  // each loads the other's checkpoint
    OnRanks(2, [&](int r, Communicator& comm) {
      Model model(0.0, &comm, shard_params);
      GradReducer reducer(*model.engine, comm);
      ASSERT_OK(
          LoadCheckpoint(*model.engine, *model.optimizer, shard_params ? whole.path() : sharded.path(), {}, &comm)
              .status());
      TrainRanks(model, r, 2, 3, 6, &comm, &reducer);
      EXPECT_EQ(params(model, shard_params, reducer), expected[r]) << "rank " << r << ", sharded " << shard_params;
    });
  }
  Model alone;  // one process from the sharded one
  ASSERT_OK(LoadCheckpoint(*alone.engine, *alone.optimizer, sharded.path()).status());
  TrainRanks(alone, -1, 2, 3, 6);
  EXPECT_EQ(Params(alone), expected[0]);
}

}  // namespace
}  // namespace strata::offload
