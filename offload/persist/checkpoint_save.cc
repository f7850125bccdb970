// A rank's part of a save: its chunks' files written, three at a time, from
// where each chunk lies or from a copy.

#include <algorithm>

#include <fmt/format.h>

#include "offload/persist/checkpoint_internal.h"
#include "src/base/alignment.h"
#include "src/base/crc32c.h"
#include "strata/buffer.h"

namespace strata::offload::checkpoint {

// Note [Writing a chunk from where it lies]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A chunk in host memory is written to its file from where it lies, neither
// copied nor pinned (Engine::PeekHostChunk), so that an asynchronous save
// neither holds up training for a chunk nor copies the model through memory
// (on the VM of docs/benchmarks.md, where the drive's writes are themselves
// copies in the host, that copy cost a quarter of the save's bandwidth).
// Its bytes do not change meanwhile: only an update writes a saved chunk,
// and the update of its group waits (UpdateFence) for `done`, called once
// its file is written. The chunk may move meanwhile, and its slot be given
// to another chunk while the write reads it; so once the file is written,
// the chunk's generation is compared with the one it was written from, and
// if it changed the file is written again from a copy (Engine::ReadChunk,
// wherever the chunk is then; counted in CheckpointSummary::rewritten). A
// chunk on the device or NVMe is read into a buffer (an NVMe-resident chunk
// is not moved), so the model is never staged in host memory. Nothing moves
// during a synchronous save: it takes the same path.
//
// Three chunks' files are written at a time (two left the drive idle
// between files: 0.77-0.83 x bench io's write against 0.86-0.91), each from
// where its chunk lies in host memory or from a copy in its own chunk-sized
// buffer; its CRC32C is taken beside its write. A file is written over a
// spare where one fits (Note [Recycled chunk files]).

namespace {

// Writes one rank's chunk files, kInFlight at a time.
class RankFileWriter {
 public:
  RankFileWriter(FileSystem& files, Engine& engine, const fs::path& staged, SpareFiles& spares,
                 const SaveHooks& hooks, CheckpointSummary& summary)
      : files_(files), engine_(engine), staged_(staged), spares_(spares), hooks_(hooks), summary_(summary),
        rank_dir_(fmt::format("rank{}", engine.rank())) {}
  // On an early return: no write left reading a buffer about to go, or a chunk.
  ~RankFileWriter() {
    for (InFlight& flight : flights_) {
      if (flight.transfer) (void)flight.transfer->Finish();
      if (flight.crc_done.valid()) flight.crc_done.wait();
    }
  }

  Result<json> Write();

 private:
  static constexpr int kInFlight = 3;

  struct InFlight {
    std::byte* buffer = nullptr;  // its own
    std::optional<ChunkInfo> chunk;
    std::optional<uint64_t> generation;  // written from where it lies in host memory, as of this generation
    fs::path path;
    std::unique_ptr<FileTransfer> transfer;
    std::shared_future<Status> crc_done;
    uint32_t crc = 0;
    json entry;
  };

  std::vector<ChunkInfo> ChunksToSave() const;
  Status AllocateBuffers(const std::vector<ChunkInfo>& chunks);
  Status StartFile(InFlight& flight, const std::byte* data);
  static Status WaitFile(InFlight& flight);
  Status RewriteIfMoved(InFlight& flight);
  Status FinishFile(InFlight& flight);
  Status TakeChunk(InFlight& flight, const ChunkInfo& c);

