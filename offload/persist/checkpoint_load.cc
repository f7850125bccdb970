// Loading and verifying a checkpoint: every file read whole and checked
// against its size and CRC32C before any of it is used.

#include <algorithm>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "offload/persist/checkpoint_internal.h"
#include "src/base/alignment.h"
#include "src/base/half.h"
#include "strata/buffer.h"

namespace strata::offload {
namespace {

namespace fs = std::filesystem;
using checkpoint::Agree;
using checkpoint::CheckCrc;
using checkpoint::CheckGroup;
using checkpoint::CheckNoSavePending;
using checkpoint::CheckpointsUnder;
using checkpoint::FileTransfer;
using checkpoint::Guarded;
using checkpoint::GroupOf;
using checkpoint::json;
using checkpoint::ReadManifest;
using checkpoint::Resolve;
using checkpoint::Saved;
using checkpoint::StepOf;
using checkpoint::TensorsJson;

// Note [Loading a checkpoint]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each chunk this rank holds (a whole chunk, or its shard of a group's) is
// filled from the files that cover its range of the group's whole chunk,
// whichever rank saved them, so a checkpoint saved by W ranks loads on any
// number (with the same precision and chunk.size_elems), with
// comm.shard_params or without. A checkpoint saved with it holds a group's
// masters but no params, and one of an fp32 run without it params but no
// masters: the other kind stands in (the params are then the masters
// rounded to their dtype, as the update rounds them; a frozen group's
// master shards are its params; fp32 params are their own masters). A
// bf16/fp16 run's params cannot stand in for fp32 masters. The files'
// ranges must tile each chunk's, no gap and no overlap, or the load is
// InvalidArgument before anything is read, as it is for a checkpoint of
// another model (its registered tensors) or an optimizer with a loss scaler
// where the saved one had none, or the reverse.
//
// A file that is exactly its chunk's bytes is read straight into the chunk
// where it lies in host memory (pinned there: no copy), or written where the
// chunk lives (Engine::WriteChunk: an NVMe-resident chunk is not read
// first); a chunk made of several files (another number of ranks), or of
// another dtype, is filled in host memory, pinned there. The next file is
// read while this one is used (two buffers). A damaged file is Corruption
// naming it; it has then overwritten its chunk, so the engine's state is
// partly overwritten: another checkpoint must be loaded, which fall_back
// does, going on to the checkpoints of earlier steps under the root (later
// ones belong to a run that was rewound), or to all of them when `latest` is
// missing or unreadable (a first save killed before it). Data parallel, the
// ranks agree on each candidate: they load the same checkpoint or all fail.

// A file of a checkpoint to read, and what of it a chunk takes: bytes
// [from, to) of its chunk group's whole chunk, into `chunk`.
struct Piece {
  const json* file = nullptr;
  uint64_t from = 0, to = 0;  // elements of the group's whole chunk
  std::optional<ChunkInfo> chunk;
  DType dtype = DType::kFloat32;  // the file's

