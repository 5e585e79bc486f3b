// lockstep-master: the run's coordinator as a standalone process.
#include "common/log.h"
#include "protocol/messages.h"

#include <lockstep/lockstep.h>
#include "master/http_server.h"
#include "master/master_server.h"

#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdio>
#include <optional>
#include <pthread.h>
#include <random>
#include <string>

namespace {

// "HOST:PORT" with a port in 0..65535; nullopt if malformed.
std::optional<std::pair<std::string, std::uint16_t>> split_host_port(const std::string& text) {
  const auto colon = text.rfind(':');
  if (colon == std::string::npos) return std::nullopt;
  int port = -1;
  try {
    std::size_t used = 0;
    port = std::stoi(text.substr(colon + 1), &used);
    if (used != text.size() - colon - 1) port = -1;
  } catch (const std::exception&) {
  }
  if (port < 0 || port > 65535) return std::nullopt;
  return std::make_pair(text.substr(0, colon), static_cast<std::uint16_t>(port));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lockstep-master: coordinates a lockstep run (membership, votes, ring order)"};
  app.set_version_flag("--version", "lockstep-master " + std::to_string(LOCKSTEP_VERSION_MAJOR) + "." +
                                        std::to_string(LOCKSTEP_VERSION_MINOR) + "." +
                                        std::to_string(LOCKSTEP_VERSION_PATCH) + " (protocol " +
                                        std::to_string(lockstep::proto::kProtocolVersion) + ")");
  std::string listen = "0.0.0.0:48148";
  std::uint32_t heartbeat_timeout_ms = lockstep::limits::kHeartbeatTimeoutMsDefault;
  std::uint32_t vote_timeout_ms = 0;
  std::uint32_t peers_max = lockstep::limits::kPeersMaxDefault;
  std::uint32_t bandwidth_test_ms = 1000;
  std::uint32_t bandwidth_streams = 4;
  std::string log_level;
  std::string http;
  std::uint32_t stall_report_ms = 10'000;
  std::string secret_file;
  std::uint32_t handshake_timeout_ms = lockstep::limits::kHandshakeTimeoutMsDefault;
  std::uint32_t pending_handshakes_max = lockstep::limits::kPendingHandshakesMax;
  app.add_option("--listen", listen, "HOST:PORT to listen on (port 0: ephemeral, printed at start)")
      ->capture_default_str();
  app.add_option("--heartbeat-timeout-ms", heartbeat_timeout_ms, "remove a peer silent for this long")
      ->check(CLI::Range(lockstep::limits::kHeartbeatTimeoutMsMin, lockstep::limits::kHeartbeatTimeoutMsMax))
      ->capture_default_str();
  app.add_option("--vote-timeout-ms", vote_timeout_ms,
                 "remove accepted peers that do not join an open vote within this time (0: off)")
      ->capture_default_str();
  app.add_option("--bandwidth-test-ms", bandwidth_test_ms,
                 "optimize topology: length of one bandwidth test (the first third is not counted)")
      ->check(CLI::Range(50u, 60'000u))
      ->capture_default_str();
  app.add_option("--bandwidth-streams", bandwidth_streams,
                 "optimize topology: connections per bandwidth test (at most the peers' pool size)")
      ->check(CLI::Range(1u, 64u))
      ->capture_default_str();
  app.add_option("--peers-max,--max-peers", peers_max, "maximum number of peers (registered and accepted)")
      ->check(CLI::Range(1u, 1u << 20))
      ->capture_default_str();
  app.add_option("--secret-file", secret_file,
                 "file holding the run secret (at least 16 bytes; trailing line breaks are ignored); peers must "
                 "present the same secret. Without it the master admits anyone who can reach it")
      ->envname("LOCKSTEP_SECRET_FILE");
  app.add_option("--handshake-timeout-ms", handshake_timeout_ms,
                 "drop a connection that has not finished its handshake (Hello, and the secret's proof) by then")
      ->check(CLI::Range(100u, 600'000u))
      ->capture_default_str();
  app.add_option("--max-pending-handshakes", pending_handshakes_max,
                 "connections that may be in their handshake at once; a new one beyond that displaces the oldest of the address holding the most")
      ->check(CLI::Range(1u, 1u << 20))
      ->capture_default_str();
  app.add_option("--http", http,
                 "HOST:PORT for the status page (/), /api/state and /metrics (port 0: ephemeral, printed at "
                 "start); off unless given");
  app.add_option("--stall-report-ms", stall_report_ms,
                 "report a vote or operation that waits this long for some peers, naming them (0: never)")
      ->capture_default_str();
  app.add_option("--log-level", log_level, "error, warn, info, debug or trace (default: $LOCKSTEP_LOG_LEVEL or info)")
      ->check(CLI::IsMember({"error", "warn", "info", "debug", "trace"}));
  CLI11_PARSE(app, argc, argv);

  if (!log_level.empty()) {
    lockstep::log::Level level{};
    lockstep::log::parse_level(log_level, &level);
    lockstep::log::set_level(level);
  }
  const auto colon = listen.rfind(':');
  if (colon == std::string::npos) {
    std::fprintf(stderr, "lockstep-master: --listen must be HOST:PORT\n");
    return 2;
  }
  lockstep::master::Options options;
  options.listen_host = listen.substr(0, colon);
  int port = -1;
  try {
    port = std::stoi(listen.substr(colon + 1));
  } catch (const std::exception&) {
  }
  if (port < 0 || port > 65535) {
    std::fprintf(stderr, "lockstep-master: bad port in --listen '%s'\n", listen.c_str());
    return 2;
  }
  options.listen_port = static_cast<std::uint16_t>(port);
  options.coordinator.heartbeat_timeout_ms = heartbeat_timeout_ms;
  options.coordinator.vote_timeout_ms = vote_timeout_ms;
  options.coordinator.peers_max = peers_max;
  options.coordinator.bandwidth_test_ms = bandwidth_test_ms;
  options.coordinator.bandwidth_streams_max = bandwidth_streams;
  options.stall_report_ms = stall_report_ms;
  std::optional<std::pair<std::string, std::uint16_t>> http_address;
  if (!http.empty()) {
    http_address = split_host_port(http);
    if (!http_address) {
      std::fprintf(stderr, "lockstep-master: --http must be HOST:PORT, got '%s'\n", http.c_str());
      return 2;
    }
  }
  options.coordinator.handshake_timeout_ms = handshake_timeout_ms;
  options.coordinator.pending_handshakes_max = pending_handshakes_max;
  if (!secret_file.empty()) {
    auto key = lockstep::security::load_secret_file(secret_file);
    if (!key.is_ok()) {
      std::fprintf(stderr, "lockstep-master: %s\n", key.status().to_string().c_str());
      return 2;
    }
    options.secret = key.value();
  }
  std::random_device random;
  options.coordinator.instance_nonce = (static_cast<std::uint64_t>(random()) << 32) | random();

  // Signals are taken synchronously by this thread; the server's thread never sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  lockstep::master::MasterServer server(options);
  lockstep::Status started = server.start();
  if (!started.is_ok()) {
    std::fprintf(stderr, "lockstep-master: %s\n", started.to_string().c_str());
    return 1;
  }
  std::printf("lockstep-master listening on %s:%u\n", options.listen_host.c_str(), server.port());
  std::fflush(stdout);
  // Declared after the master: destroyed (stopped) first, as it must be.
  std::optional<lockstep::master::HttpServer> http_server;
  if (http_address) {
    http_server.emplace(server);
    lockstep::Status serving = http_server->start(http_address->first, http_address->second);
    if (!serving.is_ok()) {
      std::fprintf(stderr, "lockstep-master: %s\n", serving.to_string().c_str());
      server.interrupt();
      server.wait();
      return 1;
    }
    std::printf("lockstep-master http listening on %s:%u\n", http_address->first.c_str(), http_server->port());
    std::fflush(stdout);
    LOG_INFO("master", "http listening on " << http_address->first << ":" << http_server->port());
  }
  int received = 0;
  sigwait(&signals, &received);
  LOG_INFO("master", "signal " << received << " received, shutting down");
  if (http_server) http_server->stop();
  server.interrupt();
  server.wait();
  return 0;
}
