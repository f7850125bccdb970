// The test model trained one step at a time, each step saved twice (the
// second save replacing the first), until killed or 10000 steps: the
// process checkpoint_kill_test kills at random moments. Prints "published"
// once the first checkpoint is, so that every kill lands after one exists.
#include <cstdio>
#include <random>

#include "offload/checkpoint.h"
#include "tests/offload/train_model.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: checkpoint_saver ROOT\n");
    return 2;
  }
  using namespace strata::offload;
  Model model;
  std::mt19937 rng(5);
  for (int l = 0; l < kLayers; ++l) model.Write(l, strata::ChunkKind::kParam, Random(rng, 0.5f));
  for (int step = 0; step < 10000; ++step) {
    for (int l = 0; l < kLayers; ++l) model.Write(l, strata::ChunkKind::kGrad, Random(rng, 0.1f));
    if (strata::Status trained = model.Iteration().status(); !trained.ok()) {
      std::fprintf(stderr, "step %d: %s\n", step, trained.ToString().c_str());
      return 1;
    }
    for (int again = 0; again < 2; ++again) {
      auto saved = SaveCheckpoint(*model.engine, *model.optimizer, argv[1], {.keep_last = 2});
      if (!saved.ok()) {
        std::fprintf(stderr, "save at step %d: %s\n", step + 1, saved.status().ToString().c_str());
        return 1;
      }
    }
    if (step == 0) {
      std::printf("published\n");
      std::fflush(stdout);
    }
  }
  return 0;
}
