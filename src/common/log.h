// A small process-wide logger: one line per record to stderr, level from
// LOCKSTEP_LOG_LEVEL (error, warn, info, debug, trace). Thread-safe.
#pragma once

#include <lockstep/lockstep.h>

#include <sstream>
#include <string_view>

namespace lockstep::log {

enum class Level { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3, kTrace = 4 };

void set_level(Level level);
Level level();
bool enabled(Level level);
// Parses "error".."trace"; false if the name is unknown.
bool parse_level(std::string_view name, Level* out);
void write(Level level, std::string_view component, std::string_view text);

}  // namespace lockstep::log

#define LOCKSTEP_LOG(lvl, component, expr)                                   \
  do {                                                                       \
    if (::lockstep::log::enabled(lvl)) {                                     \
      std::ostringstream lockstep_log_stream_;                               \
      lockstep_log_stream_ << expr;                                          \
      ::lockstep::log::write(lvl, component, lockstep_log_stream_.str());    \
    }                                                                        \
  } while (0)

#define LOG_ERROR(c, e) LOCKSTEP_LOG(::lockstep::log::Level::kError, c, e)
#define LOG_WARN(c, e) LOCKSTEP_LOG(::lockstep::log::Level::kWarn, c, e)
#define LOG_INFO(c, e) LOCKSTEP_LOG(::lockstep::log::Level::kInfo, c, e)
#define LOG_DEBUG(c, e) LOCKSTEP_LOG(::lockstep::log::Level::kDebug, c, e)
#define LOG_TRACE(c, e) LOCKSTEP_LOG(::lockstep::log::Level::kTrace, c, e)
