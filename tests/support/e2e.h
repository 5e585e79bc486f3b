// Harness for end-to-end tests with real processes: a lockstep-master process on an
// ephemeral port and lockstep-testpeer processes driven line by line (one JSON reply
// per command). Every process is killed and reaped when its owner goes out of scope.
#pragma once

#include "subprocess.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace lockstep::e2e {

using nlohmann::json;
using namespace std::chrono_literals;

// Sanitizer builds run slower: every timing constant is multiplied by this.
inline constexpr int kTimeScale = LOCKSTEP_TEST_TIME_SCALE;
inline std::chrono::milliseconds scaled(std::chrono::milliseconds ms) { return ms * kTimeScale; }

// A path relative to the directory of this test executable (LOCKSTEP_BIN_DIR is one).
inline std::string beside_test(const std::string& relative) {
  static const std::filesystem::path dir = std::filesystem::canonical("/proc/self/exe").parent_path();
  return (dir / relative).lexically_normal().string();
}
inline std::string bin(const std::string& name) { return beside_test(std::string(LOCKSTEP_BIN_DIR) + "/" + name); }

// A prefix and a number ("p3"), appended: g++ 12 at -O3 flags the insert that
// `"p" + std::to_string(i)` inlines with a false -Wrestrict.
template <typename N>
std::string numbered(const char* prefix, N n) {
  std::string out(prefix);
  out += std::to_string(n);
  return out;
}

// Resident memory of a process in KiB, from /proc.
inline long rss_kib(pid_t pid) {
  std::ifstream status("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

#ifdef LOCKSTEP_TAMPER_SHIM
// /usr/bin/env with the tamper shim (tests/support/tamper_shim.c) preloaded and armed
// (AddressSanitizer builds: the shim comes before the sanitizer runtime, which must be
// told that this is fine). call: the function whose first large call is altered
// (sendmsg: the ring; send: shared-state transfers).
inline std::vector<std::string> tamper_launcher(const std::string& call = "sendmsg") {
  std::string asan = "verify_asan_link_order=0";
  if (const char* existing = std::getenv("ASAN_OPTIONS"); existing != nullptr && *existing != '\0') {
    asan = std::string(existing) + ":" + asan;
  }
  return {"/usr/bin/env", "LD_PRELOAD=" + beside_test(LOCKSTEP_TAMPER_SHIM), "LOCKSTEP_TAMPER_MIN_BYTES=65536",
          "LOCKSTEP_TAMPER_CALL=" + call, "ASAN_OPTIONS=" + asan};
}
#endif

// The body of GET http://127.0.0.1:port/path (a POST of `post` where that is given) when
// the answer is 200; nothing otherwise (each socket call bounded by five seconds).
inline std::optional<std::string> http_get(std::uint16_t port, const std::string& path,
                                           const std::optional<std::string>& post = std::nullopt) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;
  const timeval timeout{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  sa.sin_port = htons(port);
  std::string answer;
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof sa) == 0) {
    const std::string request =
        post ? "POST " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\n"
                   "Content-Length: " + std::to_string(post->size()) + "\r\n\r\n" + *post
             : "GET " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
    if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(request.size())) {
      char buffer[4096];
      for (ssize_t n; (n = ::recv(fd, buffer, sizeof buffer, 0)) > 0;) answer.append(buffer, static_cast<std::size_t>(n));
    }
  }
  ::close(fd);
  const auto body = answer.find("\r\n\r\n");
  if (body == std::string::npos || answer.compare(0, 7, "HTTP/1.") != 0 || answer.compare(8, 5, " 200 ") != 0) {
    return std::nullopt;
  }
  return answer.substr(body + 4);
}

