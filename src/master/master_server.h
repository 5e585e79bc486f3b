// The master's IO shell: an Asio event loop on one thread that accepts connections,
// reads length-prefixed frames with the bounds of the codec, feeds decoded messages
// and the clock to the Coordinator and carries out the commands it returns. It makes
// no decisions of its own.
#pragma once

#include "common/status.h"
#include "coordinator/coordinator.h"
#include "master/election.h"
#include "security/crypto.h"

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <thread>

namespace lockstep::master {

struct Options {
  std::string listen_host = "0.0.0.0";
  std::uint16_t listen_port = LOCKSTEP_DEFAULT_MASTER_PORT;
  coord::Config coordinator;
  // How often the coordinator sees the clock (heartbeat and vote deadlines).
  std::uint32_t tick_ms = 20;
  // A vote or operation that has waited this long for some peers is reported once as a
  // stall, naming them (docs/observability.md); 0: never.
  std::uint32_t stall_report_ms = 10'000;
  // The run secret's key (security::load_secret_file). With it, every connection must
  // prove the secret before its Hello reaches the coordinator, control frames are
  // sealed, and peers get pair keys for their p2p connections (docs/security.md).
  // Without it the master admits anyone who can reach it, and says so at start.
  std::optional<security::Key> secret;
  // Runs the relay (master/relay.h) on this port (0: an ephemeral one) of listen_host:
  // ring edges between two peers that both accept no inbound connection run through it.
  // Needs `secret`. Sets coordinator.relay.
  std::optional<std::uint16_t> relay_port;
  // How long a relay connection waits for the other end of its edge.
  std::uint32_t relay_match_timeout_ms = 30'000;
  // The hot standby (docs/operations.md, "Hot standby"): with an election, this master
  // serves only while it holds the run's lease, with the term the election gives it, and
  // stops serving (every peer told so) when the lease is lost or about to end unrenewed.
  // Until then it is a standby: it refuses every peer and relay with NOT_SERVING, naming
  // the master that serves. Without one, it serves from the start.
  std::shared_ptr<Election> election;
  // The address the election names this master by; empty: the listen address and port
  // (the host's name where it listens on every address).
  std::string advertise;
};

// What render() produces (docs/observability.md).
enum class View { kStateJson, kMetricsText };

class MasterServer {
 public:
  explicit MasterServer(Options options);
  ~MasterServer();
  MasterServer(const MasterServer&) = delete;
  MasterServer& operator=(const MasterServer&) = delete;

  // Binds and listens, then serves on a background thread.
  Status start();
  std::uint16_t port() const { return port_.load(); }
  // The relay's port once started; 0 without a relay.
  std::uint16_t relay_port() const { return relay_port_.load(); }
  // Thread-safe; returns at once.
  void interrupt();
  // Blocks until the loop has stopped and the thread is joined.
  void wait();
  bool running() const { return running_.load(); }
  // Thread-safe: the picture of the run, rendered on the loop thread (the coordinator
  // is only ever touched there). Waits at most timeout_ms for the loop to answer;
  // MASTER_CONNECTION_LOST if the master is not running or did not answer in time.
  Result<std::string> render(View view, std::uint32_t timeout_ms) const;
  // Thread-safe: the operator evicts a peer, named as the status page names it
  // ("p3-5c1e0a") or by its 32 hex digits. The coordinator removes it as a kicked peer
  // (Coordinator::on_evict). Returns the peer's name; INVALID_ARGUMENT if no registered
  // or accepted peer has that name, MASTER_CONNECTION_LOST as render() does.
  Result<std::string> evict(const std::string& peer, const std::string& reason, std::uint32_t timeout_ms);
  // Thread-safe: new handshakes must prove `secret`; for window_ms more they may still
  // prove the secret this master had until now (docs/operations.md). Peers already in
  // the run are not affected. INVALID_USAGE if the master runs without a secret (a run
  // cannot gain one), MASTER_CONNECTION_LOST as render() does.
  Status rotate_secret(const security::Key& secret, std::uint32_t window_ms, std::uint32_t timeout_ms);

 private:
  class Impl;
  bool secret_ = false;
  std::string listen_host_;
  std::string advertise_;
  std::unique_ptr<Impl> impl_;
  std::thread thread_;
  std::atomic<std::uint16_t> port_{0};
  std::atomic<std::uint16_t> relay_port_{0};
  std::atomic<bool> running_{false};
};

}  // namespace lockstep::master
