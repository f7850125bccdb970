#include "strata/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "memory/chunk_layout.h"
#include "src/base/half.h"
#include "strata/buffer.h"
#include "strata/file_system.h"

namespace strata::offload {
namespace {

using nlohmann::json;

// Note [The safetensors format]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A safetensors file is an 8-byte little-endian header length, a JSON header
// naming each tensor's dtype (F64, F32, BF16, F16 here), shape and byte
// range [begin, end) of the data that follows, and the data (tensors
// contiguous, row-major, little-endian). An export writes the tensors in
// chunk layout order, so that each chunk is read once (a chunk group at a
// time: the model is never staged whole in host memory), under their
// registered names, with "__metadata__": {"format": "pt"} as the
// transformers library expects; it writes a temporary file beside `path`,
// fsyncs it and renames it into place once every rank's part is known good.
// Data parallel, the shards of the masters are gathered (a collective every
// rank joins, even after its own read failed) and rank 0 writes. An import
// reads the file on every rank and sets the param chunk (rounded to nearest
// even) and this rank's shard of the fp32 master, a tensor at a time in
// pieces of kPieceElems.

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;  // as the safetensors library allows
constexpr size_t kPieceElems = size_t{1} << 20;            // an import reads a tensor in pieces of this many

// Bytes per element of a safetensors dtype (0: not one).
uint64_t SizeOf(const std::string& dtype) {
  static const std::map<std::string, uint64_t> sizes = {
      {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"F8_E5M2", 1}, {"F8_E4M3", 1}, {"I16", 2},  {"U16", 2}, {"F16", 2},
      {"BF16", 2}, {"I32", 4}, {"U32", 4}, {"F32", 4},     {"F64", 8},     {"I64", 8},  {"U64", 8}};
  auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

// Whether an import converts `dtype` into the engine's dtypes.
bool Convertible(const std::string& dtype) {
  return dtype == "F64" || dtype == "F32" || dtype == "BF16" || dtype == "F16";
}

const char* SafetensorsDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "F32";
    case DType::kBFloat16: return "BF16";
    case DType::kFloat16: return "F16";
    case DType::kInt8Block: break;  // moments: not exported
  }
  return "F32";
}

// A file dtype an import converts (Convertible): F64, or one of the engine's.
struct FileDType {
  bool f64 = false;
  DType dtype = DType::kFloat32;
  explicit FileDType(const std::string& name)
      : f64(name == "F64"),
        dtype(name == "BF16" ? DType::kBFloat16 : name == "F16" ? DType::kFloat16 : DType::kFloat32) {}
  // Element i of an array of this dtype, in fp32 (F64 rounded to nearest).
  float At(const std::byte* data, size_t i) const {
    if (!f64) return optim::FloatAt(data, dtype, i);
    double value;
    std::memcpy(&value, data + 8 * i, sizeof value);
    return static_cast<float>(value);
  }
};

// The chunks of one chunk group.
struct Group {
  std::optional<ChunkInfo> param, master;
};

std::vector<Group> GroupsOf(const Engine& engine) {
  std::map<uint32_t, Group> by_index;
  for (ChunkInfo& c : engine.chunks()) {
    if (c.kind == ChunkKind::kParam) by_index[c.group].param = std::move(c);
    if (c.kind == ChunkKind::kMaster) by_index[c.group].master = std::move(c);
  }
  std::vector<Group> groups;
  for (auto& [index, group] : by_index) groups.push_back(std::move(group));
  return groups;
}

// The element offset of tensor `i` of `chunk` in its group's whole chunk.
uint64_t ElemOffset(const ChunkInfo& chunk, size_t i) {
  return chunk.tensor_offsets_bytes[i] / DTypeSizeBytes(chunk.dtype);
}

// `chunk`'s bytes as its group's whole chunk (`group_elems` elements): read
// where it lies (through `read`, a buffer of the largest chunk, or null when
// it could not be had), or, for a rank's shard (data parallel), gathered from
// every rank's: a collective every rank joins, even after its own read failed.
Status ReadWhole(Engine& engine, Communicator* comm, const ChunkInfo& chunk, uint64_t group_elems, Buffer& read,
                 std::vector<std::byte>& whole) {
  const size_t width = DTypeSizeBytes(chunk.dtype);
  Status status = read ? engine.ReadChunk(chunk.id, read.data())
                       : OutOfMemory("safetensors: a {}-byte chunk buffer", chunk.size_bytes);
  if (!chunk.sharded) {
    if (status.ok()) {
      whole.assign(static_cast<std::byte*>(read.data()), static_cast<std::byte*>(read.data()) + chunk.used_bytes);
    }
    return status;
  }
  // Shards are ShardOf's: equal-sized (the last ones short or empty), in rank order.
  const memory::ShardRange mine = memory::ShardOf(group_elems, comm->rank(), comm->world_size());
  std::vector<std::byte> padded(mine.elems * width), all(mine.elems * width * comm->world_size());
  if (status.ok()) std::memcpy(padded.data(), read.data(), chunk.used_bytes);
  const Status gathered = comm->AllGather(padded.data(), all.data(), padded.size())
                              .WithContext(fmt::format("gathering chunk {} to export it", chunk.id.value()));
  STRATA_RETURN_IF_ERROR(status);
  STRATA_RETURN_IF_ERROR(gathered);
  all.resize(group_elems * width);
  whole = std::move(all);
  return Status::Ok();
}

// Reads exactly `size` bytes at `offset` of `file`: a file that ends before is not safetensors.
Status ReadExactly(File& file, void* data, size_t size, uint64_t offset) {
  Result<size_t> got = file.Read(offset, static_cast<std::byte*>(data), size);
  if (!got.ok()) return got.status().WithContext("safetensors");
  if (*got < size) return InvalidArgument("safetensors: {} ends before byte {}", file.path(), offset + size);
  return Status::Ok();
}

// Appends to a file being written from its start.
class Appender {
 public:
  explicit Appender(File* file) : file_(file) {}
  Status Append(const void* data, size_t size) {
    const Status written = file_->Write(offset_, static_cast<const std::byte*>(data), size);
    offset_ += size;
    return written.WithContext("safetensors");
  }

