// Logger implementation: the level is read once from the environment, then atomic.
#include "common/log.h"

#include <cstring>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <mutex>
#include <string>

namespace lockstep::log {
namespace {

Level level_from_env() {
  const char* env = std::getenv("LOCKSTEP_LOG_LEVEL");
  Level out = Level::kInfo;
  if (env != nullptr && !parse_level(env, &out)) {
    std::fprintf(stderr, "lockstep: unknown LOCKSTEP_LOG_LEVEL '%s', using info\n", env);
  }
  return out;
}

std::atomic<int>& level_storage() {
  static std::atomic<int> value{static_cast<int>(level_from_env())};
  return value;
}

const char* level_name(Level level) {
  switch (level) {
    case Level::kError: return "error";
    case Level::kWarn: return "warn";
    case Level::kInfo: return "info";
    case Level::kDebug: return "debug";
    case Level::kTrace: return "trace";
  }
  return "?";
}

}  // namespace

void set_level(Level value) { level_storage().store(static_cast<int>(value)); }
Level level() { return static_cast<Level>(level_storage().load(std::memory_order_relaxed)); }
bool enabled(Level value) {
  return static_cast<int>(value) <= level_storage().load(std::memory_order_relaxed);
}

bool parse_level(std::string_view name, Level* out) {
  static constexpr std::string_view kNames[] = {"error", "warn", "info", "debug", "trace"};
  for (int i = 0; i < 5; ++i) {
    if (name == kNames[i]) {
      *out = static_cast<Level>(i);
      return true;
    }
  }
  return false;
}

void write(Level value, std::string_view component, std::string_view text) {
  static std::mutex mutex;
  const auto now = std::chrono::system_clock::now();
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count();
  const std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm_utc{};
  gmtime_r(&secs, &tm_utc);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%H:%M:%S", &tm_utc);
  std::lock_guard<std::mutex> lock(mutex);
  std::fprintf(stderr, "%s.%03d %-5s [%.*s] %.*s\n", stamp, static_cast<int>(ms % 1000),
               level_name(value), static_cast<int>(component.size()), component.data(),
               static_cast<int>(text.size()), text.data());
}

}  // namespace lockstep::log

extern "C" lockstep_status_t lockstep_set_log_level(lockstep_log_level_t value) {
  // Read as an int: C may pass any int, and loading an out-of-range C++ enum is undefined.
  int raw = 0;
  static_assert(sizeof raw == sizeof value);
  std::memcpy(&raw, &value, sizeof raw);
  if (raw < 0 || raw > 4) return LOCKSTEP_STATUS_INVALID_ARGUMENT;
  lockstep::log::set_level(static_cast<lockstep::log::Level>(raw));
  return LOCKSTEP_OK;
}