  uint64_t bytes() const { return file->at("bytes").get<uint64_t>(); }
  std::string path() const { return file->at("path").get<std::string>(); }
  // The file's first element in the group's whole chunk.
  uint64_t file_begin() const { return ChunkElems(dtype, file->at("shard_offset").get<uint64_t>()); }
};

// Reads every piece's file, checked against its size and CRC32C, and hands
// it to `use` in order (with its index), in a buffer of at least `room`
// bytes that `use` may change, or where `into(i)` says (a chunk's own
// bytes; nullptr: a buffer); the next file is read while `use` runs on this
// one. The two buffers grow to the largest file read into them, once its
// size on disk is the manifest's: no manifest sizes them beyond the files.
template <typename Into, typename Use>
Status ReadPieces(FileSystem& files, const fs::path& dir, const std::vector<Piece>& pieces, uint64_t room, Into into,
                  Use use) {
  TaskQueue pool(FileTransfer::kThreads);
  Buffer buffers[2];
  std::unique_ptr<FileTransfer> reading[2];
  std::byte* read_into[2] = {};
  const auto start = [&](size_t i) -> Status {
    STRATA_ASSIGN_OR_RETURN(reading[i % 2], FileTransfer::OpenRead(files, dir / pieces[i].path(), pieces[i].bytes()));
    STRATA_ASSIGN_OR_RETURN(std::byte* direct, into(i));
    Buffer& buffer = buffers[i % 2];
    const uint64_t need = RoundUp(std::max<uint64_t>({room, pieces[i].bytes(), 1}));
    if (direct == nullptr && buffer.size_bytes() < need) {
      buffer = AllocateAlignedHost(need, kIoAlignmentBytes);  // the piece read into it before has been used
      if (!buffer) {
        return OutOfMemory("checkpoint: no {} bytes of host memory for a read buffer of {}", need,
                           (dir / pieces[i].path()).string());
      }
    }
    read_into[i % 2] = direct != nullptr ? direct : buffer.bytes();
    reading[i % 2]->StartReading(pool, read_into[i % 2]);
    return Status::Ok();
  };
  if (!pieces.empty()) STRATA_RETURN_IF_ERROR(start(0));
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (i + 1 < pieces.size()) STRATA_RETURN_IF_ERROR(start(i + 1));
    const json& file = *pieces[i].file;
    std::byte* data = read_into[i % 2];
    // Named by chunk too, so that a caller can say what the chunk holds.
    const std::string named =
        fmt::format("chunk {} ({})", file.at("chunk").get<uint32_t>(), file.at("kind").get<std::string>());
    STRATA_RETURN_IF_ERROR(reading[i % 2]->Finish().WithContext(named));
    STRATA_RETURN_IF_ERROR(
        CheckCrc(dir / pieces[i].path(), data, pieces[i].bytes(), file.at("crc32c").get<uint32_t>()).WithContext(named));
    STRATA_RETURN_IF_ERROR(use(i, pieces[i], data));
  }
  return Status::Ok();
}

// Checks every file `manifest` lists under `dir` (size and CRC32C).
Result<CheckpointSummary> VerifyFiles(FileSystem& files, const fs::path& dir, const json& manifest) {
  CheckpointSummary summary;
  summary.path = dir.string();
  summary.step = manifest.at("step").get<int64_t>();
  std::vector<Piece> pieces;
  for (const json& file : manifest.at("files")) pieces.push_back({&file, 0, 0, std::nullopt});
  const auto buffered = [](size_t) -> Result<std::byte*> { return nullptr; };
  STRATA_RETURN_IF_ERROR(ReadPieces(files, dir, pieces, 0, buffered, [&](size_t, const Piece& piece, std::byte*) {
    summary.bytes += piece.bytes();
    summary.files++;
    return Status::Ok();
  }));
  return summary;
}

// Corruption unless the optimizer state's per-tensor step counts, when
// saved (Note [Checkpoint layout on disk]), are one per registered tensor,
// each within the steps taken.
Status CheckTensorSteps(const json& manifest, const std::string& where) {
  const json& state = manifest.at("optimizer");
  if (!state.contains("tensor_steps")) return Status::Ok();
  const auto counts = state.at("tensor_steps").get<std::vector<int64_t>>();
  const int64_t taken = state.at("steps_taken").get<int64_t>();
  const json& tensors = manifest.at("tensors");
  if (counts.size() != tensors.size()) {
    return Corruption("checkpoint {}: {} tensor step counts for {} tensors", where, counts.size(), tensors.size());
  }
  for (size_t id = 0; id < counts.size(); ++id) {
    if (counts[id] < 0 || counts[id] > taken) {
      return Corruption("checkpoint {}: tensor '{}' has taken {} steps, outside [0, {}] (the steps taken)", where,
                        tensors[id].at("name").get<std::string>(), counts[id], taken);
    }
  }
  return Status::Ok();
}

// InvalidArgument unless the param groups' hyperparameters, when saved, are
// one set per group of `optimizer`; Corruption for values it would refuse.
Status CheckParamGroups(const json& manifest, const std::string& where, const optim::Optimizer& optimizer) {
  const json& state = manifest.at("optimizer");
  if (!state.contains("param_groups")) return Status::Ok();
  const json& groups = state.at("param_groups");
  if (groups.size() != optimizer.num_groups()) {
    return InvalidArgument("checkpoint {} was saved with {} optimizer param groups and this optimizer has {}: the "
                           "groups must be those of the saved run",
                           where, groups.size(), optimizer.num_groups());
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    const Status valid = optim::ValidateOptimizerConfig(optim::WithHyperparams(optimizer.config(), GroupOf(groups[g])));
    if (!valid.ok()) return Corruption("checkpoint {}: param group {}: {}", where, g, valid.message());
  }
  return Status::Ok();
}

// InvalidArgument unless the checkpoint's moments are of the format of
// `engine`'s (a checkpoint or an engine without moments fits any): states are
// loaded as they are, not converted between formats.
Status CheckStatesFormat(const json& manifest, const std::string& where, const Engine& engine) {
  checkpoint::MomentsFormat saved, ours;
  for (const json& file : manifest.at("files")) {
    saved.Add(file.at("kind").get<std::string>(), file.at("dtype").get<std::string>());
  }
  for (const ChunkInfo& c : engine.chunks()) ours.Add(ChunkKindName(c.kind), DTypeName(c.dtype));
  if (!saved.format() || !ours.format() || saved.format() == ours.format()) return Status::Ok();
  return InvalidArgument("checkpoint {} holds {} optimizer states and this engine keeps {} (optimizer.states {}): "
                         "set optimizer.states to {} to load it (states are not converted between formats)",
                         where, *saved.format(), *ours.format(), DTypeName(engine.options().optimizer.state_dtype),
                         *saved.format());
}

// InvalidArgument unless the checkpoint holds `engine`'s model (the same
// registered tensors, in chunks of the same size) and `optimizer` can take
// its state.
Status CheckFits(const json& manifest, const fs::path& dir, const Engine& engine, const optim::Optimizer& optimizer) {
  const std::string where = dir.string();
  if (manifest.at("tensors") != TensorsJson(engine.tensors())) {
    return InvalidArgument(
        "checkpoint {} holds another model: its registered tensors (name, shape, dtype, trainable, param group) "
        "differ from this engine's",
        where);
  }
  STRATA_RETURN_IF_ERROR(CheckStatesFormat(manifest, where, engine));
  const uint64_t chunk_elems = engine.layout().chunk_size_elems;
  if (manifest.contains("layout") && manifest.at("layout").at("chunk_size_elems") != chunk_elems) {
    const json& saved = manifest.at("layout").at("chunk_size_elems");
    return InvalidArgument(
        "checkpoint {} was saved with chunks of {} elements and this engine's hold {} (chunk.size_elems {}; unset, "
        "the size is searched from the budgets): set chunk.size_elems to {} to load it",
        where, saved.dump(), chunk_elems, engine.options().chunk.size_elems, saved.dump());
  }
  const bool saved_scaler = !manifest.at("optimizer").at("loss_scaler").is_null();
  if (saved_scaler != (optimizer.scaler() != nullptr)) {
    return InvalidArgument("checkpoint {} was saved {} a loss scaler and this optimizer has {} (loss_scale.mode)",
                           where, saved_scaler ? "with" : "without", optimizer.scaler() ? "one" : "none");
  }
  STRATA_RETURN_IF_ERROR(CheckParamGroups(manifest, where, optimizer));
  return CheckTensorSteps(manifest, where);
}

using FilesByGroup = std::map<std::pair<uint32_t, std::string>, std::vector<const json*>>;  // (group, kind) -> files

// The pieces of the files of `source` that cover chunk `c`'s elements [begin, end).
Status AddChunkPieces(const FilesByGroup& by_group, const fs::path& dir, const ChunkInfo& c, const std::string& source,
                      uint64_t begin, uint64_t end, std::vector<Piece>& pieces) {
  const std::string kind(ChunkKindName(c.kind));
  const auto found = by_group.find({c.group, source});
  if (found == by_group.end()) return Status::Ok();
  for (const json* file : found->second) {
    Result<DType> dtype = ParseChunkDType(file->at("dtype").get<std::string>());
    if (!dtype.ok()) return Corruption("checkpoint {}: {}", dir.string(), dtype.status().message());
    Piece piece{file, 0, 0, c, *dtype};
    piece.from = std::max(begin, piece.file_begin());
    piece.to = std::min(end, piece.file_begin() + ChunkElems(*dtype, piece.bytes()));
    if (piece.from >= piece.to) continue;
    if (*dtype != c.dtype && !(c.kind == ChunkKind::kParam && *dtype == DType::kFloat32)) {
      if (source != kind) {
        return InvalidArgument(
            "checkpoint {}: it holds no masters of chunk group {}, and its params are {}: only fp32 params "
            "stand in for the fp32 masters this engine keeps",
            dir.string(), c.group, file->at("dtype").dump());
      }
      // Moments of another format were refused before (CheckStatesFormat).
      return InvalidArgument("checkpoint {}: the {} of chunk group {} was saved in {}, this engine holds {}",
                             dir.string(), kind, c.group, file->at("dtype").dump(), DTypeName(c.dtype));
    }
    pieces.push_back(std::move(piece));
  }
  return Status::Ok();
}

// What to read for every chunk this rank holds, checked to cover each
// exactly once before anything is read (Note [Loading a checkpoint]).
Result<std::vector<Piece>> PlanPieces(const json& manifest, const fs::path& dir, const Engine& engine) {
  FilesByGroup by_group;
  for (const json& file : manifest.at("files")) {
    by_group[{file.at("group").get<uint32_t>(), file.at("kind").get<std::string>()}].push_back(&file);
  }
  std::vector<Piece> pieces;
  for (const ChunkInfo& c : engine.chunks()) {
    if (!Saved(c)) continue;
    const std::string kind(ChunkKindName(c.kind));
    const uint64_t begin = ChunkElems(c.dtype, c.shard_offset_bytes), end = begin + ChunkElems(c.dtype, c.used_bytes);
    std::string source = kind;  // masters for params, or params for masters, where the kind itself is missing
    if (!by_group.contains({c.group, kind}) && (c.kind == ChunkKind::kParam || c.kind == ChunkKind::kMaster)) {
      source = c.kind == ChunkKind::kParam ? "master" : "param";
    }
    const size_t first = pieces.size();
    STRATA_RETURN_IF_ERROR(AddChunkPieces(by_group, dir, c, source, begin, end, pieces));
    std::sort(pieces.begin() + first, pieces.end(), [](const Piece& a, const Piece& b) { return a.from < b.from; });
    uint64_t covered = begin;
    size_t i = first;
    for (; i < pieces.size() && pieces[i].from == covered; ++i) covered = pieces[i].to;
    if (covered != end || i != pieces.size()) {
      return InvalidArgument(
          "checkpoint {}: its files do not cover elements {}..{} of the {} of chunk group {}{}, which this rank "
          "holds, exactly once (saved with another chunk.size_elems or precision?)",
          dir.string(), begin, end, kind, c.group, source == kind ? "" : fmt::format(" (from its {})", source));
    }
  }
  return pieces;
}

// Fills the engine's chunks from the pieces as ReadPieces hands them over:
// a whole chunk's file read where the chunk lies or written where it lives,
// another copied (converted) into the chunk pinned in host memory.
class ChunkFiller {
 public:
  ChunkFiller(Engine& engine, const std::vector<Piece>& pieces, CheckpointSummary& summary)
      : engine_(engine), pieces_(pieces), summary_(summary) {}

