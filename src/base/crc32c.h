// CRC32C (Castagnoli, the iSCSI polynomial) of a byte range, computed with
// ISA-L's run-time dispatched implementation (SSE4.2/PCLMUL where present).
// Pure function; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace strata {

// The standard CRC-32C (initial value and final XOR 0xFFFFFFFF, so leading
// zero bytes change it); `seed` chains ranges: Crc32c(b, Crc32c(a)) ==
// Crc32c(a ++ b), and Crc32c of nothing is 0.
uint32_t Crc32c(const void* data, size_t size_bytes, uint32_t seed = 0);

// The CRC32C of every `piece_bytes` piece of the range (the last may be
// shorter), computed in parallel on oneTBB's threads.
inline constexpr size_t kCrcPieceBytes = size_t{1} << 20;
std::vector<uint32_t> Crc32cPieces(const void* data, size_t size_bytes, size_t piece_bytes = kCrcPieceBytes);

}  // namespace strata
