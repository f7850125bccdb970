// Fuzz target: a safetensors file, indexed (ReadSafetensorsIndex, as
// `strata.load_safetensors` and `weights=` read one) and imported into an
// engine whose tensors some seeds match (ImportSafetensors, strict and
// not). Seeds: corpus/safetensors.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "strata/safetensors.h"
#include "tests/fuzz/fuzz_util.h"
#include "tests/offload/training/train_model.h"

namespace {

// The checkpoint tests' model: six fp32 layers of 4096 elements
// ("layer0".."layer5") and a frozen one ("frozen", 64), built once.
strata::offload::Model& TheModel() {
  static auto* model = new strata::offload::Model();
  return *model;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata::offload;
  const std::string path = strata::fuzz::WriteInput("weights.safetensors", data, size);
  strata::fuzz::ExpectRefusalNames(ReadSafetensorsIndex(path).status(), path);
  for (bool strict : {true, false}) {
    strata::fuzz::ExpectRefusalNames(ImportSafetensors(*TheModel().engine, path, {.strict = strict}).status(), path);
  }
  return 0;
}
