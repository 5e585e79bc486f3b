// The master's HTTP endpoint (docs/observability.md): the status page at /, the
// picture of the run as JSON at /api/state, and Prometheus metrics at /metrics, served
// by cpp-httplib on threads of its own. It never touches the coordinator: every answer
// is rendered on the master's loop thread (MasterServer::render) and handed over.
// Off unless started (lockstep-master --http HOST:PORT).
#pragma once

#include "common/status.h"
#include "master/master_server.h"

#include <cstdint>
#include <memory>
#include <string>

namespace lockstep::master {

class HttpServer {
 public:
  // The master must outlive this server (stop it first).
  explicit HttpServer(const MasterServer& master);
  ~HttpServer();
  HttpServer(const HttpServer&) = delete;
  HttpServer& operator=(const HttpServer&) = delete;

  // Binds host:port (port 0: ephemeral) and serves on background threads; returns once
  // it accepts connections.
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
