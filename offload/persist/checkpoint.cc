#include "offload/persist/checkpoint.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "src/base/alignment.h"
#include "src/base/crc32c.h"
#include "src/base/half.h"
#include "src/base/logging.h"
#include "src/base/task_queue.h"
#include "strata/buffer.h"
#include "strata/options.h"

namespace strata::offload {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kFormat = "strata-checkpoint";
constexpr int kVersion = 1;
constexpr const char* kManifest = "manifest.json";
constexpr const char* kLatest = "latest";
constexpr const char* kRankFiles = "files.json";  // a rank's manifest entries, merged by rank 0
constexpr const char* kRankFailed = "failed.txt";  // or why its files failed
constexpr const char* kSpares = ".spare";  // chunk files of removed checkpoints, to be written over

std::string StepName(int64_t step) { return fmt::format("step-{:08}", step); }

// The step of a checkpoint directory's name, or nothing for another name.
std::optional<int64_t> StepOf(const std::string& name) {
  if (name.size() < 13 || name.size() > 23 || name.rfind("step-", 0) != 0) return std::nullopt;  // 8 to 18 digits
  if (!std::all_of(name.begin() + 5, name.end(), [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
  return std::stoll(name.substr(5));
}

Status Errno(const std::string& what, const fs::path& path) {
  return IoError("checkpoint: {} {}: {}", what, path.string(), std::strerror(errno));
}

// Writes `size` bytes to a new file at `path` and fsyncs it.
Status WriteFileDurably(const fs::path& path, const void* data, size_t size) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("creating", path);
  const auto* bytes = static_cast<const std::byte*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::write(fd, bytes + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const Status error = Errno(fmt::format("writing byte {} of {} to", done, size), path);
      ::close(fd);
      return error;
    }
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const Status error = Errno("flushing", path);
    ::close(fd);
    return error;
  }
  if (::close(fd) != 0) return Errno("closing", path);
  return Status::Ok();
}

constexpr uint64_t kDirectAlignment = kIoAlignmentBytes;

// Opens `path` with O_DIRECT where the file system allows it (a chunk-sized
// request then goes to the drive without a copy into the page cache), else
// without (tmpfs).
int OpenDirect(const fs::path& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0644);
  return fd >= 0 || errno != EINVAL ? fd : ::open(path.c_str(), flags | O_CLOEXEC, 0644);
}

// One chunk file's transfer in flight: its pieces written or read by the
// threads of `pool` at once (the drive keeps many requests in flight, as
// bench io's queue depth does), with O_DIRECT where the file system allows
// it, while the caller prepares the next chunk in its other buffer.
class FileTransfer {
 public:
  static constexpr size_t kPieceBytes = size_t{1} << 20;
  static constexpr uint32_t kThreads = 16;

  // Writes `size` bytes of `data` (4096-aligned, readable up to `size`
  // rounded up to 4096: that tail is written too, and cut off by Finish) to
  // the file at `path`: a new one, or a spare to write over (Note [Recycled
  // chunk files]), cut to `size` by Finish. FlushAll makes it durable.
  static Result<std::unique_ptr<FileTransfer>> StartWrite(TaskQueue& pool, const fs::path& path, const std::byte* data,
                                                          size_t size) {
    const int fd = OpenDirect(path, O_WRONLY | O_CREAT);
    if (fd < 0) return Errno("creating", path);
    // Allocated up front: direct writes that extend a file are serialized by
    // the file system. (A rank's shard of a small group may be empty.)
    if (const int error = size == 0 ? 0 : ::posix_fallocate(fd, 0, static_cast<off_t>(RoundUp(size))); error != 0) {
      ::close(fd);
      errno = error;
      return Errno("allocating", path);
    }
    return Start(pool, fd, /*write=*/true, path, data, size);
  }
  // Reads the file at `path` into `data` (the same room), Corruption unless it is `size` bytes.
  static Result<std::unique_ptr<FileTransfer>> StartRead(TaskQueue& pool, const fs::path& path, std::byte* data,
                                                         size_t size) {
    const int fd = OpenDirect(path, O_RDONLY);
    if (fd < 0) return Errno("opening", path);
    const off_t actual = ::lseek(fd, 0, SEEK_END);
    if (actual != static_cast<off_t>(size)) {
      ::close(fd);
      return Corruption("checkpoint: {} is {} bytes, its manifest says {}", path.string(), actual, size);
    }
    return Start(pool, fd, /*write=*/false, path, data, size);
  }

  // Waits for every piece: the first error. A written file is then cut to its size.
  Status Finish() {
    Status first = Status::Ok();
    for (const std::shared_future<Status>& piece : pieces_) {
      const Status status = piece.get();
      if (first.ok() && !status.ok()) first = status;
    }
    pieces_.clear();
    if (fd_ < 0) return first;
    if (first.ok() && write_ && ::ftruncate(fd_, static_cast<off_t>(size_)) != 0) first = Errno("truncating", path_);
    if (::close(fd_) != 0 && first.ok()) first = Errno("closing", path_);
    fd_ = -1;
    return first;
  }
  // Never leaves a piece running into a buffer about to be freed.
  ~FileTransfer() { (void)Finish(); }

 private:
  static Result<std::unique_ptr<FileTransfer>> Start(TaskQueue& pool, int fd, bool write, const fs::path& path,
                                                     const std::byte* data, size_t size) {
    auto transfer = std::unique_ptr<FileTransfer>(new FileTransfer(fd, write, path, size));
    const size_t rounded = RoundUp(size);
    for (size_t begin = 0; begin < rounded; begin += kPieceBytes) {
      const size_t end = std::min(rounded, begin + kPieceBytes);
      transfer->pieces_.push_back(pool.Push([fd, write, path, data, begin, end, size]() -> Status {
        size_t at = begin;
        // A read stops at the end of the file: another direct read from its unaligned end may be EINVAL.
        const size_t stop = write ? end : std::min(end, size);
        while (at < stop) {
          const ssize_t n = write ? ::pwrite(fd, data + at, end - at, static_cast<off_t>(at))
                                  : ::pread(fd, const_cast<std::byte*>(data) + at, end - at, static_cast<off_t>(at));
          if (n < 0 && errno == EINTR) continue;
          if (n < 0) return Errno(fmt::format("{} bytes {}..{} of", write ? "writing" : "reading", at, end), path);
          if (n == 0) break;  // a read at the end of the file
          at += static_cast<size_t>(n);
        }
        if (at < std::min(end, size)) {
          return write ? IoError("checkpoint: writing {} stopped at byte {}", path.string(), at)
                       : Corruption("checkpoint: {} ended at byte {} of {}", path.string(), at, size);
        }
        return Status::Ok();
      }));
    }
    return transfer;
  }
  FileTransfer(int fd, bool write, fs::path path, size_t size)
      : fd_(fd), write_(write), path_(std::move(path)), size_(size) {}

