// strata._strata: the C++ engine's Python binding (pybind11).
//
// The engine's options, set key by key from their text form with the
// engine's own parsing and checks, so that a bad key or value is the same
// error, naming the key, in Python as on the command line; the engine
// (register, finalize, chunks, pinned chunk accesses whose bytes Python sees
// through the buffer protocol, stats); the pipeline's moments; the optimizer
// and one training step over them (offload/training/train_step.h); checkpoints and
// safetensors. The PyTorch side is python/strata/ (the package strata).
// Errors: InvalidArgument -> ValueError, OutOfMemory -> MemoryError,
// Corruption -> CorruptionError (a RuntimeError), the rest -> RuntimeError;
// the message is the engine's.
//
// This file holds the module; each concern has its Bind* function in a file
// of its own (binding.h), and the shared pieces are in binding.cc.
#include <pybind11/pybind11.h>

#include "python/src/binding.h"

PYBIND11_MODULE(_strata, m) {
  namespace bind = strata::python;
  m.doc() = "strata's C++ engine (the Python package is strata)";
  m.attr("__version__") = STRATA_VERSION;  // CMakeLists.txt's project() version, as `strata version` prints
  // In order: the errors first, since ThrowIfError raises them; each class before the functions whose
  // signatures name it, so that their docstrings give its Python name.
  for (auto* bind_concern : {&bind::BindErrors, &bind::BindOptions, &bind::BindCommunicator, &bind::BindTransports,
                             &bind::BindFence, &bind::BindEngine, &bind::BindChunkAccess, &bind::BindOptimizer,
                             &bind::BindPipeline, &bind::BindTrainStep, &bind::BindGradReducer,
                             &bind::BindCheckpoint, &bind::BindSafetensors}) {
    bind_concern(m);
  }
}
