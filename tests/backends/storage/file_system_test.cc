// Tests of the file-system seam: the POSIX file system does what its
// contract says (on the scratch directory's file system), and every fault
// of FaultInjectingFileSystem happens, is reported as documented, and expires.

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "strata/buffer.h"
#include "strata/file_system.h"
#include "test_util.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

// gmock is not linked: a plain substring check that prints both strings.
#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "'" << (text) << "' lacks '" << (part) << "'"

constexpr size_t kBlock = 16384;

std::string Slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

class FileSystemTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_FALSE(dir_.path().empty());
    std::mt19937_64 rng(testing::TestSeed());
    data_ = AllocateAlignedHost(kBlock, 4096);
    out_ = AllocateAlignedHost(kBlock, 4096);
    ASSERT_TRUE(data_ && out_);
    testing::FillRandom(data_.data(), kBlock, rng);
  }

  std::string Path(const std::string& name) const { return dir_.path() + "/" + name; }
  // A file of kBlock random bytes at `name`, written through `files`.
  void WriteBlock(FileSystem& files, const std::string& name, bool direct = false) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<File> file, files.Open(Path(name), OpenMode::kTruncate, direct));
    ASSERT_OK(file->Write(0, data_.bytes(), kBlock));
    ASSERT_OK(file->Close());
  }
  std::string Expected(size_t size = kBlock) const { return std::string(reinterpret_cast<const char*>(data_.data()), size); }

  testing::ScratchDir dir_{"files"};
  Buffer data_;
  Buffer out_;
};

TEST_F(FileSystemTest, PosixFilesWriteReadAndCutAtOffsets) {
  FileSystem& files = PosixFileSystem();
  WriteBlock(files, "a", /*direct=*/true);
  EXPECT_EQ(Slurp(Path("a")), Expected());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<File> file, files.Open(Path("a"), OpenMode::kWrite, /*direct=*/true));
  ASSERT_OK_AND_ASSIGN(uint64_t size, file->Size());
  EXPECT_EQ(size, kBlock);  // kWrite keeps the bytes
  ASSERT_OK(file->Allocate(2 * kBlock));
  ASSERT_OK(file->Write(kBlock, data_.bytes(), kBlock));
  ASSERT_OK(file->Truncate(kBlock + 100));
  ASSERT_OK(file->Sync());
  ASSERT_OK(file->Close());
  EXPECT_EQ(Slurp(Path("a")), Expected() + Expected(100));

  // A direct read past the unaligned end returns what there is.
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<File> read, files.Open(Path("a"), OpenMode::kRead, /*direct=*/true));
  ASSERT_OK_AND_ASSIGN(size_t got, read->Read(kBlock, out_.bytes(), kBlock));
  EXPECT_EQ(got, 100u);
  EXPECT_EQ(std::memcmp(out_.data(), data_.data(), 100), 0);
  ASSERT_OK_AND_ASSIGN(size_t none, read->Read(2 * kBlock, out_.bytes(), 4096));
  EXPECT_EQ(none, 0u);
  read->Advise(FileAdvice::kDropCache);
  ASSERT_OK(read->Close());

  ASSERT_OK_AND_ASSIGN(std::unique_ptr<File> emptied, files.Open(Path("a"), OpenMode::kTruncate));
  ASSERT_OK_AND_ASSIGN(uint64_t empty, emptied->Size());
  EXPECT_EQ(empty, 0u);
}

