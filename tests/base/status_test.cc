#include "strata/status.h"

#include <gtest/gtest.h>

namespace strata {
namespace {

Result<int> Half(int value) {
  if (value % 2 != 0) return InvalidArgument("{} is odd: expected an even number", value);
  return value / 2;
}

Result<int> Quarter(int value) {
  STRATA_ASSIGN_OR_RETURN(int half, Half(value));
  STRATA_ASSIGN_OR_RETURN(int quarter, Half(half));
  return quarter;
}

Status CheckEven(int value) {
  STRATA_RETURN_IF_ERROR(Half(value).status());
  return Status::Ok();
}

TEST(StatusTest, OkStatusHasNoMessage) {
  Status status;
  EXPECT_TRUE(status.ok());
  EXPECT_EQ(status.ToString(), "OK");
}

TEST(StatusTest, FactoryFormatsMessageAndNamesCode) {
  Status status = OutOfMemory("device tier: {} of {}", 3, 4);
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kOutOfMemory);
  EXPECT_EQ(status.ToString(), "OutOfMemory: device tier: 3 of 4");
}

TEST(StatusTest, WithContextPrefixesMessageAndKeepsCode) {
  Status status = IoError("read failed").WithContext("chunk 7");
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_EQ(status.message(), "chunk 7: read failed");
  EXPECT_TRUE(Status::Ok().WithContext("ignored").ok());
}

TEST(StatusTest, AssignOrReturnPropagatesFirstError) {
  Result<int> ok = Quarter(12);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 3);
  Result<int> bad = Quarter(6);  // 6 -> 3 -> odd
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("3 is odd"), std::string::npos);
  EXPECT_FALSE(CheckEven(5).ok());
  EXPECT_TRUE(CheckEven(4).ok());
}

TEST(StatusTest, ResultFromOkStatusIsAnInternalError) {
  Result<int> result{Status::Ok()};
  EXPECT_FALSE(result.ok());
  EXPECT_EQ(result.status().code(), StatusCode::kInternal);
}

TEST(StatusDeathTest, CheckAbortsWithMessage) {
  EXPECT_DEATH(STRATA_CHECK(1 + 1 == 3, "arithmetic is {}", "broken"), "arithmetic is broken");
  Result<int> error = Half(1);
  EXPECT_DEATH((void)error.value(), "value\\(\\) of an error Result");
}

}  // namespace
}  // namespace strata
