// safetensors export and import through the engine's chunks.
#include "strata/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "src/base/half.h"
#include "tests/offload/training/train_model.h"
#include "tests/test_util.h"

namespace strata::offload {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing::ScratchDir;

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

// A safetensors file read by the format's rules alone (not through the
// code under test): the header, and each tensor's bytes. The tensors'
// ranges must tile the data exactly, as the safetensors library checks.
struct Parsed {
  json header;
  std::map<std::string, std::string> data;
};
Parsed Parse(const std::string& path) {
  const std::string bytes = ReadBytes(path);
  EXPECT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[i]);
  Parsed parsed;
  parsed.header = json::parse(bytes.substr(8, n));
  EXPECT_EQ((8 + n) % 8, 0u) << "the data 8-byte aligned";
  const std::string data = bytes.substr(8 + n);
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, entry] : parsed.header.items()) {
    if (name == "__metadata__") continue;
    const uint64_t begin = entry["data_offsets"][0], end = entry["data_offsets"][1];
    ranges.emplace_back(begin, end);
    parsed.data[name] = data.substr(begin, end - begin);
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t covered = 0;
  for (const auto& [begin, end] : ranges) {
    EXPECT_EQ(begin, covered);
    covered = end;
  }
  EXPECT_EQ(covered, data.size());
  return parsed;
}

std::string Bytes(const std::vector<float>& values) {
  return std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(float));
}

void Initialize(Model& model) {
  std::mt19937 rng(5);
  for (int l = 0; l < kLayers; ++l) model.Write(l, ChunkKind::kParam, Random(rng, 0.5f));
}

// The whole model written (every tensor, its name, shape and bytes as the
// engine holds them) and read back into another engine, states partly on NVMe.
TEST(InterchangeTest, ExportedParametersImportIntoAnotherEngine) {
  ScratchDir dir("st");
  const std::string path = dir.path() + "/model.safetensors";
  Model model;
  Initialize(model);
  ASSERT_OK_AND_ASSIGN(InterchangeSummary out, ExportSafetensors(*model.engine, path));
  EXPECT_EQ(out.tensors, kLayers + 1u);
  EXPECT_EQ(out.bytes, (kLayers * kChunkElems + 64) * sizeof(float));
  const Parsed parsed = Parse(path);
  EXPECT_EQ(parsed.header["__metadata__"]["format"], "pt");
  for (int l = 0; l < kLayers; ++l) {
    const std::string name = "layer" + std::to_string(l);
    EXPECT_EQ(parsed.header[name]["dtype"], "F32");
    EXPECT_EQ(parsed.header[name]["shape"], json::array({kChunkElems}));
    EXPECT_EQ(parsed.data.at(name), Bytes(model.Read(l, ChunkKind::kParam))) << name;
  }
  EXPECT_EQ(parsed.data.at("frozen"), Bytes(model.Read(kLayers, ChunkKind::kParam)));
  EXPECT_FALSE(fs::exists(path + ".tmp-" + std::to_string(::getpid())));

  Model other;
  ASSERT_OK_AND_ASSIGN(InterchangeSummary in, ImportSafetensors(*other.engine, path));
  EXPECT_EQ(in.tensors, kLayers + 1u);
  EXPECT_EQ(in.bytes, out.bytes);
  for (int l = 0; l <= kLayers; ++l) EXPECT_EQ(other.Read(l, ChunkKind::kParam), model.Read(l, ChunkKind::kParam));
}

