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
#include <string_view>
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

std::optional<std::pair<std::string, std::uint16_t>> split_host_port(const std::string& text) {
  std::string host;
  std::string rest;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') return std::nullopt;
    host = text.substr(1, close - 1);
    rest = text.substr(close + 2);
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos || text.find(':') != colon) return std::nullopt;  // none, or a bare IPv6
    host = text.substr(0, colon);
    rest = text.substr(colon + 1);
  }
  if (host.empty() || rest.empty() || rest.size() > 5 || rest.find_first_not_of("0123456789") != std::string::npos) {
    return std::nullopt;
  }
  const int port = std::stoi(rest);
  if (port > 65535) return std::nullopt;
  return std::make_pair(host, static_cast<std::uint16_t>(port));
}

std::optional<std::vector<std::pair<std::string, std::uint16_t>>> parse_address_list(const std::string& text) {
  std::vector<std::pair<std::string, std::uint16_t>> out;
  std::size_t start = 0;
  while (start < text.size()) {
    const std::size_t comma = std::min(text.find(',', start), text.size());
    const auto address = split_host_port(text.substr(start, comma - start));
    if (!address || address->second == 0 || out.size() == kAddressListMax) return std::nullopt;
    out.push_back(*address);
    start = comma + 1;
    if (comma + 1 == text.size()) return std::nullopt;  // a trailing comma
  }
  return out;
}

std::string join_host_port(const std::string& host, std::uint16_t port) {
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

std::string unmapped(const std::string& address) {
  static constexpr std::string_view kMapped = "::ffff:";
  if (address.size() > kMapped.size() && address.compare(0, kMapped.size(), kMapped) == 0) {
    in_addr v4{};
    const std::string rest = address.substr(kMapped.size());
    if (::inet_pton(AF_INET, rest.c_str(), &v4) == 1) return rest;
  }
  return address;
}

int socket_family(int fd) {
  sockaddr_storage sa{};
  socklen_t len = sizeof sa;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return AF_INET;
  return sa.ss_family == AF_INET6 ? AF_INET6 : AF_INET;
}

namespace {

// The address's text (IPv4-mapped IPv6 as IPv4).
std::string address_text(const sockaddr_storage& sa) {
  char buf[INET6_ADDRSTRLEN] = {};
  if (sa.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&sa)->sin6_addr, buf, sizeof buf);
  } else {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&sa)->sin_addr, buf, sizeof buf);
  }
  return unmapped(buf);
}

// One connection attempt to one address, before the shared deadline.
Result<Fd> connect_one(const addrinfo& ai, const std::string& where, Clock::time_point deadline, int cancel_fd) {
  Fd fd(::socket(ai.ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!fd.valid()) return errno_status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, "socket for " + where);
  if (::connect(fd.get(), ai.ai_addr, ai.ai_addrlen) != 0) {
    if (errno != EINPROGRESS) return errno_status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, "connect to " + where);
    Status waited = wait_fd(fd.get(), POLLOUT, deadline, ("connect to " + where).c_str(), cancel_fd);
    if (!waited.is_ok()) return Status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, waited.message());
    int err = 0;
    socklen_t len = sizeof err;
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) {
      return Status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, "connect to " + where + ": " + std::strerror(err));
    }
  }
  return fd;
}

}  // namespace

Result<Fd> connect_tcp(const std::string& host, std::uint16_t port, std::uint32_t timeout_ms, int cancel_fd) {
  const std::string where = join_host_port(host, port);
  if (!host.empty() && host.front() == '[') {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                  "host '" + host + "' has brackets: give the IPv6 address alone (brackets only in HOST:PORT)");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, "cannot resolve host '" + host + "': " + ::gai_strerror(rc));
  }
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  Result<Fd> connected = Status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, "no address for " + where);
  for (const addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    connected = connect_one(*ai, where, deadline, cancel_fd);
    if (connected.is_ok()) break;
  }
  ::freeaddrinfo(res);
  if (!connected.is_ok()) return connected;
  Fd fd = std::move(connected.value());
  const int flags = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  set_nodelay(fd.get());
  return fd;
}

