// lockstep-demo: the README's main job. It embeds a master (through the C API) and
// starts peer processes on loopback that join in waves across two groups, then
// kills one, stops another until the master evicts it, and brings both back as new
// peers, printing each group's membership as it changes. It ends by checking that
// every live peer of a group reports the same membership view.
#include <lockstep/lockstep.h>

#include "subprocess.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using lockstep::tools::Subprocess;

namespace {

struct DemoPeer {
  std::string name;
  int group = 0;
  std::unique_ptr<Subprocess> proc;
  std::string id;
  std::vector<std::string> view;  // ids, in rank order
  bool alive = false;
};

class Demo {
 public:
  Demo(std::string peer_binary, std::uint16_t port) : peer_binary_(std::move(peer_binary)), port_(port) {}

  void spawn(const std::string& name, int group) {
    auto p = Subprocess::spawn({peer_binary_, "--loop", "--name", name, "--group", std::to_string(group),
                                "--master", "127.0.0.1:" + std::to_string(port_), "--base-port", "0",
                                "--loop-interval-ms", "100"},
                               log_path_);
    if (!p) {
      say("cannot start " + name);
      return;
    }
    auto& peer = peers_[name];
    peer.name = name;
    peer.group = group;
    peer.proc = std::make_unique<Subprocess>(std::move(*p));
    peer.alive = true;
    peer.view.clear();
    say(name + " starts (group " + std::to_string(group) + ")");
  }

  void kill(const std::string& name) {
    auto& peer = peers_.at(name);
    peer.proc->kill();
    peer.alive = false;
    say(name + " is killed (SIGKILL)");
  }

  void stop(const std::string& name) {
    peers_.at(name).proc->signal(SIGSTOP);
    say(name + " is stopped (SIGSTOP): silent but connected; the master evicts it after the heartbeat timeout");
  }

  void resume(const std::string& name) {
    peers_.at(name).proc->signal(SIGCONT);
    say(name + " is resumed (SIGCONT)");
  }