  int fd_;
  bool write_;
  fs::path path_;
  size_t size_;
  std::vector<std::shared_future<Status>> pieces_;
};

// Note [Recycled chunk files]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A direct write into a new file ran at half the drive's bandwidth on ext4
// (2.5-3.4 GB/s, against 6.5-7 GB/s over blocks already written, on the same
// disk in the same minute; docs/benchmarks.md): each write into a new file
// allocates blocks, or converts the unwritten extents fallocate left, under
// the inode's lock and in the journal, while a write over written blocks is
// a plain overwrite. A save therefore writes its chunk files over the files
// of removed checkpoints: where a checkpoint would be deleted (pruned by
// keep_last, replaced by a re-save of its step, left by a crashed save), its
// chunk files are moved into root/.spare instead, and a later save renames
// one of about the right size into its temporary directory (a rename: two
// ranks cannot both take one) and writes over it, cutting it to its size.
// Nothing a published checkpoint holds is ever written over: a pruned one is
// renamed to a hidden name before its files are moved. After each published
// save, rank 0 trims the spares to the bytes that save wrote, which the next
// save takes back from them: at rest the spares hold at most one more
// checkpoint's room, and a save's peak use of the disk is what it was without them.
// The cost: a process still reading a removed checkpoint's files (an
// uploader copying it away) reads the next save's bytes once that save
// writes over them. It must finish first, or the saves run with recycle off.

Status SyncDirectory(const fs::path& path);

// Moves the chunk files of `dir` (a checkpoint or temporary being removed,
// its rank<r>/ directories) into root/.spare, then removes `dir`; with
// `recycle` false, only removes it.
void Retire(const fs::path& root, const fs::path& dir, bool recycle) {
  std::error_code ec;
  if (recycle) {
    std::vector<fs::path> files;
    for (const fs::directory_entry& rank : fs::directory_iterator(dir, ec)) {
      if (!rank.is_directory(ec)) continue;
      for (const fs::directory_entry& file : fs::directory_iterator(rank.path(), ec)) {
        if (file.is_regular_file(ec) && file.path().extension() == ".bin") files.push_back(file.path());
      }
    }
    fs::create_directory(root / kSpares, ec);
    thread_local std::mt19937_64 names{std::random_device{}()};
    for (const fs::path& file : files) {
      (void)::rename(file.c_str(), (root / kSpares / fmt::format("{:016x}.bin", names())).c_str());
    }
    // Durable before any save writes over them: a crash must not bring a
    // removed checkpoint back holding a later save's bytes.
    (void)SyncDirectory(root / kSpares);
  }
  fs::remove_all(dir, ec);
}

// Keeps at most `keep` bytes of spare files under root/.spare.
void TrimSpares(const fs::path& root, uint64_t keep) {
  std::error_code ec;
  if (keep == 0) {
    fs::remove_all(root / kSpares, ec);
    return;
  }
  uint64_t kept = 0;
  for (const fs::directory_entry& file : fs::directory_iterator(root / kSpares, ec)) {
    const uint64_t size = file.is_regular_file(ec) ? file.file_size(ec) : 0;
    if (!ec && size > 0 && kept + size <= keep) {
      kept += size;
    } else {
      fs::remove_all(file.path(), ec);
    }
  }
}

// The spare files under root/.spare as a save found them (Note [Recycled chunk files]).
class SpareFiles {
 public:
  SpareFiles(const fs::path& root, bool recycle) {
    if (!recycle) return;
    std::error_code ec;
    for (const fs::directory_entry& file : fs::directory_iterator(root / kSpares, ec)) {
      if (const uint64_t size = file.is_regular_file(ec) ? file.file_size(ec) : 0; !ec && size > 0) {
        by_size_.emplace(size, file.path());
      }
    }
  }

  // Renames the spare that best fits a file of `bytes` (the smallest that
  // holds them, else the largest) to `path`: whether there was one.
  bool Claim(const fs::path& path, uint64_t bytes) {
    while (!by_size_.empty()) {
      auto fit = by_size_.lower_bound(bytes);
      if (fit == by_size_.end()) fit = std::prev(by_size_.end());
      const fs::path spare = std::move(fit->second);
      by_size_.erase(fit);
      if (::rename(spare.c_str(), path.c_str()) == 0) return true;  // else another rank took it
    }
    return false;
  }

 private:
  std::multimap<uint64_t, fs::path> by_size_;
};

// fsyncs every file of `paths` (the drive's cache and the file's size),
// several at once on `pool` (the file system commits them together), and
// drops any pages they left in the page cache (a file system without
// O_DIRECT): a checkpoint is not read back soon.
Status FlushAll(TaskQueue& pool, const std::vector<fs::path>& paths) {
  std::vector<std::shared_future<Status>> flushed;
  for (const fs::path& path : paths) {
    flushed.push_back(pool.Push([path]() -> Status {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) return Errno("opening", path);
      const int synced = ::fsync(fd);
      const Status error = synced != 0 ? Errno("flushing", path) : Status::Ok();
      if (synced == 0) ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
      ::close(fd);
      return error;
    }));
  }
  Status first = Status::Ok();
  for (const std::shared_future<Status>& done : flushed) {
    if (const Status status = done.get(); first.ok() && !status.ok()) first = status;
  }
  return first;
}

// A directory's entries (a rename, a new file) made durable.
Status SyncDirectory(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("opening the directory", path);
  const int synced = ::fsync(fd);
  const Status error = synced != 0 ? Errno("flushing the directory", path) : Status::Ok();
  ::close(fd);
  return error;
}

// Checks the bytes a transfer read against the manifest's CRC32C.
Status CheckCrc(const fs::path& path, const void* data, uint64_t size, uint32_t crc) {
  const uint32_t found = Crc32c(data, size);
  if (found != crc) {
    return Corruption("checkpoint: {} does not match its CRC32C: the manifest says {:08x}, the bytes give {:08x}",
                      path.string(), crc, found);
  }
  return Status::Ok();
}

Result<std::string> ReadText(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Errno("opening", path);
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return Errno("reading", path);
  return text.str();
}

// Whether a chunk is part of a checkpoint: not the gradients (zero between
// steps) nor a gathered param chunk (its group's masters are saved).
bool Saved(const ChunkInfo& chunk) { return chunk.kind != ChunkKind::kGrad && !chunk.transient; }

json TensorsJson(const std::vector<TensorSpec>& tensors) {
  json out = json::array();
  for (const TensorSpec& t : tensors) {
    out.push_back({{"name", t.name}, {"shape", t.shape}, {"dtype", DTypeName(t.dtype)}, {"trainable", t.trainable}});
  }
  return out;
}