TEST_F(FileSystemTest, PosixDirectoriesRenameExchangeListAndRemove) {
  FileSystem& files = PosixFileSystem();
  ASSERT_OK_AND_ASSIGN(bool created, files.CreateDirectory(Path("d")));
  EXPECT_TRUE(created);
  ASSERT_OK_AND_ASSIGN(bool again, files.CreateDirectory(Path("d")));
  EXPECT_FALSE(again);
  ASSERT_OK(files.CreateDirectories(Path("x/y/z")));
  EXPECT_TRUE(files.Exists(Path("x/y/z")));
  WriteBlock(files, "d/f");
  ASSERT_OK(files.SyncDirectory(Path("d")));
  ASSERT_OK_AND_ASSIGN(std::vector<DirectoryEntry> listed, files.List(dir_.path()));
  std::map<std::string, DirectoryEntry> by_name;
  for (const DirectoryEntry& entry : listed) by_name[entry.name] = entry;
  ASSERT_EQ(by_name.size(), 2u);
  EXPECT_TRUE(by_name["d"].directory);
  ASSERT_OK_AND_ASSIGN(std::vector<DirectoryEntry> inside, files.List(Path("d")));
  ASSERT_EQ(inside.size(), 1u);
  EXPECT_EQ(inside[0].size_bytes, kBlock);
  EXPECT_FALSE(inside[0].directory);

  ASSERT_OK(files.Rename(Path("d/f"), Path("x/f")));
  EXPECT_FALSE(files.Exists(Path("d/f")));
  const Status exchanged = files.Exchange(Path("d"), Path("x"));
  if (exchanged.code() == StatusCode::kNotSupported) GTEST_SKIP() << exchanged.ToString();
  ASSERT_OK(exchanged);
  EXPECT_TRUE(files.Exists(Path("d/f")));
  EXPECT_TRUE(files.Exists(Path("x")));
  ASSERT_OK(files.RemoveAll(Path("d")));
  ASSERT_OK(files.RemoveAll(Path("d")));  // nothing there is no error
  EXPECT_FALSE(files.Exists(Path("d")));
}

TEST_F(FileSystemTest, FreeBytesIsTheDrivesOrTheOneSet) {
  ASSERT_OK_AND_ASSIGN(uint64_t free_bytes, PosixFileSystem().FreeBytes(dir_.path()));
  EXPECT_GT(free_bytes, 0u);
  EXPECT_EQ(PosixFileSystem().FreeBytes(Path("missing/dir")).status().code(), StatusCode::kIoError);
  FaultInjectingFileSystem files(PosixFileSystem());
  files.SetFreeBytes(12345);
  EXPECT_EQ(files.FreeBytes(dir_.path()).value(), 12345u);
  files.SetFreeBytes(std::nullopt);
  EXPECT_GT(files.FreeBytes(dir_.path()).value(), 0u);
}

TEST_F(FileSystemTest, PosixFailuresNameThePathAndErrno) {
  FileSystem& files = PosixFileSystem();
  Result<std::unique_ptr<File>> missing = files.Open(Path("no/such"), OpenMode::kRead);
  ASSERT_EQ(missing.status().code(), StatusCode::kIoError);
  EXPECT_CONTAINS(missing.status().message(), Path("no/such"));
  EXPECT_CONTAINS(missing.status().message(), "No such file or directory");
  EXPECT_EQ(files.Rename(Path("no"), Path("b")).code(), StatusCode::kIoError);
  EXPECT_EQ(files.List(Path("no")).status().code(), StatusCode::kIoError);
  EXPECT_EQ(files.CreateDirectory(Path("no/such")).status().code(), StatusCode::kIoError);
  EXPECT_EQ(files.SyncDirectory(Path("no")).code(), StatusCode::kIoError);
}

TEST_F(FileSystemTest, FailedWritesAndReadsCarryTheirErrnoAndExpire) {
  FaultInjectingFileSystem files(PosixFileSystem());
  files.FailWrites(ENOSPC, 1, /*after=*/1);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<File> file, files.Open(Path("a"), OpenMode::kTruncate));
  ASSERT_OK(file->Write(0, data_.bytes(), kBlock));
  const Status full = file->Write(kBlock, data_.bytes(), kBlock);
  EXPECT_EQ(full.code(), StatusCode::kIoError);
  EXPECT_CONTAINS(full.message(), "No space left on device");
  EXPECT_CONTAINS(full.message(), Path("a"));
  ASSERT_OK(file->Close());
  EXPECT_EQ(Slurp(Path("a")), Expected());  // nothing of the failed write
  EXPECT_EQ(files.writes(), 2);

  files.FailReads(EIO);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<File> read, files.Open(Path("a"), OpenMode::kRead));
  const Result<size_t> failed = read->Read(0, out_.bytes(), kBlock);
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError);
  EXPECT_CONTAINS(failed.status().message(), "Input/output error");
  ASSERT_OK_AND_ASSIGN(size_t got, read->Read(0, out_.bytes(), kBlock));  // expired
  EXPECT_EQ(got, kBlock);
  EXPECT_EQ(files.reads(), 2);
}