 private:
  File* file_;
  uint64_t offset_ = 0;
};

// "a, b, c and 4 more".
std::string Few(const std::vector<std::string>& names) {
  constexpr size_t kShown = 5;
  std::vector<std::string> shown(names.begin(), names.begin() + std::min(kShown, names.size()));
  std::string out = fmt::format("{}", fmt::join(shown, ", "));
  if (names.size() > kShown) out += fmt::format(" and {} more", names.size() - kShown);
  return out;
}

// Where a chunk group's exported values come from: the masters for fp32,
// or when the param chunk is only ever gathered (comm.shard_params).
struct Source {
  ChunkInfo chunk;
  DType out;
  uint64_t group_elems;  // the param chunk's (every rank's layout has it)
};

// What an export writes: the groups' sources in layout order, and the
// header's text (padded to 8 bytes); the summary's counts.
struct ExportPlan {
  std::vector<Source> sources;
  std::string header;
};

ExportPlan PlanExport(const Engine& engine, const ExportOptions& options, InterchangeSummary& summary) {
  const std::vector<TensorSpec>& specs = engine.tensors();
  ExportPlan plan;
  json header = json::object();
  uint64_t data_bytes = 0;
  for (const Group& g : GroupsOf(engine)) {
    if (!g.param) continue;
    const bool from_master = g.master && (options.fp32 || g.param->transient);
    Source source{from_master ? *g.master : *g.param, options.fp32 ? DType::kFloat32 : g.param->dtype,
                  g.param->used_bytes / DTypeSizeBytes(g.param->dtype)};
    for (TensorId t : source.chunk.tensors) {
      const TensorSpec& spec = specs[t.value()];
      const uint64_t bytes = static_cast<uint64_t>(spec.num_elements()) * DTypeSizeBytes(source.out);
      header[spec.name] = {{"dtype", SafetensorsDType(source.out)},
                           {"shape", spec.shape},
                           {"data_offsets", {data_bytes, data_bytes + bytes}}};
      data_bytes += bytes;
      summary.tensors++;
    }
    plan.sources.push_back(std::move(source));
  }
  header["__metadata__"] = {{"format", "pt"}, {"producer", "strata"}};
  plan.header = header.dump();
  plan.header.resize((plan.header.size() + 7) / 8 * 8, ' ');  // the data 8-byte aligned, as the library's own writer does
  summary.bytes = data_bytes;
  return plan;
}

// The header's length (8 bytes, little-endian) and the header.
Status WriteHeader(Appender& out, const std::string& header) {
  std::array<std::byte, 8> length{};
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) length[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  STRATA_RETURN_IF_ERROR(out.Append(length.data(), length.size()));
  return out.Append(header.data(), header.size());
}

// The tensors of `source`'s chunk (its group's whole chunk in `whole`), converted to the export's dtype.
Status WriteTensors(Appender& out, const std::vector<TensorSpec>& specs, const Source& source,
                    const std::vector<std::byte>& whole, std::vector<std::byte>& converted) {
  const size_t in_width = DTypeSizeBytes(source.chunk.dtype), out_width = DTypeSizeBytes(source.out);
  for (size_t i = 0; i < source.chunk.tensors.size(); ++i) {
    const uint64_t n = static_cast<uint64_t>(specs[source.chunk.tensors[i].value()].num_elements());
    const std::byte* at = whole.data() + ElemOffset(source.chunk, i) * in_width;
    if (source.chunk.dtype == source.out) {
      STRATA_RETURN_IF_ERROR(out.Append(at, n * out_width));
      continue;
    }
    converted.resize(n * out_width);
    for (uint64_t e = 0; e < n; ++e) {
      optim::StoreFloat(converted.data(), source.out, e, optim::FloatAt(at, source.chunk.dtype, e));
    }
    STRATA_RETURN_IF_ERROR(out.Append(converted.data(), converted.size()));
  }
  return Status::Ok();
}

// Every source read once (gathered where sharded) and, on rank 0, written
// to `file` (null elsewhere, or where it could not be created). The first
// error is kept while every rank goes on through the gathers.
Status WriteData(Engine& engine, Communicator* comm, const ExportPlan& plan, File* file, Status status) {
  const bool lead = engine.rank() == 0;
  Appender out(file);
  if (lead && status.ok()) status = WriteHeader(out, plan.header);
  // One read buffer for every chunk, not one per chunk.
  uint64_t largest = 4096;
  for (const Source& source : plan.sources) largest = std::max(largest, source.chunk.size_bytes);
  Buffer read = AllocateAlignedHost(largest, 4096);
  std::vector<std::byte> whole, converted;
  for (const Source& source : plan.sources) {
    if (!source.chunk.sharded && !lead) continue;
    const Status got = ReadWhole(engine, comm, source.chunk, source.group_elems, read, whole);
    if (status.ok()) status = got;
    if (lead && status.ok()) status = WriteTensors(out, engine.tensors(), source, whole, converted);
  }
  return status;
}

// Writes the export's file (rank 0), reading each chunk group once; on the
// other ranks only joins the gathers of sharded chunks.
Result<InterchangeSummary> Export(Engine& engine, const std::string& path, const ExportOptions& options,
                                  Communicator* comm, FileSystem& files) {
  const bool lead = engine.rank() == 0;
  InterchangeSummary summary;
  summary.path = path;
  const ExportPlan plan = PlanExport(engine, options, summary);
  const std::string staged = fmt::format("{}.tmp-{}", path, ::getpid());
  // An error on any rank is kept, not returned: every rank goes on through
  // the gathers and the agreements, so that the collectives line up.
  Status status = Status::Ok();
  std::unique_ptr<File> file;
  if (lead) {
    Result<std::unique_ptr<File>> created = files.Open(staged, OpenMode::kTruncate);
    if (created.ok()) file = std::move(created).value();
    status = created.status().WithContext("safetensors");
  }
  status = WriteData(engine, comm, plan, file.get(), status);
  if (file) {
    if (status.ok()) status = file->Sync().WithContext("safetensors");
    if (const Status closed = file->Close().WithContext("safetensors"); status.ok()) status = closed;
  }
  // Published only once every rank's part (its shards' reads) is known good.
  status = AgreeOnStatus(comm, status, "exporting safetensors");
  Status published = Status::Ok();
  if (lead && status.ok()) published = files.Rename(staged, path).WithContext("safetensors");
  if (lead && (!status.ok() || !published.ok())) (void)files.RemoveAll(staged);
  STRATA_RETURN_IF_ERROR(status);
  STRATA_RETURN_IF_ERROR(AgreeOnStatus(comm, published, "publishing the safetensors file"));
  return summary;
}


// InvalidArgument: `path` is not a safetensors file, and why.
Status NotOne(const std::string& path, const std::string& why) {
  return InvalidArgument("safetensors: {} is not a safetensors file: {}", path, why);
}

// The header of `file` (of `file_bytes`), parsed and checked as JSON: an
// object, no name twice, __metadata__ an object of strings. `data_begin`:
// where the data after it begins.
Result<json> ReadHeader(File& file, uint64_t file_bytes, uint64_t* data_begin) {
  const std::string& path = file.path();
  if (file_bytes < 8) return NotOne(path, fmt::format("it is {} bytes, shorter than the header's length", file_bytes));
  std::array<std::byte, 8> length{};
  STRATA_RETURN_IF_ERROR(ReadExactly(file, length.data(), 8, 0));
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | static_cast<uint64_t>(length[i]);
  if (header_bytes > kMaxHeaderBytes || header_bytes > file_bytes - 8) {
    return NotOne(path, fmt::format("its header length {} exceeds the file ({} bytes) or {} bytes", header_bytes,
                                    file_bytes, kMaxHeaderBytes));
  }
  std::string text(header_bytes, '\0');
  STRATA_RETURN_IF_ERROR(ReadExactly(file, text.data(), text.size(), 8));
  *data_begin = 8 + header_bytes;
  // A key twice in the header is refused (a JSON parser keeps one of them).
  std::set<std::string> keys;
  std::string repeated;
  const json::parser_callback_t once = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key && !keys.insert(parsed.get<std::string>()).second) {
      repeated = parsed.get<std::string>();
    }
    return true;
  };
  json header = json::parse(text, once, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) return NotOne(path, "its header is not a JSON object");
  if (!repeated.empty()) return NotOne(path, fmt::format("its header names '{}' twice", repeated));
  if (header.contains("__metadata__")) {
    const json& metadata = header["__metadata__"];
    if (!metadata.is_object() ||
        std::any_of(metadata.begin(), metadata.end(), [](const json& value) { return !value.is_string(); })) {
      return NotOne(path, "its __metadata__ is not an object of strings");
    }
  }
  return header;
}

