#include "offload/persist/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
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

namespace strata::offload {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;  // as the safetensors library allows
constexpr size_t kPieceElems = size_t{1} << 20;            // an import reads a tensor in pieces of this many

Status Errno(const std::string& what, const std::string& path) {
  return IoError("safetensors: {} {}: {}", what, path, std::strerror(errno));
}

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

// A file open for reading, closed when it goes.
struct ReadOnlyFile {
  int fd = -1;
  static Result<ReadOnlyFile> Open(const std::string& path) {
    ReadOnlyFile file;
    file.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (file.fd < 0) return Errno("opening", path);
    return file;
  }
  ReadOnlyFile() = default;
  ReadOnlyFile(ReadOnlyFile&& other) noexcept : fd(std::exchange(other.fd, -1)) {}
  ReadOnlyFile& operator=(ReadOnlyFile&&) = delete;
  ~ReadOnlyFile() {
    if (fd >= 0) ::close(fd);
  }
};

Status WriteAll(int fd, const void* data, size_t size, const std::string& path) {
  const auto* bytes = static_cast<const std::byte*>(data);
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::write(fd, bytes + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Errno(fmt::format("writing byte {} of {} to", done, size), path);
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status ReadAll(int fd, void* data, size_t size, uint64_t offset, const std::string& path) {
  auto* bytes = static_cast<std::byte*>(data);
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::pread(fd, bytes + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Errno(fmt::format("reading {} bytes at {} of", size, offset), path);
    if (n == 0) return InvalidArgument("safetensors: {} ends before byte {}", path, offset + size);
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

// "a, b, c and 4 more".
std::string Few(const std::vector<std::string>& names) {
  constexpr size_t kShown = 5;
  std::vector<std::string> shown(names.begin(), names.begin() + std::min(kShown, names.size()));
  std::string out = fmt::format("{}", fmt::join(shown, ", "));
  if (names.size() > kShown) out += fmt::format(" and {} more", names.size() - kShown);
  return out;
}

// Writes the export's file (rank 0), reading each chunk group once; on the
// other ranks only joins the gathers of sharded chunks.
Result<InterchangeSummary> Export(Engine& engine, const std::string& path, const ExportOptions& options,
                                  Communicator* comm) {
  const bool lead = engine.rank() == 0;
  const std::vector<TensorSpec>& specs = engine.tensors();
  // Where each group's values come from: the masters for fp32, or when
  // the param chunk is only ever gathered (comm.shard_params).
  struct Source {
    ChunkInfo chunk;
    DType out;
    uint64_t group_elems;  // the param chunk's (every rank's layout has it)
  };
  std::vector<Source> sources;
  json header = json::object();
  uint64_t data_bytes = 0;
  InterchangeSummary summary;
  summary.path = path;
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
    sources.push_back(std::move(source));
  }
  header["__metadata__"] = {{"format", "pt"}, {"producer", "strata"}};
  std::string text = header.dump();
  text.resize((text.size() + 7) / 8 * 8, ' ');  // the data 8-byte aligned, as the library's own writer does
  summary.bytes = data_bytes;

  const std::string staged = fmt::format("{}.tmp-{}", path, ::getpid());
  // An error on any rank is kept, not returned: every rank goes on through
  // the gathers and the agreements, so that the collectives line up.
  Status status = Status::Ok();
  int fd = -1;
  if (lead) {
    fd = ::open(staged.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) status = Errno("creating", staged);
  }
  if (lead && status.ok()) {
    std::array<std::byte, 8> length{};
    const uint64_t n = text.size();
    for (int i = 0; i < 8; ++i) length[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);  // little-endian
    status = WriteAll(fd, length.data(), length.size(), staged);
    if (status.ok()) status = WriteAll(fd, text.data(), text.size(), staged);
  }
  // One read buffer for every chunk, not one per chunk.
  uint64_t largest = 4096;
  for (const Source& source : sources) largest = std::max(largest, source.chunk.size_bytes);
  Buffer read = AllocateAlignedHost(largest, 4096);
  std::vector<std::byte> whole, converted;
  for (const Source& source : sources) {
    if (!source.chunk.sharded && !lead) continue;
    const Status got = ReadWhole(engine, comm, source.chunk, source.group_elems, read, whole);
    if (status.ok()) status = got;
    if (!lead || !status.ok()) continue;
    const size_t in_width = DTypeSizeBytes(source.chunk.dtype), out_width = DTypeSizeBytes(source.out);
    for (size_t i = 0; i < source.chunk.tensors.size() && status.ok(); ++i) {
      const uint64_t n = static_cast<uint64_t>(specs[source.chunk.tensors[i].value()].num_elements());
      const std::byte* at = whole.data() + ElemOffset(source.chunk, i) * in_width;
      if (source.chunk.dtype == source.out) {
        status = WriteAll(fd, at, n * out_width, staged);
        continue;
      }
      converted.resize(n * out_width);
      for (uint64_t e = 0; e < n; ++e) {
        optim::StoreFloat(converted.data(), source.out, e, optim::FloatAt(at, source.chunk.dtype, e));
      }
      status = WriteAll(fd, converted.data(), converted.size(), staged);
    }
  }
  if (lead && fd >= 0) {
    if (status.ok() && ::fsync(fd) != 0) status = Errno("flushing", staged);
    if (::close(fd) != 0 && status.ok()) status = Errno("closing", staged);
  }
  // Published only once every rank's part (its shards' reads) is known good.
  status = AgreeOnStatus(comm, status, "exporting safetensors");
  Status published = Status::Ok();
  if (lead && status.ok() && ::rename(staged.c_str(), path.c_str()) != 0) {
    published = Errno(fmt::format("renaming {} to", staged), path);
  }
  if (lead && (!status.ok() || !published.ok())) ::unlink(staged.c_str());
  STRATA_RETURN_IF_ERROR(status);
  STRATA_RETURN_IF_ERROR(AgreeOnStatus(comm, published, "publishing the safetensors file"));
  return summary;
}

}  // namespace

Result<std::map<std::string, SafetensorsEntry>> ReadSafetensorsIndex(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(ReadOnlyFile file, ReadOnlyFile::Open(path));
  const int fd = file.fd;
  struct stat st{};
  if (::fstat(fd, &st) != 0) return Errno("reading the size of", path);
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  const auto not_one = [&](const std::string& why) {
    return InvalidArgument("safetensors: {} is not a safetensors file: {}", path, why);
  };
  if (file_bytes < 8) return not_one(fmt::format("it is {} bytes, shorter than the header's length", file_bytes));
  std::array<std::byte, 8> length{};
  STRATA_RETURN_IF_ERROR(ReadAll(fd, length.data(), 8, 0, path));
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | static_cast<uint64_t>(length[i]);
  if (header_bytes > kMaxHeaderBytes || header_bytes > file_bytes - 8) {
    return not_one(fmt::format("its header length {} exceeds the file ({} bytes) or {} bytes", header_bytes,
                               file_bytes, kMaxHeaderBytes));
  }
  std::string text(header_bytes, '\0');
  STRATA_RETURN_IF_ERROR(ReadAll(fd, text.data(), text.size(), 8, path));
  // A key twice in the header is refused (a JSON parser keeps one of them).
  std::set<std::string> keys;
  std::string repeated;
  const json::parser_callback_t once = [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key && !keys.insert(parsed.get<std::string>()).second) {
      repeated = parsed.get<std::string>();
    }
    return true;
  };
  const json header = json::parse(text, once, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) return not_one("its header is not a JSON object");
  if (!repeated.empty()) return not_one(fmt::format("its header names '{}' twice", repeated));
  if (header.contains("__metadata__")) {
    const json& metadata = header["__metadata__"];
    if (!metadata.is_object() ||
        std::any_of(metadata.begin(), metadata.end(), [](const json& value) { return !value.is_string(); })) {
      return not_one("its __metadata__ is not an object of strings");
    }
  }
  const uint64_t data_begin = 8 + header_bytes, data_bytes = file_bytes - data_begin;
  std::map<std::string, SafetensorsEntry> entries;
  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") continue;
    const auto bad = [&](const std::string& why) { return not_one(fmt::format("tensor '{}': {}", name, why)); };
    if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") ||
        !value.contains("data_offsets") || !value["dtype"].is_string() || !value["shape"].is_array() ||
        !value["data_offsets"].is_array() || value["data_offsets"].size() != 2) {
      return bad("it needs dtype (a string), shape (an array) and data_offsets ([begin, end])");
    }
    SafetensorsEntry entry;
    entry.dtype = value["dtype"].get<std::string>();
    const uint64_t width = SizeOf(entry.dtype);
    if (width == 0) return bad(fmt::format("dtype '{}' is not one of safetensors'", entry.dtype));
    uint64_t bytes = width;
    for (const json& dim : value["shape"]) {
      if (!dim.is_number_unsigned() || dim.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX) ||
          __builtin_mul_overflow(bytes, dim.get<uint64_t>(), &bytes)) {
        return bad(fmt::format("shape {} is not of non-negative integers of a size that fits", value["shape"].dump()));
      }
      entry.shape.push_back(dim.get<int64_t>());
    }
    const json& offsets = value["data_offsets"];
    if (!offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) return bad("data_offsets are not integers");
    const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
    if (begin > end || end > data_bytes) {
      return bad(fmt::format("data_offsets [{}, {}] fall outside the {} bytes of data", begin, end, data_bytes));
    }
    if (end - begin != bytes) {
      return bad(fmt::format("data_offsets [{}, {}] hold {} bytes, its shape and dtype {} need {}", begin, end,
                             end - begin, entry.dtype, bytes));
    }
    entry.offset = data_begin + begin;
    entry.bytes = end - begin;
    entries.emplace(name, std::move(entry));
  }
  // The tensors' ranges tile the data: no overlap, no hole.
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, entry] : entries) ranges.emplace_back(entry.offset, entry.offset + entry.bytes);
  std::sort(ranges.begin(), ranges.end());
  uint64_t covered = data_begin;
  for (const auto& [begin, end] : ranges) {
    if (begin != covered) {
      return not_one(fmt::format("its tensors' data_offsets {} at byte {} of the data", begin < covered ? "overlap" : "leave a hole",
                                 std::min(begin, covered) - data_begin));
    }
    covered = end;
  }
  if (covered != file_bytes) return not_one(fmt::format("{} bytes follow its last tensor", file_bytes - covered));
  return entries;
}

