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
// This file holds the module, the error conversion and the options; each
// other concern has its Bind* function in a file of its own (binding.h).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "python/src/binding.h"
#include "strata/options.h"
#include "strata/status.h"

namespace strata::python {

namespace {

// strata._strata.CorruptionError (a RuntimeError): stored bytes that do not match their CRC.
PyObject* corruption_error = nullptr;

}  // namespace

void ThrowIfError(const Status& status) {
  if (status.ok()) return;
  PyObject* type = status.code() == StatusCode::kInvalidArgument ? PyExc_ValueError
                   : status.code() == StatusCode::kOutOfMemory   ? PyExc_MemoryError
                   : status.code() == StatusCode::kCorruption    ? corruption_error
                                                                 : PyExc_RuntimeError;
  PyErr_SetString(type, status.ToString().c_str());
  throw py::error_already_set();
}

std::unique_ptr<PyAccess> Held(Engine& engine, ChunkAccess access) {
  const bool host = access.tier() == Tier::kHost || engine.device().host_accessible();
  return std::make_unique<PyAccess>(PyAccess{std::move(access), host});
}

void BindErrors(py::module_& m) {
  corruption_error = PyErr_NewExceptionWithDoc("strata._strata.CorruptionError",
                                               "stored bytes (an NVMe slot) that do not match their CRC32C",
                                               PyExc_RuntimeError, nullptr);
  m.attr("CorruptionError") = py::handle(corruption_error);
}

void BindOptions(py::module_& m) {
  py::class_<Options>(m, "Options", "the engine's settings; every key of `strata options`")
      .def(py::init<>())
      .def(
          "set", [](Options& options, const std::string& key, const std::string& value) {
            ThrowIfError(SetOption(options, key, value));
          },
          py::arg("key"), py::arg("value"), "sets one key from its text form; ValueError naming the key when bad")
      .def(
          "validate", [](const Options& options) { ThrowIfError(ValidateOptions(options)); },
          "checks the relations between keys; ValueError naming them")
      .def(
          "describe",
          [](const Options& options) {
            py::dict values;
            for (const auto& [key, value] : DescribeOptions(options)) values[py::str(key)] = value;
            return values;
          },
          "every key and its value, as text");
  m.def(
      "parse_size", [](const std::string& text) { return ValueOrThrow(ParseSize(text)); }, py::arg("text"),
      "'64MiB', '1.5GiB', '4096', '2GB' -> bytes; ValueError otherwise");
  m.def(
      "option_keys",
      [] {
        std::vector<std::string> keys;
        for (const OptionDoc& doc : OptionDocs()) keys.push_back(doc.key);
        return keys;
      },
      "every documented option key");
}

}  // namespace strata::python

PYBIND11_MODULE(_strata, m) {
  namespace bind = strata::python;
  m.doc() = "strata's C++ engine (the Python package is strata)";
  // In order: the errors first, since ThrowIfError raises them; each class before the functions whose
  // signatures name it, so that their docstrings give its Python name.
  for (auto* bind_concern : {&bind::BindErrors, &bind::BindOptions, &bind::BindCommunicator, &bind::BindTransports,
                             &bind::BindEngine, &bind::BindChunkAccess, &bind::BindOptimizer, &bind::BindPipeline,
                             &bind::BindTrainStep, &bind::BindGradReducer, &bind::BindCheckpoint,
                             &bind::BindSafetensors}) {
    bind_concern(m);
  }
}
