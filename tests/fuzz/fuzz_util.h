// What the fuzz targets share: the input as a file (the parsers read files
// others hand strata), and the properties every refusal must have.
//
//   extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
//     const std::string& path = fuzz::WriteInput("weights.safetensors", data, size);
//     fuzz::ExpectRefusalNames(Parse(path).status(), path);
//     return 0;
//   }
//
// A broken property aborts with what broke, which libFuzzer reports as a
// crash and keeps the input of.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "strata/status.h"

namespace strata::fuzz {

// A directory of this process's own under TMPDIR (or /tmp), made once and
// removed at exit.
const std::string& ScratchDir();

// Writes `size` bytes to `name` in ScratchDir() (replacing it): its path.
std::string WriteInput(const std::string& name, const uint8_t* data, size_t size);
// The same at a path of the caller's.
void WriteFileOrDie(const std::string& path, const void* data, size_t size);

// Aborts unless `status` is ok or a refusal whose message names `what` (a
// file's path or name); IoError included, an Internal error never.
void ExpectRefusalNames(const Status& status, const std::string& what);
// Aborts on an Internal error (a broken invariant, where a refusal was due).
void ExpectNotInternal(const Status& status);

}  // namespace strata::fuzz
