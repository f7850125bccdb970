// Tests of the io_uring storage backend on real files: striping, round trips,
// concurrency, startup checks and every error path it reports.

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <algorithm>
#include <numeric>
#include <iterator>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "src/backends/storage/storage_util.h"
#include "strata/buffer.h"
#include "strata/storage.h"
#include "strata/types.h"
#include "test_util.h"

namespace strata {
namespace {

// gmock is not linked: a plain substring check that prints both strings.
#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "'" << (text) << "' lacks '" << (part) << "'"

constexpr size_t kAlign = 4096;
constexpr size_t kBlock = 64 * 1024;  // small stripes: a few MiB cross many of them

// Owns N scratch directories and the options that point at them.
class Dirs {
 public:
  explicit Dirs(int count) {
    for (int i = 0; i < count; ++i) {
      dirs_.push_back(std::make_unique<testing::ScratchDir>("uring" + std::to_string(i)));
      options_.dirs.push_back(dirs_.back()->path());
    }
    options_.block_size_bytes = kBlock;
    options_.capacity_bytes = 4 * 1024 * 1024;
    options_.queue_depth = 8;
    options_.io_timeout_ms = 10'000;
  }
  UringStorageOptions& options() { return options_; }
  std::string file(int i) const { return options_.dirs[i] + "/" + options_.file_name; }