  // Where piece i is read: its chunk's own bytes, or nullptr (a buffer).
  Result<std::byte*> Into(size_t i) {
    direct_[i % 2].reset();
    const ChunkInfo& c = *pieces_[i].chunk;
    if (!Whole(pieces_[i]) || c.size_bytes < RoundUp(c.used_bytes)) return nullptr;
    STRATA_ASSIGN_OR_RETURN(std::optional<HostBytes> lies, engine_.PeekHostChunk(c.id));
    if (!lies) return nullptr;
    Result<ChunkAccess> pin = engine_.AccessChunk(c.id, Tier::kHost);
    if (!pin.ok() || !IsAligned(pin->data())) return nullptr;  // a buffer
    direct_[i % 2] = std::move(pin).value();
    return direct_[i % 2]->data();
  }

  Status Use(size_t i, const Piece& piece, std::byte* data) {
    const ChunkInfo& c = *piece.chunk;
    summary_.bytes += piece.bytes();
    summary_.files++;
    if (Whole(piece)) {
      pinned_.reset();
      std::memset(data + piece.bytes(), 0, c.size_bytes - piece.bytes());  // the slot's tail past the tensors
      if (direct_[i % 2]) {
        direct_[i % 2].reset();
        return Status::Ok();
      }
      return engine_.WriteChunk(c.id, data).WithContext("checkpoint: loading a chunk");
    }
    if (!pinned_ || pinned_->id() != c.id) {
      pinned_.reset();
      STRATA_ASSIGN_OR_RETURN(pinned_, engine_.AccessChunk(c.id, Tier::kHost));
    }
    // Byte offsets by ChunkBytes: a piece of int8 moments begins and ends on blocks (its chunk's and its file's
    // bounds), which only a piece of the same dtype has (AddChunkPieces converts floats alone).
    std::byte* to = pinned_->data() + (ChunkBytes(c.dtype, piece.from) - c.shard_offset_bytes);
    const std::byte* from =
        data + (ChunkBytes(piece.dtype, piece.from) - ChunkBytes(piece.dtype, piece.file_begin()));
    const uint64_t n = piece.to - piece.from;
    if (piece.dtype == c.dtype) {
      std::memcpy(to, from, ChunkBytes(c.dtype, piece.to) - ChunkBytes(c.dtype, piece.from));
    } else {
      for (uint64_t e = 0; e < n; ++e) optim::StoreFloat(to, c.dtype, e, optim::FloatAt(from, piece.dtype, e));
    }
    return Status::Ok();
  }