class Master {
 public:
  // With "--http", "127.0.0.1:0" among the extra words the master also serves its HTTP
  // endpoint, and state() / wait_for_state() read /api/state. host: the address it
  // listens on (an IPv6 literal without brackets; "::" serves both families); port: 0
  // for an ephemeral one (a master restarted in place of a killed one takes its port).
  explicit Master(std::vector<std::string> extra = {}, std::string host = "127.0.0.1", std::uint16_t port = 0)
      : host_(std::move(host)) {
    std::vector<std::string> argv = {bin("lockstep-master"), "--listen", with_port(host_, port)};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto p = tools::Subprocess::spawn(argv);
    if (!p) throw std::runtime_error("cannot spawn lockstep-master");
    proc_ = std::make_unique<tools::Subprocess>(std::move(*p));
    auto line = proc_->read_line(scaled(10s));
    if (!line) throw std::runtime_error("lockstep-master printed no address");
    port_ = static_cast<std::uint16_t>(std::stoi(line->substr(line->rfind(':') + 1)));
    if (std::find(extra.begin(), extra.end(), "--http") != extra.end()) {
      line = proc_->read_line(scaled(10s));
      if (!line) throw std::runtime_error("lockstep-master printed no http address");
      http_port_ = static_cast<std::uint16_t>(std::stoi(line->substr(line->rfind(':') + 1)));
    }
  }
  std::uint16_t port() const { return port_; }
  // The master's /api/state; a null json if it cannot be read.
  json state() const {
    if (http_port_ == 0) ADD_FAILURE() << "state() needs a master started with --http";
    auto body = http_port_ == 0 ? std::nullopt : http_get(http_port_, "/api/state");
    return body ? json::parse(*body, nullptr, false) : json();
  }
  // Polls /api/state until done(state) holds (true) or the timeout passes (false).
  bool wait_for_state(const std::function<bool(const json&)>& done, std::chrono::milliseconds timeout = scaled(30s)) const {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      const json s = state();
      if (s.is_object() && done(s)) return true;
      if (std::chrono::steady_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(10ms);
    }
  }
  // HOST:PORT for peers ([IPV6]:PORT; "::" as "::1").
  std::string address() const { return with_port(host_ == "::" ? "::1" : host_, port_); }
  static std::string with_port(const std::string& host, std::uint16_t port) {
    return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(port);
  }
  tools::Subprocess& proc() { return *proc_; }
  // Asks for a clean shutdown (SIGTERM) and returns the exit status (-1: it hung), so
  // that sanitizer findings at exit fail the test.
  int stop() {
    proc_->signal(SIGTERM);
    return proc_->wait(scaled(10s)).value_or(-1);
  }
  // SIGKILL, and reaped.
  void kill() { proc_->kill(); }

 private:
  std::string host_;
  std::unique_ptr<tools::Subprocess> proc_;
  std::uint16_t port_ = 0;
  std::uint16_t http_port_ = 0;  // 0: no --http
};