// The checkpoint directories under `root`, newest first.
std::vector<fs::path> CheckpointsUnder(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (const fs::directory_entry& entry : fs::directory_iterator(root, ec)) {
    if (std::optional<int64_t> step = StepOf(entry.path().filename().string()); step && entry.is_directory(ec)) {
      found.emplace_back(*step, entry.path());
    }
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<fs::path> paths;
  for (auto& [step, path] : found) paths.push_back(std::move(path));
  return paths;
}

// The name a published checkpoint `name` is moved aside under while a
// re-save of its step replaces it without RENAME_EXCHANGE, the pid appended.
std::string AsidePrefix(const std::string& name) { return fmt::format(".{}.old-", name); }

// A checkpoint `name` that a crash left moved aside under `root` (see
// Publish), when `name` itself is missing.
std::optional<fs::path> FindAside(const fs::path& root, const std::string& name) {
  std::error_code ec;
  if (fs::exists(root / name, ec)) return std::nullopt;
  for (const fs::directory_entry& entry : fs::directory_iterator(root, ec)) {
    if (entry.path().filename().string().rfind(AsidePrefix(name), 0) == 0 && fs::exists(entry.path() / kManifest, ec)) {
      return entry.path();
    }
  }
  return std::nullopt;
}

// Publishes the complete checkpoint `staged` as root/name: a rename, or, where
// a checkpoint of that name exists, an atomic exchange with it (the old one
// then retired: Retire), so that root/name is never missing. `exchange`
// false: CheckpointOptions::exchange (tests).
Status Publish(const fs::path& root, const std::string& name, const fs::path& staged, bool exchange, bool recycle) {
  const fs::path final_path = root / name;
  std::error_code ec;
  if (fs::exists(final_path, ec)) {
    if (!exchange) {
      errno = EINVAL;  // as a file system without the exchange answers
    } else if (::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, final_path.c_str(), RENAME_EXCHANGE) == 0) {
      STRATA_RETURN_IF_ERROR(SyncDirectory(root));
      Retire(root, staged, recycle);  // the replaced checkpoint
      return Status::Ok();
    }
    if (errno != EINVAL && errno != ENOSYS)
      return Errno(fmt::format("exchanging {} with", staged.string()), final_path);
    // A file system without the exchange (NFS): the old one moved aside
    // first. A crash between the two renames leaves it there, complete:
    // Resolve takes it where `latest` names the missing one, and the next
    // save puts it back.
    const fs::path aside = root / fmt::format("{}{}", AsidePrefix(name), ::getpid());
    if (::rename(final_path.c_str(), aside.c_str()) != 0) return Errno("moving aside", final_path);
    if (::rename(staged.c_str(), final_path.c_str()) != 0) {
      const Status error = Errno(fmt::format("renaming {} to", staged.string()), final_path);
      ::rename(aside.c_str(), final_path.c_str());
      return error;
    }
    STRATA_RETURN_IF_ERROR(SyncDirectory(root));
    Retire(root, aside, recycle);
    return Status::Ok();
  }
  if (::rename(staged.c_str(), final_path.c_str()) != 0)
    return Errno(fmt::format("renaming {} to", staged.string()), final_path);
  return SyncDirectory(root);
}

// Points root/latest at `name`: written beside it, then renamed over it.
Status PointLatestAt(const fs::path& root, const std::string& name) {
  const fs::path staged = root / fmt::format(".{}.tmp-{}", kLatest, ::getpid());
  const std::string text = name + "\n";
  STRATA_RETURN_IF_ERROR(WriteFileDurably(staged, text.data(), text.size()));
  if (::rename(staged.c_str(), (root / kLatest).c_str()) != 0) return Errno("renaming over", root / kLatest);
  return SyncDirectory(root);
}

// Which checkpoint `path` means: itself when it holds a manifest, else the
// one its `latest` names. `root` is set in the second case.
Result<fs::path> Resolve(const fs::path& path, std::optional<fs::path>* root) {
  std::error_code ec;
  if (fs::exists(path / kManifest, ec)) return path;
  if (!fs::exists(path / kLatest, ec)) {
    return IoError("checkpoint: {} holds neither a checkpoint ({}) nor a root's pointer to one ({})", path.string(),
                   kManifest, kLatest);
  }
  STRATA_ASSIGN_OR_RETURN(std::string name, ReadText(path / kLatest));
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  if (!StepOf(name)) return Corruption("checkpoint: {} names '{}', not a checkpoint", (path / kLatest).string(), name);
  if (root != nullptr) *root = path;
  // A re-save that crashed between its two renames (no RENAME_EXCHANGE) left the old one aside.
  if (std::optional<fs::path> aside = FindAside(path, name)) return *aside;
  return path / name;
}

Result<json> ReadManifest(const fs::path& dir) {
  STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(dir / kManifest));
  json manifest = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (manifest.is_discarded() || !manifest.is_object()) {
    return Corruption("checkpoint: {} is not a JSON object", (dir / kManifest).string());
  }
  const std::string where = (dir / kManifest).string();
  for (const char* key : {"format", "version", "step", "world_size", "files", "tensors", "optimizer"}) {
    if (!manifest.contains(key)) return Corruption("checkpoint: {} lacks '{}'", where, key);
  }
  if (manifest.at("format") != kFormat || manifest.at("version") != kVersion) {
    return InvalidArgument("checkpoint: {} is not a {} of version {} (format {}, version {})", where, kFormat, kVersion,
                           manifest.at("format").dump(), manifest.at("version").dump());
  }
  // Every file inside the checkpoint, under its rank's directory.
  for (const json& file : manifest.at("files")) {
    const std::string path = file.at("path").get<std::string>();
    const size_t slash = path.find('/');
    if (slash == std::string::npos || path.rfind("rank", 0) != 0 || path.find("..") != std::string::npos ||
        path.find('/', slash + 1) != std::string::npos) {
      return Corruption("checkpoint: {} lists '{}', not a file of a rank's directory", where, path);
    }
  }
  return manifest;
}

// Runs `read` over a manifest's fields: a field of the wrong type or missing is Corruption.
template <typename Read>
auto Guarded(const fs::path& dir, Read read) -> decltype(read()) {
  try {
    return read();
  } catch (const json::exception& error) {
    return Corruption("checkpoint: {}: {}", (dir / kManifest).string(), error.what());
  }
}

// A file of a checkpoint to read, and what of it a chunk takes: bytes
// [from, to) of its chunk group's whole chunk, into `chunk`.
struct Piece {
  const json* file = nullptr;
  uint64_t from = 0, to = 0;  // elements of the group's whole chunk
  std::optional<ChunkInfo> chunk;
  DType dtype = DType::kFloat32;  // the file's
};

// Reads every piece's file, checked against its size and CRC32C, and hands
// it to `use` in order (with its index), in a buffer of at least `room` bytes that `use` may
// change, or where `into(i)` says (a chunk's own bytes; nullptr: a buffer);
// the next file is read while `use` runs on this one (two buffers).
template <typename Into, typename Use>
Status ReadPieces(const fs::path& dir, const std::vector<Piece>& pieces, uint64_t room, Into into, Use use) {
  uint64_t largest = std::max<uint64_t>(room, 1);
  for (const Piece& piece : pieces) largest = std::max(largest, (*piece.file).at("bytes").get<uint64_t>());
  TaskQueue pool(FileTransfer::kThreads);
  Buffer buffers[2] = {AllocateAlignedHost(RoundUp(largest), kDirectAlignment),
                       AllocateAlignedHost(RoundUp(largest), kDirectAlignment)};
  if (!buffers[0] || !buffers[1]) return OutOfMemory("checkpoint: two {}-byte read buffers", RoundUp(largest));
  std::unique_ptr<FileTransfer> reading[2];
  std::byte* read_into[2] = {};
  const auto start = [&](size_t i) -> Status {
    const json& file = *pieces[i].file;
    STRATA_ASSIGN_OR_RETURN(std::byte* direct, into(i));
    read_into[i % 2] = direct != nullptr ? direct : static_cast<std::byte*>(buffers[i % 2].data());
    STRATA_ASSIGN_OR_RETURN(reading[i % 2], FileTransfer::StartRead(pool, dir / file.at("path").get<std::string>(),
                                                                    read_into[i % 2], file.at("bytes").get<uint64_t>()));
    return Status::Ok();
  };
  if (!pieces.empty()) STRATA_RETURN_IF_ERROR(start(0));
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (i + 1 < pieces.size()) STRATA_RETURN_IF_ERROR(start(i + 1));
    const json& file = *pieces[i].file;
    const fs::path path = dir / file.at("path").get<std::string>();
    std::byte* data = read_into[i % 2];
    // Named by chunk too, so that a caller can say what the chunk holds.
    const std::string named =
        fmt::format("chunk {} ({})", file.at("chunk").get<uint32_t>(), file.at("kind").get<std::string>());
    STRATA_RETURN_IF_ERROR(reading[i % 2]->Finish().WithContext(named));
    STRATA_RETURN_IF_ERROR(
        CheckCrc(path, data, file.at("bytes").get<uint64_t>(), file.at("crc32c").get<uint32_t>()).WithContext(named));
    STRATA_RETURN_IF_ERROR(use(i, pieces[i], data));
  }
  return Status::Ok();
}

