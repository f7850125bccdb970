// Checks of a communicator's collectives against their definitions, shared
// by the loopback test (ranks as threads) and the MPI test (under mpirun):
// every rank calls them in the same order.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "src/base/half.h"
#include "strata/comm.h"

namespace strata::testing {

// A 16-bit reduce-scatter (bf16 or fp16): sums of small integers (exact in
// the dtype) are exact, 2 bytes an element are counted, and with two ranks
// (one addition) a sum between two representable values is rounded to the
// nearer, not truncated.
inline Status CheckHalfReduceScatter(Communicator& comm, DType dtype) {
  const int world = comm.world_size(), me = comm.rank();
  constexpr size_t kCount = 1000;
  std::vector<uint16_t> whole(world * kCount), mine(kCount, 0xFFFF);
  for (size_t j = 0; j < whole.size(); ++j) optim::StoreFloat(whole.data(), dtype, j, static_cast<float>((me + 1) * (j % 7)));
  const uint64_t before = comm.stats().reduce_scatter.bytes;
  STRATA_RETURN_IF_ERROR(comm.ReduceScatterSum(whole.data(), mine.data(), kCount, dtype));
  const uint64_t sent = comm.stats().reduce_scatter.bytes - before;
  if (sent != static_cast<uint64_t>(world - 1) * kCount * 2) return Internal("{}: {} bytes counted", DTypeName(dtype), sent);
  const float ranks_sum = static_cast<float>(world * (world + 1) / 2);
  for (size_t i = 0; i < kCount; ++i) {
    const float got = optim::FloatAt(mine.data(), dtype, i);
    if (got != ranks_sum * static_cast<float>((me * kCount + i) % 7)) {
      return Internal("{} reduce-scatter: rank {} element {}: {}", DTypeName(dtype), me, i, got);
    }
  }
  if (world != 2) return Status::Ok();
  // 1 + 0.75 ulp rounds up to 1 + ulp.
  const float ulp = std::ldexp(1.0f, dtype == DType::kBFloat16 ? -7 : -10);
  for (size_t j = 0; j < whole.size(); ++j) optim::StoreFloat(whole.data(), dtype, j, me == 0 ? 1.0f : 0.75f * ulp);
  STRATA_RETURN_IF_ERROR(comm.ReduceScatterSum(whole.data(), mine.data(), kCount, dtype));
  for (size_t i = 0; i < kCount; ++i) {
    const float got = optim::FloatAt(mine.data(), dtype, i);
    if (got != 1.0f + ulp) return Internal("{} reduce-scatter: 1 + 0.75 ulp summed to {}", DTypeName(dtype), got);
  }
  return Status::Ok();
}

}  // namespace strata::testing
