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
#include <thread>

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