// Checks every file `manifest` lists under `dir` (size and CRC32C).
Result<CheckpointSummary> VerifyFiles(const fs::path& dir, const json& manifest) {
  CheckpointSummary summary;
  summary.path = dir.string();
  summary.step = manifest.at("step").get<int64_t>();
  std::vector<Piece> pieces;
  for (const json& file : manifest.at("files")) pieces.push_back({&file, 0, 0, std::nullopt});
  const auto buffered = [](size_t) -> Result<std::byte*> { return nullptr; };
  STRATA_RETURN_IF_ERROR(ReadPieces(dir, pieces, 0, buffered, [&](size_t, const Piece& piece, std::byte*) {
    summary.bytes += (*piece.file).at("bytes").get<uint64_t>();
    summary.files++;
    return Status::Ok();
  }));
  return summary;
}

// AgreeOnStatus, for a checkpoint's `what`.
Status Agree(Communicator* comm, const Status& status, const std::string& what, bool* any_invalid = nullptr) {
  return AgreeOnStatus(comm, status, "checkpoint: " + what, any_invalid);
}

// InvalidArgument unless the checkpoint holds `engine`'s model (the same
// registered tensors) and `optimizer` can take its state.
Status CheckFits(const json& manifest, const fs::path& dir, const Engine& engine, const optim::Optimizer& optimizer) {
  const std::string where = dir.string();
  if (manifest.at("tensors") != TensorsJson(engine.tensors())) {
    return InvalidArgument(
        "checkpoint {} holds another model: its registered tensors (name, shape, dtype, trainable) differ from this "
        "engine's",
        where);
  }
  const bool saved_scaler = !manifest.at("optimizer").at("loss_scaler").is_null();
  if (saved_scaler != (optimizer.scaler() != nullptr)) {
    return InvalidArgument("checkpoint {} was saved {} a loss scaler and this optimizer has {} (loss_scale.mode)",
                           where, saved_scaler ? "with" : "without", optimizer.scaler() ? "one" : "none");
  }
  return Status::Ok();
}

