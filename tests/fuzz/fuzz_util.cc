#include "tests/fuzz/fuzz_util.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <system_error>

namespace strata::fuzz {

namespace fs = std::filesystem;

namespace {

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "fuzz: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

}  // namespace

const std::string& ScratchDir() {
  // Never destroyed, so that the removal at exit (which runs after the
  // destructors of statics made before it) still reads it.
  static const std::string* dir = [] {
    const char* tmp = std::getenv("TMPDIR");
    const fs::path path = fs::path(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") /
                          ("strata-fuzz-" + std::to_string(::getpid()));
    std::error_code error;
    fs::create_directories(path, error);
    if (error) Die("cannot make " + path.string() + ": " + error.message());
    return new std::string(path.string());
  }();
  static const bool removed_at_exit = std::atexit([] {
    std::error_code ignored;
    fs::remove_all(*dir, ignored);
  }) == 0;
  (void)removed_at_exit;
  return *dir;
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
