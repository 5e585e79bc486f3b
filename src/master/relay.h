// The master's relay (lockstep-master --relay-port): a ring edge between two peers that
// both accept no inbound connection runs through it (docs/deployment.md, "Relays").
// Each end connects and sends a P2PHello on channel kRelay naming the other end and the
// pool slot (flag reversed: the receiving end); the relay proves and checks the pair
// key of the two as an acceptor does (a relay needs the run secret), holds the
// connection until the other end arrives, answers both with P2PHelloAck, and from then
// on only copies bytes both ways. The two ends then run their own p2p handshake through
// it and seal every frame with their session keys, so the relay forwards what it can
// neither read after the fact nor alter unnoticed.
//
// Bounds: the relay forwards only for the pairs the master assigns (two peers of one
// group's ring that both accept no inbound connection; assign()), drops a connection
// whose hello does not arrive within the handshake timeout or whose other end does not
// arrive within the match timeout, keeps at most connections_max connections (the oldest
// that has proven no key makes room for a new one), copies
// through one fixed buffer per direction, and drops a pair whose reader has not taken
// a buffer within the stall timeout. It runs on its own thread: its bytes never hold
// up the master's event loop.
#pragma once

#include "common/ids.h"
#include "common/status.h"
#include "security/crypto.h"

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>

namespace lockstep::master {

struct RelayOptions {
  std::string listen_host = "0.0.0.0";
  std::uint16_t port = 0;  // 0: an ephemeral port
  security::Key run_key{};  // the root of the pair keys (the master's)
  std::uint32_t handshake_timeout_ms = 5'000;
  std::uint32_t match_timeout_ms = 30'000;
  std::uint32_t stall_timeout_ms = 30'000;
  std::size_t buffer_bytes = 256 * 1024;
  std::size_t connections_max = 4096;
};

struct RelayStats {
  std::uint64_t bytes = 0;      // forwarded, both directions
  std::uint64_t pairs = 0;      // pairs joined since the start
  std::uint64_t refused = 0;    // connections refused or dropped before they were joined
  std::uint32_t active = 0;     // joined pairs now
  std::uint32_t waiting = 0;    // connections waiting for their other end now
};

// The stats as Prometheus text (lockstep_relay_*), for the master's /metrics.
std::string relay_metrics(const RelayStats& stats);

class Relay {
 public:
  explicit Relay(RelayOptions options);
  ~Relay();
  Relay(const Relay&) = delete;
  Relay& operator=(const Relay&) = delete;

  // Binds and serves on a background thread.
  Status start();
  std::uint16_t port() const { return port_; }
  void stop();
  // Thread-safe: the peers it may connect now (Coordinator::relay_members: two of the
  // same group). Waiting and joined connections of others are closed.
  void assign(std::map<PeerId, std::uint32_t> members);
  RelayStats stats() const;

 private:
  class Impl;
  std::shared_ptr<Impl> impl_;
  std::thread thread_;
  std::uint16_t port_ = 0;
};

}  // namespace lockstep::master