namespace {

// A numeric address to bind.
struct BindAddress {
  sockaddr_storage sa{};
  socklen_t len = 0;
  bool dual_stack = false;  // "::": IPv4 clients too, as IPv4-mapped addresses
};

// An IPv4 or IPv6 literal (an IPv6 one may carry a zone id, "fe80::1%eth0"); names are
// not resolved for binding. Empty: both families ("::"; "0.0.0.0" without IPv6).
Result<BindAddress> bind_address(const std::string& bind_host) {
  std::string host = bind_host;
  if (host.empty()) {
    Fd probe(::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0));
    host = probe.valid() || errno != EAFNOSUPPORT ? "::" : "0.0.0.0";
  }
  if (host.front() == '[') {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                  "bind address '" + host + "' has brackets: give the IPv6 address alone (brackets only in HOST:PORT)");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_PASSIVE;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), "0", &hints, &res) != 0 || res == nullptr) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                  "bind address '" + host + "' is not an IPv4 or IPv6 address (names are not resolved for binding)");
  }
  BindAddress out;
  std::memcpy(&out.sa, res->ai_addr, res->ai_addrlen);
  out.len = static_cast<socklen_t>(res->ai_addrlen);
  ::freeaddrinfo(res);
  if (out.sa.ss_family == AF_INET6) {
    const in6_addr& a = reinterpret_cast<const sockaddr_in6*>(&out.sa)->sin6_addr;
    if (IN6_IS_ADDR_V4MAPPED(&a)) {
      char v4[INET_ADDRSTRLEN] = {};
      ::inet_ntop(AF_INET, &a.s6_addr[12], v4, sizeof v4);
      return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                    "bind address '" + host + "' is an IPv4-mapped IPv6 address: give the IPv4 address " + v4);
    }
    out.dual_stack = IN6_IS_ADDR_UNSPECIFIED(&a);
  }
  return out;
}

}  // namespace

Result<Listener> listen_tcp(const std::string& bind_host, int base_port, int backlog) {
  auto address = bind_address(bind_host);
  if (!address.is_ok()) return address.status();
  sockaddr_storage& sa = address.value().sa;
  auto* v4 = reinterpret_cast<sockaddr_in*>(&sa);
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&sa);
  const bool dual_stack = address.value().dual_stack;
  const socklen_t sa_len = address.value().len;
  const std::string host = bind_host.empty() ? (sa.ss_family == AF_INET6 ? "::" : "0.0.0.0") : bind_host;
  constexpr int kPortsToTry = 1000;
  const int first = base_port < 0 ? LOCKSTEP_DEFAULT_MASTER_PORT + 1 : base_port;
  const int tries = base_port == 0 ? 1 : kPortsToTry;
  for (int i = 0; i < tries && first + i <= 65535; ++i) {
    Fd fd(::socket(sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!fd.valid()) return errno_status(LOCKSTEP_STATUS_INTERNAL_ERROR, "socket");
    if (sa.ss_family == AF_INET6) {
      const int v6only = dual_stack ? 0 : 1;
      ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &v6only, sizeof v6only);
    }
    const auto port = htons(static_cast<std::uint16_t>(first + i));
    (sa.ss_family == AF_INET6 ? v6->sin6_port : v4->sin_port) = port;
    if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&sa), sa_len) != 0) {
      if (errno == EADDRINUSE) continue;
      return errno_status(LOCKSTEP_STATUS_INTERNAL_ERROR,
                          "bind " + join_host_port(host, static_cast<std::uint16_t>(first + i)));
    }
    if (::listen(fd.get(), backlog) != 0) return errno_status(LOCKSTEP_STATUS_INTERNAL_ERROR, "listen");
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len);
    const std::uint16_t got = bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                          : reinterpret_cast<sockaddr_in*>(&bound)->sin_port;
    return Listener{std::move(fd), ntohs(got)};
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
  sockaddr_storage sa{};
  socklen_t len = sizeof sa;
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&sa), &len) != 0) return "?";
  return address_text(sa);
}

}  // namespace lockstep::transport
