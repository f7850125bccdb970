#include "src/base/logging.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace strata {
namespace {

LogLevel InitialLevel() {
  const char* env = std::getenv("STRATA_LOG_LEVEL");
  if (env != nullptr) {
    Result<LogLevel> level = ParseLogLevel(env);
    if (level.ok()) return *level;
  }
  return LogLevel::kInfo;
}

// Relaxed: the level is a filter, not a synchronization point; a message
// racing with a level change may go either way.
std::atomic<LogLevel> g_level{InitialLevel()};

}  // namespace

void SetLogLevel(LogLevel level) { g_level.store(level, std::memory_order_relaxed); }
LogLevel GetLogLevel() { return g_level.load(std::memory_order_relaxed); }

Result<LogLevel> ParseLogLevel(std::string_view name) {
  if (name == "debug") return LogLevel::kDebug;
  if (name == "info") return LogLevel::kInfo;
  if (name == "warning" || name == "warn") return LogLevel::kWarning;
  if (name == "error") return LogLevel::kError;
  if (name == "off") return LogLevel::kOff;
  return InvalidArgument("unknown log level '{}': expected debug, info, warning, error or off", name);
}

std::string_view LogLevelName(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "debug";
    case LogLevel::kInfo: return "info";
    case LogLevel::kWarning: return "warning";
    case LogLevel::kError: return "error";
    case LogLevel::kOff: return "off";
  }
  return "?";
}

void LogMessage(LogLevel level, const char* file, int line, std::string_view message) {
  const char* base = std::strrchr(file, '/');
  base = base != nullptr ? base + 1 : file;
  std::string text = fmt::format("[strata {}] {} ({}:{})\n", LogLevelName(level), message, base, line);
  std::fwrite(text.data(), 1, text.size(), stderr);
}

}  // namespace strata
