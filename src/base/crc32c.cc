#include "src/base/crc32c.h"

#include <algorithm>
#include <climits>

#include <isa-l/crc.h>
#include <tbb/parallel_for.h>

namespace strata {

uint32_t Crc32c(const void* data, size_t size_bytes, uint32_t seed) {
  // ISA-L takes an int length: feed ranges over 2 GiB in pieces.
  constexpr size_t kMaxPieceBytes = size_t{1} << 30;
  auto* bytes = static_cast<unsigned char*>(const_cast<void*>(data));
  // ISA-L's crc32_iscsi neither presets nor inverts: do both here.
  uint32_t crc = ~seed;
  while (size_bytes > 0) {
    size_t piece = std::min(size_bytes, kMaxPieceBytes);
    crc = crc32_iscsi(bytes, static_cast<int>(piece), crc);
    bytes += piece;
    size_bytes -= piece;
  }
  return ~crc;
}

std::vector<uint32_t> Crc32cPieces(const void* data, size_t size_bytes, size_t piece_bytes) {
  const size_t pieces = (size_bytes + piece_bytes - 1) / piece_bytes;
  std::vector<uint32_t> crcs(pieces);
  const auto* bytes = static_cast<const unsigned char*>(data);
  tbb::parallel_for(size_t{0}, pieces, [&](size_t i) {
    size_t begin = i * piece_bytes;
    crcs[i] = Crc32c(bytes + begin, std::min(piece_bytes, size_bytes - begin));
  });
  return crcs;
}

}  // namespace strata
