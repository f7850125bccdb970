// A rank killed in the middle of a run (SIGKILL after the first barrier):
// every surviving rank's next collective is a Timeout within the configured
// time, printed, and the run ends instead of hanging. Run by ctest under
// mpirun -np 3 with orte_abort_on_non_zero_status off, so that mpirun does
// not kill the survivors first (label mpi).
#include <chrono>
#include <csignal>
#include <cstdio>
#include <vector>

#include "strata/comm.h"

int main() {
  auto comm = strata::CreateMpiCommunicator({.timeout_ms = 2000});
  if (!comm.ok()) {
    std::printf("create: %s\n", comm.status().ToString().c_str());
    return 1;
  }
  strata::Communicator& c = **comm;
  if (strata::Status s = c.Barrier(); !s.ok()) {
    std::printf("rank %d: first barrier: %s\n", c.rank(), s.ToString().c_str());
    return 1;
  }
  if (c.rank() == 1) std::raise(SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  std::vector<double> sum = {1.0};
  const strata::Status status = c.AllReduceSum(sum);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("rank %d: %s after %.1f s\n", c.rank(), status.ToString().c_str(), seconds);
  std::fflush(stdout);
  return status.code() == strata::StatusCode::kTimeout && seconds < 10 ? 0 : 2;
}
