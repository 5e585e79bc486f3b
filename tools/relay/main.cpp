// lockstep-relay: a relay of its own, on any host that the run's peers can reach
// (docs/deployment.md, "Relays"). It registers with the master (which must have a run
// secret: the relay proves it as a peer does), receives the pairs of peers it may join
// (RelayAssign: each with the relay key of the pair, never the pair key) and forwards
// their sealed bytes. It heartbeats to the master and, when the master connection is
// lost, forgets every pair, closes their connections and registers again with backoff.
// A master that refuses it (no secret, or another one) ends it with status 1. SIGINT and
// SIGTERM stop it. The first line on stdout says where it listens; a line follows each
// registration with the master.
#include "common/log.h"
#include "master/relay.h"
#include "peer/handshake.h"
#include "protocol/messages.h"
#include "security/crypto.h"
#include "transport/framed.h"
#include "transport/socket.h"

#include <lockstep/lockstep.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <thread>
#include <unistd.h>

namespace {

namespace proto = lockstep::proto;
namespace security = lockstep::security;
namespace transport = lockstep::transport;
using lockstep::Status;
constexpr const char* kLog = "relay";

struct Settings {
  std::string master;
  std::string listen = "0.0.0.0:0";
  std::string advertise;
  std::string secret_file;
  std::string log_level;
};

// Serves one registration with the master until the connection ends or `stop_fd` is
// readable; returns why it ended.
Status serve(const Settings& settings, const std::pair<std::string, std::uint16_t>& master, const security::Key& secret,
             std::uint16_t port, lockstep::master::Relay& relay, int stop_fd) {
  constexpr std::uint32_t kTimeoutMs = 10'000;
  auto fd = transport::connect_tcp(master.first, master.second, kTimeoutMs, stop_fd);
  if (!fd.is_ok()) return fd.status();
  proto::RelayHello hello;
  hello.port = port;
  hello.advertised_host = settings.advertise;
  auto channel = lockstep::peer::master_handshake(fd.value().get(), hello, secret, settings.master, kTimeoutMs);
  if (!channel.is_ok()) return channel.status();
  if (const auto* bye = std::get_if<proto::Goodbye>(&channel.value().reply)) {
    return Status(bye->status, "master: " + bye->reason);
  }
  const auto* welcome = std::get_if<proto::Welcome>(&channel.value().reply);
  if (welcome == nullptr) return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "the master answered with something else");
  security::FrameCrypto& crypto = *channel.value().crypto;
  LOG_INFO(kLog, "registered with the master at " << settings.master << " (it sees this relay as "
                                                  << welcome->observed_host << ")");
  std::printf("lockstep-relay registered with %s\n", settings.master.c_str());
  std::fflush(stdout);
  using Clock = std::chrono::steady_clock;
  const auto timeout = std::chrono::milliseconds(std::max<std::uint32_t>(welcome->heartbeat_timeout_ms, 100));
  const auto interval = timeout / 4;
  auto last_rx = Clock::now();
  auto next_heartbeat = Clock::now();
  for (;;) {
    const auto now = Clock::now();
    if (now - last_rx > timeout) return Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "the master went silent");
    if (now >= next_heartbeat) {
      if (Status s = transport::send_message(fd.value().get(), proto::Heartbeat{}, kTimeoutMs, &crypto, stop_fd);
          !s.is_ok()) {
        return s;
      }
      next_heartbeat = now + interval;
    }
    pollfd fds[2] = {{fd.value().get(), POLLIN, 0}, {stop_fd, POLLIN, 0}};
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_heartbeat - Clock::now()).count();
    if (::poll(fds, 2, static_cast<int>(std::max<long long>(wait, 1))) < 0 && errno != EINTR) {
      return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "poll failed");
    }
    if (fds[1].revents != 0) return Status(LOCKSTEP_STATUS_INTERRUPTED, "stopping");
    if (fds[0].revents == 0) continue;
    auto message = transport::recv_message(fd.value().get(), kTimeoutMs, &crypto, stop_fd);
    if (!message.is_ok()) return message.status();
    last_rx = Clock::now();
    if (const auto* bye = std::get_if<proto::Goodbye>(&message.value())) {
      return Status(bye->status, "master: " + bye->reason);
    }
    if (const auto* assign = std::get_if<proto::RelayAssign>(&message.value())) {
      lockstep::master::RelayPairs pairs;
      for (const auto& pair : assign->pairs) {
        security::Key key{};
        security::to_key(pair.key, &key);  // the codec checked its length
        pairs[lockstep::master::relay_pair(pair.a, pair.b)] = key;
      }
      LOG_INFO(kLog, "the master assigns " << pairs.size() << " pair(s) of peers");
      relay.assign(std::move(pairs));
    } else if (!std::holds_alternative<proto::HeartbeatAck>(message.value())) {
      return Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, std::string("the master sent a relay ") +
                                                        proto::msg_type_name(proto::type_of(message.value())));
    }
  }
}

