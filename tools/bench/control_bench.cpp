// lockstep-bench control: the master's control plane at scale. A real lockstep-master
// process, and N light simulated peers in this process, each one TCP connection that
// speaks the protocol (Hello, heartbeats, votes) but moves no data: a p2p establishment
// is reported as done without connecting, a collective's Go is answered with its Done at
// once, a sync's plan with its SyncDone. Per N it prints one JSON line per kind of round:
// the latency from the last vote sent to each peer's outcome (as this process reads it),
// the master's CPU per round per peer (utime + stime of its process over the rounds,
// divided by rounds x N) and its resident memory per peer ((RSS(N) - RSS(0)) / N).
// Then a tenth of N more peers register and one update topology of the N accepted
// admits them (kind update_topology_late: from the last vote to the last result). Last,
// a flood: N more peers connect and say Hello at once, every other one hanging up right
// after its Hello, and one update topology admits the survivors (kind join_flood). All
// along, every peer sends a heartbeat each second; kind heartbeat reports how long the
// acknowledgements took (as this process reads them: its own loop is inside).
#include "bench_common.h"
#include "subprocess.h"

#include "common/limits.h"
#include "protocol/codec.h"
#include "protocol/messages.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <poll.h>
#include <span>
#include <sstream>
#include <string>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>
#include <vector>

namespace lockstep::bench {
namespace {

using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

// Raises the soft limit of open files to the hard one; returns the limit in force.
rlim_t raise_open_files() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return 0;
  if (r.rlim_cur < r.rlim_max) {
    const rlim_t before = r.rlim_cur;
    r.rlim_cur = r.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &r) == 0) {
      std::cerr << "lockstep-bench: raised the open-files limit from " << before << " to " << r.rlim_cur << "\n";
    }
    ::getrlimit(RLIMIT_NOFILE, &r);
  }
  return r.rlim_cur;
}

// The master process's CPU time (user + system) and resident memory.
double cpu_seconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = text.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream fields(text.substr(close + 2));
  std::string f;
  unsigned long long utime = 0, stime = 0;
  // After "pid (comm) ": state is field 3; utime and stime are fields 14 and 15.
  for (int i = 3; i <= 15 && (fields >> f); ++i) {
    if (i == 14) utime = std::stoull(f);
    if (i == 15) stime = std::stoull(f);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

double rss_kib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6));
  }
  return 0;
}

struct SimPeer {
  int fd = -1;
  std::vector<std::uint8_t> in;
  PeerId id;
  bool accepted = false;
  bool gone = false;
  std::vector<std::pair<proto::Message, Clock::time_point>> inbox;
  std::deque<Clock::time_point> heartbeats;  // sent, not yet acknowledged
};

// N simulated peers on one poll loop.
class Swarm {
 public:
  explicit Swarm(std::uint16_t port) : port_(port) {}
  ~Swarm() {
    for (auto& p : peers_) {
      if (p.fd >= 0) ::close(p.fd);
    }
  }

  std::vector<SimPeer>& peers() { return peers_; }
  std::size_t live() const {
    return static_cast<std::size_t>(std::count_if(peers_.begin(), peers_.end(), [](const SimPeer& p) { return !p.gone; }));
  }
  // How long each acknowledged heartbeat took, in ms.
  const std::vector<double>& heartbeat_ms() const { return heartbeat_ms_; }

  // The peer hangs up (it dies during its join); the swarm forgets it.
  void drop(SimPeer& p) {
    ::close(p.fd);
    p.fd = -1;
    p.gone = true;
    p.inbox.clear();
    p.heartbeats.clear();
  }

