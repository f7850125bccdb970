// What a training step's update of a chunk group waits for before it changes
// the group's chunks (its param, master and optimizer states): an
// asynchronous checkpoint still reading them out is one. Implementations say
// their own thread-safety.
#pragma once

#include <cstdint>

#include "strata/status.h"

namespace strata::offload {

class UpdateFence {
 public:
  virtual ~UpdateFence() = default;
  // Returns once `group`'s chunks may change.
  virtual Status BeforeUpdate(uint32_t group) = 0;
};

}  // namespace strata::offload