TEST_F(FileSystemTest, FailedSyncsFailFilesAndDirectories) {
  FaultInjectingFileSystem files(PosixFileSystem());
  files.FailSyncs(EIO, 2);
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<File> file, files.Open(Path("a"), OpenMode::kTruncate));
  EXPECT_EQ(file->Sync().code(), StatusCode::kIoError);
  EXPECT_EQ(files.SyncDirectory(dir_.path()).code(), StatusCode::kIoError);
  ASSERT_OK(file->Sync());
  ASSERT_OK(files.SyncDirectory(dir_.path()));
}

TEST_F(FileSystemTest, ShortAndCorruptTransfersReportSuccess) {
  FaultInjectingFileSystem files(PosixFileSystem());
  files.ShortWrites();
  WriteBlock(files, "short");
  EXPECT_EQ(Slurp(Path("short")), Expected(kBlock / 2));
  files.CorruptWrites();
  WriteBlock(files, "corrupt");
  const std::string corrupt = Slurp(Path("corrupt"));
  ASSERT_EQ(corrupt.size(), kBlock);
  EXPECT_NE(corrupt, Expected());
  EXPECT_EQ(corrupt.substr(0, kBlock / 2), Expected(kBlock / 2));

  WriteBlock(files, "a");
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<File> read, files.Open(Path("a"), OpenMode::kRead));
  files.ShortReads(1, /*after=*/1);
  ASSERT_OK_AND_ASSIGN(size_t whole, read->Read(0, out_.bytes(), kBlock));
  EXPECT_EQ(whole, kBlock);
  ASSERT_OK_AND_ASSIGN(size_t half, read->Read(0, out_.bytes(), kBlock));
  EXPECT_EQ(half, kBlock / 2);
  files.CorruptReads();
  ASSERT_OK_AND_ASSIGN(size_t flipped, read->Read(0, out_.bytes(), kBlock));
  EXPECT_EQ(flipped, kBlock);
  EXPECT_NE(std::memcmp(out_.data(), data_.data(), kBlock), 0);
}

TEST_F(FileSystemTest, DelaysAndAStallHoldWritesUntilReleased) {
  FaultInjectingFileSystem files(PosixFileSystem());
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<File> file, files.Open(Path("a"), OpenMode::kTruncate));
  files.SetDelayMs(50);
  auto begin = std::chrono::steady_clock::now();
  ASSERT_OK(file->Write(0, data_.bytes(), kBlock));
  EXPECT_GE(std::chrono::steady_clock::now() - begin, std::chrono::milliseconds(50));
  files.SetDelayMs(0);

  files.StallWrites(/*after=*/1);
  ASSERT_OK(file->Write(0, data_.bytes(), kBlock));  // passes
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    files.Unstall();
  });
  begin = std::chrono::steady_clock::now();
  ASSERT_OK(file->Write(0, data_.bytes(), kBlock));  // held until Unstall
  EXPECT_GE(std::chrono::steady_clock::now() - begin, std::chrono::milliseconds(100));
  releaser.join();

  files.StallWrites(0, /*max_ms=*/50);  // never released: its limit ends it
  begin = std::chrono::steady_clock::now();
  ASSERT_OK(file->Write(0, data_.bytes(), kBlock));
  EXPECT_GE(std::chrono::steady_clock::now() - begin, std::chrono::milliseconds(50));
}

TEST_F(FileSystemTest, RefusedExchangeIsNotSupportedAndAnOpenHookSeesWrites) {
  FaultInjectingFileSystem files(PosixFileSystem());
  WriteBlock(files, "a");
  WriteBlock(files, "b");
  files.RefuseExchange();
  EXPECT_EQ(files.Exchange(Path("a"), Path("b")).code(), StatusCode::kNotSupported);
  files.RefuseExchange(false);

  std::vector<std::string> opened;
  files.SetOpenHook([&](const std::string& path) {
    opened.push_back(fs::path(path).filename().string());
    return path == Path("refused") ? IoError("refused by the hook") : Status::Ok();
  });
  ASSERT_OK(files.Open(Path("a"), OpenMode::kRead).status());
  ASSERT_OK(files.Open(Path("a"), OpenMode::kWrite).status());
  EXPECT_EQ(files.Open(Path("refused"), OpenMode::kTruncate).status().code(), StatusCode::kIoError);
  EXPECT_FALSE(files.Exists(Path("refused")));
  EXPECT_EQ(opened, (std::vector<std::string>{"a", "refused"}));
}

}  // namespace
}  // namespace strata