int fail(const std::string& message) {
  std::fprintf(stderr, "lockstep-relay: %s\n", message.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lockstep-relay: forwards the relayed edges of a lockstep run (docs/deployment.md, \"Relays\")"};
  app.set_version_flag("--version", std::string("lockstep-relay ") + std::to_string(LOCKSTEP_VERSION_MAJOR) + "." +
                                        std::to_string(LOCKSTEP_VERSION_MINOR) + "." +
                                        std::to_string(LOCKSTEP_VERSION_PATCH) + " (protocol " +
                                        std::to_string(proto::kProtocolVersion) + ")");
  Settings settings;
  app.add_option("--master", settings.master, "the master's HOST:PORT")->required();
  app.add_option("--secret-file", settings.secret_file, "file holding the run secret (the master's)")->required();
  app.add_option("--listen", settings.listen, "where peers connect to the relay: HOST:PORT (port 0: ephemeral)")
      ->capture_default_str();
  app.add_option("--advertise", settings.advertise,
                 "the host peers are told to connect to (default: the address the master sees this relay at, or the "
                 "master's own address when that is a loopback one)");
  app.add_option("--log-level", settings.log_level, "error, warn, info, debug or trace (default: $LOCKSTEP_LOG_LEVEL or info)");
  CLI11_PARSE(app, argc, argv);

  if (!settings.log_level.empty()) {
    lockstep::log::Level level{};
    if (!lockstep::log::parse_level(settings.log_level, &level)) return fail("--log-level: unknown level '" + settings.log_level + "'");
    lockstep::log::set_level(level);
  }
  const auto master = transport::split_host_port(settings.master);
  if (!master || master->second == 0) {
    return fail("--master: must be HOST:PORT or [IPV6]:PORT with a port in 1..65535, got '" + settings.master + "'");
  }
  const auto listen = transport::split_host_port(settings.listen);
  if (!listen) return fail("--listen: must be HOST:PORT or [IPV6]:PORT with a port in 0..65535, got '" + settings.listen + "'");
  if (Status s = security::init(); !s.is_ok()) return fail(s.to_string());
  auto secret = security::load_secret_file(settings.secret_file);
  if (!secret.is_ok()) return fail("--secret-file: " + secret.status().message());

  // Signals are taken by a thread of their own, which wakes the main loop through an eventfd.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  const int stop_fd = ::eventfd(0, EFD_CLOEXEC);
  if (stop_fd < 0) return fail("eventfd failed");

  lockstep::master::RelayOptions options;
  options.listen_host = listen->first;
  options.port = listen->second;
  lockstep::master::Relay relay(options);
  if (Status s = relay.start(); !s.is_ok()) return fail(s.to_string());
  std::printf("lockstep-relay listening on %s\n", transport::join_host_port(listen->first, relay.port()).c_str());
  std::fflush(stdout);

  std::thread waiter([&] {
    int received = 0;
    sigwait(&signals, &received);
    LOG_INFO(kLog, "signal " << received << " received, shutting down");
    const std::uint64_t one = 1;
    [[maybe_unused]] const auto n = ::write(stop_fd, &one, sizeof one);
  });
  auto backoff = std::chrono::milliseconds(200);
  int exit_code = 0;
  for (;;) {
    const auto started = std::chrono::steady_clock::now();
    const Status ended = serve(settings, *master, secret.value(), relay.port(), relay, stop_fd);
    relay.assign({});  // no master, no pairs
    if (ended.code() == LOCKSTEP_STATUS_INTERRUPTED) break;
    if (ended.code() == LOCKSTEP_STATUS_AUTHENTICATION_FAILED || ended.code() == LOCKSTEP_STATUS_INVALID_ARGUMENT) {
      // A master without the secret, or with another: no retry mends that.
      std::fprintf(stderr, "lockstep-relay: the master refuses this relay: %s\n", ended.to_string().c_str());
      exit_code = 1;
      break;
    }
    LOG_WARN(kLog, "master connection: " << ended.to_string() << "; registering again");
    if (std::chrono::steady_clock::now() - started > std::chrono::seconds(10)) backoff = std::chrono::milliseconds(200);
    pollfd p{stop_fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(backoff.count())) > 0) break;
    backoff = std::min(backoff * 2, std::chrono::milliseconds(5'000));
  }
  relay.stop();
  if (exit_code != 0) pthread_kill(waiter.native_handle(), SIGTERM);  // still in sigwait
  waiter.join();
  ::close(stop_fd);
  return exit_code;
}