  // Reads every peer's output for the given time and reports what changed.
  void watch(std::chrono::milliseconds duration) {
    const auto until = Clock::now() + duration;
    while (Clock::now() < until) {
      bool any = false;
      for (auto& [name, peer] : peers_) {
        if (!peer.alive) continue;
        while (auto line = peer.proc->read_line(std::chrono::milliseconds(0))) {
          any = true;
          handle(peer, *line);
        }
        if (!peer.proc->running()) {
          peer.alive = false;
          say(name + " has exited");
        }
      }
      print_changes();
      if (!any) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }

  // Every live peer of a group sees the same membership, which lists exactly them.
  bool views_agree() {
    bool ok = true;
    std::map<int, std::vector<std::string>> reference;
    for (auto& [name, peer] : peers_) {
      if (!peer.alive) continue;
      auto [it, fresh] = reference.emplace(peer.group, peer.view);
      if (!fresh && it->second != peer.view) {
        std::printf("  MISMATCH: %s sees [%s]\n", name.c_str(), names(peer.view).c_str());
        ok = false;
      }
    }
    for (const auto& [group, view] : reference) {
      std::vector<std::string> live;
      for (auto& [name, peer] : peers_) {
        if (peer.alive && peer.group == group) live.push_back(peer.id);
      }
      std::printf("  group %d: %zu live peer(s), all see [%s]\n", group, live.size(), names(view).c_str());
      std::sort(live.begin(), live.end());
      std::vector<std::string> sorted = view;
      std::sort(sorted.begin(), sorted.end());
      if (sorted != live) ok = false;
    }
    return ok;
  }

  void say(const std::string& text) {
    const double t = std::chrono::duration<double>(Clock::now() - start_).count();
    std::printf("[%5.1fs] %s\n", t, text.c_str());
    std::fflush(stdout);
  }

  void set_log(std::string path) { log_path_ = std::move(path); }

 private:
  // Names for a list of ids (a peer whose first line was not read yet shows its id).
  std::string names(const std::vector<std::string>& ids, bool* all_known = nullptr) {
    std::string out;
    if (all_known != nullptr) *all_known = true;
    for (const auto& id : ids) {
      std::string name = id.substr(24);
      bool known = false;
      for (auto& [n, peer] : peers_) {
        if (peer.id == id) {
          name = n;
          known = true;
        }
      }
      if (!known && all_known != nullptr) *all_known = false;
      out += (out.empty() ? "" : " ") + name;
    }
    return out;
  }

  // Prints each group's membership when it changed, once every member is known by name.
  void print_changes() {
    for (const auto& [group, latest] : latest_) {
      const auto& [view, world] = latest;
      if (last_printed_[group] == view) continue;
      bool all_known = false;
      const std::string text = names(view, &all_known);
      if (!all_known) continue;
      last_printed_[group] = view;
      say("group " + std::to_string(group) + " membership (rank order): [" + text + "]  world size " +
          std::to_string(world));
    }
  }

  void handle(DemoPeer& peer, const std::string& line) {
    auto j = json::parse(line, nullptr, false);
    if (j.is_discarded()) return;
    const std::string op = j.value("op", "");
    if (j.contains("id") && j["id"].is_string()) peer.id = j["id"].get<std::string>();
    if (op == "error") {
      say(peer.name + ": " + j.value("error", "error"));
      return;
    }
    if ((op == "connect" || op == "view") && j.value("code", -1) == 0) {
      std::vector<std::string> view;
      for (const auto& m : j["view"]) view.push_back(m["id"].get<std::string>());
      peer.view = view;
      if (op == "connect") say(peer.name + " is accepted");
      latest_[peer.group] = {view, j.value("world", 0)};
    } else if (op == "connect") {
      say(peer.name + " could not join: " + j.value("error", ""));
    }
  }

  std::string peer_binary_;
  std::uint16_t port_;
  std::string log_path_;
  std::map<std::string, DemoPeer> peers_;
  std::map<int, std::vector<std::string>> last_printed_;
  std::map<int, std::pair<std::vector<std::string>, int>> latest_;
  Clock::time_point start_ = Clock::now();
};

std::string sibling(const char* argv0, const std::string& name) {
  char self[4096] = {};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  std::string path = n > 0 ? std::string(self, static_cast<std::size_t>(n)) : std::string(argv0);
  return path.substr(0, path.rfind('/') + 1) + name;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lockstep-demo: a master and peers joining, leaving and rejoining on loopback"};
  std::uint32_t heartbeat_timeout_ms = 2000;
  std::string log = "lockstep-demo.log";
  app.add_option("--heartbeat-timeout-ms", heartbeat_timeout_ms, "the master's heartbeat timeout")->capture_default_str();
  app.add_option("--log", log, "file that receives the master's and peers' logs")->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  // The embedded master logs to stderr; send it to the log file with the peers'.
  std::FILE* log_file = std::freopen(log.c_str(), "w", stderr);
  if (log_file == nullptr) std::fprintf(stdout, "cannot open %s; logs go to the terminal\n", log.c_str());

  lockstep_master_config_t config;
  lockstep_master_config_init(&config);
  config.listen_host = "127.0.0.1";
  config.listen_port = 0;
  config.heartbeat_timeout_ms = heartbeat_timeout_ms;
  lockstep_master_t* master = nullptr;
  std::uint16_t port = 0;
  if (lockstep_master_create(&config, &master) != LOCKSTEP_OK || lockstep_master_run(master) != LOCKSTEP_OK ||
      lockstep_master_port(master, &port) != LOCKSTEP_OK) {
    std::printf("could not start the master\n");
    return 1;
  }

  Demo demo(sibling(argv[0], "lockstep-testpeer"), port);
  demo.set_log(log);
  demo.say("master listening on 127.0.0.1:" + std::to_string(port) + " (heartbeat timeout " +
           std::to_string(heartbeat_timeout_ms) + " ms); logs in " + log);
  const auto step = [&](int ms) { demo.watch(std::chrono::milliseconds(ms)); };

  demo.say("--- wave 1: three peers in group 0");
  for (const char* name : {"alpha", "bravo", "charlie"}) demo.spawn(name, 0);
  step(2000);
  demo.say("--- wave 2: two more in group 0, two in group 1");
  demo.spawn("delta", 0);
  demo.spawn("echo", 0);
  demo.spawn("foxtrot", 1);
  demo.spawn("golf", 1);
  step(2500);
  demo.say("--- a crash");
  demo.kill("charlie");
  step(1500);
  demo.say("--- a silent peer");
  demo.stop("echo");
  step(static_cast<int>(heartbeat_timeout_ms) + 1500);
  demo.resume("echo");
  step(1000);
  demo.say("--- both come back as new peers");
  demo.kill("echo");
  demo.spawn("charlie", 0);
  demo.spawn("echo", 0);
  step(2500);

  demo.say("--- final check");
  const bool ok = demo.views_agree();
  demo.say(ok ? "every live peer agrees on the membership of its group" : "MEMBERSHIP VIEWS DIFFER");
  lockstep_master_destroy(master);
  return ok ? 0 : 1;
}
