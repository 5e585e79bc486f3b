// One bandwidth test of optimize topology: the pair opens `streams` connections (the
// initiator connects to the partner's benchmark socket) and both ends send and receive
// at the same time for the test's duration. Each end counts what it receives after
// the first third of the test (TCP's slow start is over by then on the links this is
// for) and reports that rate. Senders keep going a little past the end so that the
// partner's window, which may have started slightly later, is still fed.
#include "common/log.h"
#include "peer/communicator.h"
#include "peer/handshake.h"
#include "peer/link.h"
#include "transport/framed.h"

#include <poll.h>
#include <sys/socket.h>

namespace lockstep::peer {
namespace {

constexpr std::size_t kBufferBytes = 256 * 1024;
constexpr auto kGrace = std::chrono::milliseconds(200);
constexpr int kPollMs = 50;

void send_until(int fd, Clock::time_point until) {
  std::vector<std::uint8_t> buffer(kBufferBytes, 0x5a);
  while (Clock::now() < until) {
    pollfd p{fd, POLLOUT, 0};
    if (::poll(&p, 1, kPollMs) <= 0) continue;
    if ((p.revents & (POLLERR | POLLHUP)) != 0) return;
    const ssize_t n = ::send(fd, buffer.data(), buffer.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return;
  }
}

std::uint64_t receive_until(int fd, Clock::time_point from, Clock::time_point until) {
  std::vector<std::uint8_t> buffer(kBufferBytes);
  std::uint64_t counted = 0;
  while (Clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, kPollMs) <= 0) continue;
    const ssize_t n = ::recv(fd, buffer.data(), buffer.size(), MSG_DONTWAIT);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) continue;
      break;
    }
    if (Clock::now() >= from) counted += static_cast<std::uint64_t>(n);
  }
  return counted;
}

}  // namespace

std::uint64_t Communicator::measure_bandwidth(const proto::BandwidthTest& test) {
  const auto& partner = test.partner;
  const auto connect_deadline = Clock::now() + std::chrono::milliseconds(options_.p2p_connect_timeout_ms);
  std::vector<transport::Fd> connections;
  // Between two peers that both accept no inbound connection the test runs through the
  // relay, as their ring edge would: each connection is joined there first, then the
  // initiator handshakes through it and the partner's listener takes it as accepted.
  const bool relayed = relayed_edge(self_info(), partner) && options_.secret.has_value();
  for (std::uint32_t k = 0; k < test.streams; ++k) {
    Result<transport::Fd> joined = Status(LOCKSTEP_STATUS_PEER_CONNECTION_FAILED, "not relayed");
    if (relayed) {
      joined = peer::dial_relay(link_->relay(), id_, partner, proto::Channel::kBenchmark, k, !test.initiator,
                                options_.p2p_connect_timeout_ms);
      if (!joined.is_ok()) {
        LOG_WARN(kLog, "bandwidth test " << test.test << ": " << joined.status().to_string());
        break;
      }
      if (!test.initiator) link_->adopt_relayed(std::move(joined.value()), proto::Channel::kBenchmark);
    }
    if (test.initiator) {
      auto fd = relayed ? std::move(joined)
                        : transport::connect_tcp(partner.host, partner.benchmark_port, options_.p2p_connect_timeout_ms);
      if (!fd.is_ok()) break;
      proto::P2PHello hello;
      hello.channel = proto::Channel::kBenchmark;
      hello.from = id_;
      hello.to = partner.id;
      hello.epoch = test.test;
      hello.pool_index = k;
      // The filler stays in clear (no user data), but the setting must still agree (a
      // relayed connection says it seals, as every relayed one does).
      if (options_.encrypt_data || relayed) hello.flags = proto::kP2PFlagEncryptData;
      Status s = p2p_handshake(fd.value().get(), hello, options_.secret.has_value(), partner.key,
                               options_.p2p_connect_timeout_ms);
      if (!s.is_ok()) {
        LOG_WARN(kLog, "bandwidth test " << test.test << ": " << s.to_string());
        break;
      }
      connections.push_back(std::move(fd.value()));
    } else {
      auto in = link_->take_connection(proto::Channel::kBenchmark, test.test, partner.id, nullptr, connect_deadline);
      if (!in) break;
      connections.push_back(std::move(in->fd));
    }
  }
  if (connections.size() != test.streams) {
    LOG_WARN(kLog, "bandwidth test " << test.test << " with " << partner.id.to_string() << " at " << partner.host << ":"
                                     << partner.benchmark_port << ": could not open its connections");
    return 0;
  }
  const auto start = Clock::now();
  const auto duration = std::chrono::milliseconds(test.duration_ms);
  const auto from = start + duration / 3;
  const auto until = start + duration;
  std::vector<std::uint64_t> counted(connections.size(), 0);
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < connections.size(); ++i) {
    const int fd = connections[i].get();
    threads.emplace_back([fd, until] { send_until(fd, until + kGrace); });
    threads.emplace_back([fd, from, until, &counted, i] { counted[i] = receive_until(fd, from, until); });
  }
  for (auto& t : threads) t.join();
  std::uint64_t total = 0;
  for (const auto c : counted) total += c;
  const double seconds = std::chrono::duration<double>(until - from).count();
  const auto rate = static_cast<std::uint64_t>(static_cast<double>(total) / seconds);
  LOG_DEBUG(kLog, "bandwidth from " << partner.id.to_string() << ": " << static_cast<double>(rate) * 8 / 1e6 << " Mbit/s over "
                                    << connections.size() << " connection(s)");
  return rate;
}

}  // namespace lockstep::peer
