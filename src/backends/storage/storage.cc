#include "strata/storage.h"

namespace strata {

// The default batch: one segment after another. Backends that can keep
// requests of several segments in flight at once override these.
Status Storage::WriteBatch(std::span<const IoSegment> segments) {
  for (const IoSegment& segment : segments) {
    STRATA_RETURN_IF_ERROR(Write(segment.offset, segment.buffer, segment.size_bytes));
  }
  return Status::Ok();
}

Status Storage::ReadBatch(std::span<const IoSegment> segments) {
  for (const IoSegment& segment : segments) {
    STRATA_RETURN_IF_ERROR(Read(segment.offset, segment.buffer, segment.size_bytes));
  }
  return Status::Ok();
}

}  // namespace strata
