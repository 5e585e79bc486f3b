// The configuration file of lockstep-master (docs/operations.md): one `key = value` per
// line, keys named exactly as the long flags without their dashes, `#` comments, values
// bare (numbers, true/false, plain words) or in double quotes (strings; \" and \\ are
// the only escapes). This file only reads the syntax; lockstep-master checks every key
// and value against its flags and names the line of anything it refuses.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace lockstep::tools {

struct ConfigEntry {
  std::string key;
  std::string value;
  bool quoted = false;  // the value was a "string"
  int line = 0;
};

struct ConfigFile {
  std::string path;
  std::vector<ConfigEntry> entries;
  std::string error;  // "PATH:LINE: reason" (or "PATH: reason"); empty when it was read
};

// Bounds on what is read: a configuration file is small and written by hand.
inline constexpr std::size_t kConfigFileBytesMax = 1 << 20;
inline constexpr std::size_t kConfigLineBytesMax = 4096;

// Reads and tokenizes the file. A line that is not empty, a comment or `key = value`
// is an error naming its line, as is a key given twice.
ConfigFile read_config_file(const std::string& path);

}  // namespace lockstep::tools