// Loads this rank's part of the checkpoint at `dir`: for each chunk it
// holds (a whole chunk, or its shard of a group's), the bytes of the files
// that cover its range of the group's whole chunk, whichever rank saved them
// (so a checkpoint of W ranks loads on W'). Each file is read whole and
// checked against its size and CRC32C before any of it is used.
Result<CheckpointSummary> LoadOne(Engine& engine, optim::Optimizer& optimizer, const fs::path& dir) {
  return Guarded(dir, [&]() -> Result<CheckpointSummary> {
    STRATA_ASSIGN_OR_RETURN(json manifest, ReadManifest(dir));
    STRATA_RETURN_IF_ERROR(CheckFits(manifest, dir, engine, optimizer));
    std::map<std::pair<uint32_t, std::string>, std::vector<const json*>> by_group;  // (group, kind) -> files
    for (const json& file : manifest.at("files")) {
      by_group[{file.at("group").get<uint32_t>(), file.at("kind").get<std::string>()}].push_back(&file);
    }
    CheckpointSummary summary;
    summary.path = dir.string();
    summary.step = manifest.at("step").get<int64_t>();
    // What to read, and whether it covers every chunk this rank holds, before anything is read.
    std::vector<Piece> pieces;
    for (const ChunkInfo& c : engine.chunks()) {
      if (!Saved(c)) continue;
      const std::string kind(ChunkKindName(c.kind));
      const uint64_t width = DTypeSizeBytes(c.dtype);
      const uint64_t begin = c.shard_offset_bytes / width, end = begin + c.used_bytes / width;
      // A checkpoint saved with comm.shard_params holds a group's masters but
      // no params, and one of an fp32 run without it params but no masters:
      // the other kind stands in (masters rounded to the param dtype, as the
      // update rounds them; fp32 params are their own masters).
      std::string source = kind;
      if (by_group[{c.group, kind}].empty() && (c.kind == ChunkKind::kParam || c.kind == ChunkKind::kMaster)) {
        source = c.kind == ChunkKind::kParam ? "master" : "param";
      }
      const size_t first = pieces.size();
      for (const json* file : by_group[{c.group, source}]) {
        Result<DType> dtype = ParseDType((*file).at("dtype").get<std::string>());
        if (!dtype.ok()) return Corruption("checkpoint {}: {}", dir.string(), dtype.status().message());
        const uint64_t file_width = DTypeSizeBytes(*dtype);
        const uint64_t file_begin = (*file).at("shard_offset").get<uint64_t>() / file_width;
        const uint64_t from = std::max(begin, file_begin);
        const uint64_t to = std::min(end, file_begin + (*file).at("bytes").get<uint64_t>() / file_width);
        if (from >= to) continue;
        if (*dtype != c.dtype && !(c.kind == ChunkKind::kParam && *dtype == DType::kFloat32)) {
          if (source != kind) {  // a bf16/fp16 run's params cannot stand in for fp32 masters
            return InvalidArgument(
                "checkpoint {}: it holds no masters of chunk group {}, and its params are {}: only fp32 params "
                "stand in for the fp32 masters this engine keeps",
                dir.string(), c.group, (*file).at("dtype").dump());
          }
          return InvalidArgument("checkpoint {}: the {} of chunk group {} was saved in {}, this engine holds {}",
                                 dir.string(), kind, c.group, (*file).at("dtype").dump(), DTypeName(c.dtype));
        }
        pieces.push_back({file, from, to, c, *dtype});
      }
      // The files' ranges must tile the chunk's: no gap, no overlap.
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
    // A file that is exactly its chunk's bytes is read straight into the
    // chunk where it lies in host memory (pinned there: no copy), or written
    // where the chunk lives (Engine::WriteChunk: an NVMe-resident chunk is
    // not read first); a chunk made of several files (another number of
    // ranks), or of another dtype, is filled in host memory, pinned there.
    // (A damaged file has then overwritten its chunk: the load fails, and
    // another checkpoint must be loaded, as the header says.)
    uint64_t largest_slot = 0;
    for (const Piece& piece : pieces) largest_slot = std::max(largest_slot, piece.chunk->size_bytes);
    const auto whole = [](const Piece& piece) {
      const ChunkInfo& c = *piece.chunk;
      const uint64_t begin = c.shard_offset_bytes / DTypeSizeBytes(c.dtype);
      return piece.dtype == c.dtype && piece.from == begin &&
             (*piece.file).at("shard_offset").get<uint64_t>() / DTypeSizeBytes(piece.dtype) == begin &&
             (*piece.file).at("bytes").get<uint64_t>() == c.used_bytes;
    };
    std::optional<ChunkAccess> direct[2];  // the chunks read into where they lie
    const auto into = [&](size_t i) -> Result<std::byte*> {
      direct[i % 2].reset();
      const ChunkInfo& c = *pieces[i].chunk;
      if (!whole(pieces[i]) || c.size_bytes < RoundUp(c.used_bytes)) return nullptr;
      STRATA_ASSIGN_OR_RETURN(std::optional<HostBytes> lies, engine.PeekHostChunk(c.id));
      if (!lies) return nullptr;
      Result<ChunkAccess> pin = engine.AccessChunk(c.id, Tier::kHost);
      if (!pin.ok() || reinterpret_cast<uintptr_t>(pin->data()) % kDirectAlignment != 0) return nullptr;  // a buffer
      direct[i % 2] = std::move(pin).value();
      return direct[i % 2]->data();
    };
    std::optional<ChunkAccess> pinned;
    const auto use = [&](size_t i, const Piece& piece, std::byte* data) -> Status {
      const uint64_t bytes = (*piece.file).at("bytes").get<uint64_t>();
      const ChunkInfo& c = *piece.chunk;
      const uint64_t width = DTypeSizeBytes(c.dtype), file_width = DTypeSizeBytes(piece.dtype);
      const uint64_t begin = c.shard_offset_bytes / width;
      const uint64_t file_begin = (*piece.file).at("shard_offset").get<uint64_t>() / file_width;
      summary.bytes += bytes;
      summary.files++;
      std::optional<ChunkAccess>& read_in_place = direct[i % 2];
      if (whole(piece)) {
        pinned.reset();
        std::memset(data + bytes, 0, c.size_bytes - bytes);  // the slot's tail past the tensors
        if (read_in_place) {
          read_in_place.reset();
          return Status::Ok();
        }
        return engine.WriteChunk(c.id, data).WithContext("checkpoint: loading a chunk");
      }
      if (!pinned || pinned->id() != c.id) {
        pinned.reset();
        STRATA_ASSIGN_OR_RETURN(pinned, engine.AccessChunk(c.id, Tier::kHost));
      }
      std::byte* to = pinned->data() + (piece.from - begin) * width;
      const std::byte* from = data + (piece.from - file_begin) * file_width;
      const uint64_t n = piece.to - piece.from;
      if (piece.dtype == c.dtype) {
        std::memcpy(to, from, n * width);
      } else {
        for (uint64_t e = 0; e < n; ++e) optim::StoreFloat(to, c.dtype, e, optim::FloatAt(from, piece.dtype, e));
      }
      return Status::Ok();
    };
    STRATA_RETURN_IF_ERROR(ReadPieces(dir, pieces, largest_slot, into, use));
    pinned.reset();
    const json& state = manifest.at("optimizer");
    std::optional<optim::Optimizer::ScalerState> scaler;
    if (!state.at("loss_scaler").is_null()) {
      scaler = optim::Optimizer::ScalerState{state.at("loss_scaler").at("scale").get<float>(),
                                             state.at("loss_scaler").at("good_steps").get<int64_t>(),
                                             state.at("loss_scaler").at("overflows").get<int64_t>()};
    }
    STRATA_RETURN_IF_ERROR(optimizer.Restore(state.at("steps_taken").get<int64_t>(), scaler));
    return summary;
  });
}

// What writing a rank's files asks of the save it is part of.
struct SaveHooks {
  std::function<Status(ChunkId)> begin_chunk;                // before each chunk is taken
  std::function<Status(ChunkId, std::byte*)> read_chunk;     // Engine::ReadChunk
  std::function<void(const ChunkInfo&)> done;                // once the save no longer needs the chunk as it is
};

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
// wherever the chunk is then). A chunk on the device or NVMe is read into a
// buffer. Nothing moves during a synchronous save: it takes the same path.

// This rank's files of a checkpoint into `staged`/rank<r>: its shards, and
// on rank 0 the whole chunks too (every rank holds the same ones), in
// layout order (chunk group by chunk group). Their manifest entries.
Result<json> WriteRankFiles(Engine& engine, const fs::path& staged, SpareFiles& spares, const SaveHooks& hooks,
                            CheckpointSummary& summary) {
  const int rank = engine.rank();
  const std::string rank_dir = fmt::format("rank{}", rank);
  // Inside rank 0's directory, never creating it: a rank behind a save
  // that rank 0 has given up on and removed fails.
  std::error_code ec;
  fs::create_directory(staged / rank_dir, ec);
  if (ec) return IoError("checkpoint: creating {}: {}", (staged / rank_dir).string(), ec.message());
  std::vector<ChunkInfo> chunks;
  for (ChunkInfo& c : engine.chunks()) {
    if (Saved(c) && (c.sharded || rank == 0)) chunks.push_back(std::move(c));
  }
  std::stable_sort(chunks.begin(), chunks.end(),
                   [](const ChunkInfo& a, const ChunkInfo& b) { return a.group < b.group; });
  uint64_t largest = 4096;
  for (const ChunkInfo& c : chunks) largest = std::max(largest, c.size_bytes);
  // Three chunks' files are written at a time (two left the drive idle
  // between files: 0.77-0.83 x bench io's write against 0.86-0.91), each
  // from where its chunk lies in host memory or from a copy in its own
  // buffer (Note [Writing a chunk from where it lies]); its CRC32C is taken
  // beside its write.
  constexpr int kInFlight = 3;
  TaskQueue pool(FileTransfer::kThreads);
  Buffer buffers[kInFlight];
  for (Buffer& buffer : buffers) {
    buffer = AllocateAlignedHost(RoundUp(largest), kDirectAlignment);
    if (!buffer) return OutOfMemory("checkpoint: {} {}-byte chunk buffers", kInFlight, RoundUp(largest));
  }
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
  InFlight flights[kInFlight];
  for (int i = 0; i < kInFlight; ++i) flights[i].buffer = static_cast<std::byte*>(buffers[i].data());
  json files = json::array();
  std::vector<fs::path> written;
  const auto start = [&](InFlight& flight, const std::byte* data) -> Status {
    const uint64_t size = flight.chunk->used_bytes;
    STRATA_ASSIGN_OR_RETURN(flight.transfer, FileTransfer::StartWrite(pool, flight.path, data, size));
    flight.crc_done = pool.Push([&flight, data, size] {
      flight.crc = Crc32c(data, size);
      return Status::Ok();
    });
    return Status::Ok();
  };
  const auto wait = [](InFlight& flight) -> Status {
    const Status status = flight.transfer->Finish();
    const Status crc = flight.crc_done.get();
    flight.transfer.reset();
    return status.ok() ? crc : status;
  };
  // A file written from where its chunk lay, the chunk moved since: written again from a copy.
  const auto rewrite_if_moved = [&](InFlight& flight) -> Status {
    STRATA_ASSIGN_OR_RETURN(uint64_t now, engine.ChunkGeneration(flight.chunk->id));
    if (now == *flight.generation) return Status::Ok();
    summary.rewritten++;
    STRATA_RETURN_IF_ERROR(
        hooks.read_chunk(flight.chunk->id, flight.buffer).WithContext("checkpoint: reading a chunk that moved"));
    STRATA_RETURN_IF_ERROR(start(flight, flight.buffer));
    return wait(flight);
  };
  const auto finish = [&](InFlight& flight) -> Status {
    if (!flight.transfer) return Status::Ok();
    Status status = wait(flight);
    if (status.ok() && flight.generation) status = rewrite_if_moved(flight);
    if (flight.generation) hooks.done(*flight.chunk);
    STRATA_RETURN_IF_ERROR(status);
    flight.entry["crc32c"] = flight.crc;
    files.push_back(std::move(flight.entry));
    return Status::Ok();
  };
  // On an early return: no write left reading a buffer about to go, or a chunk.
  struct Drain {
    InFlight* flights;
    ~Drain() {
      for (int i = 0; i < kInFlight; ++i) {
        if (flights[i].transfer) (void)flights[i].transfer->Finish();
        if (flights[i].crc_done.valid()) flights[i].crc_done.wait();
      }
    }
  } drain{flights};
  int b = 0;
  for (const ChunkInfo& c : chunks) {
    InFlight& flight = flights[b];
    STRATA_RETURN_IF_ERROR(finish(flight));
    STRATA_RETURN_IF_ERROR(hooks.begin_chunk(c.id));
    const std::string path = fmt::format("{}/chunk-{}.bin", rank_dir, c.id.value());
    flight.chunk = c;
    flight.path = staged / path;
    flight.generation.reset();
    const std::byte* data = flight.buffer;
    STRATA_ASSIGN_OR_RETURN(std::optional<HostBytes> lies, engine.PeekHostChunk(c.id));
    if (lies && reinterpret_cast<uintptr_t>(lies->data) % kDirectAlignment == 0 &&
        c.size_bytes >= RoundUp(c.used_bytes)) {
      data = lies->data;
      flight.generation = lies->generation;
    } else {
      STRATA_RETURN_IF_ERROR(hooks.read_chunk(c.id, flight.buffer).WithContext("checkpoint: reading a chunk to save"));
      hooks.done(c);
    }
    summary.recycled += c.used_bytes > 0 && spares.Claim(flight.path, c.used_bytes) ? 1 : 0;
    STRATA_RETURN_IF_ERROR(start(flight, data));
    written.push_back(flight.path);
    flight.entry = {{"path", path},
                    {"chunk", c.id.value()},
                    {"kind", ChunkKindName(c.kind)},
                    {"dtype", DTypeName(c.dtype)},
                    {"group", c.group},
                    {"rank", rank},
                    {"shard_offset", c.shard_offset_bytes},
                    {"bytes", c.used_bytes}};
    summary.bytes += c.used_bytes;
    summary.files++;
    b = (b + 1) % kInFlight;
  }
  for (int i = 0; i < kInFlight; ++i) STRATA_RETURN_IF_ERROR(finish(flights[(b + i) % kInFlight]));  // the older first
  STRATA_RETURN_IF_ERROR(FlushAll(pool, written));
  STRATA_RETURN_IF_ERROR(SyncDirectory(staged / rank_dir));
  return files;
}

// Rank r > 0 tells rank 0 how its files went, in its directory of `staged`:
// their manifest entries (files.json), or why they failed (failed.txt),
// each published by a rename so that rank 0 never reads half of one.
Status ReportToLead(const fs::path& staged, int rank, const Result<json>& files) {
  const fs::path dir = staged / fmt::format("rank{}", rank);
  const std::string text = files.ok() ? files->dump() : files.status().ToString();
  const fs::path report = dir / (files.ok() ? kRankFiles : kRankFailed);
  const fs::path temporary = dir / ".report.tmp";
  STRATA_RETURN_IF_ERROR(WriteFileDurably(temporary, text.data(), text.size()));
  if (::rename(temporary.c_str(), report.c_str()) != 0) return Errno("renaming over", report);
  return SyncDirectory(dir);
}

// Rank 0: every other rank's manifest entries appended to `files`, as each
// reports (ReportToLead); the first rank that failed, or that has not
// reported `timeout_ms` after this call, fails it.
Status CollectRankFiles(const fs::path& staged, int world, uint32_t timeout_ms, json& files) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (int r = 1; r < world; ++r) {
    const fs::path dir = staged / fmt::format("rank{}", r);
    std::error_code ec;
    while (!fs::exists(dir / kRankFiles, ec)) {
      if (fs::exists(dir / kRankFailed, ec)) {
        Result<std::string> why = ReadText(dir / kRankFailed);
        return IoError("checkpoint: rank {} failed writing its files: {}", r,
                       why.ok() ? *why : why.status().ToString());
      }
      if (std::chrono::steady_clock::now() > deadline) {
        return Timeout("checkpoint: rank {} had not written its files {} ms after rank 0 had (comm.timeout_ms)", r,
                       timeout_ms);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    STRATA_ASSIGN_OR_RETURN(std::string text, ReadText(dir / kRankFiles));
    json entries = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!entries.is_array()) return Corruption("checkpoint: {} is not a JSON array", (dir / kRankFiles).string());
    for (json& entry : entries) files.push_back(std::move(entry));
  }
  return Status::Ok();
}

// What the manifest says besides its files, fixed as a save begins.
json ManifestHead(const Engine& engine, const optim::Optimizer& optimizer) {
  json scaler = nullptr;
  if (const optim::LossScaler* s = optimizer.scaler()) {
    scaler = {{"scale", s->scale()}, {"good_steps", s->good_steps()}, {"overflows", s->overflows()}};
  }
  json described = json::object();
  for (const auto& [key, value] : DescribeOptions(engine.options())) described[key] = value;
  return {{"format", kFormat},
          {"version", kVersion},
          {"step", optimizer.steps_taken()},
          {"world_size", engine.world_size()},
          {"optimizer", {{"steps_taken", optimizer.steps_taken()}, {"loss_scaler", scaler}}},
          {"options", described},
          {"tensors", TensorsJson(engine.tensors())}};
}

// InvalidArgument unless `comm` is the group `engine` is a rank of.
Status CheckGroup(const Engine& engine, const Communicator* comm) {
  if (engine.world_size() == 1 && comm == nullptr) return Status::Ok();
  if (comm == nullptr || comm->world_size() != engine.world_size() || comm->rank() != engine.rank()) {
    return InvalidArgument(
        "checkpoint: this engine is rank {} of {}: pass its communicator (every rank saves and loads together)",
        engine.rank(), engine.world_size());
  }
  return Status::Ok();
}

}  // namespace

