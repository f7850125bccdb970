// The MPI library's own blocking collectives, without strata's timeout
// polling: the reference `strata bench comm` measures its communicator
// against in the same run. Internal (src/comm); NotSupported without MPI.
#pragma once

#include <cstddef>

#include "strata/status.h"

namespace strata::comm {

Status MpiRawAllGather(const void* send, void* recv, size_t bytes_per_rank);
Status MpiRawReduceScatterSum(const float* send, float* recv, size_t count_per_rank);

}  // namespace strata::comm