// A file written by hand: bf16 and F64 tensors convert to the engine's
// fp32 (bf16 exactly), with header padding and tensors in another order.
TEST(InterchangeTest, OtherDtypesConvertOnImport) {
  ScratchDir dir("st");
  const std::string path = dir.path() + "/hand.safetensors";
  Model model;
  std::mt19937 rng(9);
  json header = json::object();
  std::string data;
  std::vector<std::vector<float>> expected;
  for (int l = kLayers - 1; l >= 0; --l) {  // reversed
    const std::vector<float> values = Random(rng, 1.0f);
    std::vector<float> rounded(values.size());
    std::string bytes;
    for (size_t i = 0; i < values.size(); ++i) {
      if (l % 2 == 0) {
        const uint16_t bits = optim::Bf16FromFloat(values[i]);
        rounded[i] = optim::FloatFromBf16(bits);
        bytes.append(reinterpret_cast<const char*>(&bits), 2);
      } else {
        const double wide = values[i];
        rounded[i] = static_cast<float>(wide);
        bytes.append(reinterpret_cast<const char*>(&wide), 8);
      }
    }
    header["layer" + std::to_string(l)] = {{"dtype", l % 2 == 0 ? "BF16" : "F64"},
                                           {"shape", {kChunkElems}},
                                           {"data_offsets", {data.size(), data.size() + bytes.size()}}};
    data += bytes;
    expected.insert(expected.begin(), rounded);
  }
  header["frozen"] = {{"dtype", "F32"}, {"shape", {64}}, {"data_offsets", {data.size(), data.size() + 256}}};
  data += std::string(256, '\0');
  std::string text = header.dump() + "    ";
  std::string file(8, '\0');
  for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  WriteBytes(path, file + text + data);
  ASSERT_OK(ImportSafetensors(*model.engine, path).status());
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(model.Read(l, ChunkKind::kParam), expected[l]) << l;
}

// What is not the model's, or not safetensors, is refused before anything
// is set, naming what is wrong; strict=false takes what matches.
TEST(InterchangeTest, MismatchesAndDamagedFilesAreRefused) {
  ScratchDir dir("st");
  const std::string path = dir.path() + "/model.safetensors";
  Model model;
  Initialize(model);
  ASSERT_OK(ExportSafetensors(*model.engine, path).status());
  const std::string good = ReadBytes(path);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(good[i]);
  json header = json::parse(good.substr(8, n));
  const std::string data = good.substr(8 + n);
  const auto write = [&](const json& h, const std::string& body) {
    std::string text = h.dump();
    std::string file(8, '\0');
    for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
    WriteBytes(path, file + text + body);
  };
  const auto refused = [&](const std::string& expected) {
    Model fresh;
    const std::vector<float> before = fresh.Read(0, ChunkKind::kParam);
    const Status status = ImportSafetensors(*fresh.engine, path).status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
    EXPECT_NE(status.message().find(expected), std::string::npos) << status.ToString();
    EXPECT_EQ(fresh.Read(0, ChunkKind::kParam), before);
  };

  json renamed = header;
  renamed["extra"] = renamed["layer0"];
  renamed.erase("layer0");
  write(renamed, data);
  refused("it lacks layer0; it has extra that this model does not");
  Model loose;
  ASSERT_OK_AND_ASSIGN(InterchangeSummary partial, ImportSafetensors(*loose.engine, path, {.strict = false}));
  EXPECT_EQ(partial.missing, std::vector<std::string>{"layer0"});
  EXPECT_EQ(partial.unused, std::vector<std::string>{"extra"});
  EXPECT_EQ(loose.Read(1, ChunkKind::kParam), model.Read(1, ChunkKind::kParam));

  json reshaped = header;
  reshaped["layer2"]["shape"] = {kChunkElems / 2, 2};
  write(reshaped, data);
  refused("layer2 is [2048, 2] in the file, [4096] here");

  json ints = header;
  ints["layer3"]["dtype"] = "I32";
  write(ints, data);
  refused("layer3 is I32 in the file");

  write(header, data.substr(0, data.size() - 4));  // cut
  refused("fall outside the");

  // What the format forbids, checked in the header alone.
  const auto header_refused = [&](const std::string& text, const std::string& expected) {
    std::string file(8, '\0');
    for (int i = 0; i < 8; ++i) file[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
    WriteBytes(path, file + text + std::string(8, '\0'));
    const Status status = ReadSafetensorsIndex(path).status();
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << text;
    EXPECT_NE(status.message().find(expected), std::string::npos) << status.ToString();
  };
  header_refused(R"({"a": {"dtype": "F32", "shape": [8589934592, 2147483648], "data_offsets": [0, 0]}})",
                 "of a size that fits");  // 2^33 x 2^31 x 4 bytes wraps to 0
  header_refused(R"({"a": {"dtype": "F32", "shape": [9223372036854775808, 2], "data_offsets": [0, 8]}})",
                 "of a size that fits");
  header_refused(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})",
                 "overlap");
  header_refused(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", "leave a hole");
  header_refused(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})", "4 bytes follow");
  header_refused(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                     "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
                 "names 'a' twice");
  header_refused(R"({"__metadata__": {"x": [1, 2]}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})",
                 "not an object of strings");
  header_refused(R"({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}})", "dtype 'Q4'");

  WriteBytes(path, "not a safetensors file at all");
  refused("is not a safetensors file");
  WriteBytes(path, std::string("\x10\0\0\0\0\0\0\0[1, 2, 3]       ", 24));
  refused("its header is not a JSON object");
  EXPECT_EQ(ImportSafetensors(*model.engine, dir.path() + "/missing.safetensors").status().code(),
            StatusCode::kIoError);
}

