#include "tests/fuzz/fuzz_util.h"

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>

#include <gtest/gtest.h>

namespace strata::fuzz {
namespace {

namespace fs = std::filesystem;

// TMPDIR pointed at a fresh directory named for the test, so that a death
// test's child (which runs the test again from its start, SetUp included)
// makes its scratch where the parent looks.
class FuzzUtilTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* base = std::getenv("STRATA_TEST_DIR");
    const std::string name = ::testing::UnitTest::GetInstance()->current_test_info()->name();
    tmp_ = fs::path(base != nullptr ? base : "/tmp") / ("fuzz-util-test-" + name);
    fs::remove_all(tmp_);
    fs::create_directories(tmp_);
    const char* before = std::getenv("TMPDIR");
    if (before != nullptr) before_ = before;
    ::setenv("TMPDIR", tmp_.c_str(), 1);
  }
  void TearDown() override {
    if (before_) {
      ::setenv("TMPDIR", before_->c_str(), 1);
    } else {
      ::unsetenv("TMPDIR");
    }
    fs::remove_all(tmp_);
  }
  fs::path tmp_;
  std::optional<std::string> before_;
};

TEST_F(FuzzUtilTest, ATargetThatAbortsOnAFindingLeavesNoScratchDirectory) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the child runs from the start: its own pid, its own scratch
  const uint8_t byte = 7;
  EXPECT_DEATH(
      {
        WriteInput("input", &byte, 1);
        ExpectNotInternal(Internal("a broken invariant"));
      },
      "fuzz: an internal error: .*a broken invariant");
  EXPECT_TRUE(fs::is_empty(tmp_)) << fs::begin(fs::directory_iterator(tmp_))->path();
}

TEST_F(FuzzUtilTest, ARefusalNamingTheFileGoesOnAndTheScratchHoldsTheInput) {
  const uint8_t bytes[] = {1, 2, 3};
  const std::string path = WriteInput("input", bytes, sizeof(bytes));
  EXPECT_EQ(fs::path(path).parent_path().parent_path(), tmp_);
  EXPECT_EQ(fs::file_size(path), sizeof(bytes));
  ExpectRefusalNames(InvalidArgument("{}: not a safetensors file", path), path);  // returns: a refusal naming it
}

}  // namespace
}  // namespace strata::fuzz