namespace {

// The engines with an asynchronous save not yet waited for: another save or
// a load of theirs is refused meanwhile.
std::mutex pending_mu;
std::set<const Engine*> pending_engines;

Status CheckNoSavePending(const Engine& engine) {
  std::lock_guard<std::mutex> lock(pending_mu);
  if (pending_engines.contains(&engine)) {
    return InvalidArgument(
        "checkpoint: an asynchronous save of this engine is in flight: wait for it (PendingCheckpoint::Wait) before "
        "another save or a load");
  }
  return Status::Ok();
}

void SetSavePending(const Engine& engine, bool pending) {
  std::lock_guard<std::mutex> lock(pending_mu);
  if (pending) {
    pending_engines.insert(&engine);
  } else {
    pending_engines.erase(&engine);
  }
}

}  // namespace

// A save's state, shared by the thread that writes it and its caller.
struct PendingCheckpoint::State {
  Engine& engine;
  Communicator* comm;
  CheckpointOptions options;
  bool asynchronous;  // on a thread of its own, the communicator left alone; else the caller's
  fs::path dir;    // the root
  std::string name;
  fs::path staged;
  json head;  // the manifest but its files
  int64_t step;

  std::mutex mu;
  std::condition_variable released;
  std::map<uint32_t, uint32_t> unread;  // chunk group -> its chunks this rank has yet to read out
  bool reading = false;     // a chunk is being copied out of the engine (ReadOut)
  std::string abandoned;    // why an update stopped waiting for the save; then no chunk is read again
  bool finished = false;
  Status own = Status::Ok();  // this rank's part (rank 0: the publishing too)
  CheckpointSummary summary;
  std::thread thread;