// An export whose write fails (a full disk) or whose flush fails returns
// IoError naming the cause and leaves no file, not even its temporary.
TEST(InterchangeTest, AFailedWriteOrFlushFailsTheExportAndLeavesNoFile) {
  ScratchDir dir("st");
  const std::string path = dir.path() + "/model.safetensors";
  Model model;
  FaultInjectingFileSystem files(PosixFileSystem());
  files.FailWrites(ENOSPC, 1, /*after=*/2);
  const Status full = ExportSafetensors(*model.engine, path, {}, nullptr, files).status();
  EXPECT_EQ(full.code(), StatusCode::kIoError) << full.ToString();
  EXPECT_NE(full.message().find("No space left on device"), std::string::npos) << full.ToString();
  files.FailSyncs(EIO);
  const Status unflushed = ExportSafetensors(*model.engine, path, {}, nullptr, files).status();
  EXPECT_EQ(unflushed.code(), StatusCode::kIoError) << unflushed.ToString();
  EXPECT_TRUE(fs::is_empty(dir.path()));
  ASSERT_OK(ExportSafetensors(*model.engine, path, {}, nullptr, files).status());
  EXPECT_EQ(Parse(path).data.size(), static_cast<size_t>(kLayers) + 1);
}

// An import whose read fails is IoError; one whose file ends early is
// InvalidArgument (not a whole safetensors file).
TEST(InterchangeTest, AFailedOrShortReadFailsTheImport) {
  ScratchDir dir("st");
  const std::string path = dir.path() + "/model.safetensors";
  Model model;
  ASSERT_OK(ExportSafetensors(*model.engine, path).status());
  FaultInjectingFileSystem files(PosixFileSystem());
  Model fresh;
  files.FailReads(EIO, 1, /*after=*/2);  // after the header's length and the header
  const Status unreadable = ImportSafetensors(*fresh.engine, path, {}, nullptr, files).status();
  EXPECT_EQ(unreadable.code(), StatusCode::kIoError) << unreadable.ToString();
  EXPECT_NE(unreadable.message().find("Input/output error"), std::string::npos) << unreadable.ToString();
  files.ShortReads(1, /*after=*/1);  // the header
  const Status cut = ImportSafetensors(*fresh.engine, path, {}, nullptr, files).status();
  EXPECT_EQ(cut.code(), StatusCode::kInvalidArgument) << cut.ToString();
  EXPECT_NE(cut.message().find("ends before byte"), std::string::npos) << cut.ToString();
  ASSERT_OK(ImportSafetensors(*fresh.engine, path, {}, nullptr, files).status());
  EXPECT_EQ(fresh.Read(0, ChunkKind::kParam), model.Read(0, ChunkKind::kParam));
}

