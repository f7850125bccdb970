#include "tests/fuzz/fuzz_util.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <system_error>

// Built with AddressSanitizer (GCC says so by a macro, Clang by a feature).
#if defined(__SANITIZE_ADDRESS__)
#define STRATA_FUZZ_DEATH_CALLBACK 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define STRATA_FUZZ_DEATH_CALLBACK 1
#endif
#endif
#ifdef STRATA_FUZZ_DEATH_CALLBACK
#include <sanitizer/common_interface_defs.h>
#endif

namespace strata::fuzz {

namespace fs = std::filesystem;

namespace {

// ScratchDir's path once made; never destroyed, so that the removal at exit
// (which runs after the destructors of statics made before it) still reads it.
const std::string* scratch = nullptr;

void RemoveScratch() {
  if (scratch == nullptr) return;
  std::error_code ignored;
  fs::remove_all(*scratch, ignored);
}

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "fuzz: %s\n", what.c_str());
  std::fflush(stderr);
  RemoveScratch();  // abort runs no atexit handler
  std::abort();
}

}  // namespace

const std::string& ScratchDir() {
  static const bool made = [] {
    const char* tmp = std::getenv("TMPDIR");
    const fs::path path = fs::path(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") /
                          ("strata-fuzz-" + std::to_string(::getpid()));
    std::error_code error;
    fs::create_directories(path, error);
    if (error) Die("cannot make " + path.string() + ": " + error.message());
    scratch = new std::string(path.string());
    std::atexit(RemoveScratch);
#ifdef STRATA_FUZZ_DEATH_CALLBACK
    // A sanitizer's finding (a crash, a leak, an allocation over the limit) ends the process without atexit.
    __sanitizer_set_death_callback(RemoveScratch);
#endif
    return true;
  }();
  (void)made;
  return *scratch;
}

void WriteFileOrDie(const std::string& path, const void* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  out.close();
  if (!out) Die("cannot write " + path);
}

std::string WriteInput(const std::string& name, const uint8_t* data, size_t size) {
  const std::string path = (fs::path(ScratchDir()) / name).string();
  WriteFileOrDie(path, data, size);
  return path;
}

void ExpectNotInternal(const Status& status) {
  if (status.code() == StatusCode::kInternal) Die("an internal error: " + status.ToString());
}

void ExpectRefusalNames(const Status& status, const std::string& what) {
  if (status.ok()) return;
  ExpectNotInternal(status);
  if (status.message().find(what) == std::string::npos) {
    Die("a refusal that does not name " + what + ": " + status.ToString());
  }
}

}  // namespace strata::fuzz
