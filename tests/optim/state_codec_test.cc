// The 8-bit states' codec: the code maps, the nearest-code encoding and the
// block scales (python/tests/test_state_codec.py checks it against torchao).
#include "optim/state_codec.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "optim/cpu/cpu_kernels.h"

namespace strata::optim {
namespace {

TEST(StateCodecTest, TheMapsAscendWithinMinusOneAndOneAndHoldZeroAndOne) {
  for (bool is_signed : {true, false}) {
    const StateCodeMap& map = CodeMap(is_signed);
    for (size_t i = 1; i < map.size(); ++i) EXPECT_LT(map[i - 1], map[i]) << i;
    EXPECT_EQ(map[255], 1.0f);
    EXPECT_GE(map[0], is_signed ? -1.0f : 0.0f);
  }
  const StateCodeMap& signed_map = CodeMap(true);
  EXPECT_EQ(signed_map[127], 0.0f);  // 127 negative values below it, 127 positive and 1 above
  for (size_t j = 0; j < 127; ++j) EXPECT_EQ(signed_map[126 - j], -signed_map[128 + j]) << j;
  EXPECT_EQ(CodeMap(false)[0], 0.0f);
  // The finest decade's first value, 1e-6 x the midpoint of 0.1 and 1 (one interval there when signed).
  EXPECT_FLOAT_EQ(signed_map[128], 0.55e-6f);
  EXPECT_FLOAT_EQ(CodeMap(false)[1], 1e-6f * (0.1f + 0.55f) / 2);
}

TEST(StateCodecTest, EachValueGetsTheNearestCodeAndATieTheUpperOne) {
  std::mt19937 random(7);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (bool is_signed : {true, false}) {
    const StateCodeMap& map = CodeMap(is_signed);
    for (int trial = 0; trial < 20000; ++trial) {
      float y = uniform(random);
      if (!is_signed) y = std::fabs(y);
      if (trial % 4 == 0) y *= 1e-4f;  // the fine codes near zero
      size_t nearest = 0;
      for (size_t c = 1; c < map.size(); ++c) {
        if (std::fabs(y - map[c]) <= std::fabs(y - map[nearest])) nearest = c;
      }
      const uint8_t code = EncodeScaled(y, map);
      EXPECT_LE(std::fabs(y - map[code]), std::fabs(y - map[nearest]) * (1 + 1e-6f)) << y;
    }
    // Midway between two neighbours: the upper one.
    const float mid = map[200] + (map[201] - map[200]) * 0.5f;
    EXPECT_EQ(EncodeScaled(mid, map), 201);
    EXPECT_EQ(EncodeScaled(map[37], map), 37);
    EXPECT_EQ(EncodeScaled(2.0f, map), 255);
    EXPECT_EQ(EncodeScaled(std::numeric_limits<float>::quiet_NaN(), map), 0);
  }
}

// Note [Encoding by thresholds]: the lookups give the search's code for every float.
TEST(StateCodecTest, TheThresholdEncoderCodesEveryFloatAsTheSearchDoes) {
  const auto from_bits = [](uint32_t bits) {
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  };
  for (bool is_signed : {true, false}) {
    const StateCodeMap& map = CodeMap(is_signed);
    const ThresholdEncoder& encoder = Encoder(is_signed);
    size_t checked = 0;
    const auto check = [&](float value) {
      ASSERT_EQ(EncodeByThresholds(value, encoder), EncodeScaled(value, map)) << value;
      ++checked;
    };
    // Every 61st bit pattern: every sign and exponent, NaNs and infinities too.
    for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 61) check(from_bits(static_cast<uint32_t>(bits)));
    // 64 ulps either side of every boundary and of every bucket's edges, both signs.
    std::vector<float> edges(encoder.threshold.begin(), encoder.threshold.end());
    for (uint32_t b = 0; b <= ThresholdEncoder::kBucketsPerSign; ++b) {
      using E = ThresholdEncoder;
      const float edge = from_bits(((E::kMinExponent << E::kBucketBits) + b) << E::kLowBits);
      edges.push_back(edge);
      edges.push_back(-edge);
    }
    for (float edge : edges) {
      float below = edge, above = edge;
      for (int k = 0; k < 64; ++k) {
        check(below = std::nextafter(below, -2.0f));
        check(above = std::nextafter(above, 2.0f));
      }
      check(edge);
    }
    EXPECT_GT(checked, size_t{70'000'000});
  }
}

// The vector kernels' encoders (AVX-512: by runs, Note [Encoding by runs],
// the lookup near boundaries; AVX2: the lookup) against the search, on every
// 61st float pattern and on the 256 floats either side of every boundary,
// run start and octave edge.
TEST(StateCodecTest, TheVectorEncodersCodeEveryFloatAsTheSearchDoes) {
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!CpuSupports(isa)) continue;
    for (bool is_signed : {true, false}) {
      SCOPED_TRACE(fmt::format("{}, {} map", CpuIsaName(isa), is_signed ? "signed" : "unsigned"));
      const StateCodeMap& map = CodeMap(is_signed);
      std::vector<float> values;
      for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 61) {
        values.push_back(std::bit_cast<float>(static_cast<uint32_t>(bits)));
      }
      std::vector<float> edges(Encoder(is_signed).threshold.begin(), Encoder(is_signed).threshold.end());
      for (int e = -40; e <= 1; ++e) edges.push_back(std::ldexp(1.0f, e));
      for (float edge : std::vector<float>(edges)) edges.push_back(-edge);
      values.resize(values.size() / 16 * 16);
      // Near an edge each value fills a vector of its own: a vector goes whole to the lookup when one of its
      // values lies within the runs' margins, and these must be coded by the runs where they are outside.
      for (float edge : edges) {
        float below = edge, above = edge;
        values.insert(values.end(), 16, edge);
        for (int k = 0; k < 256; ++k) {
          values.insert(values.end(), 16, below = std::nextafter(below, -2.0f));
          values.insert(values.end(), 16, above = std::nextafter(above, 2.0f));
        }
      }
      std::vector<uint8_t> codes(values.size());
      if (isa == CpuIsa::kAvx512) {
        avx512::EncodeScaled(values.data(), values.size(), is_signed, codes.data());
      } else {
        avx2::EncodeScaled(values.data(), values.size(), is_signed, codes.data());
      }
      for (size_t i = 0; i < values.size(); ++i) {
        ASSERT_EQ(int{codes[i]}, int{EncodeScaled(values[i], map)}) << values[i] << " (bits " << std::hex
                                                                     << std::bit_cast<uint32_t>(values[i]) << ")";
      }
    }
  }
}

