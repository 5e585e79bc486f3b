// The ring driver over socket pairs, without a master: a ring whose neighbour moves no
// byte fails at the stall timeout with the destination as it was (a link cut between two
// peers that both still reach the master must not hold a collective forever), and the
// stall timer does not fire on a ring that moves data; an aborted attempt restores the
// destination; one driving thread and two (a sender thread) give the same bits. Every
// case runs in both modes.
#include "collectives/ring.h"

#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <sys/eventfd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
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

// A TCP connection over loopback, both ends non-blocking: the receive tuning's poll
// waits for the low-water mark only on TCP (a Unix socket reports any byte).
struct TcpPair {
  int fds[2] = {-1, -1};  // fds[0] sends, fds[1] receives
  TcpPair() {
    const int listener = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    EXPECT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    EXPECT_EQ(::listen(listener, 1), 0);
    EXPECT_EQ(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    fds[0] = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    EXPECT_EQ(::connect(fds[0], reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    fds[1] = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    ::close(listener);
    for (const int fd : fds) EXPECT_EQ(::fcntl(fd, F_SETFL, O_NONBLOCK), 0);
  }
  ~TcpPair() {
    for (int fd : fds) {
      if (fd >= 0) ::close(fd);
    }
  }
};

int socket_option(int fd, int name) {
  int value = 0;
  socklen_t len = sizeof value;
  EXPECT_EQ(::getsockopt(fd, SOL_SOCKET, name, &value, &len), 0);
  return value;
}

// An attempt's abort as the communicator raises it: the flag, then the event.
struct AbortSignal {
  int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  std::atomic<bool> flag{false};
  AbortSignal() { EXPECT_GE(fd, 0); }
  ~AbortSignal() {
    if (fd >= 0) ::close(fd);
  }
  void attach(RingIo& io) {
    io.abort_fd = fd;
    io.abort_flag = &flag;
  }
  void raise() {
    flag.store(true);
    const std::uint64_t one = 1;
    EXPECT_EQ(::write(fd, &one, sizeof one), static_cast<ssize_t>(sizeof one));
  }
};

// One attempt per plan, each peer on its own thread, links[i] from peer i to peer i+1;
// the peers' statuses.
template <typename Link>
std::vector<lockstep::Status> run_ring(const std::vector<RingPlan>& plans, std::vector<Link>& links,
                                       std::vector<RingScratch>& scratch) {
  const std::size_t n = plans.size();
  std::vector<lockstep::Status> status(n);
  std::vector<std::thread> peers;
  for (std::size_t i = 0; i < n; ++i) {
    peers.emplace_back([&, i] {
      RingIo io;
      io.tx_fd = links[i].fds[0];
      io.rx_fd = links[(i + n - 1) % n].fds[1];
      io.stall_timeout_ms = 30'000;
      status[i] = lockstep::coll::run_ring_all_reduce(plans[i], io, scratch[i], nullptr);
    });
  }
  for (auto& t : peers) t.join();
  return status;
}

// The parameter: whether large buffers get a sender thread (every buffer here is large
// enough when it is on, none when it is off). The one-thread ring spins before it
// sleeps, as it does where each peer has a core.
class Ring : public ::testing::TestWithParam<bool> {
 protected:
  RingPlan plan_for(std::uint32_t rank, const std::vector<float>& src, std::vector<float>& dst) const {
    RingPlan plan = base_plan(rank, src, dst);
    plan.sender_thread_bytes_min = GetParam() ? 0 : SIZE_MAX;
    plan.spin_us = GetParam() ? 0 : lockstep::coll::kRingSpinUs;
    return plan;
  }

 public:
  static RingPlan base_plan(std::uint32_t rank, const std::vector<float>& src, std::vector<float>& dst);
};

RingPlan Ring::base_plan(std::uint32_t rank, const std::vector<float>& src, std::vector<float>& dst) {
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

TEST_P(Ring, SilentNeighbourFailsAtTheStallTimeoutAndRestores) {
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

TEST_P(Ring, StallTimerDoesNotFireWhileDataMoves) {
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

TEST_P(Ring, AbortRestoresTheDestination) {
  SocketPair a_to_b, b_to_a;  // peer b never runs: a waits until it is aborted
  std::vector<float> buffer(300'000);
  for (std::size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<float>(i % 977) * 0.25f;
  const std::vector<float> before = buffer;
  RingScratch scratch;
  AbortSignal abort;
  RingIo io;
  io.tx_fd = a_to_b.fds[0];
  io.rx_fd = b_to_a.fds[1];
  abort.attach(io);
  std::thread aborter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    abort.raise();
  });
  const auto s = lockstep::coll::run_ring_all_reduce(plan_for(0, buffer, buffer), io, scratch, nullptr);
  aborter.join();
  EXPECT_EQ(s.code(), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << s.to_string();
  EXPECT_EQ(buffer, before) << "an aborted attempt must leave the buffer as it was";
}

// Peer a (rank 0) of a two-peer ring whose neighbour stops midway: peer b runs for
// real, but a relay passes only the first `forwarded` bytes b sends on to a, so that a
// reduces part of b's data into its destination before its attempt fails. Once a has
// taken every forwarded byte, `fail_a` runs (raise a's abort, or nothing for the stall
// timeout). b is aborted at the end. Returns a's status; *stats_a its byte counts.
lockstep::Status run_against_partial_neighbour(const RingPlan& plan_a, const RingPlan& plan_b, RingIo io_a,
                                               std::size_t forwarded, const std::function<void()>& fail_a,
                                               lockstep::coll::RingStats* stats_a) {
  SocketPair a_to_b, b_out, relay_to_a;
  io_a.tx_fd = a_to_b.fds[0];
  io_a.rx_fd = relay_to_a.fds[1];
  AbortSignal abort_b;
  RingIo io_b;
  io_b.tx_fd = b_out.fds[0];
  io_b.rx_fd = a_to_b.fds[1];
  io_b.stall_timeout_ms = 30'000;
  abort_b.attach(io_b);
  RingScratch scratch_a, scratch_b;
  std::thread b([&] {
    [[maybe_unused]] const auto s = lockstep::coll::run_ring_all_reduce(plan_b, io_b, scratch_b, nullptr);
  });
  std::thread relay([&] {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    std::vector<std::uint8_t> bytes(4096);
    std::size_t passed = 0;
    while (passed < forwarded && std::chrono::steady_clock::now() < deadline) {
      pollfd in{b_out.fds[1], POLLIN, 0};
      if (::poll(&in, 1, 100) <= 0) continue;
      const ssize_t n = ::read(b_out.fds[1], bytes.data(), std::min(bytes.size(), forwarded - passed));
      if (n <= 0) continue;
      for (ssize_t at = 0; at < n;) {
        pollfd out{relay_to_a.fds[0], POLLOUT, 0};
        ::poll(&out, 1, 100);
        const ssize_t w = ::write(relay_to_a.fds[0], bytes.data() + at, static_cast<std::size_t>(n - at));
        if (w > 0) at += w;
      }
      passed += static_cast<std::size_t>(n);
    }
    EXPECT_EQ(passed, forwarded);
    // a has read everything forwarded (and reduced all but at most the last sub-chunk).
    int queued = 1;
    while (std::chrono::steady_clock::now() < deadline && ::ioctl(relay_to_a.fds[1], FIONREAD, &queued) == 0 && queued > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(queued, 0);
    fail_a();
  });
  const auto status = lockstep::coll::run_ring_all_reduce(plan_a, io_a, scratch_a, stats_a);
  relay.join();
  abort_b.raise();
  b.join();
  return status;
}

// The destination had been partly overwritten by reduced sub-chunks when the abort came:
// every one of them is put back.
TEST_P(Ring, AbortAfterPartOfTheDataRestoresTheDestination) {
  std::vector<float> a(300'000), b(300'000, 1.0f);
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i % 977) * 0.25f;
  const std::vector<float> before = a;
  constexpr std::size_t kForwarded = 10 * (4096 + 64);  // about ten sub-chunks
  AbortSignal abort;
  RingIo io;
  io.stall_timeout_ms = 30'000;
  abort.attach(io);
  lockstep::coll::RingStats stats;
  const auto s = run_against_partial_neighbour(plan_for(0, a, a), plan_for(1, b, b), io, kForwarded,
                                               [&] { abort.raise(); }, &stats);
  EXPECT_EQ(s.code(), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << s.to_string();
  EXPECT_GT(stats.bytes_received, 4u * 4096u);  // a reduced several of b's sub-chunks
  EXPECT_EQ(a, before) << "an aborted attempt must leave the buffer as it was";
}

// The same with a neighbour that falls silent midway: the stall timeout ends the attempt
// and the reduced sub-chunks are put back.
TEST_P(Ring, NeighbourSilentMidwayFailsAtTheStallTimeoutAndRestores) {
  std::vector<float> a(300'000, 1.5f), b(300'000, 2.0f);
  const std::vector<float> before = a;
  constexpr std::size_t kForwarded = 10 * (4096 + 64);
  RingIo io;
  io.stall_timeout_ms = 200;
  lockstep::coll::RingStats stats;
  const auto s = run_against_partial_neighbour(plan_for(0, a, a), plan_for(1, b, b), io, kForwarded, [] {}, &stats);
  EXPECT_EQ(s.code(), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << s.to_string();
  EXPECT_GT(stats.bytes_received, 4u * 4096u);  // a reduced several of b's sub-chunks
  EXPECT_EQ(a, before) << "a failed attempt must leave the buffer as it was";
}

// Semantics rule 3: bytes of another attempt (a neighbour still in an aborted one, or
// already in the next) are never mixed into this one: the attempt fails and the
// destination is put back.
TEST_P(Ring, FrameOfAnotherAttemptFailsTheAttemptAndRestores) {
  SocketPair a_to_b, b_to_a;
  std::vector<float> a(300'000, 1.0f), b(300'000, 2.0f);
  const std::vector<float> before = a;
  RingPlan plan_a = plan_for(0, a, a);
  RingPlan plan_b = plan_for(1, b, b);
  plan_b.attempt = plan_a.attempt + 1;
  RingScratch scratch_a, scratch_b;
  RingIo io_a, io_b;
  io_a.tx_fd = a_to_b.fds[0];
  io_a.rx_fd = b_to_a.fds[1];
  io_b.tx_fd = b_to_a.fds[0];
  io_b.rx_fd = a_to_b.fds[1];
  io_a.stall_timeout_ms = io_b.stall_timeout_ms = 1'000;
  lockstep::Status sb;
  std::thread peer_b([&] { sb = lockstep::coll::run_ring_all_reduce(plan_b, io_b, scratch_b, nullptr); });
  const auto sa = lockstep::coll::run_ring_all_reduce(plan_a, io_a, scratch_a, nullptr);
  peer_b.join();
  // Whichever reads the other's first frame ends at once; the other may have stopped
  // sending by then and ends at its stall timeout. Neither succeeds.
  const auto refused = [](const lockstep::Status& st) {
    return st.code() == LOCKSTEP_STATUS_PROTOCOL_ERROR && st.message().find("during attempt") != std::string::npos;
  };
  EXPECT_TRUE(refused(sa) || refused(sb)) << sa.to_string() << " / " << sb.to_string();
  for (const lockstep::Status& st : {sa, sb}) {
    EXPECT_TRUE(st.code() == LOCKSTEP_STATUS_PROTOCOL_ERROR || st.code() == LOCKSTEP_STATUS_PEER_CONNECTION_LOST)
        << st.to_string();
  }
  EXPECT_EQ(a, before);
  EXPECT_EQ(b, std::vector<float>(300'000, 2.0f));
}

// A ring frame with this header and 4096 bytes of payload, as a neighbour would send it.
std::vector<std::uint8_t> frame_of(const lockstep::coll::RingHeader& h) {
  std::vector<std::uint8_t> frame(lockstep::coll::kRingHeaderBytes + 4096, 0x3f);
  lockstep::coll::put_ring_header(frame.data(), h);
  return frame;
}

// A frame of an older attempt first on the receiving connection: the previous peer ran
// an attempt that ended here before its turn (its frames were never read here). With
// rx_replace the connection is given up for a newer one and the attempt goes on, its
// result exact; the older frame reaches nothing. Without rx_replace it fails the attempt.
TEST_P(Ring, FrameOfAnOlderAttemptFirstGivesUpTheConnection) {
  for (const bool replace : {true, false}) {
    SCOPED_TRACE(replace ? "with rx_replace" : "without");
    SocketPair a_to_b, stale_b_to_a, b_to_a;
    std::vector<float> a(300'000, 1.0f), b(300'000, 2.0f);
    const std::vector<float> before = a;
    RingPlan plan_a = plan_for(0, a, a);
    RingPlan plan_b = plan_for(1, b, b);
    plan_a.attempt = plan_b.attempt = 9;
    // b's older attempt 8 left a whole frame, and more, in the connection a holds.
    const std::vector<std::uint8_t> frame = frame_of({0, 1, 0, 8});
    ASSERT_EQ(::write(stale_b_to_a.fds[0], frame.data(), frame.size()), static_cast<ssize_t>(frame.size()));
    RingScratch scratch_a, scratch_b;
    RingIo io_a, io_b;
    io_a.tx_fd = a_to_b.fds[0];
    io_a.rx_fd = stale_b_to_a.fds[1];
    io_b.tx_fd = b_to_a.fds[0];
    io_b.rx_fd = a_to_b.fds[1];
    io_a.stall_timeout_ms = io_b.stall_timeout_ms = 2'000;
    int replaced = 0;
    if (replace) {
      io_a.rx_replace = [&](std::size_t stream) -> lockstep::Result<lockstep::coll::RingStream> {
        EXPECT_EQ(stream, 0u);
        ++replaced;
        return lockstep::coll::RingStream{b_to_a.fds[1], nullptr};
      };
    }
    lockstep::Status sb;
    std::thread peer_b([&] { sb = lockstep::coll::run_ring_all_reduce(plan_b, io_b, scratch_b, nullptr); });
    const auto sa = lockstep::coll::run_ring_all_reduce(plan_a, io_a, scratch_a, nullptr);
    peer_b.join();
    if (replace) {
      ASSERT_TRUE(sa.is_ok()) << sa.to_string();
      ASSERT_TRUE(sb.is_ok()) << sb.to_string();
      EXPECT_EQ(replaced, 1);
      EXPECT_EQ(a, std::vector<float>(300'000, 3.0f));
      EXPECT_EQ(b, std::vector<float>(300'000, 3.0f));
    } else {
      EXPECT_EQ(sa.code(), LOCKSTEP_STATUS_PROTOCOL_ERROR) << sa.to_string();
      EXPECT_NE(sa.message().find("ring frame of attempt 8 during attempt 9"), std::string::npos) << sa.to_string();
      EXPECT_EQ(a, before);
    }
  }
}

// A neighbour whose frame header is wrong (no magic number; a frame out of sequence)
// fails the attempt with PROTOCOL_ERROR, whatever else it sends.
TEST_P(Ring, MalformedFrameHeaderFailsTheAttempt) {
  for (const bool bad_magic : {true, false}) {
    SCOPED_TRACE(bad_magic ? "bad magic" : "out of sequence");
    SocketPair a_to_b, b_to_a;
    std::vector<float> a(300'000, 1.0f);
    const std::vector<float> before = a;
    const RingPlan plan = plan_for(0, a, a);
    std::vector<std::uint8_t> frame = frame_of({0, 1, bad_magic ? 0u : 7u, plan.attempt});
    if (bad_magic) frame[0] ^= 0x5a;
    ASSERT_EQ(::write(b_to_a.fds[0], frame.data(), frame.size()), static_cast<ssize_t>(frame.size()));
    RingScratch scratch;
    RingIo io;
    io.tx_fd = a_to_b.fds[0];
    io.rx_fd = b_to_a.fds[1];
    io.stall_timeout_ms = 5'000;
    const auto s = lockstep::coll::run_ring_all_reduce(plan, io, scratch, nullptr);
    EXPECT_EQ(s.code(), LOCKSTEP_STATUS_PROTOCOL_ERROR) << s.to_string();
    EXPECT_EQ(a, before);
  }
}

// Four peers in threads over socket pairs, random f32 (so any difference in the order of
// operations would show in the bits), plain and quantized: each mode (one thread that
// sleeps at once, one thread that spins first, two threads) gives every peer the same
// bits, all modes give the same bits, and restore() after a successful attempt brings
// back the input.
TEST(RingModes, FourPeersAgreeBitForBit) {
  for (const auto quant : {LOCKSTEP_QUANT_NONE, LOCKSTEP_QUANT_MINMAX_U8}) {
    SCOPED_TRACE(quant == LOCKSTEP_QUANT_NONE ? "unquantized" : "quantized");
    constexpr std::size_t kPeers = 4;
    constexpr std::size_t kCount = 250'003;  // chunks of unequal length
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> d(-1000.0f, 1000.0f);
    std::vector<std::vector<float>> input(kPeers, std::vector<float>(kCount));
    for (auto& v : input) {
      for (auto& x : v) x = d(rng);
    }
    enum Mode { kOneThread, kOneThreadSpinning, kSenderThread, kModes };
    auto run_all = [&](Mode mode, std::vector<std::vector<float>>& data, std::vector<RingScratch>& scratch,
                       std::vector<RingPlan>& plans) {
      for (std::size_t i = 0; i < kPeers; ++i) {
        plans[i] = Ring::base_plan(static_cast<std::uint32_t>(i), data[i], data[i]);
        plans[i].world = kPeers;
        plans[i].quantization = quant;
        plans[i].sender_thread_bytes_min = mode == kSenderThread ? 0 : SIZE_MAX;
        plans[i].spin_us = mode == kOneThreadSpinning ? lockstep::coll::kRingSpinUs : 0;
      }
      std::vector<SocketPair> links(kPeers);
      const auto status = run_ring(plans, links, scratch);
      for (std::size_t i = 0; i < kPeers; ++i) ASSERT_TRUE(status[i].is_ok()) << i << ": " << status[i].to_string();
    };
    std::vector<std::vector<float>> results[kModes];
    for (const Mode mode : {kOneThread, kOneThreadSpinning, kSenderThread}) {
      SCOPED_TRACE("mode " + std::to_string(mode));
      auto data = input;
      std::vector<RingScratch> scratch(kPeers);
      std::vector<RingPlan> plans(kPeers);
      run_all(mode, data, scratch, plans);
      for (std::size_t i = 1; i < kPeers; ++i) {
        ASSERT_EQ(std::memcmp(data[i].data(), data[0].data(), kCount * sizeof(float)), 0) << "peer " << i;
      }
      // A plausibility check on the value: the sum of four inputs, up to rounding (and
      // for the 8-bit codes, well within five encodings of 8000/255 each).
      for (std::size_t k = 0; k < kCount; k += 4999) {
        const float expected = input[0][k] + input[1][k] + input[2][k] + input[3][k];
        EXPECT_NEAR(data[0][k], expected, quant == LOCKSTEP_QUANT_NONE ? 1e-2f : 200.0f) << k;
      }
      results[mode] = data;
      for (std::size_t i = 0; i < kPeers; ++i) {
        lockstep::coll::restore(plans[i], scratch[i]);
        ASSERT_EQ(std::memcmp(data[i].data(), input[i].data(), kCount * sizeof(float)), 0) << "restore, peer " << i;
      }
    }
    for (const Mode mode : {kOneThreadSpinning, kSenderThread}) {
      EXPECT_EQ(std::memcmp(results[kOneThread][0].data(), results[mode][0].data(), kCount * sizeof(float)), 0)
          << "mode " << mode << " must give the bits of one thread";
    }
  }
}

// The same-host tuning over TCP, three peers: sub-chunks smaller than the low-water
// mark (which must then wait only for what is due) and larger ones, plain and
// quantized; the tuned ring gives the bits of the untuned one, sets the send and
// receive buffers, and leaves the low-water mark at one byte.
TEST(RingTuning, TunedRingGivesTheSameBitsAndLeavesTheLowWaterMarkAtOneByte) {
  constexpr std::size_t kPeers = 3;
  constexpr std::size_t kCount = 300'007;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> d(-1000.0f, 1000.0f);
  std::vector<std::vector<float>> input(kPeers, std::vector<float>(kCount));
  for (auto& v : input) {
    for (auto& x : v) x = d(rng);
  }
  for (const std::size_t subchunk : {std::size_t{4096}, std::size_t{256 * 1024}}) {
    for (const auto quant : {LOCKSTEP_QUANT_NONE, LOCKSTEP_QUANT_MINMAX_U8}) {
      SCOPED_TRACE(std::to_string(subchunk) + "-byte sub-chunks, " + (quant == LOCKSTEP_QUANT_NONE ? "plain" : "quantized"));
      std::vector<std::vector<float>> results[2];
      for (const bool tuned : {false, true}) {
        std::vector<std::vector<float>> data = input;
        std::vector<RingPlan> plans(kPeers);
        for (std::size_t i = 0; i < kPeers; ++i) {
          plans[i] = Ring::base_plan(static_cast<std::uint32_t>(i), data[i], data[i]);
          plans[i].world = kPeers;
          plans[i].quantization = quant;
          plans[i].subchunk_bytes = subchunk;
          plans[i].spin_us = lockstep::coll::kRingSpinUs;
          if (tuned) {
            plans[i].tx_buffer_bytes = lockstep::coll::kRingSameHostSndBufBytes;
            plans[i].rx_buffer_bytes = lockstep::coll::kRingSameHostRcvBufBytes;
            plans[i].rx_lowat_bytes = lockstep::coll::kRingRcvLowatBytes;
          }
        }
        std::vector<TcpPair> links(kPeers);
        std::vector<RingScratch> scratch(kPeers);
        const auto status = run_ring(plans, links, scratch);
        for (std::size_t i = 0; i < kPeers; ++i) {
          ASSERT_TRUE(status[i].is_ok()) << i << ": " << status[i].to_string();
          ASSERT_EQ(std::memcmp(data[i].data(), data[0].data(), kCount * sizeof(float)), 0) << "peer " << i;
          const int rx = links[(i + kPeers - 1) % kPeers].fds[1];
          EXPECT_EQ(socket_option(rx, SO_RCVLOWAT), 1) << "peer " << i;
          // Linux reports twice the size asked for (its bookkeeping overhead).
          if (tuned) {
            EXPECT_EQ(socket_option(rx, SO_RCVBUF), 2 * lockstep::coll::kRingSameHostRcvBufBytes);
            EXPECT_EQ(socket_option(links[i].fds[0], SO_SNDBUF), 2 * lockstep::coll::kRingSameHostSndBufBytes);
          }
        }
        results[tuned ? 1 : 0] = data;
      }
      EXPECT_EQ(std::memcmp(results[0][0].data(), results[1][0].data(), kCount * sizeof(float)), 0)
          << "the tuned ring must give the bits of the untuned one";
    }
  }
}

// An attempt that waits with a raised low-water mark and is aborted restores the
// destination and puts the mark back to one byte.
TEST(RingTuning, AbortedTunedAttemptPutsTheLowWaterMarkBack) {
  TcpPair a_to_b, b_to_a;  // peer b never runs
  std::vector<float> buffer(300'000, 0.5f);
  const std::vector<float> before = buffer;
  RingScratch scratch;
  AbortSignal abort;
  RingPlan plan = Ring::base_plan(0, buffer, buffer);
  plan.subchunk_bytes = 256 * 1024;
  plan.spin_us = lockstep::coll::kRingSpinUs;
  plan.rx_buffer_bytes = lockstep::coll::kRingSameHostRcvBufBytes;
  plan.rx_lowat_bytes = lockstep::coll::kRingRcvLowatBytes;
  RingIo io;
  io.tx_fd = a_to_b.fds[0];
  io.rx_fd = b_to_a.fds[1];
  abort.attach(io);
  std::thread aborter([&] {
    // The first sub-chunk's header and fewer bytes of it than the mark: a waits for more.
    std::vector<std::uint8_t> some(lockstep::coll::kRingHeaderBytes + 1000, 0);
    lockstep::coll::put_ring_header(some.data(), {0, 1, 0, plan.attempt});
    EXPECT_EQ(::write(b_to_a.fds[0], some.data(), some.size()), static_cast<ssize_t>(some.size()));
    // The abort comes once a waits with the mark raised (or after ten seconds, and the
    // check fails).
    const int lowat = static_cast<int>(lockstep::coll::kRingRcvLowatBytes);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (socket_option(b_to_a.fds[1], SO_RCVLOWAT) != lowat && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(socket_option(b_to_a.fds[1], SO_RCVLOWAT), lowat) << "a never raised the low-water mark";
    abort.raise();
  });
  const auto s = lockstep::coll::run_ring_all_reduce(plan, io, scratch, nullptr);
  aborter.join();
  EXPECT_EQ(s.code(), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << s.to_string();
  EXPECT_EQ(buffer, before) << "an aborted attempt must leave the buffer as it was";
  EXPECT_EQ(socket_option(io.rx_fd, SO_RCVLOWAT), 1);
}

INSTANTIATE_TEST_SUITE_P(OneAndTwoThreads, Ring, ::testing::Bool(),
                         [](const auto& param_info) { return param_info.param ? "SenderThread" : "OneThread"; });

}  // namespace

// The sender thread runs where a peer has a spare core for it or where the host's cores
// are oversubscribed, not where the ring's peers on the host just fill its cores.
TEST(RingModes, SenderThreadWhereACoreIsSpareOrCoresAreOversubscribed) {
  using lockstep::coll::ring_sender_thread;
  EXPECT_FALSE(ring_sender_thread(2, 2));   // a core each
  EXPECT_FALSE(ring_sender_thread(10, 16));
  EXPECT_FALSE(ring_sender_thread(16, 16));
  EXPECT_TRUE(ring_sender_thread(4, 2));    // oversubscribed
  EXPECT_TRUE(ring_sender_thread(17, 16));
  EXPECT_TRUE(ring_sender_thread(1, 2));    // a spare core
  EXPECT_TRUE(ring_sender_thread(8, 16));
  EXPECT_FALSE(ring_sender_thread(4, 0));   // core count unknown
  EXPECT_FALSE(ring_sender_thread(0, 16));  // not in the ring's view
}

// The one-thread ring spins before it sleeps where the ring's peers on the host have a
// core each, never where they oversubscribe the cores.
TEST(RingModes, SpinsBeforeSleepingOnlyWhereNoCoreIsOversubscribed) {
  using lockstep::coll::kRingSpinUs;
  using lockstep::coll::ring_spin_us;
  EXPECT_EQ(ring_spin_us(2, 2), kRingSpinUs);
  EXPECT_EQ(ring_spin_us(1, 2), kRingSpinUs);
  EXPECT_EQ(ring_spin_us(16, 16), kRingSpinUs);
  EXPECT_EQ(ring_spin_us(4, 2), 0u);
  EXPECT_EQ(ring_spin_us(17, 16), 0u);
  EXPECT_EQ(ring_spin_us(2, 0), 0u);  // core count unknown
  EXPECT_EQ(ring_spin_us(0, 2), 0u);  // not in the ring's view
}

// The same-host tuning is for the one-thread spinning ring and large buffers only, and
// for each connection only where the peer at its other end runs on this host.
TEST(RingModes, TunesConnectionsToPeersOnThisHostInTheSpinningOneThreadRing) {
  using lockstep::coll::RingPlan;
  struct Tuned {
    bool tx, rx;
  };
  const auto tune = [](bool prev_here, bool next_here, std::uint32_t spin_us, std::size_t thread_min, std::size_t count) {
    RingPlan plan;
    plan.count = count;  // f32
    plan.spin_us = spin_us;
    plan.sender_thread_bytes_min = thread_min;
    lockstep::coll::tune_same_host(plan, prev_here, next_here);
    EXPECT_EQ(plan.rx_buffer_bytes > 0, plan.rx_lowat_bytes > 0);
    return Tuned{plan.tx_buffer_bytes > 0, plan.rx_buffer_bytes > 0};
  };
  constexpr std::size_t kLarge = 64 * 1024 * 1024 / 4;
  constexpr std::size_t kMin = lockstep::coll::kRingSameHostTuningBytesMin / 4;
  constexpr std::uint32_t kSpin = lockstep::coll::kRingSpinUs;
  auto t = tune(true, true, kSpin, SIZE_MAX, kLarge);
  EXPECT_TRUE(t.tx && t.rx);
  t = tune(true, true, kSpin, SIZE_MAX, kMin);
  EXPECT_TRUE(t.tx && t.rx);
  t = tune(true, false, kSpin, SIZE_MAX, kLarge);  // the next peer on another host
  EXPECT_TRUE(!t.tx && t.rx);
  t = tune(false, true, kSpin, SIZE_MAX, kLarge);  // the previous peer on another host
  EXPECT_TRUE(t.tx && !t.rx);
  t = tune(true, true, kSpin, SIZE_MAX, kMin - 1);  // small
  EXPECT_TRUE(!t.tx && !t.rx);
  t = tune(true, true, 0, SIZE_MAX, kLarge);  // cores oversubscribed
  EXPECT_TRUE(!t.tx && !t.rx);
  t = tune(true, true, kSpin, lockstep::coll::kSenderThreadBytesMin, kLarge);  // a sender thread
  EXPECT_TRUE(!t.tx && !t.rx);
}

// Counts below the ring size (empty chunks) and just above it: every peer ends with the
// exact sum (small integers in f32). Through the communicator such buffers travel with the
// votes; a quantized one takes the ring, with one thread (a sender thread starts at 4 MiB).
// Not with two: there every sub-chunk is one system call, and ThreadSanitizer reports the
// receive of an element's final value as racing with the earlier send of its partial sum,
// an order the ring itself guarantees (the final value is made from that partial sum) but
// that the sanitizer, which sees only this process, cannot.
TEST(RingModes, CountsBelowAndJustAboveTheRingSize) {
  constexpr std::size_t kPeers = 4;
  for (const std::size_t count : {std::size_t{1}, std::size_t{3}, std::size_t{5}}) {
    SCOPED_TRACE(std::to_string(count) + " elements");
    std::vector<std::vector<float>> data(kPeers);
    for (std::size_t i = 0; i < kPeers; ++i) {
      for (std::size_t k = 0; k < count; ++k) data[i].push_back(static_cast<float>((i + 1) * (k + 1)));
    }
    std::vector<RingPlan> plans(kPeers);
    for (std::size_t i = 0; i < kPeers; ++i) {
      plans[i] = Ring::base_plan(static_cast<std::uint32_t>(i), data[i], data[i]);
      plans[i].world = kPeers;
    }
    std::vector<SocketPair> links(kPeers);
    std::vector<RingScratch> scratch(kPeers);
    const auto status = run_ring(plans, links, scratch);
    for (std::size_t i = 0; i < kPeers; ++i) {
      ASSERT_TRUE(status[i].is_ok()) << i << ": " << status[i].to_string();
      for (std::size_t k = 0; k < count; ++k) EXPECT_EQ(data[i][k], static_cast<float>(10 * (k + 1))) << i << "/" << k;
    }
  }
}

// ---------------------------------------------------------------- the commit exchange

using lockstep::coll::CommitEnd;

// Bytes waiting to be read on a receiving end.
int unread(int fd) {
  int n = -1;
  EXPECT_EQ(::ioctl(fd, FIONREAD, &n), 0);
  return n;
}

// Each peer runs the attempt and then the commit exchange, on its own thread; `settled`
// (per peer, may be null) is its master's outcome already in.
struct CommitRun {
  std::vector<lockstep::Status> status;
  std::vector<lockstep::Result<CommitEnd>> end;
  std::vector<lockstep::coll::RingStats> stats;  // the attempts' (the exchange's are not counted)
};
CommitRun run_with_commit(const std::vector<RingPlan>& plans, std::vector<SocketPair>& links,
                          std::vector<RingScratch>& scratch, const std::vector<std::atomic<bool>*>& settled) {
  const std::size_t n = plans.size();
  CommitRun out{std::vector<lockstep::Status>(n),
                std::vector<lockstep::Result<CommitEnd>>(n, lockstep::Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "not run")),
                std::vector<lockstep::coll::RingStats>(n)};
  std::vector<std::thread> peers;
  for (std::size_t i = 0; i < n; ++i) {
    peers.emplace_back([&, i] {
      RingIo io;
      io.tx_fd = links[i].fds[0];
      io.rx_fd = links[(i + n - 1) % n].fds[1];
      io.stall_timeout_ms = 10'000;
      io.settled_flag = settled[i];
      out.status[i] = lockstep::coll::run_ring_all_reduce(plans[i], io, scratch[i], &out.stats[i]);
      if (out.status[i].is_ok()) out.end[i] = lockstep::coll::run_ring_commit(plans[i], io, nullptr);
    });
  }
  for (auto& t : peers) t.join();
  return out;
}

// Every peer commits once the tokens went round, and the exchange leaves nothing on the
// connections: the next attempt on them runs as on fresh ones. A peer that learned the
// outcome first (settled) sends its remaining tokens and stops reading; the tokens it did
// not read are skipped by the next attempt, whose result is exact.
TEST(RingCommit, TokensGoRoundAndWhatASettledPeerLeftIsSkippedByTheNextAttempt) {
  constexpr std::size_t kPeers = 4;
  // Small enough that a peer's data never waits in a full send buffer: a settled peer
  // whose tokens cannot leave at once fails instead (the caller replaces the
  // connections), which a slow build (ThreadSanitizer) made happen with 400 KB.
  constexpr std::size_t kCount = 10'000;
  std::vector<SocketPair> links(kPeers);
  std::vector<RingScratch> scratch(kPeers);
  std::atomic<bool> settled{true};
  // Peer 0 settles by the outcome in the second and fourth attempts, leaving its previous
  // peer's tokens unread: the third, an all-reduce, meets them in its data phase; the
  // fifth, a broadcast from peer 0 whose data phase reads nothing, in its exchange.
  struct Round {
    bool settle_first;
    bool broadcast;
  };
  std::uint64_t attempt = 0;
  for (const Round round : {Round{false, false}, Round{true, false}, Round{false, false}, Round{true, false}, Round{false, true},
                           Round{false, false}}) {
    ++attempt;
    SCOPED_TRACE("attempt " + std::to_string(attempt));
    std::vector<std::vector<float>> data(kPeers);
    std::vector<RingPlan> plans(kPeers);
    for (std::size_t i = 0; i < kPeers; ++i) {
      data[i].assign(kCount, static_cast<float>(i + attempt));
      plans[i] = Ring::base_plan(static_cast<std::uint32_t>(i), data[i], data[i]);
      plans[i].world = kPeers;
      plans[i].attempt = attempt;
      if (round.broadcast) plans[i].kind = lockstep::coll::RingKind::kBroadcast;  // root 0
    }
    std::vector<std::atomic<bool>*> flags(kPeers, nullptr);
    if (round.settle_first) flags[0] = &settled;
    const CommitRun run = run_with_commit(plans, links, scratch, flags);
    const float want = round.broadcast ? static_cast<float>(attempt)
                                       : static_cast<float>(0 + 1 + 2 + 3 + kPeers * attempt);
    for (std::size_t i = 0; i < kPeers; ++i) {
      ASSERT_TRUE(run.status[i].is_ok()) << i << ": " << run.status[i].to_string();
      ASSERT_TRUE(run.end[i].is_ok()) << i << ": " << run.end[i].status().to_string();
      EXPECT_EQ(run.end[i].value(), round.settle_first && i == 0 ? CommitEnd::kSettled : CommitEnd::kCommitted) << i;
      EXPECT_EQ(data[i], std::vector<float>(kCount, want)) << i;
      // What a peer counts as received is what its previous peer counts as sent: the
      // tokens it skipped are not counted, as their sender does not count them.
      EXPECT_EQ(run.stats[i].bytes_received, run.stats[(i + kPeers - 1) % kPeers].bytes_sent) << i;
    }
    // Only the settled peer's connection from its previous peer holds unread tokens
    // (world - 1 of them, 16 bytes each).
    for (std::size_t i = 0; i < kPeers; ++i) {
      EXPECT_EQ(unread(links[i].fds[1]), round.settle_first && i == kPeers - 1 ? int{16 * (kPeers - 1)} : 0) << i;
    }
  }
}

// A ring of one commits at once; a frame that is not this attempt's token, a neighbour
// that closes, and an abort end the exchange with an error (the caller then drops the
// connections and waits for the master's outcome).
TEST(RingCommit, AnythingButTheAttemptsTokensEndsTheExchange) {
  std::vector<float> a(1000, 1.0f);
  RingPlan plan = Ring::base_plan(0, a, a);
  plan.world = 1;
  RingIo alone;
  auto end = lockstep::coll::run_ring_commit(plan, alone, nullptr);
  ASSERT_TRUE(end.is_ok());
  EXPECT_EQ(end.value(), CommitEnd::kCommitted);
  plan.world = 2;
  plan.attempt = 5;
  for (int c = 0; c < 4; ++c) {
    SCOPED_TRACE(c);
    SocketPair a_to_b, b_to_a;
    AbortSignal abort;
    RingIo io;
    io.tx_fd = a_to_b.fds[0];
    io.rx_fd = b_to_a.fds[1];
    io.stall_timeout_ms = 10'000;
    abort.attach(io);
    std::vector<std::uint8_t> frame(lockstep::coll::kRingHeaderBytes);
    if (c == 0) lockstep::coll::put_ring_header(frame.data(), {0, 1, 0, 5});  // a data frame's header
    if (c == 1) lockstep::coll::put_ring_header(frame.data(), {0, 1, lockstep::coll::kRingTokenSeq, 6});  // a later token
    if (c <= 1) {
      ASSERT_EQ(::write(b_to_a.fds[0], frame.data(), frame.size()), static_cast<ssize_t>(frame.size()));
    }
    if (c == 2) {
      ::close(b_to_a.fds[0]);
      b_to_a.fds[0] = -1;
    }
    if (c == 3) abort.raise();
    end = lockstep::coll::run_ring_commit(plan, io, nullptr);
    ASSERT_FALSE(end.is_ok());
    EXPECT_EQ(end.status().code(), c <= 1 ? LOCKSTEP_STATUS_PROTOCOL_ERROR : LOCKSTEP_STATUS_PEER_CONNECTION_LOST)
        << end.status().to_string();
    // Its own token went out first (it holds the result), whole.
    EXPECT_EQ(unread(a_to_b.fds[1]), c == 3 ? 0 : 16);
  }
}

// Once the outcome came, nothing is waited for: a peer whose tokens cannot leave at once
// (its send buffer still full of data a cut link has not acknowledged) ends at once,
// out of step, rather than at the stall timeout.
TEST(RingCommit, ASettledPeerNeverWaitsForItsTokensToLeave) {
  std::vector<float> a(1000, 1.0f);
  RingPlan plan = Ring::base_plan(0, a, a);
  plan.world = 3;
  SocketPair a_to_b, c_to_a;
  std::vector<std::uint8_t> fill(65536, 0);
  while (::send(a_to_b.fds[0], fill.data(), fill.size(), MSG_DONTWAIT) > 0) {
  }
  std::atomic<bool> settled{false};
  AbortSignal signal;
  RingIo io;
  io.tx_fd = a_to_b.fds[0];
  io.rx_fd = c_to_a.fds[1];
  io.stall_timeout_ms = 30'000;
  io.abort_fd = signal.fd;
  io.settled_flag = &settled;
  std::thread outcome([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    settled.store(true);
    const std::uint64_t one = 1;
    EXPECT_EQ(::write(signal.fd, &one, sizeof one), static_cast<ssize_t>(sizeof one));
  });
  const auto started = std::chrono::steady_clock::now();
  const auto end = lockstep::coll::run_ring_commit(plan, io, nullptr);
  const auto waited = std::chrono::steady_clock::now() - started;
  outcome.join();
  ASSERT_FALSE(end.is_ok());
  EXPECT_EQ(end.status().code(), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << end.status().to_string();
  EXPECT_LT(waited, std::chrono::seconds(10)) << "it waited for the stall timeout";
}
