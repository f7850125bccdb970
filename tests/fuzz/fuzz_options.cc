// Fuzz target: an options file (JSON), as `strata ... --config` and
// strata.Engine(config=...) read one, then the checks of the options'
// relations. Seeds: corpus/options.
#include <cstddef>
#include <cstdint>

#include "strata/options.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  const std::string path = fuzz::WriteInput("options.json", data, size);
  Options options;
  const Status applied = ApplyOptionsFile(options, path);
  fuzz::ExpectRefusalNames(applied, path);
  if (applied.ok()) fuzz::ExpectNotInternal(ValidateOptions(options));  // its refusals name keys, not the file
  return 0;
}
