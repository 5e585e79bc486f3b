// The blocking transport helpers: a wait on a silent connection ends as soon as the
// caller's cancel descriptor becomes readable (an all-reduce's abort event), not at the
// timeout. Without it a peer making a ring connection to a stopped neighbour waited for
// the handshake answer until the neighbour resumed, long after the master had ended the
// attempt (found by the chaos soak).
#include "transport/framed.h"
#include "transport/socket.h"

#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

using lockstep::transport::Fd;
using Clock = std::chrono::steady_clock;

struct Pair {
  Fd a, b;
  Pair() {
    int fds[2] = {-1, -1};
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
    a = Fd(fds[0]);
    b = Fd(fds[1]);
  }
};

void signal_after(int event_fd, std::chrono::milliseconds delay) {
  std::this_thread::sleep_for(delay);
  const std::uint64_t one = 1;
  ASSERT_EQ(::write(event_fd, &one, sizeof one), static_cast<ssize_t>(sizeof one));
}

TEST(Transport, ReceiveEndsWhenCancelled) {
  Pair pair;  // nobody ever writes to pair.b
  Fd cancel(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  ASSERT_TRUE(cancel.valid());
  std::thread signaller(signal_after, cancel.get(), std::chrono::milliseconds(50));
  const auto start = Clock::now();
  auto got = lockstep::transport::recv_message(pair.a.get(), 60'000, nullptr, cancel.get());
  const auto waited = Clock::now() - start;
  signaller.join();
  ASSERT_FALSE(got.is_ok());
  EXPECT_EQ(got.status().code(), LOCKSTEP_STATUS_PEER_CONNECTION_LOST);
  EXPECT_LT(waited, std::chrono::seconds(30));  // the timeout was 60 s
}

TEST(Transport, SendEndsWhenCancelled) {
  Pair pair;  // nobody reads pair.b: the socket buffers fill up
  Fd cancel(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  ASSERT_TRUE(cancel.valid());
  std::thread signaller(signal_after, cancel.get(), std::chrono::milliseconds(50));
  std::vector<std::uint8_t> bytes(64u << 20, 0x5a);
  const auto start = Clock::now();
  const auto sent = lockstep::transport::send_all(pair.a.get(), bytes, 60'000, cancel.get());
  const auto waited = Clock::now() - start;
  signaller.join();
  EXPECT_EQ(sent.code(), LOCKSTEP_STATUS_PEER_CONNECTION_LOST);
  EXPECT_LT(waited, std::chrono::seconds(30));
}

TEST(Transport, WithoutCancelTheTimeoutStillApplies) {
  Pair pair;
  std::array<std::uint8_t, 4> out{};
  const auto s = lockstep::transport::recv_exact(pair.a.get(), out, 20);
  EXPECT_EQ(s.code(), LOCKSTEP_STATUS_TIMEOUT);
}

TEST(Transport, DataAlreadyThereIsReadDespiteNoCancel) {
  Pair pair;
  Fd cancel(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  const std::array<std::uint8_t, 3> in{1, 2, 3};
  ASSERT_TRUE(lockstep::transport::send_all(pair.b.get(), in, 1000).is_ok());
  std::array<std::uint8_t, 3> out{};
  ASSERT_TRUE(lockstep::transport::recv_exact(pair.a.get(), out, 1000, cancel.get()).is_ok());
  EXPECT_EQ(out, in);
}

}  // namespace

// ---- addresses: IPv4 and IPv6 (docs/deployment.md)

TEST(TransportAddress, SplitsAndJoinsHostPort) {
  using lockstep::transport::join_host_port;
  using lockstep::transport::split_host_port;
  using HostPort = std::pair<std::string, std::uint16_t>;
  EXPECT_EQ(split_host_port("10.0.0.1:48148"), (HostPort{"10.0.0.1", 48148}));
  EXPECT_EQ(split_host_port("localhost:0"), (HostPort{"localhost", 0}));
  EXPECT_EQ(split_host_port("[::1]:48148"), (HostPort{"::1", 48148}));
  EXPECT_EQ(split_host_port("[fe80::1%eth0]:65535"), (HostPort{"fe80::1%eth0", 65535}));
  for (const char* bad : {"", "10.0.0.1", ":48148", "10.0.0.1:", "10.0.0.1:65536", "10.0.0.1:-1", "10.0.0.1:4x",
                          "::1:48148", "[::1]", "[::1]48148", "[]:1", "[::1:48148", "h:123456"}) {
    EXPECT_FALSE(split_host_port(bad).has_value()) << bad;
  }
  EXPECT_EQ(join_host_port("10.0.0.1", 1), "10.0.0.1:1");
  EXPECT_EQ(join_host_port("::1", 48148), "[::1]:48148");
  EXPECT_EQ(split_host_port(join_host_port("2001:db8::7", 9)), (HostPort{"2001:db8::7", 9}));
}

TEST(TransportAddress, UnmapsIpv4MappedAddresses) {
  using lockstep::transport::unmapped;
  EXPECT_EQ(unmapped("::ffff:127.0.0.1"), "127.0.0.1");
  EXPECT_EQ(unmapped("::ffff:10.1.2.3"), "10.1.2.3");
  EXPECT_EQ(unmapped("::1"), "::1");
  EXPECT_EQ(unmapped("::ffff:zz"), "::ffff:zz");
  EXPECT_EQ(unmapped("10.1.2.3"), "10.1.2.3");
}

// The default listener takes both families (where the host has IPv6), and a peer's
// address reads as the family it came over.
TEST(TransportAddress, DefaultListenerIsDualStack) {
  using namespace lockstep::transport;
  auto listener = listen_tcp("", 0);
  ASSERT_TRUE(listener.is_ok()) << listener.status().to_string();
  const int family = socket_family(listener.value().fd.get());
  std::vector<std::pair<std::string, std::string>> cases = {{"127.0.0.1", "127.0.0.1"}};
  if (family == AF_INET6) cases.emplace_back("::1", "::1");
  for (const auto& [host, seen] : cases) {
    auto client = connect_tcp(host, listener.value().port, 5000);
    ASSERT_TRUE(client.is_ok()) << host << ": " << client.status().to_string();
    Fd accepted(::accept(listener.value().fd.get(), nullptr, nullptr));
    ASSERT_TRUE(accepted.valid());
    EXPECT_EQ(peer_address(accepted.get()), seen);
  }
  // An explicit IPv4 literal stays IPv4.
  auto v4 = listen_tcp("127.0.0.1", 0);
  ASSERT_TRUE(v4.is_ok());
  EXPECT_EQ(socket_family(v4.value().fd.get()), AF_INET);
}

// Addresses that cannot be bound or dialled as given get INVALID_ARGUMENT and a message
// that says what to give instead.
TEST(TransportAddress, MalformedAddressesAreRefusedClearly) {
  using namespace lockstep::transport;
  const auto refused = [](const lockstep::Result<Listener>& r, const std::string& says) {
    ASSERT_FALSE(r.is_ok());
    EXPECT_EQ(r.status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(r.status().message().find(says), std::string::npos) << r.status().message();
  };
  refused(listen_tcp("localhost", 0), "not an IPv4 or IPv6 address");
  refused(listen_tcp("300.1.1.1", 0), "not an IPv4 or IPv6 address");
  refused(listen_tcp("[::1]", 0), "brackets");
  refused(listen_tcp("::ffff:127.0.0.1", 0), "give the IPv4 address 127.0.0.1");
  refused(listen_tcp("::FFFF:7F00:1", 0), "give the IPv4 address 127.0.0.1");
  auto bracketed = connect_tcp("[::1]", 1, 1000);
  ASSERT_FALSE(bracketed.is_ok());
  EXPECT_EQ(bracketed.status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(bracketed.status().message().find("brackets"), std::string::npos);
}
