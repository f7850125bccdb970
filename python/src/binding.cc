// strata._strata's shared pieces (binding.h): the error conversion and the
// pinned-chunk handle every binding uses.
#include "python/src/binding.h"

#include <pybind11/pybind11.h>

#include <memory>

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

}  // namespace strata::python
