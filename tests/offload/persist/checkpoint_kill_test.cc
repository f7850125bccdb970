// A process killed (SIGKILL) at random moments while it saves checkpoints
// always leaves one that loads, the one before or the new one: over many
// kill points, the saver (checkpoint_saver_main.cc) started afresh each time,
// in turn saving synchronously, asynchronously while it trains, and as on a
// file system without RENAME_EXCHANGE (NFS), where a kill between the two
// renames of a re-save leaves the old checkpoint aside, which loads from there.
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <random>
#include <string>
#include <thread>

#include "strata/checkpoint.h"
#include "tests/offload/training/train_model.h"
#include "tests/test_util.h"

extern char** environ;

namespace strata::offload {
namespace {

namespace fs = std::filesystem;

// Starts the saver on `root` in `mode` ("", "async" or "nfs"); its pid,
// once it says the first checkpoint is published.
pid_t StartSaver(const std::string& root, std::string mode) {
  const std::string saver = (fs::read_symlink("/proc/self/exe").parent_path() / "checkpoint_saver").string();
  int out[2];
  if (::pipe(out) != 0) return -1;
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  char* argv[] = {const_cast<char*>(saver.c_str()), const_cast<char*>(root.c_str()),
                  mode.empty() ? nullptr : mode.data(), nullptr};
  pid_t pid = -1;
  const int spawned = ::posix_spawn(&pid, saver.c_str(), &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  std::string said;
  pollfd ready{out[0], POLLIN, 0};
  while (spawned == 0 && said.find('\n') == std::string::npos && ::poll(&ready, 1, 60'000) > 0) {
    char c[64];
    const ssize_t n = ::read(out[0], c, sizeof c);
    if (n <= 0) break;
    said.append(c, static_cast<size_t>(n));
  }
  ::close(out[0]);
  if (spawned != 0 || said != "published\n") {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    ADD_FAILURE() << "the saver " << saver << " did not publish a first checkpoint (said '" << said << "')";
    return -1;
  }
  return pid;
}

TEST(CheckpointKillTest, AProcessKilledWhileSavingAlwaysLeavesACheckpointThatLoads) {
  constexpr int kTrials = 40;
  std::mt19937 rng(static_cast<uint32_t>(testing::TestSeed()));
  int torn = 0;  // kills that left a save half done
  for (int trial = 0; trial < kTrials; ++trial) {
    testing::ScratchDir dir("kill");
    const std::string mode = trial % 3 == 0 ? "" : trial % 3 == 1 ? "async" : "nfs";
    const pid_t pid = StartSaver(dir.path(), mode);
    ASSERT_GT(pid, 0);
    std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<int>(0, 300'000)(rng)));
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the saver ended by itself (a failed save?), status " << status;
    for (const fs::directory_entry& entry : fs::directory_iterator(dir.path())) {
      if (entry.path().filename().string().rfind(".step-", 0) == 0) {
        torn++;
        break;
      }
    }
    SCOPED_TRACE("trial " + std::to_string(trial) + " (" + (mode.empty() ? "sync" : mode) + ")");
    ASSERT_OK(VerifyCheckpoint(dir.path()).status());
    Model fresh;
    ASSERT_OK_AND_ASSIGN(CheckpointSummary loaded, LoadCheckpoint(*fresh.engine, *fresh.optimizer, dir.path()));
    EXPECT_GE(loaded.step, 1);
    EXPECT_EQ(fresh.optimizer->steps_taken(), loaded.step);
  }
  std::printf("[ kills    ] %d of %d kills left a save half done\n", torn, kTrials);
  EXPECT_GT(torn, 0) << "no kill landed inside a save: the test proved little";
}

}  // namespace
}  // namespace strata::offload