  void Done() { pinned_.reset(); }

 private:
  // Whether the piece is exactly its chunk's bytes.
  static bool Whole(const Piece& piece) {
    const ChunkInfo& c = *piece.chunk;
    const uint64_t begin = ChunkElems(c.dtype, c.shard_offset_bytes);
    return piece.dtype == c.dtype && piece.from == begin && piece.file_begin() == begin &&
           piece.bytes() == c.used_bytes;
  }

  Engine& engine_;
  const std::vector<Piece>& pieces_;
  CheckpointSummary& summary_;
  std::optional<ChunkAccess> direct_[2];  // the chunks read into where they lie
  std::optional<ChunkAccess> pinned_;     // the chunk being filled piece by piece
};

Status RestoreOptimizer(const json& manifest, optim::Optimizer& optimizer) {
  const json& state = manifest.at("optimizer");
  std::optional<optim::Optimizer::ScalerState> scaler;
  if (!state.at("loss_scaler").is_null()) {
    scaler = optim::Optimizer::ScalerState{state.at("loss_scaler").at("scale").get<float>(),
                                           state.at("loss_scaler").at("good_steps").get<int64_t>(),
                                           state.at("loss_scaler").at("overflows").get<int64_t>()};
  }
  // A checkpoint saved before step counts were per tensor: every tensor at the global count.
  const std::vector<int64_t> tensor_steps =
      state.contains("tensor_steps") ? state.at("tensor_steps").get<std::vector<int64_t>>() : std::vector<int64_t>{};
  // One saved before param groups: every group at the config's values.
  std::vector<optim::GroupHyperparams> groups;
  if (state.contains("param_groups")) {
    for (const json& group : state.at("param_groups")) groups.push_back(GroupOf(group));
  }
  return optimizer.Restore(state.at("steps_taken").get<int64_t>(), scaler, tensor_steps, groups);
}

// Loads this rank's part of the checkpoint at `dir`.
Result<CheckpointSummary> LoadOne(FileSystem& files, Engine& engine, optim::Optimizer& optimizer,
                                  const fs::path& dir) {
  return Guarded(dir, [&]() -> Result<CheckpointSummary> {
    STRATA_ASSIGN_OR_RETURN(json manifest, ReadManifest(files, dir));
    STRATA_RETURN_IF_ERROR(CheckFits(manifest, dir, engine, optimizer));
    STRATA_ASSIGN_OR_RETURN(std::vector<Piece> pieces, PlanPieces(manifest, dir, engine));
    CheckpointSummary summary;
    summary.path = dir.string();
    summary.step = manifest.at("step").get<int64_t>();
    uint64_t largest_slot = 0;
    for (const Piece& piece : pieces) largest_slot = std::max(largest_slot, piece.chunk->size_bytes);
    ChunkFiller filler(engine, pieces, summary);
    STRATA_RETURN_IF_ERROR(ReadPieces(
        files, dir, pieces, largest_slot, [&](size_t i) { return filler.Into(i); },
        [&](size_t i, const Piece& piece, std::byte* data) { return filler.Use(i, piece, data); }));
    filler.Done();
    STRATA_RETURN_IF_ERROR(RestoreOptimizer(manifest, optimizer));
    return summary;
  });
}

// The checkpoints a load tries in turn: the one `path` names, then with
// fall_back the earlier ones (Note [Loading a checkpoint]).
std::vector<fs::path> Candidates(FileSystem& files, const std::string& path, bool fall_back,
                                 const Result<fs::path>& named, const std::optional<fs::path>& root) {
  std::vector<fs::path> candidates;
  if (named.ok()) candidates.push_back(*named);
  if (fall_back && (root || !named.ok())) {
    const fs::path under = root ? *root : fs::path(path);
    const std::optional<int64_t> newest = named.ok() ? StepOf(named->filename().string()) : std::nullopt;
    for (const fs::path& older : CheckpointsUnder(files, under)) {
      if (!newest || *StepOf(older.filename().string()) < *newest) candidates.push_back(older);
    }
  }
  return candidates;  // every rank sees the same directories: it decides the same candidates
}

}  // namespace