  void Release(uint32_t group) {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = unread.find(group); it != unread.end() && --it->second == 0) unread.erase(it);
    released.notify_all();
  }

  // Before each chunk is taken: the test hook, then (asynchronous) only
  // while the save has not been abandoned.
  Status BeginChunk(ChunkId id) {
    if (options.before_chunk) STRATA_RETURN_IF_ERROR(options.before_chunk(id));
    if (!asynchronous) return Status::Ok();
    std::lock_guard<std::mutex> lock(mu);
    if (!abandoned.empty()) return Timeout("{}", abandoned);
    return Status::Ok();
  }

  // Engine::ReadChunk, (asynchronous) only while the save has not been
  // abandoned, flagged as being read meanwhile.
  Status ReadOut(ChunkId id, std::byte* into) {
    if (asynchronous) {
      std::lock_guard<std::mutex> lock(mu);
      if (!abandoned.empty()) return Timeout("{}", abandoned);
      reading = true;
    }
    const Status status = engine.ReadChunk(id, into);
    std::lock_guard<std::mutex> lock(mu);
    reading = false;
    released.notify_all();
    return status;
  }

  // Writes this rank's files; rank 0 then gathers the others' entries,
  // writes the manifest, publishes, points `latest` and prunes.
  void Run() {
    const int rank = engine.rank();
    SpareFiles spares(dir, options.recycle);
    Result<json> files = WriteRankFiles(
        engine, staged, spares, {[this](ChunkId id) { return BeginChunk(id); },
                                 [this](ChunkId id, std::byte* into) { return ReadOut(id, into); },
                                 [this](const ChunkInfo& c) { Release(c.group); }},
        summary);
    Status status = files.status();
    {
      std::lock_guard<std::mutex> lock(mu);
      // Abandoned as its last chunk was read: the update went on, so it is not published either.
      if (status.ok() && !abandoned.empty()) status = Timeout("{}", abandoned);
    }
    std::error_code ec;
    if (rank != 0) {
      // Its status, not its files alone: files written while an abandoned
      // save's update changed their chunks must not be published.
      const Status reported = ReportToLead(staged, rank, status.ok() ? files : Result<json>(status));
      if (status.ok()) status = reported;
    }
    // The caller's thread: the ranks' outcomes agreed at once (a rank that
    // failed, even to report, is known now, not after rank 0's wait).
    if (!asynchronous) status = Agree(comm, status, "writing the checkpoint's files");
    if (rank == 0) {
      json merged = files.ok() ? std::move(files).value() : json::array();
      if (status.ok()) {
        status = CollectRankFiles(staged, engine.world_size(), engine.options().comm.timeout_ms, merged);
      }
      uint64_t bytes = 0;  // of every rank's files
      for (const json& file : merged) bytes += file.contains("bytes") ? file["bytes"].get<uint64_t>() : 0;
      if (status.ok()) {
        json manifest = head;
        manifest["files"] = std::move(merged);
        const std::string text = manifest.dump(1);
        status = WriteFileDurably(staged / kManifest, text.data(), text.size());
      }
      if (status.ok()) status = SyncDirectory(staged);
      if (status.ok()) status = Publish(dir, name, staged, options.exchange, options.recycle);
      if (!status.ok()) fs::remove_all(staged, ec);  // the last published checkpoint is untouched
      if (status.ok()) status = PointLatestAt(dir, name);
      // Pruned among this step and earlier ones: later steps belong to a run
      // that was rewound (loaded from an earlier checkpoint), left to the user.
      // Each is hidden by a rename first, so that a crash while its files
      // go never leaves a checkpoint that looks published but is not whole.
      if (status.ok() && options.keep_last > 0) {
        size_t kept = 0;
        for (const fs::path& older : CheckpointsUnder(dir)) {
          if (*StepOf(older.filename().string()) > step || ++kept <= options.keep_last) continue;
          const fs::path hidden = dir / fmt::format(".{}.pruned-{}", older.filename().string(), ::getpid());
          Retire(dir, ::rename(older.c_str(), hidden.c_str()) == 0 ? hidden : older, options.recycle);
        }
      }
      if (status.ok()) TrimSpares(dir, options.recycle ? bytes : 0);
    }
    std::lock_guard<std::mutex> lock(mu);
    own = status;
    finished = true;
    unread.clear();  // a failed save needs nothing more
    released.notify_all();
  }
};

PendingCheckpoint::PendingCheckpoint(std::unique_ptr<State> state) : state_(std::move(state)) {}

PendingCheckpoint::~PendingCheckpoint() {
  WaitLocal();
  if (!outcome_) {
    SetSavePending(state_->engine, false);
    if (!state_->own.ok()) {
      STRATA_LOG_ERROR("checkpoint: the asynchronous save of step {} failed and was never waited for: {}",
                       state_->step, state_->own.ToString());
    }
  }
}

void PendingCheckpoint::WaitLocal() {
  if (state_->thread.joinable()) state_->thread.join();
}

Status PendingCheckpoint::BeforeUpdate(uint32_t group) {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  const auto ready = [&] { return s.finished || !s.abandoned.empty() || !s.unread.contains(group); };
  uint32_t wait_ms = s.options.update_wait_ms;
  // Data parallel, the other ranks wait in the collective after their update meanwhile: give up well within it.
  if (s.engine.world_size() > 1) wait_ms = std::min(wait_ms, std::max(1u, s.engine.options().comm.timeout_ms / 2));
  if (s.options.update_wait_ms == 0) {
    s.released.wait(lock, ready);
  } else if (!s.released.wait_for(lock, std::chrono::milliseconds(wait_ms), ready)) {
    s.abandoned = fmt::format(
        "checkpoint: the asynchronous save of step {} was abandoned: the update of chunk group {} waited {} ms "
        "(CheckpointOptions::update_wait_ms, at most half of comm.timeout_ms with several ranks) for the save to "
        "read it (the drive or file system stalled); training went on, nothing of this save is published, and the "
        "last published checkpoint is intact",
        s.step, group, wait_ms);
    STRATA_LOG_WARNING("{}", s.abandoned);
    // A chunk being read as the save was abandoned is read to its end first.
    s.released.wait(lock, [&] { return s.finished || !s.reading; });
  }
  return Status::Ok();
}

bool PendingCheckpoint::done() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->finished;
}

Result<CheckpointSummary> PendingCheckpoint::Wait() {
  if (outcome_) return *outcome_;
  WaitLocal();
  State& s = *state_;
  SetSavePending(s.engine, false);
  // Every rank's outcome is every rank's (a rank that failed returns its own error).
  const Status agreed = Agree(s.comm, s.own, "saving the checkpoint");
  if (!s.own.ok()) {
    outcome_ = s.own;
  } else if (!agreed.ok()) {
    outcome_ = agreed;
  } else {
    CheckpointSummary summary = s.summary;
    summary.path = (s.dir / s.name).string();
    summary.step = s.step;
    outcome_ = std::move(summary);
  }
  return *outcome_;
}

