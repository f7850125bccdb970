// SQPOLL rings (option nvme.sqpoll) were tried and withdrawn (Note [SQPOLL]
// in uring_storage.cc): asking for them is a clear error, not a stall.
#include "strata/storage.h"
#include "test_util.h"

namespace strata {
namespace {

TEST(UringSqpollTest, AskingForSqpollRingsIsNotSupportedNamingTheOption) {
  testing::ScratchDir dir("sqpoll");
  UringStorageOptions options;
  options.dirs = {dir.path()};
  options.capacity_bytes = 4 << 20;
  options.sqpoll = true;
  Result<std::unique_ptr<Storage>> storage = CreateUringStorage(options);
  ASSERT_FALSE(storage.ok());
  EXPECT_EQ(storage.status().code(), StatusCode::kNotSupported);
  EXPECT_NE(storage.status().message().find("nvme.sqpoll=false"), std::string::npos) << storage.status().ToString();
}

}  // namespace
}  // namespace strata