  // Connects n more peers and sends their Hellos.
  bool add(int n) {
    for (int i = 0; i < n; ++i) {
      int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0) return fail("socket: " + std::string(std::strerror(errno)));
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_port = htons(port_);
      sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
        ::close(fd);
        return fail("connect: " + std::string(std::strerror(errno)));
      }
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      SimPeer p;
      p.fd = fd;
      peers_.push_back(std::move(p));
      proto::Hello hello;
      hello.p2p_port = 9;  // never dialled: establishments are reported without connecting
      hello.shared_state_port = 9;
      hello.benchmark_port = 9;
      hello.advertised_host = "127.0.0.1";
      if (!send(peers_.back(), hello)) return false;
    }
    return true;
  }

  bool send(SimPeer& p, const proto::Message& m) {
    out_.clear();
    proto::encode_frame(m, out_);
    std::size_t sent = 0;
    while (sent < out_.size()) {
      const ssize_t n = ::send(p.fd, out_.data() + sent, out_.size() - sent, MSG_NOSIGNAL);
      if (n > 0) {
        sent += static_cast<std::size_t>(n);
      } else if (n < 0 && (errno == EINTR || errno == EAGAIN)) {
        continue;
      } else {
        p.gone = true;
        return fail("send: the master closed a connection");
      }
    }
    return true;
  }

  // Reads and decodes whatever arrived within wait (heartbeats every second meanwhile).
  bool pump(std::chrono::milliseconds wait) {
    fds_.resize(peers_.size());
    for (std::size_t i = 0; i < peers_.size(); ++i) fds_[i] = pollfd{peers_[i].fd, POLLIN, 0};  // -1: ignored
    const int ready = ::poll(fds_.data(), fds_.size(), static_cast<int>(wait.count()));
    if (ready < 0 && errno != EINTR) return fail("poll: " + std::string(std::strerror(errno)));
    const auto now = Clock::now();
    for (std::size_t i = 0; ready > 0 && i < peers_.size(); ++i) {
      if ((fds_[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      SimPeer& p = peers_[i];
      std::uint8_t buf[65536];
      const ssize_t n = ::recv(p.fd, buf, sizeof buf, MSG_DONTWAIT);
      if (n <= 0) {
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
        p.gone = true;
        return fail("the master closed the connection of a simulated peer");
      }
      p.in.insert(p.in.end(), buf, buf + n);
      std::size_t at = 0;
      while (p.in.size() - at >= proto::kFrameHeaderBytes) {
        auto header = proto::decode_header(std::span<const std::uint8_t, proto::kFrameHeaderBytes>(
            p.in.data() + at, proto::kFrameHeaderBytes));
        if (!header.is_ok()) return fail("a bad frame header from the master");
        const std::size_t whole = proto::kFrameHeaderBytes + header.value().payload_bytes;
        if (p.in.size() - at < whole) break;
        auto message = proto::decode_payload(
            header.value().type,
            std::span<const std::uint8_t>(p.in.data() + at + proto::kFrameHeaderBytes, header.value().payload_bytes));
        if (!message.is_ok()) return fail("a bad frame from the master: " + message.status().message());
        at += whole;
        if (std::holds_alternative<proto::HeartbeatAck>(message.value())) {
          if (p.heartbeats.empty()) return fail("an acknowledgement of no heartbeat");
          heartbeat_ms_.push_back(std::chrono::duration<double, std::milli>(now - p.heartbeats.front()).count());
          p.heartbeats.pop_front();
          continue;
        }
        if (const auto* bye = std::get_if<proto::Goodbye>(&message.value())) {
          return fail("the master said goodbye to a simulated peer: " + bye->reason);
        }
        if (const auto* refused = std::get_if<proto::Refused>(&message.value())) {
          return fail("the master refused a simulated peer's " + std::string(proto::msg_type_name(refused->request)) +
                      ": " + refused->reason);
        }
        p.inbox.emplace_back(std::move(message.value()), now);
      }
      p.in.erase(p.in.begin(), p.in.begin() + static_cast<std::ptrdiff_t>(at));
    }
    if (now - last_heartbeat_ >= std::chrono::seconds(1)) {
      last_heartbeat_ = now;
      for (auto& p : peers_) {
        if (p.gone) continue;
        if (!send(p, proto::Heartbeat{})) return false;
        p.heartbeats.push_back(Clock::now());
      }
    }
    return true;
  }

  // Pumps until the inbox of every peer from the first-th on holds a message for which
  // take() returns true (the message is removed and handle()d), or the timeout passes.
  // Returns false on either.
  template <typename T>
  bool await_each(const std::function<bool(SimPeer&, const T&, Clock::time_point)>& handle,
                  std::chrono::seconds timeout, std::size_t per_peer = 1, std::size_t first = 0) {
    const auto deadline = Clock::now() + timeout;
    std::vector<std::size_t> got(peers_.size(), 0);
    std::size_t done = first;
    for (std::size_t i = first; i < peers_.size(); ++i) {
      if (peers_[i].gone) ++done;  // nothing to wait for
    }
    for (;;) {
      for (std::size_t i = first; i < peers_.size(); ++i) {
        if (peers_[i].gone) continue;
        auto& inbox = peers_[i].inbox;
        for (auto it = inbox.begin(); it != inbox.end() && got[i] < per_peer;) {
          if (const auto* m = std::get_if<T>(&it->first)) {
            const T copy = *m;
            const auto at = it->second;
            it = inbox.erase(it);
            if (!handle(peers_[i], copy, at)) return false;
            if (++got[i] == per_peer) ++done;
          } else {
            ++it;
          }
        }
      }
      if (done == peers_.size()) return true;
      if (Clock::now() >= deadline) return fail("timed out waiting for " + std::to_string(peers_.size() * per_peer) +
                                                " outcomes (" + std::to_string(done) + " peers complete)");
      if (!pump(std::chrono::milliseconds(5))) return false;
    }
  }

  const std::string& error() const { return error_; }

 private:
  bool fail(const std::string& why) {
    if (error_.empty()) error_ = why;
    return false;
  }

  std::uint16_t port_;
  std::vector<SimPeer> peers_;
  std::vector<pollfd> fds_;
  std::vector<std::uint8_t> out_;
  Clock::time_point last_heartbeat_{};  // the first pump sends the first heartbeats
  std::vector<double> heartbeat_ms_;
  std::string error_;
};

double ms_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Waits for the Welcome of every peer from the first-th on.
bool await_welcomes(Swarm& swarm, std::size_t first) {
  return swarm.await_each<proto::Welcome>(
      [](SimPeer& p, const proto::Welcome& w, Clock::time_point) {
        p.id = w.id;
        return true;
      },
      std::chrono::seconds(60), 1, first);
}

// An establishment reported done without connecting.
bool report_established(Swarm& swarm, SimPeer& p, const proto::EstablishP2P& e) {
  return swarm.send(p, proto::P2PReport{e.epoch, {}});
}

// The accepted peers vote update topology; every participant (the registered newcomers
// too) gets EstablishP2P, reports, and gets the result. An update that fails
// (UPDATE_TOPOLOGY_FAILED: a newcomer left during it) is retried, as an application
// does, up to `tries` times. Returns the figures of the update that succeeded.
std::optional<json> update_admitting(Swarm& swarm, std::size_t newcomers, int tries = 1) {
  for (int attempt = 1;; ++attempt) {
    for (auto& p : swarm.peers()) {
      if (p.accepted && !p.gone && !swarm.send(p, proto::VoteUpdateTopology{})) return std::nullopt;
    }
    const Clock::time_point last_vote = Clock::now();
    Clock::time_point last_establish = last_vote;
    if (!swarm.await_each<proto::EstablishP2P>(
            [&](SimPeer& p, const proto::EstablishP2P& e, Clock::time_point at) {
              last_establish = std::max(last_establish, at);
              return report_established(swarm, p, e);
            },
            std::chrono::seconds(120))) {
      return std::nullopt;
    }
    Clock::time_point last_result = last_vote;
    bool all_ok = true;
    bool failed = false;
    const std::size_t n = swarm.live();
    if (!swarm.await_each<proto::TopologyResult>(
            [&](SimPeer& p, const proto::TopologyResult& t, Clock::time_point at) {
              last_result = std::max(last_result, at);
              failed = failed || t.status == LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED;
              all_ok = all_ok && t.status == LOCKSTEP_OK && t.ring.size() == n;
              if (t.status == LOCKSTEP_OK) p.accepted = true;
              return true;
            },
            std::chrono::seconds(120))) {
      return std::nullopt;
    }
    if (failed && attempt < tries) continue;
    if (!all_ok) return std::nullopt;
    return json{{"newcomers", newcomers},
                {"tries", attempt},
                {"last_vote_to_last_establish_ms", ms_between(last_vote, last_establish)},
                {"last_vote_to_last_result_ms", ms_between(last_vote, last_result)}};
  }
}

// Brings every simulated peer into the run: the first are admitted without a vote, the
// rest by one update topology of the accepted ones. Returns the update's figures.
std::optional<json> admit_all(Swarm& swarm, int n) {
  auto& peers = swarm.peers();
  if (!await_welcomes(swarm, 0)) return std::nullopt;
  // Answer establishments until some are accepted.
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  std::size_t accepted = 0;
  while (accepted == 0 && Clock::now() < deadline) {
    if (!swarm.pump(std::chrono::milliseconds(5))) return std::nullopt;
    for (auto& p : peers) {
      for (auto it = p.inbox.begin(); it != p.inbox.end();) {
        if (const auto* e = std::get_if<proto::EstablishP2P>(&it->first)) {
          if (!report_established(swarm, p, *e)) return std::nullopt;
          it = p.inbox.erase(it);
        } else if (const auto* t = std::get_if<proto::TopologyResult>(&it->first)) {
          if (t->status == LOCKSTEP_OK) {
            p.accepted = true;
            ++accepted;
          }
          it = p.inbox.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
  if (accepted == 0) return std::nullopt;
  return update_admitting(swarm, static_cast<std::size_t>(n) - accepted);
}

}  // namespace

int run_control(const ControlSettings& c) {
  const rlim_t limit = raise_open_files();
  // The largest N, a tenth of it more for the late newcomers, and N for the flood.
  const int largest = *std::max_element(c.peers.begin(), c.peers.end());
  const int files = 2 * largest + largest / 10 + 65;
  if (limit < static_cast<rlim_t>(files)) {
    std::cerr << "lockstep-bench control: " << largest << " peers need " << files
              << " open files here, and the limit is " << limit << "\n";
    return 2;
  }
  for (const int n : c.peers) {
    std::uint16_t port = 0;
    auto master = spawn_master_process(c.self, &port,
                                       {"--heartbeat-timeout-ms", "60000", "--peers-max",
                                        std::to_string(2 * n + n / 10 + 16), "--log-level", "warn"});
    if (!master) return 1;
    const pid_t pid = master->pid();
    ::usleep(200'000);
    const double rss0 = rss_kib(pid);
    Swarm swarm(port);
    const auto failed = [&](const std::string& what) {
      std::cerr << "lockstep-bench control: " << n << " peers, " << what << ": " << swarm.error() << "\n";
      master->kill();
      return 1;
    };
    if (!swarm.add(n)) return failed("connecting");
    const auto joined = admit_all(swarm, n);
    if (!joined) return failed("admitting");
    auto update = *joined;
    update["bench"] = "control";
    update["peers"] = n;
    update["kind"] = "update_topology";
    std::cout << update.dump() << std::endl;

    // The slowest heartbeat acknowledgement since the last line: how late the master
    // answered others while it worked for these rounds (this process's loop included);
    // null if no heartbeat (one per peer per second) was answered meanwhile.
    std::size_t heartbeats_seen = 0;
    const auto slowest_heartbeat = [&] {
      const auto& hb = swarm.heartbeat_ms();
      json most = nullptr;
      for (std::size_t i = heartbeats_seen; i < hb.size(); ++i) {
        if (most.is_null() || hb[i] > most.get<double>()) most = hb[i];
      }
      heartbeats_seen = hb.size();
      return most;
    };
    const auto report = [&](const char* kind, const std::vector<double>& lat, double cpu_s, int rounds,
                            json extra = json::object()) {
      json j{{"bench", "control"},
             {"heartbeat_max_ms", slowest_heartbeat()},
             {"peers", n},
             {"kind", kind},
             {"rounds", rounds},
             {"p50_ms", percentile(lat, 0.5)},
             {"p99_ms", percentile(lat, 0.99)},
             {"max_ms", lat.empty() ? 0.0 : *std::max_element(lat.begin(), lat.end())},
             {"master_cpu_us_per_round_per_peer", cpu_s * 1e6 / rounds / n}};
      for (auto& [k, v] : extra.items()) j[k] = v;
      std::cout << j.dump() << std::endl;
    };
    // One vote per peer, one outcome per peer.
    const auto simple = [&]<typename Result>(const char* kind, const proto::Message& vote) -> bool {
      std::vector<double> lat;
      const double cpu0 = cpu_seconds(pid);
      for (int r = 0; r < c.rounds; ++r) {
        for (auto& p : swarm.peers()) {
          if (!swarm.send(p, vote)) return false;
        }
        const auto last_vote = Clock::now();
        if (!swarm.await_each<Result>(
                [&](SimPeer&, const Result&, Clock::time_point at) {
                  lat.push_back(ms_between(last_vote, at));
                  return true;
                },
                std::chrono::seconds(60))) {
          return false;
        }
      }
      report(kind, lat, cpu_seconds(pid) - cpu0, c.rounds);
      return true;
    };
    if (!simple.operator()<proto::PeersPendingResult>("are_peers_pending", proto::VotePeersPending{})) {
      return failed("are-peers-pending");
    }
    if (!simple.operator()<proto::AgreeResult>("agree", proto::VoteAgree{.flag = true})) return failed("agree");

    // Collectives: `tags` all-reduces in flight at once (too large to travel with the
    // votes): the initiate votes, then every peer's Done; two rounds each.
    {
      std::vector<double> init_lat, done_lat;
      const double cpu0 = cpu_seconds(pid);
      std::uint64_t next_tag = 1;
      for (int r = 0; r < c.rounds; ++r) {
        const std::uint64_t first = next_tag;
        next_tag += static_cast<std::uint64_t>(c.tags);
        for (auto& p : swarm.peers()) {
          for (int t = 0; t < c.tags; ++t) {
            proto::CollectiveInit init;
            init.tag = first + static_cast<std::uint64_t>(t);
            init.descriptor.count = 1 << 20;
            init.descriptor.dtype = LOCKSTEP_F32;
            init.descriptor.op = LOCKSTEP_SUM;
            if (!swarm.send(p, init)) return failed("collective initiate");
          }
        }
        auto last_vote = Clock::now();
        std::vector<std::vector<proto::CollectiveGo>> gos(swarm.peers().size());
        if (!swarm.await_each<proto::CollectiveGo>(
                [&](SimPeer& p, const proto::CollectiveGo& go, Clock::time_point at) {
                  init_lat.push_back(ms_between(last_vote, at));
                  gos[static_cast<std::size_t>(&p - swarm.peers().data())].push_back(go);
                  return true;
                },
                std::chrono::seconds(60), static_cast<std::size_t>(c.tags))) {
          return failed("collective go");
        }
        for (std::size_t i = 0; i < swarm.peers().size(); ++i) {
          for (const auto& go : gos[i]) {
            proto::CollectiveDone done;
            done.tag = go.tag;
            done.attempt = go.attempt;
            done.ok = true;
            if (!swarm.send(swarm.peers()[i], done)) {
              return failed("collective done");
            }
          }
        }
        last_vote = Clock::now();
        if (!swarm.await_each<proto::CollectiveResult>(
                [&](SimPeer&, const proto::CollectiveResult& res, Clock::time_point at) {
                  done_lat.push_back(ms_between(last_vote, at));
                  return res.status == LOCKSTEP_OK;
                },
                std::chrono::seconds(60), static_cast<std::size_t>(c.tags))) {
          return failed("collective result");
        }
      }
      const double cpu = cpu_seconds(pid) - cpu0;
      // Both votes of a collective count as rounds: 2 x rounds x tags.
      report("collective_initiate", init_lat, cpu / 2, c.rounds * c.tags, json{{"tags_in_flight", c.tags}});
      report("collective_complete", done_lat, cpu / 2, c.rounds * c.tags, json{{"tags_in_flight", c.tags}});
    }

    // All-reduces small enough to travel with the votes (16 KiB each): the master holds
    // every contribution, folds them on its event loop and sends each peer the result.
    {
      std::vector<double> lat;
      const double cpu0 = cpu_seconds(pid);
      proto::CollectiveInit init;
      init.descriptor.count = limits::kVoteCarriedBytesMax / sizeof(float);
      init.descriptor.dtype = LOCKSTEP_F32;
      init.descriptor.op = LOCKSTEP_SUM;
      init.data.assign(limits::kVoteCarriedBytesMax, 0);
      for (int r = 0; r < c.rounds; ++r) {
        init.tag = 1'000'000 + static_cast<std::uint64_t>(r);
        for (auto& p : swarm.peers()) {
          if (!swarm.send(p, init)) return failed("carried all-reduce vote");
        }
        const auto last_vote = Clock::now();
        if (!swarm.await_each<proto::CollectiveResult>(
                [&](SimPeer&, const proto::CollectiveResult& res, Clock::time_point at) {
                  lat.push_back(ms_between(last_vote, at));
                  return res.status == LOCKSTEP_OK && res.data.size() == limits::kVoteCarriedBytesMax;
                },
                std::chrono::seconds(60))) {
          return failed("carried all-reduce result");
        }
      }
      report("collective_carried", lat, cpu_seconds(pid) - cpu0, c.rounds,
             json{{"bytes", limits::kVoteCarriedBytesMax}});
    }

    // Shared-state syncs: every peer holds the same content (the plan moves nothing).
    {
      std::vector<double> lat;
      const double cpu0 = cpu_seconds(pid);
      for (int r = 0; r < c.rounds; ++r) {
        proto::SyncVote vote;
        vote.revision = static_cast<std::uint64_t>(r) + 1;
        vote.tensors.push_back(proto::TensorEntry{.key = "weights", .dtype = LOCKSTEP_F32, .count = 1024,
                                                  .hash = state::Digest{1, 2}});
        for (auto& p : swarm.peers()) {
          if (!swarm.send(p, vote)) return failed("sync vote");
        }
        const auto last_vote = Clock::now();
        // A plan (then SyncDone) or at once the result.
        std::size_t results = 0;
        const auto deadline = Clock::now() + std::chrono::seconds(60);
        while (results < swarm.peers().size()) {
          if (Clock::now() >= deadline || !swarm.pump(std::chrono::milliseconds(5))) return failed("sync");
          for (auto& p : swarm.peers()) {
            for (auto it = p.inbox.begin(); it != p.inbox.end();) {
              if (const auto* plan = std::get_if<proto::SyncPlan>(&it->first)) {
                proto::SyncDone done;
                done.attempt = plan->attempt;
                if (!swarm.send(p, done)) return failed("sync done");
                it = p.inbox.erase(it);
              } else if (const auto* res = std::get_if<proto::SyncResult>(&it->first)) {
                if (res->status != LOCKSTEP_OK) return failed("sync result " + res->reason);
                lat.push_back(ms_between(last_vote, it->second));
                ++results;
                it = p.inbox.erase(it);
              } else {
                ++it;
              }
            }
          }
        }
      }
      report("shared_state_sync", lat, cpu_seconds(pid) - cpu0, c.rounds);
    }
    const double rss = rss_kib(pid);
    std::cout << json{{"bench", "control"},
                      {"peers", n},
                      {"kind", "memory"},
                      {"master_rss_kib", rss},
                      {"master_rss_kib_empty", rss0},
                      {"master_rss_kib_per_peer", (rss - rss0) / n}}
                     .dump()
              << std::endl;
    // Newcomers into a run that is already large: a tenth of N more peers register, and
    // one update topology of the N accepted admits them all.
    const int late = std::max(1, n / 10);
    if (!swarm.add(late) || !await_welcomes(swarm, static_cast<std::size_t>(n))) return failed("late newcomers");
    auto later = update_admitting(swarm, static_cast<std::size_t>(late));
    if (!later) return failed("admitting late newcomers");
    (*later)["bench"] = "control";
    (*later)["peers"] = n;
    (*later)["kind"] = "update_topology_late";
    std::cout << later->dump() << std::endl;
    // A join flood: N more peers connect and say Hello in one go, every other one hangs
    // up at once; the accepted ones then admit the survivors.
    {
      const std::size_t first = swarm.peers().size();
      const auto flood_start = Clock::now();
      if (!swarm.add(n)) return failed("flood");
      for (std::size_t i = first; i < swarm.peers().size(); i += 2) swarm.drop(swarm.peers()[i]);
      const double hello_ms = ms_between(flood_start, Clock::now());
      if (!await_welcomes(swarm, first)) return failed("flood welcomes");
      auto flood = update_admitting(swarm, static_cast<std::size_t>(n / 2), 3);
      if (!flood) return failed("admitting the flood's survivors");
      (*flood)["bench"] = "control";
      (*flood)["peers"] = n;
      (*flood)["kind"] = "join_flood";
      (*flood)["joining"] = n;
      (*flood)["died"] = n - n / 2;
      (*flood)["hellos_ms"] = hello_ms;
      (*flood)["master_rss_kib"] = rss_kib(pid);
      std::cout << flood->dump() << std::endl;
    }
    const auto& hb = swarm.heartbeat_ms();
    std::cout << json{{"bench", "control"},
                      {"peers", n},
                      {"kind", "heartbeat"},
                      {"acknowledged", hb.size()},
                      {"p50_ms", percentile(hb, 0.5)},
                      {"p99_ms", percentile(hb, 0.99)},
                      {"max_ms", hb.empty() ? 0.0 : *std::max_element(hb.begin(), hb.end())}}
                     .dump()
              << std::endl;
    master->kill();
    master->wait(std::chrono::seconds(10));
  }
  return 0;
}

}  // namespace lockstep::bench