 private:
  std::vector<std::unique_ptr<testing::ScratchDir>> dirs_;
  UringStorageOptions options_;
};

Buffer RandomBuffer(size_t size_bytes, std::mt19937_64& rng) {
  Buffer buffer = AllocateAlignedHost(size_bytes, kAlign);
  testing::FillRandom(buffer.data(), size_bytes, rng);
  return buffer;
}

bool SameBytes(const Buffer& a, const Buffer& b, size_t size_bytes) {
  return std::memcmp(a.data(), b.data(), size_bytes) == 0;
}

std::vector<char> FileContents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class UringRoundTripTest : public ::testing::TestWithParam<int> {};

TEST_P(UringRoundTripTest, RandomDataAtUnalignedToStripeMultiBlockRangesRoundTrips) {
  Dirs dirs(GetParam());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage, CreateUringStorage(dirs.options()));
  std::mt19937_64 rng(testing::TestSeed());
  const size_t capacity = storage->capacity_bytes();
  // Fixed awkward cases (start and end inside stripes, > queue_depth pieces),
  // then random ones.
  std::vector<std::pair<uint64_t, size_t>> ranges = {
      {3 * kAlign, 5 * kBlock + 5 * kAlign}, {kBlock - kAlign, 2 * kAlign}, {0, capacity}, {kBlock, 11 * kBlock}};
  std::uniform_int_distribution<uint64_t> pages(0, capacity / kAlign - 1);
  for (int i = 0; i < 20; ++i) {
    uint64_t first = pages(rng);
    uint64_t last = pages(rng);
    if (first > last) std::swap(first, last);
    ranges.emplace_back(first * kAlign, (last - first + 1) * kAlign);
  }
  for (const auto& [offset, size] : ranges) {
    Buffer in = RandomBuffer(size, rng);
    Buffer out = AllocateAlignedHost(size, kAlign);
    ASSERT_OK(storage->Write(offset, in.bytes(), size));
    ASSERT_OK(storage->Read(offset, out.bytes(), size));
    ASSERT_TRUE(SameBytes(in, out, size)) << "offset " << offset << " size " << size;
  }
}

INSTANTIATE_TEST_SUITE_P(OneAndThreeDirs, UringRoundTripTest, ::testing::Values(1, 3),
                         [](const ::testing::TestParamInfo<int>& param) {
                           return std::to_string(param.param) + "Dirs";
                         });

// Random scattered segments (some with unaligned-to-stripe tails) written
// and read in one batch each, over 1 and 3 directories, several block sizes
// and queue depths.
struct BatchCase {
  int dirs;
  size_t block_bytes;
  uint32_t queue_depth;
};

class UringBatchTest : public ::testing::TestWithParam<BatchCase> {};

TEST_P(UringBatchTest, ScatteredSegmentsRoundTripInOneBatch) {
  const BatchCase c = GetParam();
  Dirs dirs(c.dirs);
  dirs.options().block_size_bytes = c.block_bytes;
  dirs.options().queue_depth = c.queue_depth;
  dirs.options().capacity_bytes = 8 * 1024 * 1024;
  ASSERT_OK_AND_ASSIGN(auto storage, CreateUringStorage(dirs.options()));
  std::mt19937_64 rng(testing::TestSeed());
  // Disjoint slots of 64 KiB in shuffled order; each segment fills 4 KiB .. 64 KiB of its slot.
  constexpr size_t kSlot = 64 * 1024;
  std::vector<size_t> slots(storage->capacity_bytes() / kSlot);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(48);
  Buffer source = RandomBuffer(slots.size() * kSlot, rng);
  Buffer target = AllocateAlignedHost(slots.size() * kSlot, kAlign);
  std::memset(target.data(), 0, target.size_bytes());
  std::vector<IoSegment> writes, reads;
  for (size_t i = 0; i < slots.size(); ++i) {
    size_t size = (1 + rng() % (kSlot / kAlign)) * kAlign;
    writes.push_back({slots[i] * kSlot, source.bytes() + i * kSlot, size});
    reads.push_back({slots[i] * kSlot, target.bytes() + i * kSlot, size});
  }
  ASSERT_OK(storage->WriteBatch(writes));
  ASSERT_OK(storage->ReadBatch(reads));
  for (size_t i = 0; i < slots.size(); ++i) {
    ASSERT_EQ(std::memcmp(source.bytes() + i * kSlot, target.bytes() + i * kSlot, reads[i].size_bytes), 0) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(BlockSizesQueueDepthsDirs, UringBatchTest,
                         ::testing::Values(BatchCase{1, 4096, 1}, BatchCase{1, 64 * 1024, 8},
                                           BatchCase{3, 16 * 1024, 32}, BatchCase{3, 1024 * 1024, 4}));

TEST(UringStorageTest, BatchWithAMisalignedSegmentIsInvalidArgumentAndWritesNothing) {
  Dirs dirs(1);
  ASSERT_OK_AND_ASSIGN(auto storage, CreateUringStorage(dirs.options()));
  Buffer buffer = AllocateAlignedHost(2 * kAlign, kAlign);
  std::memset(buffer.data(), 7, buffer.size_bytes());
  std::vector<IoSegment> segments = {{0, buffer.bytes(), kAlign}, {kAlign + 512, buffer.bytes(), kAlign}};
  EXPECT_EQ(storage->WriteBatch(segments).code(), StatusCode::kInvalidArgument);
  ASSERT_OK(storage->Read(0, buffer.bytes(), kAlign));
  EXPECT_EQ(buffer.bytes()[0], std::byte{0});  // the valid first segment was not written either
}

TEST(UringStorageTest, RegisteredBufferIsUsedForFixedBufferIo) {
  Dirs dirs(2);
  ASSERT_OK_AND_ASSIGN(auto storage, CreateUringStorage(dirs.options()));
  std::mt19937_64 rng(testing::TestSeed());
  Buffer registered = AllocateAlignedHost(2 << 20, kAlign);
  ASSERT_OK(storage->RegisterBuffer(registered.data(), registered.size_bytes()));
  EXPECT_CONTAINS(storage->Describe(), "fixed buffer");
  testing::FillRandom(registered.data(), 1 << 20, rng);
  ASSERT_OK(storage->Write(0, registered.bytes(), 1 << 20));
  ASSERT_OK(storage->Read(0, registered.bytes() + (1 << 20), 1 << 20));  // into the registered range too
  EXPECT_EQ(std::memcmp(registered.bytes(), registered.bytes() + (1 << 20), 1 << 20), 0);
  Buffer plain = AllocateAlignedHost(1 << 20, kAlign);  // outside it: plain buffers still work
  ASSERT_OK(storage->Read(0, plain.bytes(), 1 << 20));
  EXPECT_EQ(std::memcmp(registered.bytes(), plain.bytes(), 1 << 20), 0);
}

TEST(UringStorageTest, RefusedRegistrationFallsBackToPlainBuffers) {
  Dirs dirs(1);
  ASSERT_OK_AND_ASSIGN(auto storage, CreateUringStorage(dirs.options()));
  // A range with nothing mapped behind it: the kernel refuses to pin it.
  void* hole = ::mmap(nullptr, 1 << 20, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(hole, MAP_FAILED);
  ASSERT_OK(storage->RegisterBuffer(hole, 1 << 20));
  EXPECT_CONTAINS(storage->Describe(), "plain buffers (registration refused");
  std::mt19937_64 rng(testing::TestSeed());
  Buffer source = RandomBuffer(1 << 20, rng);
  Buffer target = AllocateAlignedHost(1 << 20, kAlign);
  ASSERT_OK(storage->Write(0, source.bytes(), 1 << 20));
  ASSERT_OK(storage->Read(0, target.bytes(), 1 << 20));
  EXPECT_TRUE(SameBytes(source, target, 1 << 20));
  ::munmap(hole, 1 << 20);
  EXPECT_EQ(storage->RegisterBuffer(nullptr, 0).code(), StatusCode::kInvalidArgument);
}

TEST(UringStorageTest, StripesConsecutiveBlocksRoundRobinOverTheFiles) {
  Dirs dirs(3);
  // 10 blocks over 3 files: ceil(10 / 3) = 4 blocks per file.
  dirs.options().capacity_bytes = 10 * kBlock;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage, CreateUringStorage(dirs.options()));
  Buffer in = AllocateAlignedHost(10 * kBlock, kAlign);
  for (size_t block = 0; block < 10; ++block) std::memset(in.bytes() + block * kBlock, int(block + 1), kBlock);
  ASSERT_OK(storage->Write(0, in.bytes(), 10 * kBlock));

  std::vector<std::vector<char>> files;
  for (int i = 0; i < 3; ++i) {
    files.push_back(FileContents(dirs.file(i)));
    EXPECT_EQ(files.back().size(), 4 * kBlock) << dirs.file(i);
  }
  for (size_t block = 0; block < 10; ++block) {
    const std::vector<char>& file = files[block % 3];
    size_t file_offset = (block / 3) * kBlock;
    ASSERT_GE(file.size(), file_offset + kBlock);
    for (size_t i = 0; i < kBlock; i += 1024) {
      ASSERT_EQ(file[file_offset + i], char(block + 1)) << "block " << block << " byte " << i;
    }
  }
}

TEST(UringStorageTest, NeverWrittenRangesReadAsZeros) {
  Dirs dirs(2);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage, CreateUringStorage(dirs.options()));
  Buffer out = AllocateAlignedHost(3 * kBlock, kAlign);
  std::memset(out.data(), 0x5A, 3 * kBlock);
  ASSERT_OK(storage->Read(kBlock, out.bytes(), 3 * kBlock));
  for (size_t i = 0; i < 3 * kBlock; ++i) ASSERT_EQ(out.bytes()[i], std::byte{0}) << "byte " << i;
}

TEST(UringStorageTest, ConcurrentReadsAndWritesFromFourThreadsOnDisjointRanges) {
  Dirs dirs(3);
  dirs.options().capacity_bytes = 16 * 1024 * 1024;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage, CreateUringStorage(dirs.options()));
  constexpr int kThreads = 4;
  constexpr int kRounds = 20;
  const size_t region = storage->capacity_bytes() / kThreads;
  const uint64_t seed = testing::TestSeed();
  std::vector<std::string> failures(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(seed + t);
      std::uniform_int_distribution<size_t> pages(1, region / kAlign);
      for (int round = 0; round < kRounds && failures[t].empty(); ++round) {
        size_t size = pages(rng) * kAlign;
        uint64_t offset = t * region + (region - size) / kAlign / 2 * kAlign;
        Buffer in = RandomBuffer(size, rng);
        Buffer out = AllocateAlignedHost(size, kAlign);
        Status written = storage->Write(offset, in.bytes(), size);
        Status read = written.ok() ? storage->Read(offset, out.bytes(), size) : written;
        if (!read.ok()) {
          failures[t] = read.ToString();
        } else if (!SameBytes(in, out, size)) {
          failures[t] = "data mismatch at offset " + std::to_string(offset);
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(failures[t], "") << "thread " << t;
}

TEST(UringStorageTest, ReopeningExistingFilesKeepsTheirData) {
  Dirs dirs(2);
  std::mt19937_64 rng(testing::TestSeed());
  const size_t size = 7 * kBlock + kAlign;
  Buffer in = RandomBuffer(size, rng);
  {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage, CreateUringStorage(dirs.options()));
    ASSERT_OK(storage->Write(kBlock + kAlign, in.bytes(), size));
  }
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> reopened, CreateUringStorage(dirs.options()));
  Buffer out = AllocateAlignedHost(size, kAlign);
  ASSERT_OK(reopened->Read(kBlock + kAlign, out.bytes(), size));
  EXPECT_TRUE(SameBytes(in, out, size));
}

TEST(UringStorageTest, DescribeNamesModeDirsCapacityBlockAndQueueDepth) {
  Dirs dirs(2);
  dirs.options().capacity_bytes = size_t{1} << 30;
  dirs.options().block_size_bytes = size_t{1} << 20;
  dirs.options().queue_depth = 32;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage, CreateUringStorage(dirs.options()));
  std::string description = storage->Describe();
  const std::vector<std::string>& paths = dirs.options().dirs;
  EXPECT_CONTAINS(description, "io_uring O_DIRECT, 2 dirs (" + paths[0] + ", " + paths[1] + ")");
  EXPECT_CONTAINS(description, "1GiB");
  EXPECT_CONTAINS(description, "block 1MiB");
  EXPECT_CONTAINS(description, "qd 32");
  EXPECT_EQ(storage->alignment_bytes(), kAlign);
  EXPECT_EQ(storage->capacity_bytes(), size_t{1} << 30);
}

TEST(UringStorageTest, EachBadOptionIsInvalidArgumentNamingItsKey) {
  Dirs dirs(1);
  struct Case {
    const char* key;
    void (*spoil)(UringStorageOptions&);
  };
  const Case cases[] = {
      {"nvme.dirs", [](UringStorageOptions& o) { o.dirs.clear(); }},
      {"nvme.capacity", [](UringStorageOptions& o) { o.capacity_bytes = 0; }},
      {"nvme.block_size", [](UringStorageOptions& o) { o.block_size_bytes = 1000; }},
      {"nvme.block_size", [](UringStorageOptions& o) { o.block_size_bytes = 0; }},
      {"nvme.block_size", [](UringStorageOptions& o) { o.block_size_bytes = 4096 + 512; }},
      {"nvme.queue_depth", [](UringStorageOptions& o) { o.queue_depth = 0; }},
      {"nvme.io_timeout_ms", [](UringStorageOptions& o) { o.io_timeout_ms = 0; }},
  };
  for (const Case& c : cases) {
    UringStorageOptions options = dirs.options();
    c.spoil(options);
    Result<std::unique_ptr<Storage>> storage = CreateUringStorage(options);
    ASSERT_FALSE(storage.ok()) << c.key;
    EXPECT_EQ(storage.status().code(), StatusCode::kInvalidArgument) << storage.status().ToString();
    EXPECT_CONTAINS(storage.status().message(), c.key);
  }
}

TEST(UringStorageTest, SameDirectoryListedTwiceIsInvalidArgument) {
  Dirs dirs(1);
  dirs.options().dirs.push_back(dirs.options().dirs[0] + "/.");
  Result<std::unique_ptr<Storage>> storage = CreateUringStorage(dirs.options());
  EXPECT_EQ(storage.status().code(), StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(storage.status().message(), "nvme.dirs");
}

TEST(UringStorageTest, MissingDirectoryIsIoErrorNamingIt) {
  Dirs dirs(2);
  std::string missing = dirs.options().dirs[1] + "/does-not-exist";
  dirs.options().dirs[1] = missing;
  Result<std::unique_ptr<Storage>> storage = CreateUringStorage(dirs.options());
  EXPECT_EQ(storage.status().code(), StatusCode::kIoError);
  EXPECT_CONTAINS(storage.status().message(), missing);
  EXPECT_CONTAINS(storage.status().message(), "errno 2");
}

TEST(UringStorageTest, DirectoryThatIsAFileIsIoError) {
  Dirs dirs(1);
  std::string file = dirs.options().dirs[0] + "/plain-file";
  std::ofstream(file) << "x";
  dirs.options().dirs[0] = file;
  Result<std::unique_ptr<Storage>> storage = CreateUringStorage(dirs.options());
  EXPECT_EQ(storage.status().code(), StatusCode::kIoError);
  EXPECT_CONTAINS(storage.status().message(), file);
}

TEST(UringStorageTest, CapacityBeyondFreeSpaceIsOutOfMemoryWithNeededAndFree) {
  Dirs dirs(2);
  dirs.options().capacity_bytes = size_t{1} << 50;  // 1 PiB
  Result<std::unique_ptr<Storage>> storage = CreateUringStorage(dirs.options());
  EXPECT_EQ(storage.status().code(), StatusCode::kOutOfMemory);
  EXPECT_CONTAINS(storage.status().message(), "needed");
  EXPECT_CONTAINS(storage.status().message(), "free");
  EXPECT_CONTAINS(storage.status().message(), dirs.options().dirs[0]);
  // Failing early means before any backing file was made.
  EXPECT_FALSE(std::filesystem::exists(dirs.file(0)));
  EXPECT_FALSE(std::filesystem::exists(dirs.file(1)));
}

TEST(UringStorageTest, FreeSpaceIsReadThroughTheFileSystemSeam) {
  Dirs dirs(1);
  FaultInjectingFileSystem files(PosixFileSystem());
  files.SetFreeBytes(dirs.options().capacity_bytes - kBlock);  // a drive nearly full
  Result<std::unique_ptr<Storage>> storage = CreateUringStorage(dirs.options(), files);
  EXPECT_EQ(storage.status().code(), StatusCode::kOutOfMemory);
  EXPECT_CONTAINS(storage.status().message(),
                  fmt::format("free {} ({} bytes)", FormatSize(dirs.options().capacity_bytes - kBlock),
                              dirs.options().capacity_bytes - kBlock));
  files.SetFreeBytes(std::nullopt);
  EXPECT_OK(CreateUringStorage(dirs.options(), files).status());
}

TEST(UringStorageTest, MisalignedOrOutOfBoundsRangesAreInvalidArgument) {
  Dirs dirs(2);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage, CreateUringStorage(dirs.options()));
  Buffer buffer = AllocateAlignedHost(2 * kBlock, kAlign);
  const size_t capacity = storage->capacity_bytes();
  EXPECT_EQ(storage->Write(512, buffer.bytes(), kBlock).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(storage->Read(512, buffer.bytes(), kBlock).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(storage->Write(0, buffer.bytes(), kBlock - 512).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(storage->Read(0, buffer.bytes() + 512, kBlock).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(storage->Write(capacity - kBlock, buffer.bytes(), 2 * kBlock).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(storage->Read(capacity + kAlign, buffer.bytes(), kAlign).code(), StatusCode::kInvalidArgument);
  EXPECT_OK(storage->Read(capacity, buffer.bytes(), 0));
  EXPECT_OK(storage->Write(capacity - kBlock, buffer.bytes(), kBlock));
}

TEST(UringStorageTest, ReadOfTruncatedBackingFileIsIoErrorNamingThePath) {
  Dirs dirs(2);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage, CreateUringStorage(dirs.options()));
  std::mt19937_64 rng(testing::TestSeed());
  Buffer in = RandomBuffer(4 * kBlock, rng);
  ASSERT_OK(storage->Write(0, in.bytes(), 4 * kBlock));
  ASSERT_EQ(::truncate(dirs.file(1).c_str(), 0), 0) << std::strerror(errno);
  Status status = storage->Read(0, in.bytes(), 4 * kBlock);
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_CONTAINS(status.message(), "short read");
  EXPECT_CONTAINS(status.message(), dirs.file(1));
}

TEST(UringStorageTest, ReadEndingInsideATruncatedFileIsIoErrorAfterThePartThatExists) {
  Dirs dirs(1);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage, CreateUringStorage(dirs.options()));
  Buffer buffer = AllocateAlignedHost(kBlock, kAlign);
  ASSERT_OK(storage->Write(0, buffer.bytes(), kBlock));
  // Half a block is left: the read of the block returns short, the rest is
  // asked for again and finds the end of the file.
  ASSERT_EQ(::truncate(dirs.file(0).c_str(), kBlock / 2), 0) << std::strerror(errno);
  Status status = storage->Read(0, buffer.bytes(), kBlock);
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_CONTAINS(status.message(), "short read");
  EXPECT_CONTAINS(status.message(), dirs.file(0) + " at offset " + std::to_string(kBlock / 2));
}

// A write the kernel refuses: past RLIMIT_FSIZE it fails with EFBIG, and one
// that straddles the limit is cut short first.
TEST(UringStorageTest, WriteRefusedByTheKernelIsIoErrorWithPathOffsetAndErrno) {
  Dirs dirs(1);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage, CreateUringStorage(dirs.options()));
  Buffer buffer = AllocateAlignedHost(kBlock, kAlign);
  std::memset(buffer.data(), 1, kBlock);

  struct rlimit saved {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  auto saved_handler = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit limited = saved;
  limited.rlim_cur = kBlock + kBlock / 2;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  Status status = storage->Write(kBlock, buffer.bytes(), kBlock);
  ::setrlimit(RLIMIT_FSIZE, &saved);
  std::signal(SIGXFSZ, saved_handler);

  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_CONTAINS(status.message(), dirs.file(0));
  EXPECT_CONTAINS(status.message(), "at offset " + std::to_string(kBlock + kBlock / 2));
  EXPECT_CONTAINS(status.message(), "errno 27");
}

TEST(UringStorageTest, TransferOutlastingIoTimeoutIsTimeout) {
  Dirs dirs(1);
  // 256 MiB cannot reach the disk in 1 ms (that would be 256 GB/s).
  const size_t size = size_t{256} << 20;
  dirs.options().capacity_bytes = size;
  dirs.options().block_size_bytes = size_t{1} << 20;
  dirs.options().queue_depth = 32;
  dirs.options().io_timeout_ms = 1;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage, CreateUringStorage(dirs.options()));
  Buffer buffer = AllocateAlignedHost(size, kAlign);
  std::memset(buffer.data(), 7, size);
  Status status = storage->Write(0, buffer.bytes(), size);
  EXPECT_EQ(status.code(), StatusCode::kTimeout) << status.ToString();
  EXPECT_CONTAINS(status.message(), "nvme.io_timeout_ms = 1 ms");
}

TEST(UringStorageTest, StalledTransferLeavesDataStoredBeforeIntact) {
  Dirs dirs(1);
  const size_t size = size_t{256} << 20;
  dirs.options().capacity_bytes = size;
  dirs.options().block_size_bytes = size_t{1} << 20;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> patient, CreateUringStorage(dirs.options()));
  std::mt19937_64 rng(testing::TestSeed());
  Buffer stored = RandomBuffer(1 << 20, rng);
  ASSERT_OK(patient->Write(0, stored.bytes(), 1 << 20));
  // The same file through a storage with a 1 ms deadline: a big write there times out.
  dirs.options().io_timeout_ms = 1;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> hasty, CreateUringStorage(dirs.options()));
  Buffer big = AllocateAlignedHost(size - (1 << 20), kAlign);
  std::memset(big.data(), 9, big.size_bytes());
  EXPECT_EQ(hasty->Write(1 << 20, big.bytes(), big.size_bytes()).code(), StatusCode::kTimeout);
  Buffer back = AllocateAlignedHost(1 << 20, kAlign);
  ASSERT_OK(patient->Read(0, back.bytes(), 1 << 20));
  EXPECT_TRUE(SameBytes(stored, back, 1 << 20));
}

TEST(UringStorageTest, DiskFillingUpBeforePreallocationIsOutOfMemoryAndLeavesNoFile) {
  // A small filesystem of our own, so that it can be filled for real.
  testing::ScratchDir mount_point("smallfs");
  if (::mount("tmpfs", mount_point.path().c_str(), "tmpfs", 0, "size=8m") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs here (" << std::strerror(errno) << "): needs root";
  }
  UringStorageOptions options;
  options.dirs = {mount_point.path()};
  options.capacity_bytes = 4 << 20;  // passes the free-space check: 8 MiB are free
  options.block_size_bytes = kBlock;
  options.allow_buffered_io = true;  // in case this kernel's tmpfs refuses O_DIRECT
  // Between the check and the preallocation another writer takes every byte.
  std::string filler = mount_point.path() + "/filler";
  auto open_then_fill = [&](const char* path, int flags, mode_t mode) {
    int fd = ::open(path, flags, mode);
    int fill = ::open(filler.c_str(), O_WRONLY | O_CREAT, 0600);
    std::vector<char> chunk(1 << 16, 1);
    while (fill >= 0 && ::write(fill, chunk.data(), chunk.size()) > 0) {
    }
    if (fill >= 0) ::close(fill);
    return fd;
  };
  Result<std::unique_ptr<Storage>> storage = storage::CreateUringStorageWithOpen(options, open_then_fill);
  bool backing_file_left = std::filesystem::exists(mount_point.path() + "/" + options.file_name);
  ::umount(mount_point.path().c_str());
  ASSERT_FALSE(storage.ok());
  EXPECT_EQ(storage.status().code(), StatusCode::kOutOfMemory) << storage.status().ToString();
  EXPECT_CONTAINS(storage.status().message(), "ran out of space");
  EXPECT_FALSE(backing_file_left);
}

// Opens with O_DIRECT fail with EINVAL, as on a filesystem that refuses it.
int OpenRefusingDirectIo(const char* path, int flags, mode_t mode) {
  if ((flags & O_DIRECT) != 0) {
    errno = EINVAL;
    return -1;
  }
  return ::open(path, flags, mode);
}

TEST(UringStorageTest, FilesystemRefusingDirectIoIsNotSupportedSuggestingBufferedIo) {
  Dirs dirs(2);
  Result<std::unique_ptr<Storage>> storage = storage::CreateUringStorageWithOpen(dirs.options(), OpenRefusingDirectIo);
  EXPECT_EQ(storage.status().code(), StatusCode::kNotSupported);
  EXPECT_CONTAINS(storage.status().message(), dirs.options().dirs[0]);
  EXPECT_CONTAINS(storage.status().message(), "O_DIRECT");
  EXPECT_CONTAINS(storage.status().message(), "nvme.allow_buffered_io");
  EXPECT_FALSE(std::filesystem::exists(dirs.file(0)));
}

TEST(UringStorageTest, AllowBufferedIoFallsBackWhenDirectIoIsRefused) {
  Dirs dirs(2);
  dirs.options().allow_buffered_io = true;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage,
                       storage::CreateUringStorageWithOpen(dirs.options(), OpenRefusingDirectIo));
  EXPECT_CONTAINS(storage->Describe(), "io_uring buffered");
  std::mt19937_64 rng(testing::TestSeed());
  const size_t size = 5 * kBlock + kAlign;
  Buffer in = RandomBuffer(size, rng);
  Buffer out = AllocateAlignedHost(size, kAlign);
  ASSERT_OK(storage->Write(kAlign, in.bytes(), size));
  ASSERT_OK(storage->Read(kAlign, out.bytes(), size));
  EXPECT_TRUE(SameBytes(in, out, size));
}

