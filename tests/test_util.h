// Helpers shared by the test suites: scratch directories on a filesystem that
// supports O_DIRECT, seeded random data, and status assertions.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "strata/status.h"

#define ASSERT_OK(expr)                                         \
  do {                                                          \
    ::strata::Status strata_test_status_ = (expr);              \
    ASSERT_TRUE(strata_test_status_.ok()) << strata_test_status_.ToString(); \
  } while (0)
#define EXPECT_OK(expr)                                         \
  do {                                                          \
    ::strata::Status strata_test_status_ = (expr);              \
    EXPECT_TRUE(strata_test_status_.ok()) << strata_test_status_.ToString(); \
  } while (0)
// `lhs = value of a Result expression`, failing the test on an error.
#define ASSERT_OK_AND_ASSIGN(lhs, expr)                                        \
  ASSERT_OK_AND_ASSIGN_IMPL(STRATA_CONCAT(strata_test_result_, __LINE__), lhs, expr)
#define ASSERT_OK_AND_ASSIGN_IMPL(result, lhs, expr)                \
  auto result = (expr);                                             \
  ASSERT_TRUE(result.ok()) << result.status().ToString();          \
  lhs = std::move(result).value()

namespace strata::testing {

// A fresh directory, removed when the object dies. It lives under
// $STRATA_TEST_DIR (set by ctest to build/test-scratch), else the system
// temporary directory.
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& tag = "t") {
    const char* root = std::getenv("STRATA_TEST_DIR");
    std::filesystem::path base = root != nullptr ? root : std::filesystem::temp_directory_path().string();
    std::filesystem::create_directories(base);
    std::string pattern = (base / ("strata-" + tag + "-XXXXXX")).string();
    std::vector<char> buffer(pattern.begin(), pattern.end());
    buffer.push_back('\0');
    char* made = ::mkdtemp(buffer.data());
    path_ = made != nullptr ? made : "";
  }
  ~ScratchDir() {
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove_all(path_, ignored);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The seed for a randomized test: $STRATA_TEST_SEED if set, else random.
// Printed so that a failure can be replayed.
inline uint64_t TestSeed() {
  const char* env = std::getenv("STRATA_TEST_SEED");
  uint64_t seed = env != nullptr ? std::strtoull(env, nullptr, 10) : std::random_device{}();
  std::printf("[ seed     ] STRATA_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

// Fills `size` bytes at `data` with random bytes from `rng`.
inline void FillRandom(void* data, size_t size, std::mt19937_64& rng) {
  auto* bytes = static_cast<unsigned char*>(data);
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    uint64_t word = rng();
    std::memcpy(bytes + i, &word, 8);
  }
  for (; i < size; ++i) bytes[i] = static_cast<unsigned char>(rng());
}

}  // namespace strata::testing
