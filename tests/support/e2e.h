// Harness for end-to-end tests with real processes: a lockstep-master process on an
// ephemeral port and lockstep-testpeer processes driven line by line (one JSON reply
// per command). Every process is killed and reaped when its owner goes out of scope.
#pragma once

#include "subprocess.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <csignal>
#include <fstream>
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

inline std::string bin(const std::string& name) { return std::string(LOCKSTEP_BIN_DIR) + "/" + name; }

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

class Master {
 public:
  explicit Master(std::vector<std::string> extra = {}) {
    std::vector<std::string> argv = {bin("lockstep-master"), "--listen", "127.0.0.1:0"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    auto p = tools::Subprocess::spawn(argv);
    if (!p) throw std::runtime_error("cannot spawn lockstep-master");
    proc_ = std::make_unique<tools::Subprocess>(std::move(*p));
    auto line = proc_->read_line(scaled(10s));
    if (!line) throw std::runtime_error("lockstep-master printed no address");
    port_ = static_cast<std::uint16_t>(std::stoi(line->substr(line->rfind(':') + 1)));
  }
  std::uint16_t port() const { return port_; }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  tools::Subprocess& proc() { return *proc_; }
  // Asks for a clean shutdown (SIGTERM) and returns the exit status (-1: it hung), so
  // that sanitizer findings at exit fail the test.
  int stop() {
    proc_->signal(SIGTERM);
    return proc_->wait(scaled(10s)).value_or(-1);
  }

 private:
  std::unique_ptr<tools::Subprocess> proc_;
  std::uint16_t port_ = 0;
};

class Peer {
 public:
  // launcher: words put before the program (e.g. /usr/bin/env VAR=value ...).
  Peer(const Master& master, std::string name, std::uint32_t group = 0, std::vector<std::string> extra = {},
       std::vector<std::string> launcher = {})
      : name_(std::move(name)) {
    std::vector<std::string> argv = std::move(launcher);
    for (const auto& word : {bin("lockstep-testpeer"), std::string("--master"), master.address(), std::string("--name"),
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
// holds everyone. An empty run admits its first newcomers without a vote.
inline void admit(std::vector<Peer*>& members, const std::vector<Peer*>& newcomers) {
  for (auto* n : newcomers) n->send("connect");
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