  FileSystem& files_;
  Engine& engine_;
  const fs::path& staged_;
  SpareFiles& spares_;
  const SaveHooks& hooks_;
  CheckpointSummary& summary_;
  const std::string rank_dir_;
  TaskQueue pool_{FileTransfer::kThreads};
  Buffer buffers_[kInFlight];
  InFlight flights_[kInFlight];  // after the buffers and the pool they use
  json entries_ = json::array();
  std::vector<fs::path> written_;
};

// This rank's chunks to save: its shards, and on rank 0 the whole chunks
// too (every rank holds the same ones), chunk group by chunk group.
std::vector<ChunkInfo> RankFileWriter::ChunksToSave() const {
  std::vector<ChunkInfo> chunks;
  for (ChunkInfo& c : engine_.chunks()) {
    if (Saved(c) && (c.sharded || engine_.rank() == 0)) chunks.push_back(std::move(c));
  }
  std::stable_sort(chunks.begin(), chunks.end(),
                   [](const ChunkInfo& a, const ChunkInfo& b) { return a.group < b.group; });
  return chunks;
}

Status RankFileWriter::AllocateBuffers(const std::vector<ChunkInfo>& chunks) {
  uint64_t largest = kIoAlignmentBytes;
  for (const ChunkInfo& c : chunks) largest = std::max(largest, c.size_bytes);
  for (int i = 0; i < kInFlight; ++i) {
    buffers_[i] = AllocateAlignedHost(RoundUp(largest), kIoAlignmentBytes);
    if (!buffers_[i]) return OutOfMemory("checkpoint: {} {}-byte chunk buffers", kInFlight, RoundUp(largest));
    flights_[i].buffer = static_cast<std::byte*>(buffers_[i].data());
  }
  return Status::Ok();
}

Status RankFileWriter::StartFile(InFlight& flight, const std::byte* data) {
  const uint64_t size = flight.chunk->used_bytes;
  STRATA_ASSIGN_OR_RETURN(flight.transfer, FileTransfer::StartWrite(files_, pool_, flight.path, data, size));
  flight.crc_done = pool_.Push([&flight, data, size] {
    flight.crc = Crc32c(data, size);
    return Status::Ok();
  });
  return Status::Ok();
}

Status RankFileWriter::WaitFile(InFlight& flight) {
  const Status status = flight.transfer->Finish();
  const Status crc = flight.crc_done.get();
  flight.transfer.reset();
  return status.ok() ? crc : status;
}

// A file written from where its chunk lay, the chunk moved since: written again from a copy.
Status RankFileWriter::RewriteIfMoved(InFlight& flight) {
  STRATA_ASSIGN_OR_RETURN(uint64_t now, engine_.ChunkGeneration(flight.chunk->id));
  if (now == *flight.generation) return Status::Ok();
  summary_.rewritten++;
  STRATA_RETURN_IF_ERROR(
      hooks_.read_chunk(flight.chunk->id, flight.buffer).WithContext("checkpoint: reading a chunk that moved"));
  STRATA_RETURN_IF_ERROR(StartFile(flight, flight.buffer));
  return WaitFile(flight);
}

Status RankFileWriter::FinishFile(InFlight& flight) {
  if (!flight.transfer) return Status::Ok();
  Status status = WaitFile(flight);
  if (status.ok() && flight.generation) status = RewriteIfMoved(flight);
  if (flight.generation) hooks_.done(*flight.chunk);
  STRATA_RETURN_IF_ERROR(status);
  flight.entry["crc32c"] = flight.crc;
  entries_.push_back(std::move(flight.entry));
  return Status::Ok();
}

// Starts chunk `c`'s file in `flight` (done with its last one): from where
// the chunk lies in host memory, else from a copy in the flight's buffer.
Status RankFileWriter::TakeChunk(InFlight& flight, const ChunkInfo& c) {
  STRATA_RETURN_IF_ERROR(hooks_.begin_chunk(c.id));
  const std::string path = fmt::format("{}/chunk-{}.bin", rank_dir_, c.id.value());
  flight.chunk = c;
  flight.path = staged_ / path;
  flight.generation.reset();
  const std::byte* data = flight.buffer;
  STRATA_ASSIGN_OR_RETURN(std::optional<HostBytes> lies, engine_.PeekHostChunk(c.id));
  if (lies && IsAligned(lies->data) && c.size_bytes >= RoundUp(c.used_bytes)) {
    data = lies->data;
    flight.generation = lies->generation;
  } else {
    STRATA_RETURN_IF_ERROR(hooks_.read_chunk(c.id, flight.buffer).WithContext("checkpoint: reading a chunk to save"));
    hooks_.done(c);
  }
  summary_.recycled += c.used_bytes > 0 && spares_.Claim(flight.path, c.used_bytes) ? 1 : 0;
  STRATA_RETURN_IF_ERROR(StartFile(flight, data));
  written_.push_back(flight.path);
  flight.entry = {{"path", path},
                  {"chunk", c.id.value()},
                  {"kind", ChunkKindName(c.kind)},
                  {"dtype", DTypeName(c.dtype)},
                  {"group", c.group},
                  {"rank", engine_.rank()},
                  {"shard_offset", c.shard_offset_bytes},
                  {"bytes", c.used_bytes}};
  summary_.bytes += c.used_bytes;
  summary_.files++;
  return Status::Ok();
}

Result<json> RankFileWriter::Write() {
  // Inside rank 0's directory, never creating it (Note [Publishing a checkpoint]).
  const fs::path dir = staged_ / rank_dir_;
  if (Result<bool> made = files_.CreateDirectory(dir.string()); !made.ok()) {
    return made.status().WithContext("checkpoint");
  }
  const std::vector<ChunkInfo> chunks = ChunksToSave();
  STRATA_RETURN_IF_ERROR(AllocateBuffers(chunks));
  int b = 0;
  for (const ChunkInfo& c : chunks) {
    STRATA_RETURN_IF_ERROR(FinishFile(flights_[b]));
    STRATA_RETURN_IF_ERROR(TakeChunk(flights_[b], c));
    b = (b + 1) % kInFlight;
  }
  for (int i = 0; i < kInFlight; ++i) STRATA_RETURN_IF_ERROR(FinishFile(flights_[(b + i) % kInFlight]));  // older first
  STRATA_RETURN_IF_ERROR(FlushAll(files_, pool_, written_));
  STRATA_RETURN_IF_ERROR(files_.SyncDirectory(dir.string()).WithContext("checkpoint"));
  return std::move(entries_);
}

}  // namespace

Result<json> WriteRankFiles(FileSystem& files, Engine& engine, const fs::path& staged, SpareFiles& spares,
                            const SaveHooks& hooks, CheckpointSummary& summary) {
  RankFileWriter writer(files, engine, staged, spares, hooks, summary);
  return writer.Write();
}

}  // namespace strata::offload::checkpoint
