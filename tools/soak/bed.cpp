#include "bed.h"

#include "subprocess.h"

#include <chrono>
#include <fstream>
#include <unistd.h>

namespace lockstep::soak {

using tools::Subprocess;

Bed::~Bed() {
  if (up_) run({"down"});
}

bool Bed::up(std::uint32_t hosts) {
  up_ = true;  // from here on, down at the end (up may have made part of the bed)
  return run({"up", std::to_string(hosts), "--owner", std::to_string(::getpid())});
}

bool Bed::run(const std::vector<std::string>& args, std::string* out) {
  std::vector<std::string> argv = {command_, "--prefix", prefix_};
  argv.insert(argv.end(), args.begin(), args.end());
  auto p = Subprocess::spawn(argv, log_path_);
  if (!p) return false;
  std::string text;
  while (auto line = p->read_line(std::chrono::seconds(60))) text += *line;
  const auto status = p->wait(std::chrono::seconds(60));
  if (out != nullptr) *out = text;
  return status && *status == 0;
}

std::vector<std::string> Bed::in_host(std::uint32_t host, const std::vector<std::string>& argv) const {
  std::vector<std::string> full = {command_, "--prefix", prefix_, "exec", std::to_string(host)};
  full.insert(full.end(), argv.begin(), argv.end());
  return full;
}

long status_kib(pid_t pid, const std::string& field) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
  }
  return -1;
}

}  // namespace lockstep::soak