// Data parallel with parameters sharded: the masters are the only stored
// copy, each rank holding a shard; the export gathers them (rank 0 writes),
// and an import sets each rank's shard, which exports the same file again.
TEST(InterchangeTest, ShardedMastersExportWholeAndImportIntoShards) {
  ScratchDir dir("st");
  const std::string first = dir.path() + "/first.safetensors", second = dir.path() + "/second.safetensors";
  std::vector<std::vector<float>> values;
  std::mt19937 rng(3);
  for (int l = 0; l < kLayers; ++l) values.push_back(Random(rng, 0.5f));
  OnRanks(2, [&](int r, Communicator& comm) {
    Model rank(0.0, &comm, /*shard_params=*/true);
    for (int l = 0; l < kLayers; ++l) rank.WriteShard(l, values[l]);
    ASSERT_OK_AND_ASSIGN(InterchangeSummary out, ExportSafetensors(*rank.engine, first, {}, &comm));
    EXPECT_EQ(out.tensors, kLayers + 1u) << "rank " << r;
  });
  const Parsed parsed = Parse(first);
  for (int l = 0; l < kLayers; ++l) EXPECT_EQ(parsed.data.at("layer" + std::to_string(l)), Bytes(values[l])) << l;
  OnRanks(2, [&](int, Communicator& comm) {
    Model rank(0.0, &comm, /*shard_params=*/true);
    ASSERT_OK(ImportSafetensors(*rank.engine, first).status());
    ASSERT_OK(ExportSafetensors(*rank.engine, second, {}, &comm).status());
    EXPECT_EQ(ExportSafetensors(*rank.engine, second).status().code(), StatusCode::kInvalidArgument);
  });
  EXPECT_EQ(ReadBytes(second), ReadBytes(first));
}

// Data parallel, a rank that fails (its shard unreadable; the file not
// creatable on rank 0; the file missing on one rank for an import) fails
// the export or import on every rank at once, and no file is published.
TEST(InterchangeTest, ARankThatFailsFailsEveryRankAndPublishesNothing) {
  ScratchDir dir("st");
  const std::string path = dir.path() + "/model.safetensors";
  std::vector<Status> unreadable(2, Status::Ok()), uncreatable(2, Status::Ok()), missing(2, Status::Ok());
  OnRanks(2, [&](int r, Communicator& comm) {
    Model rank(0.0, &comm, /*shard_params=*/true);
    std::mt19937 rng(3);
    for (int l = 0; l < kLayers; ++l) rank.WriteShard(l, Random(rng, 0.5f));
    if (r == 1) {
      for (const ChunkInfo& c : rank.engine->chunks()) {
        if (c.kind == ChunkKind::kMaster) ASSERT_OK(rank.engine->MoveChunk(c.id, Tier::kNvme));
      }
      rank.faults->FailReads(EIO, 1000);
    }
    unreadable[r] = ExportSafetensors(*rank.engine, path, {}, &comm).status();
    rank.faults->FailReads(EIO, 0);
    uncreatable[r] = ExportSafetensors(*rank.engine, dir.path() + "/no/such/dir/x.safetensors", {}, &comm).status();
    ASSERT_OK(ExportSafetensors(*rank.engine, path, {}, &comm).status());
    missing[r] = ImportSafetensors(*rank.engine, r == 1 ? path + ".gone" : path, {}, &comm).status();
  });
  EXPECT_EQ(unreadable[1].code(), StatusCode::kIoError) << unreadable[1].ToString();
  EXPECT_NE(unreadable[0].message().find("failed on rank(s) 1"), std::string::npos) << unreadable[0].ToString();
  EXPECT_EQ(uncreatable[0].code(), StatusCode::kIoError) << uncreatable[0].ToString();
  EXPECT_NE(uncreatable[1].message().find("failed on rank(s) 0"), std::string::npos) << uncreatable[1].ToString();
  EXPECT_EQ(missing[1].code(), StatusCode::kIoError) << missing[1].ToString();
  EXPECT_NE(missing[0].message().find("failed on rank(s) 1"), std::string::npos) << missing[0].ToString();
  for (const fs::directory_entry& entry : fs::directory_iterator(dir.path())) {
    EXPECT_EQ(entry.path().filename(), "model.safetensors");  // no temporary left
  }
}

}  // namespace
}  // namespace strata::offload
