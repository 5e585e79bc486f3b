// The configuration file's syntax (config_file.h).
#include "config_file.h"

#include <fstream>
#include <map>
#include <sstream>

namespace lockstep::tools {
namespace {

std::string trim(const std::string& text) {
  const auto first = text.find_first_not_of(" \t");
  if (first == std::string::npos) return "";
  const auto last = text.find_last_not_of(" \t\r");
  return text.substr(first, last - first + 1);
}

bool valid_key(const std::string& key) {
  if (key.empty()) return false;
  for (const char c : key) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '_')) return false;
  }
  return true;
}

}  // namespace

ConfigFile read_config_file(const std::string& path) {
  ConfigFile file;
  file.path = path;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    file.error = path + ": cannot read the configuration file";
    return file;
  }
  std::string text(kConfigFileBytesMax + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<std::size_t>(in.gcount()));
  if (text.size() > kConfigFileBytesMax) {
    file.error = path + ": the configuration file is larger than " + std::to_string(kConfigFileBytesMax) + " bytes";
    return file;
  }
  std::map<std::string, int> seen;
  std::istringstream lines(text);
  std::string raw;
  int number = 0;
  const auto fail = [&](const std::string& why) {
    file.error = path + ":" + std::to_string(number) + ": " + why;
    file.entries.clear();
    return file;
  };
  while (std::getline(lines, raw)) {
    ++number;
    if (raw.size() > kConfigLineBytesMax) return fail("the line is longer than " + std::to_string(kConfigLineBytesMax) + " bytes");
    const std::string line = trim(raw);
    if (line.empty() || line[0] == '#') continue;
    if (line[0] == '[') return fail("sections are not supported: every key stands alone at the top level");
    const auto equals = line.find('=');
    if (equals == std::string::npos) return fail("expected `key = value`, got '" + line + "'");
    ConfigEntry entry;
    entry.line = number;
    entry.key = trim(line.substr(0, equals));
    if (!valid_key(entry.key)) {
      return fail("'" + entry.key + "' is not a key (keys are the long flags without their dashes, e.g. listen)");
    }
    std::string rest = trim(line.substr(equals + 1));
    if (!rest.empty() && rest[0] == '"') {
      entry.quoted = true;
      std::size_t i = 1;
      bool closed = false;
      for (; i < rest.size(); ++i) {
        if (rest[i] == '\\') {
          if (i + 1 >= rest.size() || (rest[i + 1] != '"' && rest[i + 1] != '\\')) {
            return fail("in the value of " + entry.key + ": only \\\" and \\\\ may be escaped");
          }
          entry.value += rest[++i];
        } else if (rest[i] == '"') {
          closed = true;
          break;
        } else {
          entry.value += rest[i];
        }
      }
      if (!closed) return fail("the string value of " + entry.key + " has no closing quote");
      const std::string after = trim(rest.substr(i + 1));
      if (!after.empty() && after[0] != '#') return fail("unexpected text after the value of " + entry.key + ": '" + after + "'");
    } else {
      const auto comment = rest.find('#');
      entry.value = trim(comment == std::string::npos ? rest : rest.substr(0, comment));
      if (entry.value.empty()) return fail(entry.key + " has no value");
      if (entry.value.find_first_of(" \t") != std::string::npos) {
        return fail("the value of " + entry.key + " holds a space: put it in double quotes");
      }
    }
    if (auto [it, fresh] = seen.emplace(entry.key, number); !fresh) {
      return fail(entry.key + " is given twice (first on line " + std::to_string(it->second) + ")");
    }
    file.entries.push_back(std::move(entry));
  }
  return file;
}

}  // namespace lockstep::tools