Result<CheckpointSummary> LoadCheckpoint(Engine& engine, optim::Optimizer& optimizer, const std::string& path,
                                         const LoadOptions& options, Communicator* comm, FileSystem& files) {
  if (!engine.finalized()) return InvalidArgument("checkpoint: finalize the engine (the same model) before loading");
  STRATA_RETURN_IF_ERROR(CheckGroup(engine, comm));
  STRATA_RETURN_IF_ERROR(CheckNoSavePending(engine));
  std::optional<fs::path> root;
  Result<fs::path> named = Resolve(files, path, &root);
  const std::vector<fs::path> candidates = Candidates(files, path, options.fall_back, named, root);
  if (candidates.empty()) return named.status();
  std::vector<std::string> skipped;
  if (!named.ok()) skipped.push_back(named.status().ToString());
  Status last = Status::Ok();
  for (const fs::path& dir : candidates) {
    Result<CheckpointSummary> loaded = LoadOne(files, engine, optimizer, dir);
    bool invalid = false;
    last = Agree(comm, loaded.status(), fmt::format("loading {}", dir.string()), &invalid);
    if (last.ok()) {
      loaded->skipped = std::move(skipped);
      return loaded;
    }
    // Another model or optimizer: no older checkpoint under this root fits either.
    if (!options.fall_back || invalid) break;
    skipped.push_back(last.ToString());
  }
  if (skipped.empty() || !options.fall_back) return last;
  return last.WithContext(
      fmt::format("no checkpoint under {} loads; the newer ones failed: {}", path, fmt::join(skipped, "; ")));
}

Result<CheckpointSummary> VerifyCheckpoint(const std::string& path, FileSystem& files) {
  STRATA_ASSIGN_OR_RETURN(fs::path dir, Resolve(files, path, nullptr));
  return Guarded(dir, [&]() -> Result<CheckpointSummary> {
    STRATA_ASSIGN_OR_RETURN(json manifest, ReadManifest(files, dir));
    return VerifyFiles(files, dir, manifest);
  });
}

}  // namespace strata::offload
