// The compute of a training step's optimizer updates, as a seam (an Env
// covers time and threads so). Without one (EngineSeams::compute null) the
// optimizer's kernels run; with one, it runs instead of each chunk group's
// update, on the same chunks, in the same moment and on the same thread,
// and every move, pin and wait around it is the step's own. The replay
// benchmark gives one that takes an emulated machine's time for each update,
// so that it drives the real step (Note [The replay] in
// benchmarks/replay_bench.cc). Implementations are called from the step's
// thread and the pipeline's update thread at once.
#pragma once

#include <cstdint>

#include "strata/status.h"
#include "strata/types.h"

namespace strata {

class ComputeSeam {
 public:
  struct Update {
    uint32_t group = 0;  // the chunk group (ChunkInfo::group)
    uint64_t elems = 0;  // of its elements, those this rank updates
    Tier where = Tier::kHost;  // where the plan runs it (the emulated device's memory is the host's)
    bool overlapped = false;   // begun beside backward (offload::OverlapUpdates)
  };
  virtual ~ComputeSeam() = default;
  // The update, and what the kernels' pass does beside it (the copy kept for
  // an overlapped update, the gradients zeroed): the chunks' values are not
  // the seam's concern, so a step that puts a kept copy back (a redo, an
  // undo) puts back what the copy's memory held. A step the plan skips does
  // not call it. An error fails the step as a kernel's would.
  virtual Status RunUpdate(const Update& update) = 0;
};

}  // namespace strata
