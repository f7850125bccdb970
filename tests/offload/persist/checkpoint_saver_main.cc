// The test model trained one step at a time, each step saved twice (the
// second save replacing the first), until killed or 10000 steps: the
// process checkpoint_kill_test kills at random moments. Prints "published"
// once the first checkpoint is, so that every kill lands after one exists.
// With "async", each step is saved once, asynchronously, while the next
// step trains. With "nfs", the second save of a step replaces the first as
// on a file system without RENAME_EXCHANGE (FaultInjectingFileSystem::RefuseExchange).
#include <cstdio>
#include <memory>
#include <random>
#include <string>

#include "strata/checkpoint.h"
#include "tests/offload/training/train_model.h"

int main(int argc, char** argv) {
  const std::string mode = argc == 3 ? argv[2] : "";
  if (argc < 2 || argc > 3 || (argc == 3 && mode != "async" && mode != "nfs")) {
    std::fprintf(stderr, "usage: checkpoint_saver ROOT [async|nfs]\n");
    return 2;
  }
  const bool asynchronous = mode == "async";
  using namespace strata::offload;
  strata::FaultInjectingFileSystem files(strata::PosixFileSystem());
  files.RefuseExchange(mode == "nfs");
  Model model;
  std::mt19937 rng(5);
  for (int l = 0; l < kLayers; ++l) model.Write(l, strata::ChunkKind::kParam, Random(rng, 0.5f));
  std::unique_ptr<PendingCheckpoint> pending;
  for (int step = 0; step < 10000; ++step) {
    for (int l = 0; l < kLayers; ++l) model.Write(l, strata::ChunkKind::kGrad, Random(rng, 0.1f));
    if (strata::Status trained = model.Iteration().status(); !trained.ok()) {
      std::fprintf(stderr, "step %d: %s\n", step, trained.ToString().c_str());
      return 1;
    }
    // Asynchronous: the save before is waited for, and this one runs while the next step trains.
    const strata::Status waited = pending ? pending->Wait().status() : strata::Status::Ok();
    model.fence = nullptr;
    pending.reset();
    for (int again = 0; again < (asynchronous ? 0 : 2) && waited.ok(); ++again) {
      auto saved = SaveCheckpoint(*model.engine, *model.optimizer, argv[1], {.keep_last = 2}, nullptr, files);
      if (!saved.ok()) {
        std::fprintf(stderr, "save at step %d: %s\n", step + 1, saved.status().ToString().c_str());
        return 1;
      }
    }
    if (asynchronous && waited.ok()) {
      auto started = StartCheckpoint(*model.engine, *model.optimizer, argv[1], {.keep_last = 2});
      if (!started.ok()) {
        std::fprintf(stderr, "save at step %d: %s\n", step + 1, started.status().ToString().c_str());
        return 1;
      }
      pending = std::move(started).value();
      model.fence = pending.get();
      if (step == 0) {  // "published" only once it is
        if (strata::Status first = pending->Wait().status(); !first.ok()) {
          std::fprintf(stderr, "save at step 1: %s\n", first.ToString().c_str());
          return 1;
        }
        model.fence = nullptr;
        pending.reset();
      }
    }
    if (!waited.ok()) {
      std::fprintf(stderr, "save at step %d: %s\n", step, waited.ToString().c_str());
      return 1;
    }
    if (step == 0) {
      std::printf("published\n");
      std::fflush(stdout);
    }
  }
  return 0;
}
