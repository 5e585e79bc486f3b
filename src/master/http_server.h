// The master's HTTP endpoint (docs/observability.md): the status page at /, the
// picture of the run as JSON at /api/state, and Prometheus metrics at /metrics, served
// by cpp-httplib on threads of its own. It never touches the coordinator: every answer
// is rendered on the master's loop thread (MasterServer::render) and handed over.
// Off unless started (lockstep-master --http HOST:PORT).
//
// With an access token (docs/operations.md) every request must carry it
// ("Authorization: Bearer TOKEN"; GET requests may also use HTTP Basic with the token
// as the password, so that a browser can open the page); others get 401, and refusals
// are logged at most once per kRefusalLogIntervalMs. The one request that changes the
// run, POST /api/peers/ID/evict, needs the token as a Bearer header, and is refused
// (403) on a server without one.
#pragma once

#include "common/status.h"
#include "master/master_server.h"

#include <cstdint>
#include <memory>
#include <string>

namespace lockstep::master {

struct HttpOptions {
  // The access token (security::load_token_file); empty: no authentication.
  std::string token;
  // Without a token, start() refuses a non-loopback address unless this is set.
  bool insecure = false;
};

// 127.0.0.0/8, localhost and ::1.
bool is_loopback_host(const std::string& host);

inline constexpr std::uint32_t kRefusalLogIntervalMs = 10'000;

class HttpServer {
 public:
  // The master must outlive this server (stop it first).
  explicit HttpServer(MasterServer& master, HttpOptions options = {});
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds host:port (port 0: ephemeral) and serves on background threads; returns once
  // it accepts connections. INVALID_ARGUMENT for a non-loopback host without a token
  // (unless options.insecure; then it logs a warning).
  Status start(const std::string& host, std::uint16_t port);
  std::uint16_t port() const { return port_; }
  // Stops accepting, finishes the requests in progress, joins every thread. Idempotent.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::uint16_t port_ = 0;
};

}  // namespace lockstep::master
