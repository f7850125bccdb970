// strata._strata: the C++ engine's Python binding (pybind11).
//
// So far: the engine's options, set key by key from their text form with the
// engine's own parsing and checks, so that a bad key or value is the same
// error, naming the key, in Python (ValueError) as on the command line.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "strata/options.h"
#include "strata/status.h"

namespace py = pybind11;

namespace {

void ThrowIfError(const strata::Status& status) {
  if (!status.ok()) throw py::value_error(status.ToString());
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

  m.def(
      "option_keys",
      [] {
        std::vector<std::string> keys;
        for (const strata::OptionDoc& doc : strata::OptionDocs()) keys.push_back(doc.key);
        return keys;
      },
      "every documented option key");
}