TEST(StateCodecTest, BlocksRoundTripWithinHalfACodeOfTheirScale) {
  std::mt19937 random(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t n = 4 * kStateBlockElems;
  std::vector<float> values(n), back(n), scales(n / kStateBlockElems);
  std::vector<uint8_t> codes(n);
  for (size_t i = 0; i < n; ++i) values[i] = normal(random) * (i < kStateBlockElems ? 1e-3f : 1.0f);
  for (bool is_signed : {true, false}) {
    std::vector<float> input = values;
    if (!is_signed) {
      for (float& v : input) v = v * v;
    }
    QuantizeBlocks(input.data(), n, is_signed, codes.data(), scales.data());
    DequantizeBlocks(codes.data(), scales.data(), n, is_signed, back.data());
    const StateCodeMap& map = CodeMap(is_signed);
    for (size_t b = 0; b < scales.size(); ++b) {
      const float* block = input.data() + b * kStateBlockElems;
      EXPECT_EQ(scales[b], BlockScale(block, kStateBlockElems));
      float largest = 0;
      for (size_t i = 0; i < kStateBlockElems; ++i) largest = std::max(largest, std::fabs(block[i]));
      EXPECT_EQ(scales[b], largest);
    }
    for (size_t i = 0; i < n; ++i) {
      const float scale = scales[i / kStateBlockElems];
      const size_t code = codes[i];
      // Within half the gap to the neighbour on its side; beyond the map's last value on that side (the
      // signed map ends at -0.993, not -1), within the distance to the block's bound.
      const bool above = input[i] / scale >= map[code];
      const bool last = above ? code == 255 : code == 0;
      const float bound = last ? 1.0f - std::fabs(map[code])
                               : std::fabs(map[above ? code + 1 : code - 1] - map[code]) * 0.5f;
      EXPECT_LE(std::fabs(back[i] - input[i]), bound * scale * (1 + 1e-5f)) << i;
      EXPECT_EQ(back[i], map[code] * scale);
    }
  }
}

TEST(StateCodecTest, AZeroBlockKeepsZeroAndANanBlockANanScale) {
  std::vector<float> values(kStateBlockElems, 0.0f), back(kStateBlockElems);
  std::vector<uint8_t> codes(kStateBlockElems);
  float scale = 0;
  QuantizeBlocks(values.data(), kStateBlockElems, true, codes.data(), &scale);
  EXPECT_EQ(scale, 1e-12f);
  DequantizeBlocks(codes.data(), &scale, kStateBlockElems, true, back.data());
  EXPECT_EQ(back, values);
  values[9] = std::numeric_limits<float>::quiet_NaN();
  QuantizeBlocks(values.data(), kStateBlockElems, true, codes.data(), &scale);
  EXPECT_TRUE(std::isnan(scale));
}

TEST(StateCodecTest, OnlyTensorsOfWholeBlocksFromFourThousandElementsAreQuantized) {
  EXPECT_TRUE(QuantizesStates(4096));
  EXPECT_TRUE(QuantizesStates(256 * 1000));
  EXPECT_FALSE(QuantizesStates(3840));  // whole blocks, too small
  EXPECT_FALSE(QuantizesStates(4097));  // large enough, a partial block
  EXPECT_FALSE(QuantizesStates(0));
}

}  // namespace
}  // namespace strata::optim