namespace {

// The part of a save every rank does together, before any file is written:
// the directory prepared and named alike on every rank, and what the
// manifest says fixed. Then the files, on a thread (`asynchronous`) or here.
Result<std::unique_ptr<PendingCheckpoint>> Start(Engine& engine, const optim::Optimizer& optimizer,
                                                 const std::string& root, const CheckpointOptions& options,
                                                 Communicator* comm, bool asynchronous) {
  if (!engine.finalized()) return InvalidArgument("checkpoint: the engine is not finalized: nothing to save yet");
  STRATA_RETURN_IF_ERROR(CheckGroup(engine, comm));
  STRATA_RETURN_IF_ERROR(CheckNoSavePending(engine));
  const bool lead = engine.rank() == 0;
  const fs::path dir(root);
  std::error_code ec;
  Status prepared = Status::Ok();
  // Every rank writes into rank 0's temporary directory, named afresh for
  // each save (a report left by an earlier failed one is never read).
  uint64_t token = (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  if (comm != nullptr && comm->world_size() > 1) STRATA_RETURN_IF_ERROR(comm->Broadcast(&token, sizeof token, 0));
  const std::string name = StepName(optimizer.steps_taken());
  const fs::path staged = dir / fmt::format(".{}.tmp-{:016x}", name, token);
  if (lead) {
    fs::create_directories(dir, ec);
    if (ec) prepared = IoError("checkpoint: creating {}: {}", root, ec.message());
    // What a crashed save left: hidden temporaries (one saver per root),
    // but a published checkpoint moved aside by a re-save that crashed
    // before its replacement was in place, which goes back.
    std::vector<fs::path> leftovers;
    for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec)) leftovers.push_back(entry.path());
    for (const fs::path& entry : leftovers) {
      const std::string entry_name = entry.filename().string();
      const size_t old = entry_name.find(".old-");
      if (entry_name.rfind(".step-", 0) == 0 && old != std::string::npos) {
        const std::string original = entry_name.substr(1, old - 1);
        if (FindAside(dir, original) == entry && ::rename(entry.c_str(), (dir / original).c_str()) == 0) continue;
      }
      if (entry_name.rfind(".step-", 0) == 0) {
        Retire(dir, entry, options.recycle);
      } else if (entry_name.rfind(".latest.", 0) == 0) {
        fs::remove_all(entry, ec);
      }
    }
    if (prepared.ok() && !fs::create_directory(staged, ec)) {
      prepared = IoError("checkpoint: creating {}: {}", staged.string(), ec ? ec.message() : "it exists");
    }
  }
  STRATA_RETURN_IF_ERROR(Agree(comm, prepared, "preparing the checkpoint directory"));
  auto state = std::unique_ptr<PendingCheckpoint::State>(new PendingCheckpoint::State{
      .engine = engine,
      .comm = comm,
      .options = options,
      .asynchronous = asynchronous,
      .dir = dir,
      .name = name,
      .staged = staged,
      .head = ManifestHead(engine, optimizer),
      .step = optimizer.steps_taken(),
  });
  for (const ChunkInfo& c : engine.chunks()) {
    if (Saved(c) && (c.sharded || lead)) state->unread[c.group]++;
  }
  PendingCheckpoint::State* run = state.get();
  auto pending = std::make_unique<PendingCheckpoint>(std::move(state));
  if (asynchronous) {
    SetSavePending(engine, true);
    run->thread = std::thread([run] { run->Run(); });
  } else {
    run->Run();
  }
  return pending;
}

}  // namespace

Result<std::unique_ptr<PendingCheckpoint>> StartCheckpoint(Engine& engine, const optim::Optimizer& optimizer,
                                                           const std::string& root, const CheckpointOptions& options,
                                                           Communicator* comm) {
  return Start(engine, optimizer, root, options, comm, /*asynchronous=*/true);
}

Result<CheckpointSummary> SaveCheckpoint(Engine& engine, const optim::Optimizer& optimizer, const std::string& root,
                                         const CheckpointOptions& options, Communicator* comm) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<PendingCheckpoint> pending,
                          Start(engine, optimizer, root, options, comm, /*asynchronous=*/false));
  return pending->Wait();
}

Result<CheckpointSummary> LoadCheckpoint(Engine& engine, optim::Optimizer& optimizer, const std::string& path,
                                         const LoadOptions& options, Communicator* comm) {
  if (!engine.finalized()) return InvalidArgument("checkpoint: finalize the engine (the same model) before loading");
  STRATA_RETURN_IF_ERROR(CheckGroup(engine, comm));
  STRATA_RETURN_IF_ERROR(CheckNoSavePending(engine));
  std::optional<fs::path> root;
  Result<fs::path> named = Resolve(path, &root);
  std::vector<fs::path> candidates;
  if (named.ok()) candidates.push_back(*named);
  // Falling back: the checkpoints of earlier steps than the one `latest`
  // names (later ones belong to a run that was rewound), or all of them
  // when `latest` is missing or unreadable (a first save killed before it).
  if (options.fall_back && (root || !named.ok())) {
    const fs::path under = root ? *root : fs::path(path);
    const std::optional<int64_t> newest = named.ok() ? StepOf(named->filename().string()) : std::nullopt;
    for (const fs::path& older : CheckpointsUnder(under)) {
      if (!newest || *StepOf(older.filename().string()) < *newest) candidates.push_back(older);
    }
  }
  // (Every rank sees the same directories: it decides the same candidates.)
  if (candidates.empty()) return named.status();
  std::vector<std::string> skipped;
  if (!named.ok()) skipped.push_back(named.status().ToString());
  Status last = Status::Ok();
  for (const fs::path& dir : candidates) {
    Result<CheckpointSummary> loaded = LoadOne(engine, optimizer, dir);
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

Result<CheckpointSummary> VerifyCheckpoint(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(fs::path dir, Resolve(path, nullptr));
  return Guarded(dir, [&]() -> Result<CheckpointSummary> {
    STRATA_ASSIGN_OR_RETURN(json manifest, ReadManifest(dir));
    return VerifyFiles(dir, manifest);
  });
}

Result<CheckpointManifest> ReadCheckpointManifest(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(fs::path dir, Resolve(path, nullptr));
  return Guarded(dir, [&]() -> Result<CheckpointManifest> {
    STRATA_ASSIGN_OR_RETURN(json manifest, ReadManifest(dir));
    return CheckpointManifest{dir.string(), manifest.dump(1)};
  });
}

Result<std::string> DescribeCheckpoint(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(fs::path dir, Resolve(path, nullptr));
  return Guarded(dir, [&]() -> Result<std::string> {
    STRATA_ASSIGN_OR_RETURN(json manifest, ReadManifest(dir));
    std::map<std::string, std::pair<uint32_t, uint64_t>> kinds;  // files and bytes
    uint64_t total = 0;
    for (const json& file : manifest.at("files")) {
      auto& [files, bytes] = kinds[file.at("kind").get<std::string>()];
      files++;
      bytes += file.at("bytes").get<uint64_t>();
      total += file.at("bytes").get<uint64_t>();
    }
    const json& state = manifest.at("optimizer");
    std::string out = fmt::format("checkpoint {}\n", dir.string());
    out += fmt::format("  step {}, saved by {} rank(s), {} of version {}\n", manifest.at("step").get<int64_t>(),
                       manifest.at("world_size").get<int>(), kFormat, kVersion);
    out += fmt::format("  optimizer: {} steps taken", state.at("steps_taken").get<int64_t>());
    if (state.at("loss_scaler").is_null()) {
      out += ", no loss scaler\n";
    } else {
      out += fmt::format(", loss scale {} ({} good steps, {} overflows)\n",
                         state.at("loss_scaler").at("scale").get<float>(),
                         state.at("loss_scaler").at("good_steps").get<int64_t>(),
                         state.at("loss_scaler").at("overflows").get<int64_t>());
    }
    out += fmt::format("  {} tensors, {} files, {:.2f} MiB\n", manifest.at("tensors").size(),
                       manifest.at("files").size(), total / 1048576.0);
    for (const auto& [kind, counted] : kinds) {
      out += fmt::format("    {:<12} {:>5} files {:>10.2f} MiB\n", kind, counted.first, counted.second / 1048576.0);
    }
    return out;
  });
}

}  // namespace strata::offload
