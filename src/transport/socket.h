// Blocking TCP helpers with deadlines, for the peer side: the handshake with the
// master and the p2p connections whose file descriptors the data path owns. Every
// wait is bounded by a timeout; every call reports failures as a Status.
#pragma once

#include "common/status.h"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>
#include <string>
#include <utility>

namespace lockstep::transport {

// An owned file descriptor (closed on destruction; movable, not copyable).
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset();

 private:
  int fd_ = -1;
};

// Addresses as text. IPv4 and IPv6 alike: a literal, or a name resolved with both
// families (each address tried in turn when connecting).
//
// "HOST:PORT", "[IPV6]:PORT" (brackets removed from the host) with a port in 0..65535;
// nullopt if malformed (a bare IPv6 literal has no port: "::1:80" is refused).
std::optional<std::pair<std::string, std::uint16_t>> split_host_port(const std::string& text);
// The inverse: an IPv6 literal in brackets.
std::string join_host_port(const std::string& host, std::uint16_t port);
// A comma-separated list of HOST:PORT (at most kAddressListMax, port above 0); nullopt
// if any is malformed. Empty text: an empty list.
inline constexpr std::size_t kAddressListMax = 16;
std::optional<std::vector<std::pair<std::string, std::uint16_t>>> parse_address_list(const std::string& text);
// An IPv4-mapped IPv6 address ("::ffff:10.0.0.1", as a dual-stack listener sees IPv4
// clients) as the IPv4 address it is; any other text unchanged.
std::string unmapped(const std::string& address);
// The address family of a socket (AF_INET or AF_INET6; AF_INET if it cannot be read).
int socket_family(int fd);

// Every wait below also ends, with PEER_CONNECTION_LOST, once `cancel_fd` (when >= 0)
// becomes readable: an operation's abort event, so that a silent peer cannot hold a
// caller whose operation the master has already ended.

// Connects with a deadline; the socket is left blocking with TCP_NODELAY set.
Result<Fd> connect_tcp(const std::string& host, std::uint16_t port, std::uint32_t timeout_ms, int cancel_fd = -1);

// A listening socket. base_port < 0: try 48149 upwards; 0: ephemeral; > 0: try it upwards.
// bind_host is an IP literal; empty: every address of both families ("::" with
// IPV6_V6ONLY off, or "0.0.0.0" where the system has no IPv6); "::" is dual-stack too.
struct Listener {
  Fd fd;
  std::uint16_t port = 0;
};
Result<Listener> listen_tcp(const std::string& bind_host, int base_port, int backlog = 128);

// Sends everything or fails (EPIPE is reported, never raised as a signal).
Status send_all(int fd, std::span<const std::uint8_t> bytes, std::uint32_t timeout_ms, int cancel_fd = -1);
// Receives exactly out.size() bytes before the deadline.
Status recv_exact(int fd, std::span<std::uint8_t> out, std::uint32_t timeout_ms, int cancel_fd = -1);

void set_nodelay(int fd);
void set_nonblocking(int fd);
// Bytes written to a TCP socket that have not been acknowledged yet (SIOCOUTQ; 0 when
// the kernel does not say).
std::uint64_t queued_bytes(int fd);
// Sets the connection's TCP congestion control (TCP_CONGESTION); the kernel's reason
// (strerror) when it refuses (an algorithm it does not have, or one an unprivileged
// process may not choose).
Status set_congestion_control(int fd, const std::string& name);
// Whether a name could be a congestion control's: 1 to 15 characters of [a-z0-9_-].
bool congestion_control_name_valid(const std::string& name);

// The remote address of a connected socket, as text (IPv4-mapped ones as IPv4).
std::string peer_address(int fd);

}  // namespace lockstep::transport
