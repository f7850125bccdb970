// strata._strata: the C++ engine's Python binding (pybind11).
//
// So far: the engine's options, set key by key from their text form with the
// engine's own parsing and checks, so that a bad key or value is the same
// error, naming the key, in Python as on the command line; and the engine
// itself as far as registering tensors, packing them into chunks and saying
// where each chunk lives. Errors: InvalidArgument -> ValueError,
// OutOfMemory -> MemoryError, the rest -> RuntimeError; the message is the
// engine's.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "strata/engine.h"
#include "strata/options.h"
#include "strata/status.h"

namespace py = pybind11;

namespace {

// Raises the Python exception for a failed status (see the top).
void ThrowIfError(const strata::Status& status) {
  if (status.ok()) return;
  PyObject* type = status.code() == strata::StatusCode::kInvalidArgument ? PyExc_ValueError
                   : status.code() == strata::StatusCode::kOutOfMemory   ? PyExc_MemoryError
                                                                         : PyExc_RuntimeError;
  PyErr_SetString(type, status.ToString().c_str());
  throw py::error_already_set();
}

template <typename T>
T ValueOrThrow(strata::Result<T> result) {
  ThrowIfError(result.status());
  return std::move(result).value();
}

}  // namespace

PYBIND11_MODULE(_strata, m) {
  m.doc() = "strata's C++ engine (the Python package is strata)";

  py::class_<strata::Options>(m, "Options", "the engine's settings; every key of `strata options`")
      .def(py::init<>())
      .def(
          "set", [](strata::Options& options, const std::string& key, const std::string& value) {
            ThrowIfError(strata::SetOption(options, key, value));
          },
          py::arg("key"), py::arg("value"), "sets one key from its text form; ValueError naming the key when bad")
      .def(
          "validate", [](const strata::Options& options) { ThrowIfError(strata::ValidateOptions(options)); },
          "checks the relations between keys; ValueError naming them")
      .def(
          "describe",
          [](const strata::Options& options) {
            py::dict values;
            for (const auto& [key, value] : strata::DescribeOptions(options)) values[py::str(key)] = value;
            return values;
          },
          "every key and its value, as text");

  py::class_<strata::Engine, std::unique_ptr<strata::Engine>>(m, "Engine",
                                                               "the engine: tensors in chunks on three tiers")
      .def(py::init([](const strata::Options& options) { return ValueOrThrow(strata::Engine::Create(options)); }),
           py::arg("options"))
      .def(
          "register_tensor",
          [](strata::Engine& engine, const std::string& name, const std::vector<int64_t>& shape,
             const std::string& dtype, bool trainable, const std::string& module) {
            const strata::DType parsed = ValueOrThrow(strata::ParseDType(dtype));
            return ValueOrThrow(engine.RegisterTensor({name, shape, parsed, trainable, module})).value();
          },
          py::arg("name"), py::arg("shape"), py::arg("dtype") = "fp32", py::arg("trainable") = true,
          py::arg("module") = "", "registers a tensor (model order); returns its id")
      .def(
          "finalize", [](strata::Engine& engine) { ThrowIfError(engine.Finalize()); },
          "packs the registered tensors into chunks and gives each a home tier")
      .def(
          "chunks",
          [](const strata::Engine& engine) {
            py::list chunks;
            for (const strata::ChunkInfo& chunk : engine.chunks()) {
              py::dict d;
              d["id"] = chunk.id.value();
              d["kind"] = std::string(strata::ChunkKindName(chunk.kind));
              d["dtype"] = std::string(strata::DTypeName(chunk.dtype));
              d["group"] = chunk.group;
              d["size_bytes"] = chunk.size_bytes;
              d["used_bytes"] = chunk.used_bytes;
              d["home"] = std::string(strata::TierName(ValueOrThrow(engine.ChunkHome(chunk.id))));
              std::vector<uint32_t> tensors;
              for (strata::TensorId t : chunk.tensors) tensors.push_back(t.value());
              d["tensors"] = tensors;
              chunks.append(d);
            }
            return chunks;
          },
          "after finalize: every chunk (id, kind, dtype, group, size_bytes, used_bytes, home, tensors)")
      .def_property_readonly("host_staging_bytes", &strata::Engine::host_staging_bytes);

  m.def(
      "option_keys",
      [] {
        std::vector<std::string> keys;
        for (const strata::OptionDoc& doc : strata::OptionDocs()) keys.push_back(doc.key);
        return keys;
      },
      "every documented option key");
}