// Whether a tensor's header entry has its fields, of their types.
bool HasEntryFields(const json& value) {
  return value.is_object() && value.contains("dtype") && value.contains("shape") && value.contains("data_offsets") &&
         value["dtype"].is_string() && value["shape"].is_array() && value["data_offsets"].is_array() &&
         value["data_offsets"].size() == 2;
}

// The bytes of a tensor of `shape` and elements of `width` bytes, its
// dimensions appended to `dims`; nothing unless they are non-negative
// integers whose product fits.
std::optional<uint64_t> ShapeBytes(const json& shape, uint64_t width, std::vector<int64_t>& dims) {
  uint64_t bytes = width;
  for (const json& dim : shape) {
    if (!dim.is_number_unsigned() || dim.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX) ||
        __builtin_mul_overflow(bytes, dim.get<uint64_t>(), &bytes)) {
      return std::nullopt;
    }
    dims.push_back(dim.get<int64_t>());
  }
  return bytes;
}

// One tensor of the header: its dtype one of safetensors', its range of its
// shape's size (no overflow) inside the `data_bytes` of data at `data_begin`.
Result<SafetensorsEntry> ParseEntry(const std::string& path, const std::string& name, const json& value,
                                    uint64_t data_begin, uint64_t data_bytes) {
  const auto bad = [&](const std::string& why) { return NotOne(path, fmt::format("tensor '{}': {}", name, why)); };
  if (!HasEntryFields(value)) return bad("it needs dtype (a string), shape (an array) and data_offsets ([begin, end])");
  SafetensorsEntry entry;
  entry.dtype = value["dtype"].get<std::string>();
  const uint64_t width = SizeOf(entry.dtype);
  if (width == 0) return bad(fmt::format("dtype '{}' is not one of safetensors'", entry.dtype));
  const std::optional<uint64_t> bytes = ShapeBytes(value["shape"], width, entry.shape);
  if (!bytes) {
    return bad(fmt::format("shape {} is not of non-negative integers of a size that fits", value["shape"].dump()));
  }
  const json& offsets = value["data_offsets"];
  if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) return bad("data_offsets are not integers");
  const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
  if (begin > end || end > data_bytes) {
    return bad(fmt::format("data_offsets [{}, {}] fall outside the {} bytes of data", begin, end, data_bytes));
  }
  if (end - begin != *bytes) {
    return bad(fmt::format("data_offsets [{}, {}] hold {} bytes, its shape and dtype {} need {}", begin, end,
                           end - begin, entry.dtype, *bytes));
  }
  entry.offset = data_begin + begin;
  entry.bytes = end - begin;
  return entry;
}

