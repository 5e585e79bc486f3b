// The ring driver over socket pairs, without a master: a ring whose neighbour moves no
// byte fails at the stall timeout with the destination as it was (a link cut between two
// peers that both still reach the master must not hold a collective forever), and the
// stall timer does not fire on a ring that moves data.
#include "collectives/ring.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

using lockstep::coll::RingIo;
using lockstep::coll::RingPlan;
using lockstep::coll::RingScratch;

struct SocketPair {
  int fds[2] = {-1, -1};
  SocketPair() {
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, fds), 0);
  }
  ~SocketPair() {
    for (int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
  }
};

RingPlan plan_for(std::uint32_t rank, const std::vector<float>& src, std::vector<float>& dst) {
  RingPlan plan;
  plan.world = 2;
  plan.rank = rank;
  plan.src = src.data();
  plan.dst = dst.data();
  plan.count = src.size();
  plan.dtype = LOCKSTEP_F32;
  plan.op = LOCKSTEP_SUM;
  plan.attempt = 1;
  plan.subchunk_bytes = 4096;
  return plan;
}

TEST(Ring, SilentNeighbourFailsAtTheStallTimeoutAndRestores) {
  SocketPair a_to_b, b_to_a;  // peer b never runs
  std::vector<float> buffer(100'000, 1.5f);
  const std::vector<float> before = buffer;
  RingScratch scratch;
  RingIo io;
  io.tx_fd = a_to_b.fds[0];
  io.rx_fd = b_to_a.fds[1];
  io.stall_timeout_ms = 200;
  const auto start = std::chrono::steady_clock::now();
  const auto s = lockstep::coll::run_ring_all_reduce(plan_for(0, buffer, buffer), io, scratch, nullptr);
  const auto waited = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(s.code(), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << s.to_string();
  EXPECT_GE(waited, std::chrono::milliseconds(200));
  EXPECT_LT(waited, std::chrono::seconds(20));
  EXPECT_EQ(buffer, before) << "a failed attempt must leave the buffer as it was";
}

TEST(Ring, StallTimerDoesNotFireWhileDataMoves) {
  SocketPair a_to_b, b_to_a;
  std::vector<float> a(300'000, 1.0f), b(300'000, 2.0f);
  RingScratch scratch_a, scratch_b;
  RingIo io_a, io_b;
  io_a.tx_fd = a_to_b.fds[0];
  io_a.rx_fd = b_to_a.fds[1];
  io_b.tx_fd = b_to_a.fds[0];
  io_b.rx_fd = a_to_b.fds[1];
  io_a.stall_timeout_ms = io_b.stall_timeout_ms = 2000;
  lockstep::Status sb;
  std::thread peer_b([&] {
    // b starts late: a waits idle for part of the timeout first, then data flows.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    sb = lockstep::coll::run_ring_all_reduce(plan_for(1, b, b), io_b, scratch_b, nullptr);
  });
  const auto sa = lockstep::coll::run_ring_all_reduce(plan_for(0, a, a), io_a, scratch_a, nullptr);
  peer_b.join();
  ASSERT_TRUE(sa.is_ok()) << sa.to_string();
  ASSERT_TRUE(sb.is_ok()) << sb.to_string();
  EXPECT_EQ(a, std::vector<float>(300'000, 3.0f));
  EXPECT_EQ(a, b);
}

}  // namespace
