// MPI initialized by another library with MPI_Init (thread level single):
// strata's communicator refuses it with NotSupported naming the level it
// needs, since its gradient reducer calls MPI from a thread of its own.
// Run by ctest under mpirun -np 1 (label mpi).
// The C API only (OpenMPI and MPICH would pull in their C++ bindings).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <cstdio>

#include "strata/comm.h"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int level = 0;
  MPI_Query_thread(&level);
  auto comm = strata::CreateMpiCommunicator({.timeout_ms = 2000});
  std::printf("level %d: %s\n", level, comm.ok() ? "accepted" : comm.status().ToString().c_str());
  const bool refused = !comm.ok() && comm.status().code() == strata::StatusCode::kNotSupported;
  MPI_Finalize();
  return level < MPI_THREAD_SERIALIZED && refused ? 0 : 1;
}