Result<InterchangeSummary> ExportSafetensors(Engine& engine, const std::string& path, const ExportOptions& options,
                                             Communicator* comm) {
  if (!engine.finalized()) return InvalidArgument("safetensors: the engine is not finalized: nothing to export yet");
  if (engine.world_size() > 1 &&
      (comm == nullptr || comm->world_size() != engine.world_size() || comm->rank() != engine.rank())) {
    return InvalidArgument("safetensors: this engine is rank {} of {}: pass its communicator (every rank exports together)",
                           engine.rank(), engine.world_size());
  }
  return Export(engine, path, options, engine.world_size() > 1 ? comm : nullptr);
}

namespace {

Result<InterchangeSummary> Import(Engine& engine, const std::string& path, const ImportOptions& options) {
  STRATA_ASSIGN_OR_RETURN(auto entries, ReadSafetensorsIndex(path));
  const std::vector<TensorSpec>& specs = engine.tensors();
  InterchangeSummary summary;
  summary.path = path;
  // Every name and shape checked before anything is set.
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
  for (const auto& [name, entry] : entries) {
    if (std::none_of(specs.begin(), specs.end(), [&](const TensorSpec& s) { return s.name == name; })) {
      summary.unused.push_back(name);
    }
  }
  if (options.strict && (!summary.missing.empty() || !summary.unused.empty())) {
    std::string what;
    if (!summary.missing.empty()) what += fmt::format("; it lacks {}", Few(summary.missing));
    if (!summary.unused.empty()) what += fmt::format("; it has {} that this model does not", Few(summary.unused));
    return InvalidArgument("safetensors: {} does not hold this model's tensors{} (strict=false takes what matches)",
                           path, what);
  }

  STRATA_ASSIGN_OR_RETURN(ReadOnlyFile file, ReadOnlyFile::Open(path));
  const int fd = file.fd;
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::vector<std::byte> piece;
  for (const Group& g : GroupsOf(engine)) {
    if (!g.param) continue;
    // The targets: the param chunk (unless only ever gathered) and this rank's range of the master.
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
    for (size_t i = 0; i < g.param->tensors.size(); ++i) {
      const TensorSpec& spec = specs[g.param->tensors[i].value()];
      auto it = entries.find(spec.name);
      if (it == entries.end()) continue;
      const SafetensorsEntry& entry = it->second;
      const FileDType dtype(entry.dtype);
      const uint64_t width = SizeOf(entry.dtype), n = entry.bytes / width;
      const uint64_t at = ElemOffset(*g.param, i);  // in the group's whole chunk
      for (uint64_t from = 0; from < n; from += kPieceElems) {
        const uint64_t count = std::min<uint64_t>(kPieceElems, n - from);
        piece.resize(count * width);
        STRATA_RETURN_IF_ERROR(ReadAll(fd, piece.data(), piece.size(), entry.offset + from * width, path));
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
  }
  return summary;
}

}  // namespace

Result<InterchangeSummary> ImportSafetensors(Engine& engine, const std::string& path, const ImportOptions& options,
                                             Communicator* comm) {
  if (!engine.finalized()) return InvalidArgument("safetensors: finalize the engine (register its tensors) first");
  Result<InterchangeSummary> imported = Import(engine, path, options);
  STRATA_RETURN_IF_ERROR(AgreeOnStatus(engine.world_size() > 1 ? comm : nullptr, imported.status(),
                                       fmt::format("importing {}", path)));
  return imported;
}

}  // namespace strata::offload