class Peer {
 public:
  // launcher: words put before the program (e.g. /usr/bin/env VAR=value ...).
  Peer(const Master& master, std::string name, std::uint32_t group = 0, std::vector<std::string> extra = {},
       std::vector<std::string> launcher = {})
      : Peer(master.address(), std::move(name), group, std::move(extra), std::move(launcher)) {}
  // master_address: HOST:PORT or [IPV6]:PORT.
  Peer(const std::string& master_address, std::string name, std::uint32_t group = 0,
       std::vector<std::string> extra = {}, std::vector<std::string> launcher = {})
      : name_(std::move(name)) {
    std::vector<std::string> argv = std::move(launcher);
    for (const auto& word : {bin("lockstep-testpeer"), std::string("--master"), master_address, std::string("--name"),
                             name_, std::string("--group"), std::to_string(group), std::string("--base-port"),
                             std::string("0")}) {
      argv.push_back(word);
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto p = tools::Subprocess::spawn(argv);
    if (!p) throw std::runtime_error("cannot spawn lockstep-testpeer");
    proc_ = std::make_unique<tools::Subprocess>(std::move(*p));
  }

  const std::string& name() const { return name_; }
  tools::Subprocess& proc() { return *proc_; }

  // Sends a command without waiting for its reply.
  void send(const std::string& command) { ASSERT_TRUE(proc_->write_line(command)) << name_ << ": " << command; }
  // The next reply, or a null json if none arrives in time.
  json reply(std::chrono::milliseconds timeout = scaled(30s)) {
    auto line = proc_->read_line(timeout);
    if (!line) return json();
    auto parsed = json::parse(*line, nullptr, false);
    if (parsed.is_discarded()) ADD_FAILURE() << name_ << " printed non-JSON: " << *line;
    if (parsed.contains("id") && parsed["id"].is_string()) id_ = parsed["id"].get<std::string>();
    return parsed;
  }
  json call(const std::string& command, std::chrono::milliseconds timeout = scaled(30s)) {
    send(command);
    return reply(timeout);
  }
  const std::string& id() const { return id_; }
  // Asks the peer to destroy its communicator and exit; returns the exit status.
  int stop() {
    proc_->write_line("exit");
    return proc_->wait(scaled(10s)).value_or(-1);
  }

 private:
  std::string name_;
  std::unique_ptr<tools::Subprocess> proc_;
  std::string id_;
};

inline int code(const json& reply) { return reply.is_object() && reply.contains("code") ? reply["code"].get<int>() : -1; }

// The ids of a reply's membership view, in rank order.
inline std::vector<std::string> view_ids(const json& reply) {
  std::vector<std::string> out;
  if (!reply.is_object() || !reply.contains("view") || !reply["view"].is_array()) return out;
  for (const auto& m : reply["view"]) out.push_back(m["id"].get<std::string>());
  return out;
}

// Sends the same command to every peer first, then collects every reply, so that
// votes (which are barriers) can complete.
inline std::vector<json> call_all(const std::vector<Peer*>& peers, const std::string& command,
                                  std::chrono::milliseconds timeout = scaled(30s)) {
  for (auto* p : peers) p->send(command);
  std::vector<json> out;
  for (auto* p : peers) out.push_back(p->reply(timeout));
  return out;
}

// Admits newcomers into the run: they call connect while the members vote
// are-peers-pending and update topology until all are accepted; then members
// holds everyone. An empty run admits its first newcomers without a vote. command: what
// the newcomers call ("reconnect": a new communicator in the same process).
inline void admit(std::vector<Peer*>& members, const std::vector<Peer*>& newcomers,
                  const std::string& command = "connect") {
  for (auto* n : newcomers) n->send(command);
  std::vector<Peer*> waiting = newcomers;
  // Collects connect replies until `count` newcomers are in (or the deadline passes).
  auto collect = [&](std::size_t count, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (count > 0 && !waiting.empty() && std::chrono::steady_clock::now() < deadline) {
      for (auto it = waiting.begin(); it != waiting.end() && count > 0;) {
        auto r = (*it)->reply(10ms);
        if (r.is_null()) {
          ++it;
          continue;
        }
        EXPECT_EQ(code(r), 0) << r.dump();
        members.push_back(*it);
        it = waiting.erase(it);
        --count;
      }
    }
  };
  if (members.empty()) collect(1, scaled(30s));
  const auto deadline = std::chrono::steady_clock::now() + scaled(60s);
  while (!waiting.empty() && std::chrono::steady_clock::now() < deadline) {
    auto pending = call_all(members, "pending");
    for (const auto& r : pending) {
      EXPECT_EQ(code(r), 0) << r.dump();
      EXPECT_EQ(r.value("pending", false), pending[0].value("pending", false)) << "answers differ";
    }
    if (!pending[0].value("pending", false)) {
      std::this_thread::sleep_for(10ms);
      continue;
    }
    auto updates = call_all(members, "update");
    for (const auto& r : updates) ASSERT_EQ(code(r), 0) << r.dump();
    const auto world = updates[0].value("world", 0);
    ASSERT_GE(static_cast<std::size_t>(world), members.size());
    collect(static_cast<std::size_t>(world) - members.size(), scaled(30s));
  }
  EXPECT_TRUE(waiting.empty()) << waiting.size() << " newcomer(s) not admitted in time";
}

}  // namespace lockstep::e2e
