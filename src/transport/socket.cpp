// Blocking TCP helpers built on poll() deadlines.
#include "transport/socket.h"

#include "common/limits.h"

#include <arpa/inet.h>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <linux/sockios.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

namespace lockstep::transport {
namespace {

using Clock = std::chrono::steady_clock;

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(left);
}

Status errno_status(StatusCode code, const std::string& what) {
  return Status(code, what + ": " + std::strerror(errno));
}

// cancel_fd >= 0: a descriptor that becomes readable when the caller must give up.
Status wait_fd(int fd, short events, Clock::time_point deadline, const char* what, int cancel_fd) {
  for (;;) {
    pollfd p[2] = {{fd, events, 0}, {cancel_fd, POLLIN, 0}};
    const int rc = ::poll(p, cancel_fd >= 0 ? 2 : 1, remaining_ms(deadline));
    if (rc > 0 && cancel_fd >= 0 && p[1].revents != 0) {
      return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, std::string(what) + " cancelled: the operation ended");
    }
    if (rc > 0) return Status::ok();
    if (rc == 0) return Status(LOCKSTEP_STATUS_TIMEOUT, std::string(what) + " timed out");
    if (errno != EINTR) return errno_status(LOCKSTEP_STATUS_INTERNAL_ERROR, "poll");
  }
}

}  // namespace

Fd& Fd::operator=(Fd&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

void Fd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

std::uint64_t queued_bytes(int fd) {
  int queued = 0;
  if (::ioctl(fd, SIOCOUTQ, &queued) != 0 || queued < 0) return 0;
  return static_cast<std::uint64_t>(queued);
}

Status set_congestion_control(int fd, const std::string& name) {
  if (::setsockopt(fd, IPPROTO_TCP, TCP_CONGESTION, name.data(), static_cast<socklen_t>(name.size())) == 0) {
    return Status::ok();
  }
  return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, std::strerror(errno));
}

bool congestion_control_name_valid(const std::string& name) {
  if (name.empty() || name.size() > 15) return false;
  for (const char c : name) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-')) return false;
  }
  return true;
}

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

Result<std::string> resolve_ipv4(const std::string& host) {
  in_addr addr{};
  if (::inet_pton(AF_INET, host.c_str(), &addr) == 1) return host;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0 || res == nullptr) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "cannot resolve host '" + host + "': " + ::gai_strerror(rc));
  }
  char buf[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr, buf, sizeof buf);
  ::freeaddrinfo(res);
  return std::string(buf);
}

Result<Fd> connect_tcp(const std::string& host, std::uint16_t port, std::uint32_t timeout_ms, int cancel_fd) {
  auto ip = resolve_ipv4(host);
  if (!ip.is_ok()) return ip.status();
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(port);
  ::inet_pton(AF_INET, ip.value().c_str(), &sa.sin_addr);
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return errno_status(LOCKSTEP_STATUS_INTERNAL_ERROR, "socket");
  const std::string where = host + ":" + std::to_string(port);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
    if (errno != EINPROGRESS) return errno_status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, "connect to " + where);
    const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
    Status waited = wait_fd(fd.get(), POLLOUT, deadline, ("connect to " + where).c_str(), cancel_fd);
    if (!waited.is_ok()) return Status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, waited.message());
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      return Status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, "connect to " + where + ": " + std::strerror(err));
    }
  }
  const int flags = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  set_nodelay(fd.get());
  return fd;
}

Result<Listener> listen_tcp(const std::string& bind_host, int base_port, int backlog) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  const std::string host = bind_host.empty() ? "0.0.0.0" : bind_host;
  if (::inet_pton(AF_INET, host.c_str(), &sa.sin_addr) != 1) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "bind address '" + host + "' is not an IPv4 literal");
  }
  constexpr int kPortsToTry = 1000;
  const int first = base_port < 0 ? LOCKSTEP_DEFAULT_MASTER_PORT + 1 : base_port;
  const int tries = base_port == 0 ? 1 : kPortsToTry;
  for (int i = 0; i < tries && first + i <= 65535; ++i) {
    Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return errno_status(LOCKSTEP_STATUS_INTERNAL_ERROR, "socket");
    sa.sin_port = htons(static_cast<std::uint16_t>(first + i));
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&sa), sizeof sa) != 0) {
      if (errno == EADDRINUSE) continue;
      return errno_status(LOCKSTEP_STATUS_INTERNAL_ERROR, "bind " + host + ":" + std::to_string(first + i));
    }
    if (::listen(fd.get(), backlog) != 0) return errno_status(LOCKSTEP_STATUS_INTERNAL_ERROR, "listen");
    socklen_t len = sizeof sa;
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&sa), &len);
    return Listener{std::move(fd), ntohs(sa.sin_port)};
  }
  return Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "no free port from " + std::to_string(first));
}

Status send_all(int fd, std::span<const std::uint8_t> bytes, std::uint32_t timeout_ms, int cancel_fd) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  std::size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      Status waited = wait_fd(fd, POLLOUT, deadline, "send", cancel_fd);
      if (!waited.is_ok()) return waited;
      continue;
    }
    return errno_status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "send");
  }
  return Status::ok();
}

Status recv_exact(int fd, std::span<std::uint8_t> out, std::uint32_t timeout_ms, int cancel_fd) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  std::size_t got = 0;
  while (got < out.size()) {
    Status waited = wait_fd(fd, POLLIN, deadline, "receive", cancel_fd);
    if (!waited.is_ok()) return waited;
    const ssize_t n = ::recv(fd, out.data() + got, out.size() - got, MSG_DONTWAIT);
    if (n > 0) {
      got += static_cast<std::size_t>(n);
      continue;
    }
    if (n == 0) return Status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "connection closed by the other side");
    if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
    return errno_status(LOCKSTEP_STATUS_PEER_CONNECTION_LOST, "receive");
  }
  return Status::ok();
}

std::string peer_address(int fd) {
  sockaddr_in sa{};
  socklen_t len = sizeof sa;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return "?";
  char buf[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &sa.sin_addr, buf, sizeof buf);
  return buf;
}

}  // namespace lockstep::transport
