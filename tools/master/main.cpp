// lockstep-master: the run's coordinator as a standalone process. Every flag can also
// be given in a configuration file (--config FILE; flags override it), which is checked
// line by line at start: an unknown key, a value of the wrong type or out of range, or a
// file it names that cannot be read stops the master with the file, the line and the
// reason (docs/operations.md). SIGHUP re-reads the secret file and rotates the run
// secret; SIGINT and SIGTERM stop the master.
#include "common/limits.h"
#include "common/log.h"
#include "config_file.h"
#include "protocol/messages.h"
#include "security/crypto.h"
#include "transport/socket.h"

#include <lockstep/lockstep.h>
#include "master/etcd.h"
#include "master/http_server.h"
#include "master/master_server.h"

#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <pthread.h>
#include <random>
#include <sys/resource.h>
#include <string>
#include <vector>

namespace {

namespace limits = lockstep::limits;

struct Settings {
  std::string config;
  std::string listen = "0.0.0.0:48148";
  std::uint32_t heartbeat_timeout_ms = limits::kHeartbeatTimeoutMsDefault;
  std::uint32_t vote_timeout_ms = 0;
  std::uint32_t newcomer_timeout_ms = limits::kNewcomerTimeoutMsDefault;
  std::uint32_t peers_max = limits::kPeersMaxDefault;
  std::uint32_t bandwidth_test_ms = 1000;
  std::uint32_t bandwidth_streams = 4;
  std::string log_level;
  std::string http;
  std::string http_token_file;
  bool http_insecure = false;
  std::uint32_t stall_report_ms = 10'000;
  std::string secret_file;
  std::string relay_port;  // empty: no relay
  std::uint32_t secret_rotation_window_s = 600;
  std::uint32_t handshake_timeout_ms = limits::kHandshakeTimeoutMsDefault;
  std::uint32_t pending_handshakes_max = limits::kPendingHandshakesMax;
  std::uint32_t kv_keys_max = limits::kKvKeysMaxDefault;
  std::uint32_t kv_key_bytes_max = limits::kKvKeyBytesMaxDefault;
  std::uint32_t kv_value_bytes_max = limits::kKvValueBytesMaxDefault;
  std::uint32_t recovery_window_ms = limits::kRecoveryWindowMsDefault;
  std::uint32_t recovery_quorum = 0;
  std::uint32_t resume_hold_ms = 0;
  std::string ha_etcd;  // empty: no hot standby
  std::string ha_key = "/lockstep/master";
  std::uint32_t ha_lease_ttl_s = limits::kHaLeaseTtlSecondsDefault;
  std::string ha_advertise;
};

// What a key of the configuration file must hold.
enum class Kind { kInteger, kText, kBool, kNotInFile };
using Kinds = std::map<std::string, Kind>;

// Registers every flag on app, bound to s; kinds (if given) gets each long name without
// its dashes. The last occurrence of a flag wins, so that flags given after the
// configuration file's entries override them.
void add_options(CLI::App& app, Settings& s, Kinds* kinds) {
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  const auto record = [kinds](const std::string& names, Kind kind) {
    if (kinds == nullptr) return;
    std::size_t at = 0;
    while (at <= names.size()) {
      const auto comma = names.find(',', at);
      const std::string name = names.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
      if (name.rfind("--", 0) == 0) (*kinds)[name.substr(2)] = kind;
      if (comma == std::string::npos) break;
      at = comma + 1;
    }
  };
  const auto integer = [&](const std::string& names, std::uint32_t& value, const std::string& help) {
    record(names, Kind::kInteger);
    return app.add_option(names, value, help)->capture_default_str();
  };
  const auto text = [&](const std::string& names, std::string& value, const std::string& help) {
    record(names, Kind::kText);
    return app.add_option(names, value, help);
  };
  text("--config", s.config,
       "configuration file: `key = value` lines, keys named as these flags without their dashes; flags given here "
       "override it (docs/operations.md)");
  record("--config", Kind::kNotInFile);
  text("--listen", s.listen, "HOST:PORT to listen on, [IPV6]:PORT for IPv6 (\"[::]:PORT\": both families; port 0: ephemeral, printed at start)")->capture_default_str();
  integer("--heartbeat-timeout-ms", s.heartbeat_timeout_ms, "remove a peer silent for this long")
      ->check(CLI::Range(limits::kHeartbeatTimeoutMsMin, limits::kHeartbeatTimeoutMsMax));
  integer("--vote-timeout-ms", s.vote_timeout_ms,
          "remove accepted peers that do not join an open vote within this time (0: off)");
  integer("--newcomer-timeout-ms", s.newcomer_timeout_ms,
          "reject a newcomer that has not reported its p2p connections this long after an update topology began "
          "connecting it (the accepted peers' update then fails, and they go on without it)")
      ->check(CLI::Range(limits::kNewcomerTimeoutMsMin, limits::kNewcomerTimeoutMsMax));
  integer("--bandwidth-test-ms", s.bandwidth_test_ms,
          "optimize topology: length of one bandwidth test (the first third is not counted)")
      ->check(CLI::Range(50u, 60'000u));
  integer("--bandwidth-streams", s.bandwidth_streams,
          "optimize topology: connections per bandwidth test (at most the peers' pool size)")
      ->check(CLI::Range(1u, 64u));
  integer("--peers-max,--max-peers", s.peers_max, "maximum number of peers (registered and accepted)")
      ->check(CLI::Range(1u, 1u << 20));
  text("--secret-file", s.secret_file,
       "file holding the run secret (at least 16 bytes; trailing line breaks are ignored); peers must present the "
       "same secret. Without it the master admits anyone who can reach it. SIGHUP re-reads it (a rotation)")
      ->envname("LOCKSTEP_SECRET_FILE");
  text("--relay-port", s.relay_port,
       "run a relay on this port of the --listen address (0: ephemeral, printed at start): ring edges between two peers "
       "that both accept no inbound connection run through it, sealed end to end. Needs --secret-file "
       "(docs/deployment.md, \"Relays\")")
      ->check(CLI::Range(0, 65535));
  integer("--recovery-window-ms", s.recovery_window_ms,
          "failover: when peers of a lost master's run ask this master to take them back, wait this long for every "
          "peer of their last view before resuming with a quorum of them (docs/operations.md, \"Failover\")")
      ->check(CLI::Range(0u, 3'600'000u));
  integer("--recovery-quorum", s.recovery_quorum,
          "failover: peers of the last view that must be back to resume after the window (0: a strict majority, all "
          "of one or two). Lower only for a run that lost most of its peers with its master: two masters could then "
          "each resume a part of it")
      ->check(CLI::Range(0u, 1u << 20));
  integer("--resume-hold-ms", s.resume_hold_ms,
          "failover: a master that may replace a lost one (restarted on its address by a supervisor, or a standby) "
          "waits this long from its start (a standby: its election) before newcomers found a new run, so that the lost "
          "run's reconnecting peers are taken back first; 2000 covers the peers' reconnection pause (0: no wait)")
      ->check(CLI::Range(0u, lockstep::limits::kResumeHoldMsMax));
  text("--ha-etcd", s.ha_etcd,
       "hot standby: etcd endpoints (http://HOST:PORT, comma-separated). Every master of the run given the same etcd "
       "and --ha-key competes for one lease; the holder serves, the others refuse peers until it is lost "
       "(docs/operations.md, \"Hot standby\")");
  text("--ha-key", s.ha_key, "hot standby: the etcd key the run's masters compete for (one per run)")
      ->capture_default_str();
  integer("--ha-lease-ttl-s", s.ha_lease_ttl_s,
          "hot standby: the lease's time to live; a crashed master is replaced about this long after it died")
      ->check(CLI::Range(limits::kHaLeaseTtlSecondsMin, limits::kHaLeaseTtlSecondsMax));
  text("--ha-advertise", s.ha_advertise,
       "hot standby: HOST:PORT peers reach this master at, as the others name it (default: the --listen address, or "
       "this host's name where it listens on every address)");
  integer("--secret-rotation-window-s", s.secret_rotation_window_s,
          "after SIGHUP rotates the secret, new handshakes may still prove the previous one for this long")
      ->check(CLI::Range(1u, 86'400u));
  integer("--handshake-timeout-ms", s.handshake_timeout_ms,
          "drop a connection that has not finished its handshake (Hello, and the secret's proof) by then")
      ->check(CLI::Range(100u, 600'000u));
  integer("--max-pending-handshakes", s.pending_handshakes_max,
          "connections that may be in their handshake at once; a new one beyond that displaces the oldest of the "
          "address holding the most")
      ->check(CLI::Range(1u, 1u << 20));
  integer("--kv-keys-max", s.kv_keys_max, "keys the key-value store holds at most (a set of a new key beyond: "
          "LIMIT_EXCEEDED)")
      ->check(CLI::Range(1u, limits::kKvKeysMaxLimit));
  integer("--kv-key-bytes-max", s.kv_key_bytes_max, "bytes of one key-value store key at most")
      ->check(CLI::Range(1u, limits::kKvKeyBytesMaxLimit));
  integer("--kv-value-bytes-max", s.kv_value_bytes_max, "bytes of one key-value store value at most")
      ->check(CLI::Range(0u, limits::kKvValueBytesMaxLimit));
  text("--http", s.http,
       "HOST:PORT for the status page (/), /api/state and /metrics (port 0: ephemeral, printed at start); off unless "
       "given. A non-loopback address needs --http-token-file (or --http-insecure)");
  text("--http-token-file", s.http_token_file,
       "file holding the HTTP access token (16..4096 visible ASCII characters): every request must carry "
       "`Authorization: Bearer TOKEN` (browsers: any user name, the token as password), else 401");
  record("--http-insecure", Kind::kBool);
  app.add_flag("--http-insecure", s.http_insecure,
               "serve --http on a non-loopback address without a token (anyone who can reach it sees the run)");
  integer("--stall-report-ms", s.stall_report_ms,
          "report a vote or operation that waits this long for some peers, naming them (0: never)");
  text("--log-level", s.log_level, "error, warn, info, debug or trace (default: $LOCKSTEP_LOG_LEVEL or info)")
      ->check(CLI::IsMember({"error", "warn", "info", "debug", "trace"}));
}

bool is_unsigned_integer(const std::string& text) {
  if (text.empty() || text.size() > 10) return false;
  for (const char c : text) {
    if (c < '0' || c > '9') return false;
  }
  return true;
}

// CLI11's messages start with the flag ("--x: Value 5 not in range ..."); the file's
// errors name the key themselves.
std::string without_flag_prefix(const std::string& message, const std::string& key) {
  const std::string prefix = "--" + key + ": ";
  return message.rfind(prefix, 0) == 0 ? message.substr(prefix.size()) : message;
}

// The files a configuration file names are found relative to its own directory.
bool key_is_path(const std::string& key) { return key.size() > 5 && key.substr(key.size() - 5) == "-file"; }
std::string relative_to(const std::string& config_path, const std::string& path) {
  const std::filesystem::path p(path);
  if (p.is_absolute()) return path;
  return (std::filesystem::path(config_path).parent_path() / p).string();
}

// Where a setting came from, for its error messages: the file and line, or the flag.
class Origins {
 public:
  void from_file(const std::string& key, const std::string& path, int line) {
    where_[key] = path + ":" + std::to_string(line) + ": " + key;
  }
  std::string operator()(const std::string& key) const {
    const auto it = where_.find(key);
    return it != where_.end() ? it->second : "--" + key;
  }

 private:
  std::map<std::string, std::string> where_;
};

// Reads the configuration file into `settings` under the flags of the command line.
// Returns the error to print, or nothing.
std::optional<std::string> apply_config_file(int argc, char** argv, const CLI::App& cli, const Kinds& kinds,
                                             Settings& settings, Origins& origins) {
  const auto file = lockstep::tools::read_config_file(settings.config);
  if (!file.error.empty()) return file.error;
  std::vector<std::string> merged{argv[0]};
  for (const auto& entry : file.entries) {
    const std::string at = file.path + ":" + std::to_string(entry.line) + ": ";
    const auto kind = kinds.find(entry.key);
    if (kind == kinds.end()) {
      std::string known;
      for (const auto& [key, k] : kinds) {
        if (k != Kind::kNotInFile) known += (known.empty() ? "" : ", ") + key;
      }
      return at + "unknown key '" + entry.key + "' (the keys: " + known + ")";
    }
    switch (kind->second) {
      case Kind::kNotInFile: return at + "'" + entry.key + "' cannot be given in a configuration file";
      case Kind::kInteger:
        if (entry.quoted || !is_unsigned_integer(entry.value)) {
          return at + entry.key + ": wrong type: expected a non-negative integer, got " +
                 (entry.quoted ? "the string \"" + entry.value + "\"" : "'" + entry.value + "'");
        }
        break;
      case Kind::kBool:
        if (entry.quoted || (entry.value != "true" && entry.value != "false")) {
          return at + entry.key + ": wrong type: expected true or false, got " +
                 (entry.quoted ? "the string \"" + entry.value + "\"" : "'" + entry.value + "'");
        }
        break;
      case Kind::kText: break;
    }
    // The value alone through the flag's own checks (ranges, allowed words).
    Settings scratch;
    CLI::App check;
    add_options(check, scratch, nullptr);
    const std::string arg = "--" + entry.key + "=" + entry.value;
    const char* args[] = {argv[0], arg.c_str()};
    try {
      check.parse(2, args);
    } catch (const CLI::ParseError& e) {
      const std::string why = without_flag_prefix(e.what(), entry.key);
      return at + entry.key + ": " + (why.find("not in range") != std::string::npos ? "out of range: " : "") + why;
    }
    merged.push_back(key_is_path(entry.key) ? "--" + entry.key + "=" + relative_to(file.path, entry.value) : arg);
    if (cli.get_option("--" + entry.key)->count() == 0) origins.from_file(entry.key, file.path, entry.line);
  }
  // The file's entries first, then the command line: the last occurrence wins.
  for (int i = 1; i < argc; ++i) merged.emplace_back(argv[i]);
  std::vector<const char*> args;
  for (const auto& a : merged) args.push_back(a.c_str());
  Settings combined;
  CLI::App app;
  add_options(app, combined, nullptr);
  try {
    app.parse(static_cast<int>(args.size()), args.data());
  } catch (const CLI::ParseError& e) {
    return file.path + ": " + e.what();
  }
  settings = combined;
  // Aliases: a key the file gave under another name of the same flag.
  for (const auto& entry : file.entries) {
    const auto* option = app.get_option("--" + entry.key);
    for (const auto& name : option->get_lnames()) {
      if (name != entry.key && cli.get_option("--" + name)->count() == 0) origins.from_file(name, file.path, entry.line);
    }
  }
  return std::nullopt;
}

int fail(const std::string& message) {
  std::fprintf(stderr, "lockstep-master: %s\n", message.c_str());
  return 2;
}

// SIGHUP: the secret file is read again and becomes the run secret; the previous one
// stays valid for new handshakes during the window.
void rotate_secret(lockstep::master::MasterServer& server, const Settings& settings) {
  if (settings.secret_file.empty()) {
    LOG_WARN("master", "SIGHUP: no --secret-file to read again; nothing changes");
    return;
  }
  auto key = lockstep::security::load_secret_file(settings.secret_file);
  if (!key.is_ok()) {
    LOG_ERROR("master", "SIGHUP: " << key.status().message() << "; the current secret stays");
    return;
  }
  const lockstep::Status rotated =
      server.rotate_secret(key.value(), settings.secret_rotation_window_s * 1000u, limits::kHttpRenderTimeoutMs);
  if (!rotated.is_ok()) LOG_ERROR("master", "SIGHUP: " << rotated.message());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lockstep-master: coordinates a lockstep run (membership, votes, ring order)"};
  app.set_version_flag("--version", "lockstep-master " + std::to_string(LOCKSTEP_VERSION_MAJOR) + "." +
                                        std::to_string(LOCKSTEP_VERSION_MINOR) + "." +
                                        std::to_string(LOCKSTEP_VERSION_PATCH) + " (protocol " +
                                        std::to_string(lockstep::proto::kProtocolVersion) + ")");
  Settings settings;
  Kinds kinds;
  add_options(app, settings, &kinds);
  CLI11_PARSE(app, argc, argv);
  Origins origin;
  if (!settings.config.empty()) {
    if (auto error = apply_config_file(argc, argv, app, kinds, settings, origin)) return fail(*error);
  }

  if (!settings.log_level.empty()) {
    lockstep::log::Level level{};
    lockstep::log::parse_level(settings.log_level, &level);
    lockstep::log::set_level(level);
  }
  // One connection per peer: --peers-max can exceed the default limit of open files
  // (1024 soft on most systems). The soft limit goes up to the hard one, and says so.
  if (rlimit files{}; ::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    const rlim_t before = files.rlim_cur;
    files.rlim_cur = files.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &files) == 0) {
      LOG_INFO("master", "open-files limit raised from " << before << " to " << files.rlim_cur);
    }
  }
  if (rlimit files{}; ::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < settings.peers_max + 64ull) {
    LOG_WARN("master", "the open-files limit (" << files.rlim_cur << ") is below --peers-max (" << settings.peers_max
                                                << ") plus room for the master's own files: connections beyond it "
                                                   "cannot be accepted; raise it (ulimit -n) or lower --peers-max");
  }
  const auto listen = lockstep::transport::split_host_port(settings.listen);
  if (!listen) return fail(origin("listen") + ": must be HOST:PORT or [IPV6]:PORT with a port in 0..65535, got '" + settings.listen + "'");
  lockstep::master::Options options;
  options.listen_host = listen->first;
  options.listen_port = listen->second;
  options.coordinator.heartbeat_timeout_ms = settings.heartbeat_timeout_ms;
  options.coordinator.vote_timeout_ms = settings.vote_timeout_ms;
  options.coordinator.newcomer_timeout_ms = settings.newcomer_timeout_ms;
  options.coordinator.peers_max = settings.peers_max;
  options.coordinator.bandwidth_test_ms = settings.bandwidth_test_ms;
  options.coordinator.bandwidth_streams_max = settings.bandwidth_streams;
  options.coordinator.handshake_timeout_ms = settings.handshake_timeout_ms;
  options.coordinator.pending_handshakes_max = settings.pending_handshakes_max;
  options.coordinator.kv = lockstep::coord::KvConfig{settings.kv_keys_max, settings.kv_key_bytes_max, settings.kv_value_bytes_max};
  options.coordinator.recovery_window_ms = settings.recovery_window_ms;
  options.coordinator.recovery_quorum = settings.recovery_quorum;
  options.coordinator.resume_hold_ms = settings.resume_hold_ms;
  options.stall_report_ms = settings.stall_report_ms;

  std::optional<std::pair<std::string, std::uint16_t>> http_address;
  lockstep::master::HttpOptions http_options;
  if (!settings.http.empty()) {
    http_address = lockstep::transport::split_host_port(settings.http);
    if (!http_address) return fail(origin("http") + ": must be HOST:PORT or [IPV6]:PORT with a port in 0..65535, got '" + settings.http + "'");
  }
  if (!settings.http_token_file.empty()) {
    if (!http_address) return fail(origin("http-token-file") + ": given without --http (there is no endpoint to protect)");
    auto token = lockstep::security::load_token_file(settings.http_token_file);
    if (!token.is_ok()) return fail(origin("http-token-file") + ": " + token.status().message());
    http_options.token = token.value();
  }
  if (settings.http_insecure && !http_address) return fail(origin("http-insecure") + ": given without --http");
  if (http_address && http_options.token.empty() && !lockstep::master::is_loopback_host(http_address->first)) {
    if (!settings.http_insecure) {
      return fail(origin("http") + ": " + http_address->first +
                  " is not a loopback address and no access token is set: give --http-token-file (or --http-insecure "
                  "to let anyone who can reach it see the run)");
    }
    http_options.insecure = true;
  }
  if (!settings.secret_file.empty()) {
    auto key = lockstep::security::load_secret_file(settings.secret_file);
    if (!key.is_ok()) return fail(origin("secret-file") + ": " + key.status().message());
    options.secret = key.value();
  }
  if (!settings.relay_port.empty()) {
    if (settings.secret_file.empty()) {
      return fail(origin("relay-port") + ": a relay needs --secret-file (the frames of a relayed edge are sealed end "
                                         "to end with the keys of its two peers)");
    }
    options.relay_port = static_cast<std::uint16_t>(std::stoul(settings.relay_port));
  }
  if (!settings.ha_etcd.empty()) {
    lockstep::master::EtcdOptions etcd{lockstep::master::split_endpoints(settings.ha_etcd), settings.ha_key,
                                       settings.ha_lease_ttl_s};
    if (auto checked = lockstep::master::check_etcd_options(etcd); !checked.is_ok()) {
      return fail(origin("ha-etcd") + ": " + checked.message());
    }
    if (!settings.ha_advertise.empty() && (!lockstep::transport::split_host_port(settings.ha_advertise) ||
                                           settings.ha_advertise.size() > limits::kHaAdvertiseBytesMax)) {
      return fail(origin("ha-advertise") + ": must be HOST:PORT or [IPV6]:PORT of at most " +
                  std::to_string(limits::kHaAdvertiseBytesMax) + " bytes, got '" + settings.ha_advertise + "'");
    }
    options.election = lockstep::master::make_etcd_election(std::move(etcd));
    options.advertise = settings.ha_advertise;
  } else if (!settings.ha_advertise.empty()) {
    return fail(origin("ha-advertise") + ": given without --ha-etcd");
  }
  std::random_device random;
  options.coordinator.instance_nonce = (static_cast<std::uint64_t>(random()) << 32) | random();

  // Signals are taken synchronously by this thread; the server's thread never sees them.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  lockstep::master::MasterServer server(options);
  lockstep::Status started = server.start();
  if (!started.is_ok()) {
    std::fprintf(stderr, "lockstep-master: %s\n", started.to_string().c_str());
    return 1;
  }
  std::printf("lockstep-master listening on %s\n", lockstep::transport::join_host_port(options.listen_host, server.port()).c_str());
  if (server.relay_port() != 0) {
    std::printf("lockstep-master relay listening on %s\n",
                lockstep::transport::join_host_port(options.listen_host, server.relay_port()).c_str());
  }
  std::fflush(stdout);
  // Declared after the master: destroyed (stopped) first, as it must be.
  std::optional<lockstep::master::HttpServer> http_server;
  if (http_address) {
    const bool with_token = !http_options.token.empty();
    http_server.emplace(server, std::move(http_options));
    lockstep::Status serving = http_server->start(http_address->first, http_address->second);
    if (!serving.is_ok()) {
      std::fprintf(stderr, "lockstep-master: %s\n", serving.to_string().c_str());
      server.interrupt();
      server.wait();
      return 1;
    }
    std::printf("lockstep-master http listening on %s\n",
                lockstep::transport::join_host_port(http_address->first, http_server->port()).c_str());
    std::fflush(stdout);
    LOG_INFO("master", "http listening on " << lockstep::transport::join_host_port(http_address->first, http_server->port())
                                            << (with_token ? " (access token required)" : " (no access token)"));
  }
  int received = 0;
  for (;;) {
    sigwait(&signals, &received);
    if (received != SIGHUP) break;
    rotate_secret(server, settings);
  }
  LOG_INFO("master", "signal " << received << " received, shutting down");
  if (http_server) http_server->stop();
  server.interrupt();
  server.wait();
  return 0;
}