// The tensors' ranges tile the data: no overlap, no hole, nothing after the last.
Status CheckTiling(const std::string& path, const std::map<std::string, SafetensorsEntry>& entries,
                   uint64_t data_begin, uint64_t file_bytes) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, entry] : entries) ranges.emplace_back(entry.offset, entry.offset + entry.bytes);
  std::sort(ranges.begin(), ranges.end());
  uint64_t covered = data_begin;
  for (const auto& [begin, end] : ranges) {
    if (begin != covered) {
      return NotOne(path, fmt::format("its tensors' data_offsets {} at byte {} of the data",
                                      begin < covered ? "overlap" : "leave a hole", std::min(begin, covered) - data_begin));
    }
    covered = end;
  }
  if (covered != file_bytes) return NotOne(path, fmt::format("{} bytes follow its last tensor", file_bytes - covered));
  return Status::Ok();
}

// The index of the open safetensors `file`.
Result<std::map<std::string, SafetensorsEntry>> ReadIndex(File& file) {
  Result<uint64_t> size = file.Size();
  if (!size.ok()) return size.status().WithContext("safetensors");
  const uint64_t file_bytes = *size;
  uint64_t data_begin = 0;
  STRATA_ASSIGN_OR_RETURN(json header, ReadHeader(file, file_bytes, &data_begin));
  std::map<std::string, SafetensorsEntry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") continue;
    STRATA_ASSIGN_OR_RETURN(SafetensorsEntry entry,
                            ParseEntry(file.path(), name, value, data_begin, file_bytes - data_begin));
    entries.emplace(name, std::move(entry));
  }
  STRATA_RETURN_IF_ERROR(CheckTiling(file.path(), entries, data_begin, file_bytes));
  return entries;
}

