// strata._strata's shared pieces: the error conversion every binding uses,
// the pinned-chunk handle Python holds, and one Bind* function per concern
// (module.cc calls them in order). Not thread-safe beyond pybind11's own
// rules: every function here runs with the GIL held unless it says otherwise.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <utility>

#include "strata/device.h"
#include "strata/engine.h"
#include "strata/status.h"

namespace strata::python {

namespace py = pybind11;

// Raises the Python exception for a failed status: InvalidArgument -> ValueError, OutOfMemory ->
// MemoryError, Corruption -> CorruptionError, the rest -> RuntimeError; the message is the engine's.
void ThrowIfError(const Status& status);

template <typename T>
T ValueOrThrow(Result<T> result) {
  ThrowIfError(result.status());
  return std::move(result).value();
}

// Runs `f` with the GIL released (the engine's waits must not block other
// Python threads); errors are raised after, with the GIL held again.
template <typename F>
auto Unlocked(F f) {
  py::gil_scoped_release unlocked;
  return f();
}

// A pinned chunk as Python holds it: its bytes are seen through the buffer
// protocol only where the host can address them (the host tier, or the
// emulated device); elsewhere (CUDA memory) and once released, the buffer is
// empty, so that a view of it fails in Python instead of reading a stray address.
struct PyAccess {
  ChunkAccess access;
  bool host_addressable = false;
};

// A device event Python holds (Engine.record_fence) and hands to ChunkAccess.release_after.
struct Fence {
  std::shared_ptr<Event> event;
};

// Takes ownership of `access`, noting whether the host can address its bytes.
std::unique_ptr<PyAccess> Held(Engine& engine, ChunkAccess access);

// Adds the CorruptionError exception type (a RuntimeError) to `m`; first, since ThrowIfError raises it.
void BindErrors(py::module_& m);
void BindOptions(py::module_& m);            // Options, parse_size, option_keys
void BindCommunicator(py::module_& m);       // Communicator (subclassable from Python)
void BindTransports(py::module_& m);         // mpi_communicator, nccl_communicator, what was built in
void BindFence(py::module_& m);              // Fence
void BindEngine(py::module_& m);             // Engine
void BindChunkAccess(py::module_& m);        // ChunkAccess
void BindOptimizer(py::module_& m);          // Optimizer
void BindPipeline(py::module_& m);           // Pipeline
void BindGradReducer(py::module_& m);        // GradReducer
void BindTrainStep(py::module_& m);          // train_step
void BindCheckpoint(py::module_& m);         // save/start/load/verify_checkpoint, PendingCheckpoint
void BindSafetensors(py::module_& m);        // export/import_safetensors, safetensors_index

}  // namespace strata::python
