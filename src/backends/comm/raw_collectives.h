// The backends' own blocking collectives, without strata's timeout polling
// or staging: a reference for what a communicator adds. Private to
// src/backends/comm/. MPI's are NotSupported
// without MPI; NCCL's take a communicator CreateNcclCommunicator made and
// buffers in its device's memory (InvalidArgument for any other
// communicator, NotSupported without CUDA).
#pragma once

#include <cstddef>

#include "strata/comm.h"
#include "strata/status.h"

namespace strata::comm {

Status MpiRawAllGather(const void* send, void* recv, size_t bytes_per_rank);
Status MpiRawReduceScatterSum(const float* send, float* recv, size_t count_per_rank);
Status NcclRawAllGather(Communicator& nccl, const void* send, void* recv, size_t bytes_per_rank);
Status NcclRawReduceScatterSum(Communicator& nccl, const float* send, float* recv, size_t count_per_rank);

}  // namespace strata::comm
