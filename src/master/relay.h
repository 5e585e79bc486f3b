// A relay: a ring edge (or a shared-state connection) between two peers that both accept
// no inbound connection runs through it (docs/deployment.md, "Relays"). The master runs
// one with --relay-port; lockstep-relay runs one as a process of its own, on any host both
// ends can reach. Each end connects and sends a P2PHello on channel kRelay naming the
// other end and the pool slot (flag reversed: the receiving end); the relay proves and
// checks the key of the pair that the master assigned (security::relay_key of their pair
// key, which the relay cannot turn back into the pair key), holds the connection until
// the other end arrives, answers both with P2PHelloAck, and from then on only copies
// bytes both ways. The two ends then run their own p2p handshake through it and seal
// every frame with their session keys, so the relay forwards what it can neither read
// nor alter unnoticed.
//
// Bounds: the relay forwards only for the pairs the master assigns (two peers of one
// group's ring that both accept no inbound connection; assign(); a hello for a pair not
// assigned yet waits at most the assignment wait for it), drops a connection
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
#include <utility>

namespace lockstep::master {

struct RelayOptions {
  std::string listen_host = "0.0.0.0";
  std::uint16_t port = 0;  // 0: an ephemeral port
  std::uint32_t handshake_timeout_ms = 5'000;
  std::uint32_t match_timeout_ms = 30'000;
  // How long a hello for a pair the relay was not given waits for the master to give it:
  // the master's assignment and its EstablishP2P to the peers travel on different
  // connections, and a peer may dial before the relay has heard of its pair.
  std::uint32_t assignment_wait_ms = 2'000;
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

// The pairs a relay may join, by (smaller id, larger id), each with the key both ends
// prove to it (security::relay_key of their pair key).
using RelayPairs = std::map<std::pair<PeerId, PeerId>, security::Key>;
inline std::pair<PeerId, PeerId> relay_pair(PeerId a, PeerId b) { return a < b ? std::pair{a, b} : std::pair{b, a}; }
// Every pair of `members` (peer -> group) in one group, keyed from `run_key`: what the
// master assigns (Coordinator::relay_members), at most limits::kRelayPairsMax.
RelayPairs relay_pairs(const std::map<PeerId, std::uint32_t>& members, const security::Key& run_key);

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
  // Thread-safe: the pairs it may join now. Waiting and joined connections of others
  // are closed.
  void assign(RelayPairs pairs);
  RelayStats stats() const;

 private:
  class Impl;
  std::shared_ptr<Impl> impl_;
  std::thread thread_;
  std::uint16_t port_ = 0;
};

}  // namespace lockstep::master
