// Leveled logging to stderr: STRATA_LOG_INFO("moved {} bytes", n).
// The level is process-wide (SetLogLevel, or the STRATA_LOG_LEVEL
// environment variable). Thread-safe: each message is written with one call.
#pragma once

#include <string_view>

#include <fmt/format.h>

#include "strata/status.h"
#include "strata/types.h"

namespace strata {

void SetLogLevel(LogLevel level);
LogLevel GetLogLevel();
Result<LogLevel> ParseLogLevel(std::string_view name);
std::string_view LogLevelName(LogLevel level);
void LogMessage(LogLevel level, const char* file, int line, std::string_view message);

}  // namespace strata

#define STRATA_LOG(level, ...)                                                      \
  do {                                                                              \
    if (static_cast<int>(level) >= static_cast<int>(::strata::GetLogLevel()))      \
      ::strata::LogMessage(level, __FILE__, __LINE__, ::fmt::format(__VA_ARGS__));  \
  } while (0)
#define STRATA_LOG_DEBUG(...) STRATA_LOG(::strata::LogLevel::kDebug, __VA_ARGS__)
#define STRATA_LOG_INFO(...) STRATA_LOG(::strata::LogLevel::kInfo, __VA_ARGS__)
#define STRATA_LOG_WARNING(...) STRATA_LOG(::strata::LogLevel::kWarning, __VA_ARGS__)
#define STRATA_LOG_ERROR(...) STRATA_LOG(::strata::LogLevel::kError, __VA_ARGS__)
