#include "optim/state_codec.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

namespace strata::optim {

// Note [8-bit states]
// Adam's two moments take 8 bytes a parameter in fp32; in 8 bits they take
// one each, plus a 4-byte scale per block of 256 (Dettmers et al., "8-bit
// Optimizers via Block-wise Quantization", 2110.02861), the scheme of
// bitsandbytes' and torchao's 8-bit Adam, whose semantics these follow:
//   - a block's scale is its largest magnitude (at least 1e-12); each value
//     is divided by it and stored as the code of the nearest value in a map
//     of 256 (ties to the upper one);
//   - the maps are "dynamic": per decade from 1e-6 to 1, a linear run of
//     values between 0.1 and 1 of that decade, finer in the larger decades;
//     the signed map (the first moment) spends half its codes on negative
//     values, the unsigned map (the second moment, never negative) all on
//     positive ones; both also hold 0 and 1;
//   - tensors under 4096 elements, or not in whole blocks, keep fp32 states.
// The maps here are computed in fp32 from their definition, one operation
// at a time. torchao builds its map with torch.linspace, whose last bits
// depend on the vector width PyTorch's kernels run at: its values are
// within 2 ulps of these on an AVX-512 machine. The maps are part of the
// states' format (a checkpoint's codes mean these values), so they do not
// vary with the machine.
// The update (scalar::Adam8bitUpdate in cpu/cpu_reference.cc, the
// reference) dequantizes a block's moments, updates them and the weights in
// fp32 with torchao's arithmetic (the moments by lerp, the decay as
// w - lr * wd * w, the step as lr * (m / (1 - beta1^t)) / denom, no fused
// multiply-add) and quantizes the block's new moments; the weights' update
// reads the fp32 moments, not their codes. So given the same maps, 20 steps
// are torchao's bit for bit (python/tests/test_state_codec.py). fp32 states
// keep torch.optim's arithmetic instead (Note [torch.optim's arithmetic] in
// cpu/cpu_kernels.cc): each path is exact against its own reference.

// Note [Encoding by thresholds]
// EncodeScaled's eight-step search and its rounding make a code that never
// falls as the value grows, so it is the number of boundaries between
// neighbouring codes that the value reaches, each boundary the least float
// the search codes above it (found once by bisection over the floats
// between the two map values). Vector code cannot afford eight dependent
// lookups a value, nor a gather per boundary. It looks up the value's bucket
// (its sign, exponent and top 7 mantissa bits), narrow enough that no bucket
// holds two boundaries: the map's values lie at least 0.007 apart where
// they are densest, near 1, and a bucket there is 2^-8 wide. The entry
// holds the code at the bucket's least magnitude and the low 16 mantissa
// bits where the one boundary in it lies; a value at or past them is one
// code further (up for a positive value, down for a negative one). The
// buckets below 2^-30 and from 1 up share one entry each, so they must hold
// no boundary: BuildEncoder checks every bucket as it fills it.
// tests/optim/state_codec_test.cc checks the lookup against the search on
// every 61st float pattern and around every boundary and bucket edge.

namespace {

// n values from 0.1 to 1 evenly spaced, in fp32 as a linear space is: from
// the near end, each half of it.
std::vector<float> Spaced(int n) {
  const float start = 0.1f, end = 1.0f;
  const float step = (end - start) / static_cast<float>(n - 1);
  std::vector<float> values(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    values[static_cast<size_t>(i)] =
        i < n / 2 ? start + step * static_cast<float>(i) : end - step * static_cast<float>(n - 1 - i);
  }
  return values;
}

StateCodeMap BuildCodeMap(bool is_signed) {
  std::vector<float> values;
  for (int decade = 0; decade < 7; ++decade) {
    // Decade 10^(decade - 6): 2^decade intervals (signed), 2^(decade + 1) (unsigned), each its midpoint.
    const std::vector<float> bounds = Spaced((is_signed ? 1 << decade : 2 << decade) + 1);
    const auto scale = static_cast<float>(std::pow(10.0, decade - 6));
    for (size_t i = 0; i + 1 < bounds.size(); ++i) {
      const float mid = (bounds[i] + bounds[i + 1]) / 2.0f;
      values.push_back(scale * mid);
      if (is_signed) values.push_back(-scale * mid);
    }
  }
  values.push_back(0.0f);
  values.push_back(1.0f);
  std::sort(values.begin(), values.end());
  StateCodeMap map{};
  std::copy(values.begin(), values.end(), map.begin());  // 256: 2 x 127 + 2 signed, 254 + 2 unsigned
  return map;
}

float FromBits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// Floats in the order of their values as unsigned keys (negative ones
// first), and back: the thresholds are found by bisection over these.
uint32_t OrderKey(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits >> 31 ? ~bits : bits | 0x80000000u;
}
float FromOrderKey(uint32_t key) { return FromBits(key >> 31 ? key & 0x7fffffffu : ~key); }

ThresholdEncoder BuildEncoder(const StateCodeMap& map) {
  ThresholdEncoder e{};
  // The least float between map[c] and map[c + 1] that EncodeScaled codes above c.
  for (size_t c = 0; c < 255; ++c) {
    uint32_t low = OrderKey(map[c]), high = OrderKey(map[c + 1]);
    while (low < high) {
      const uint32_t mid = low + (high - low) / 2;
      if (EncodeScaled(FromOrderKey(mid), map) > c) {
        high = mid;
      } else {
        low = mid + 1;
      }
    }
    e.threshold[c] = FromOrderKey(low);
  }
  // Each bucket: its magnitudes' range as bits (the lowest from 0, the last
  // to +inf), the code at its least magnitude and where the code changes.
  using E = ThresholdEncoder;
  const auto start = [](uint32_t b) { return ((E::kMinExponent << E::kBucketBits) + b) << E::kLowBits; };
  for (uint32_t negative = 0; negative < 2; ++negative) {
    const auto code_of = [&](uint32_t magnitude) {
      return EncodeScaled(FromBits(magnitude | negative << 31), map);
    };
    for (uint32_t b = 0; b < E::kBucketsPerSign; ++b) {
      const bool shared = b == 0 || b + 1 == E::kBucketsPerSign;  // covers more than its own 16 low bits
      const uint32_t low = b == 0 ? 0 : start(b), high = b + 1 == E::kBucketsPerSign ? 0x7f800000u : start(b + 1) - 1;
      const uint8_t base = code_of(low);
      uint32_t boundary = E::kNoBoundary;
      if (code_of(high) != base) {
        if (shared || std::abs(int{code_of(high)} - int{base}) != 1) {
          std::fprintf(stderr, "state codec: bucket %u holds more than one boundary\n", b);
          std::abort();
        }
        uint32_t a = low, z = high;  // the least magnitude coded past base
        while (a < z) {
          const uint32_t mid = a + (z - a) / 2;
          if (code_of(mid) != base) {
            z = mid;
          } else {
            a = mid + 1;
          }
        }
        boundary = a & (E::kNoBoundary - 1);
      }
      e.entry[negative * E::kBucketsPerSign + b] = base | boundary << 8;
    }
  }
  return e;
}

// Note [Encoding by runs]
// A gather a value (the lookup of Note [Encoding by thresholds]) took about
// 40% of the 8-bit update on the development VM: its two tables (31 KiB
// each) miss the L1 cache. The maps are made of runs of evenly spaced
// values (Note [8-bit states]: each decade's linear run, 0 and 1), so a
// positive value's code is its run's first code plus where it falls in the
// run: int(x * slope + offset), the boundaries between codes at the
// integers. Runs start at least a factor 5 apart, so an octave holds at most
// one run start: the octave's entry gives the run below it and that start,
// and one comparison the run. The multiply-add rounds, and the map's values
// and boundaries are fp32 computations: the result is trusted only at least
// kMargin of a code's width from an integer and kUlps from a run start, as
// BuildRuns checks every exact threshold lies far closer than that (a
// multiply-add with a positive slope never falls as x grows, so a value
// outside the margins lies on its threshold's side), and every run start
// (and its mirror) kUlps from an octave's edge, where no entry would see it.
// The rest (about 0.2% of values, so about 3% of 16-lane vectors, which go
// whole; and NaN) go to the lookup. A signed map is symmetric: a
// negative value's code mirrors its magnitude's (254 - code, at least 0: no
// -1); an unsigned map codes every negative value 0. BuildRuns aborts where
// a map is not so.
RunEncoder BuildRuns(const StateCodeMap& map, const ThresholdEncoder& encoder, bool is_signed) {
  const auto fail = [](const char* what) {
    std::fprintf(stderr, "state codec: %s\n", what);
    std::abort();
  };
  const int zero = static_cast<int>(std::find(map.begin(), map.end(), 0.0f) - map.begin());
  if (map[255] != 1.0f || zero == 256 || (is_signed && zero != 127) || (!is_signed && zero != 0)) {
    fail("a map without 0 and 1 where the runs need them");
  }
  for (int j = 0; is_signed && j < 127; ++j) {
    if (map[126 - j] != -map[128 + j]) fail("a signed map that is not symmetric");
  }
  std::vector<std::pair<int, int>> runs = {{zero, zero}};  // first and last code
  for (int c = zero + 1; c < 255;) {
    int last = c;
    const double width = static_cast<double>(map[c + 1]) - map[c];
    while (last + 1 < 255 && std::abs((static_cast<double>(map[last + 1]) - map[last]) - width) <= 1e-3 * width) ++last;
    runs.emplace_back(c, last);
    c = last + 1;
  }
  runs.emplace_back(255, 255);
  RunEncoder r{};
  if (runs.size() > r.base.size()) fail("a map of more runs than the encoder holds");
  std::vector<float> starts;  // of the runs after the first: the least float of their first code
  for (size_t i = 0; i < runs.size(); ++i) {
    const auto [first, last] = runs[i];
    r.base[i] = first;
    r.last[i] = last - first;
    const double width = last > first ? (static_cast<double>(map[last]) - map[first]) / (last - first) : 0.0;
    r.slope[i] = last > first ? static_cast<float>(1.0 / width) : 0.0f;
    r.offset[i] = last > first ? static_cast<float>(0.5 - map[first] / width) : 0.5f;  // a run of one: mid-code
    if (i > 0) starts.push_back(encoder.threshold[first - 1]);
    for (int c = first; c < last; ++c) {  // each boundary in the run, and its mirror, well inside the margin
      for (float edge : {encoder.threshold[c], is_signed ? -encoder.threshold[253 - c] : encoder.threshold[c]}) {
        const float t = std::fma(edge, r.slope[i], r.offset[i]);
        if (std::abs(t - static_cast<float>(c - first + 1)) > RunEncoder::kMargin / 8) fail("a boundary off its run");
      }
    }
  }
  for (size_t i = 0; is_signed && i + 1 < starts.size(); ++i) {  // the mirrored starts (not 1's: no -1)
    const int32_t apart = static_cast<int32_t>(OrderKey(-encoder.threshold[253 - (runs[i + 1].first - 1)])) -
                          static_cast<int32_t>(OrderKey(starts[i]));
    if (std::abs(apart) > RunEncoder::kUlps / 8) fail("a run start whose mirror is far from it");
  }
  for (float start : starts) {  // the octave's entry sees a start within kUlps of its edge only from one side
    const int edge = static_cast<int>(std::round(std::log2(start)));
    if (std::abs(static_cast<int64_t>(OrderKey(start)) - OrderKey(std::ldexp(1.0f, edge))) < 2 * RunEncoder::kUlps) {
      fail("a run start beside a power of two");
    }
  }
  for (uint32_t e = RunEncoder::kLowestExponent; e < 128; ++e) {
    const float low = std::ldexp(1.0f, static_cast<int>(e) - 127), high = 2 * low;
    int run = 0;
    float next = std::numeric_limits<float>::infinity();
    for (size_t i = 0; i < starts.size(); ++i) {
      if (starts[i] <= low) run = static_cast<int>(i) + 1;
      if (starts[i] > low && starts[i] < high) {
        if (next != std::numeric_limits<float>::infinity()) fail("an octave with two run starts");
        next = starts[i];
      }
    }
    if (e == RunEncoder::kLowestExponent && run != 0) fail("a run that starts below the lowest octave");
    r.run_below[e & 31] = run;
    r.next_run_from[e & 31] = next;
  }
  return r;
}

}  // namespace

const RunEncoder& Runs(bool is_signed) {
  static const RunEncoder signed_runs = BuildRuns(CodeMap(true), Encoder(true), true);
  static const RunEncoder unsigned_runs = BuildRuns(CodeMap(false), Encoder(false), false);
  return is_signed ? signed_runs : unsigned_runs;
}

const ThresholdEncoder& Encoder(bool is_signed) {
  static const ThresholdEncoder signed_encoder = BuildEncoder(CodeMap(true));
  static const ThresholdEncoder unsigned_encoder = BuildEncoder(CodeMap(false));
  return is_signed ? signed_encoder : unsigned_encoder;
}

const StateTables& TablesOf(bool is_signed) {
  // Made once (the kernels ask for them a block at a time), each with the planes it points at.
  struct Made {
    std::array<uint8_t, 4 * 256> planes;
    StateTables tables;
    explicit Made(bool is_signed) : planes() {
      const StateCodeMap& map = CodeMap(is_signed);
      for (size_t c = 0; c < 256; ++c) {
        uint32_t bits;
        std::memcpy(&bits, &map[c], sizeof(bits));
        for (size_t k = 0; k < 4; ++k) planes[256 * k + c] = static_cast<uint8_t>(bits >> (8 * k));
      }
      tables = {.map = map.data(),
                .entry = Encoder(is_signed).entry.data(),
                .planes = planes.data(),
                .runs = &Runs(is_signed),
                .is_signed = is_signed};
    }
  };
  static const Made signed_tables(true), unsigned_tables(false);
  return (is_signed ? signed_tables : unsigned_tables).tables;
}

const StateCodeMap& CodeMap(bool is_signed) {
  static const StateCodeMap signed_map = BuildCodeMap(true);
  static const StateCodeMap unsigned_map = BuildCodeMap(false);
  return is_signed ? signed_map : unsigned_map;
}

float BlockScale(const float* values, size_t n) {
  float largest = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    const float magnitude = std::fabs(values[i]);
    if (std::isnan(magnitude)) return magnitude;
    largest = std::max(largest, magnitude);
  }
  return std::max(largest, 1e-12f);
}

void QuantizeBlocks(const float* values, size_t n, bool is_signed, uint8_t* codes, float* scales) {
  const StateCodeMap& map = CodeMap(is_signed);
  for (size_t block = 0; block * kStateBlockElems < n; ++block) {
    const size_t at = block * kStateBlockElems;
    const float scale = BlockScale(values + at, kStateBlockElems);
    scales[block] = scale;
    for (size_t i = at; i < at + kStateBlockElems; ++i) codes[i] = EncodeScaled(values[i] / scale, map);
  }
}

void DequantizeBlocks(const uint8_t* codes, const float* scales, size_t n, bool is_signed, float* values) {
  const StateCodeMap& map = CodeMap(is_signed);
  for (size_t i = 0; i < n; ++i) values[i] = map[codes[i]] * scales[i / kStateBlockElems];
}

}  // namespace strata::optim