// `path` opened for reading through `files`, a failure named as the module's.
Result<std::unique_ptr<File>> OpenToRead(FileSystem& files, const std::string& path) {
  Result<std::unique_ptr<File>> file = files.Open(path, OpenMode::kRead);
  if (!file.ok()) return file.status().WithContext("safetensors");
  return file;
}

}  // namespace

Result<std::map<std::string, SafetensorsEntry>> ReadSafetensorsIndex(const std::string& path, FileSystem& files) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<File> file, OpenToRead(files, path));
  return ReadIndex(*file);
}

Result<InterchangeSummary> ExportSafetensors(Engine& engine, const std::string& path, const ExportOptions& options,
                                             Communicator* comm, FileSystem& files) {
  if (!engine.finalized()) return InvalidArgument("safetensors: the engine is not finalized: nothing to export yet");
  if (engine.world_size() > 1 &&
      (comm == nullptr || comm->world_size() != engine.world_size() || comm->rank() != engine.rank())) {
    return InvalidArgument("safetensors: this engine is rank {} of {}: pass its communicator (every rank exports together)",
                           engine.rank(), engine.world_size());
  }
  return Export(engine, path, options, engine.world_size() > 1 ? comm : nullptr, files);
}

namespace {

using Index = std::map<std::string, SafetensorsEntry>;

// Every registered tensor's name, shape and dtype checked against the file's
// before anything is set; the summary's missing and unused tensors.
Status CheckImport(const std::string& path, const Index& entries, const std::vector<TensorSpec>& specs,
                   const ImportOptions& options, InterchangeSummary& summary) {
  std::vector<std::string> wrong;
  for (const TensorSpec& spec : specs) {
    auto it = entries.find(spec.name);
    if (it == entries.end()) {
      summary.missing.push_back(spec.name);
      continue;
    }
    if (it->second.shape != spec.shape) {
      wrong.push_back(fmt::format("{} is {} in the file, [{}] here", spec.name, fmt::format("[{}]", fmt::join(it->second.shape, ", ")),
                                  fmt::join(spec.shape, ", ")));
    } else if (!Convertible(it->second.dtype)) {
      wrong.push_back(fmt::format("{} is {} in the file (F64, F32, BF16 or F16 convert)", spec.name, it->second.dtype));
    }
  }
  if (!wrong.empty()) return InvalidArgument("safetensors: {}: {}", path, fmt::format("{}", fmt::join(wrong, "; ")));
  for (const auto& named : entries) {  // not a structured binding: Clang 14 cannot capture one
    if (std::none_of(specs.begin(), specs.end(), [&](const TensorSpec& s) { return s.name == named.first; })) {
      summary.unused.push_back(named.first);
    }
  }
  if (options.strict && (!summary.missing.empty() || !summary.unused.empty())) {
    std::string what;
    if (!summary.missing.empty()) what += fmt::format("; it lacks {}", Few(summary.missing));
    if (!summary.unused.empty()) what += fmt::format("; it has {} that this model does not", Few(summary.unused));
    return InvalidArgument("safetensors: {} does not hold this model's tensors{} (strict=false takes what matches)",
                           path, what);
  }
  return Status::Ok();
}

// Sets group `g`'s param chunk (unless only ever gathered) and this rank's
// range of its master from the file's tensors, read in pieces.
Status ImportGroup(Engine& engine, File& file, const Index& entries, const Group& g, InterchangeSummary& summary) {
  std::optional<ChunkAccess> param, master;
  if (!g.param->transient) {
    STRATA_ASSIGN_OR_RETURN(param, engine.AccessChunk(g.param->id, Tier::kHost));
  }
  if (g.master) {
    STRATA_ASSIGN_OR_RETURN(master, engine.AccessChunk(g.master->id, Tier::kHost));
  }
  // fp32, or a frozen group's param dtype (its params sharded: comm.shard_params).
  const uint64_t master_width = g.master ? DTypeSizeBytes(g.master->dtype) : 1;
  const uint64_t master_begin = g.master ? g.master->shard_offset_bytes / master_width : 0;
  const uint64_t master_end = g.master ? master_begin + g.master->used_bytes / master_width : 0;
  std::vector<std::byte> piece;
  for (size_t i = 0; i < g.param->tensors.size(); ++i) {
    auto it = entries.find(engine.tensors()[g.param->tensors[i].value()].name);
    if (it == entries.end()) continue;
    const SafetensorsEntry& entry = it->second;
    const FileDType dtype(entry.dtype);
    const uint64_t width = SizeOf(entry.dtype), n = entry.bytes / width;
    const uint64_t at = ElemOffset(*g.param, i);  // in the group's whole chunk
    for (uint64_t from = 0; from < n; from += kPieceElems) {
      const uint64_t count = std::min<uint64_t>(kPieceElems, n - from);
      piece.resize(count * width);
      STRATA_RETURN_IF_ERROR(ReadExactly(file, piece.data(), piece.size(), entry.offset + from * width));
      for (uint64_t e = 0; e < count; ++e) {
        const float value = dtype.At(piece.data(), e);
        const uint64_t k = at + from + e;
        if (param) optim::StoreFloat(param->data(), g.param->dtype, k, value);
        if (master && k >= master_begin && k < master_end) {
          optim::StoreFloat(master->data(), g.master->dtype, k - master_begin, value);
        }
      }
    }
    summary.tensors++;
    summary.bytes += entry.bytes;
  }
  return Status::Ok();
}

Result<InterchangeSummary> Import(Engine& engine, const std::string& path, const ImportOptions& options,
                                  FileSystem& files) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<File> file, OpenToRead(files, path));
  STRATA_ASSIGN_OR_RETURN(Index entries, ReadIndex(*file));
  InterchangeSummary summary;
  summary.path = path;
  STRATA_RETURN_IF_ERROR(CheckImport(path, entries, engine.tensors(), options, summary));
  file->Advise(FileAdvice::kSequential);
  for (const Group& g : GroupsOf(engine)) {
    if (g.param) STRATA_RETURN_IF_ERROR(ImportGroup(engine, *file, entries, g, summary));
  }
  return summary;
}

}  // namespace

Result<InterchangeSummary> ImportSafetensors(Engine& engine, const std::string& path, const ImportOptions& options,
                                             Communicator* comm, FileSystem& files) {
  if (!engine.finalized()) return InvalidArgument("safetensors: finalize the engine (register its tensors) first");
  Result<InterchangeSummary> imported = Import(engine, path, options, files);
  STRATA_RETURN_IF_ERROR(AgreeOnStatus(engine.world_size() > 1 ? comm : nullptr, imported.status(),
                                       fmt::format("importing {}", path)));
  return imported;
}

}  // namespace strata::offload
