#include "src/base/crc32c.h"

#include <cstring>
#include <string>
#include <vector>

#include "test_util.h"

namespace strata {
namespace {

TEST(Crc32cTest, MatchesKnownCheckValue) {
  // The CRC-32C check value of "123456789" (RFC 3720, iSCSI) is 0xE3069283.
  const std::string text = "123456789";
  EXPECT_EQ(Crc32c(text.data(), text.size()), 0xE3069283u);
  EXPECT_EQ(Crc32c(text.data(), 0), 0u);
}

TEST(Crc32cTest, LeadingZerosChangeIt) {
  std::vector<unsigned char> zeros(4096, 0);
  EXPECT_NE(Crc32c(zeros.data(), 4096), Crc32c(zeros.data(), 2048));
  EXPECT_NE(Crc32c(zeros.data(), 4096), 0u);
}

TEST(Crc32cTest, ChainsAcrossRanges) {
  std::mt19937_64 rng(testing::TestSeed());
  std::vector<unsigned char> data(100'003);
  testing::FillRandom(data.data(), data.size(), rng);
  uint32_t whole = Crc32c(data.data(), data.size());
  uint32_t first = Crc32c(data.data(), 4096);
  EXPECT_EQ(Crc32c(data.data() + 4096, data.size() - 4096, first), whole);
}

TEST(Crc32cTest, DetectsOneFlippedBit) {
  std::vector<unsigned char> data(8192, 0x5A);
  uint32_t before = Crc32c(data.data(), data.size());
  data[5000] ^= 0x10;
  EXPECT_NE(Crc32c(data.data(), data.size()), before);
}

TEST(Crc32cTest, PiecesMatchTheCrcOfEachPiece) {
  std::mt19937_64 rng(testing::TestSeed());
  std::vector<unsigned char> data(5 * 4096 + 123);
  testing::FillRandom(data.data(), data.size(), rng);
  std::vector<uint32_t> pieces = Crc32cPieces(data.data(), data.size(), 4096);
  ASSERT_EQ(pieces.size(), 6u);
  for (size_t i = 0; i < pieces.size(); ++i) {
    size_t size = std::min<size_t>(4096, data.size() - i * 4096);
    EXPECT_EQ(pieces[i], Crc32c(data.data() + i * 4096, size)) << i;
  }
  EXPECT_TRUE(Crc32cPieces(data.data(), 0).empty());
}

}  // namespace
}  // namespace strata