TEST(UringStorageTest, FailedOpenIsIoErrorNamingThePathAndErrno) {
  Dirs dirs(1);
  auto refuse = [](const char*, int, mode_t) {
    errno = EACCES;
    return -1;
  };
  Result<std::unique_ptr<Storage>> storage = storage::CreateUringStorageWithOpen(dirs.options(), refuse);
  EXPECT_EQ(storage.status().code(), StatusCode::kIoError);
  EXPECT_CONTAINS(storage.status().message(), dirs.file(0));
  EXPECT_CONTAINS(storage.status().message(), "errno 13");
}

// Whether a file under `dir` can be opened with O_DIRECT (tmpfs can since Linux 6.6).
bool AcceptsDirectIo(const std::string& dir) {
  std::string path = dir + "/probe";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
  if (fd >= 0) ::close(fd);
  ::unlink(path.c_str());
  return fd >= 0;
}

TEST(UringStorageTest, TmpfsRefusingDirectIoIsNotSupportedAndWorksWithAllowBufferedIo) {
  if (!std::filesystem::is_directory("/dev/shm")) GTEST_SKIP() << "no /dev/shm";
  // Not a ScratchDir: those live under $STRATA_TEST_DIR, and this one must be on tmpfs.
  std::string pattern = "/dev/shm/strata-shm-XXXXXX";
  ASSERT_NE(::mkdtemp(pattern.data()), nullptr) << std::strerror(errno);
  struct RemoveOnExit {
    std::string path;
    ~RemoveOnExit() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  } shm{pattern};
  if (AcceptsDirectIo(shm.path)) {
    GTEST_SKIP() << "tmpfs accepts O_DIRECT on this kernel; the refusal is covered through the open seam";
  }
  UringStorageOptions options;
  options.dirs = {shm.path};
  options.capacity_bytes = 4 * kBlock;
  options.block_size_bytes = kBlock;
  Result<std::unique_ptr<Storage>> refused = CreateUringStorage(options);
  EXPECT_EQ(refused.status().code(), StatusCode::kNotSupported);
  EXPECT_CONTAINS(refused.status().message(), shm.path);
  EXPECT_CONTAINS(refused.status().message(), "nvme.allow_buffered_io");

  options.allow_buffered_io = true;
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage, CreateUringStorage(options));
  std::mt19937_64 rng(testing::TestSeed());
  Buffer in = RandomBuffer(3 * kBlock, rng);
  Buffer out = AllocateAlignedHost(3 * kBlock, kAlign);
  ASSERT_OK(storage->Write(kBlock, in.bytes(), 3 * kBlock));
  ASSERT_OK(storage->Read(kBlock, out.bytes(), 3 * kBlock));
  EXPECT_TRUE(SameBytes(in, out, 3 * kBlock));
}

}  // namespace
}  // namespace strata
