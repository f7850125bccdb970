// The engine's options in Python, set key by key from their text form with
// the engine's own parsing and checks, so that a bad key or value is the same
// error, naming the key, in Python as on the command line.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "python/src/binding.h"
#include "strata/options.h"
#include "strata/status.h"

namespace strata::python {

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
          "every key and its value, as text")
      .def("wait_timeout_ms", &EngineWaitTimeoutMs,
           "the longest one of the engine's waits may take: the larger of device.copy_timeout_ms and "
           "nvme.io_timeout_ms");
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
