// The striped ring (several connections per hop, each hop choosing its own count), over
// socket pairs and without a master:
//  - striped rings give the bits of the unstriped ring, for 2 to 5 peers, hops with
//    different stream counts (1, 2, 3, 16), plain, quantized and encrypted, with one
//    thread and with a sender thread, and restore() brings the input back;
//  - a striped attempt aborted while data flows, and one whose neighbour stops midway,
//    restore the destination;
//  - a neighbour that announces more streams than it opens, sends a frame on the wrong
//    stream, announces a count above the bound or changes its count midway fails the
//    attempt with PROTOCOL_ERROR; one stream that stalls while the others flow fails it
//    at the stall timeout, not later.
#include "collectives/ring.h"
#include "ring_hops.h"
#include "security/crypto.h"

#include <gtest/gtest.h>

#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <thread>
#include <vector>

namespace {

using lockstep::Status;
using lockstep::coll::RingIo;
using lockstep::coll::RingPlan;
using lockstep::coll::RingScratch;
using lockstep::coll::RingStream;
using lockstep::testing::attach;
using lockstep::testing::Hop;
using lockstep::testing::SocketPair;

struct Case {
  std::size_t world = 4;
  std::vector<std::size_t> streams;  // per hop; empty: one each
  lockstep_quantization_t quant = LOCKSTEP_QUANT_NONE;
  bool encrypted = false;
  bool sender_thread = false;
  std::size_t count = 250'003;  // chunks of unequal length
};

std::vector<std::vector<float>> inputs(std::size_t world, std::size_t count) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> d(-1000.0f, 1000.0f);
  std::vector<std::vector<float>> input(world, std::vector<float>(count));
  for (auto& v : input) {
    for (auto& x : v) x = d(rng);
  }
  return input;
}

RingPlan plan_of(const Case& c, std::size_t rank, std::vector<float>& data) {
  RingPlan plan;
  plan.world = c.world;
  plan.rank = rank;
  plan.src = data.data();
  plan.dst = data.data();
  plan.count = data.size();
  plan.quantization = c.quant;
  plan.attempt = 3;
  plan.subchunk_bytes = 4096;
  plan.sender_thread_bytes_min = c.sender_thread ? 0 : SIZE_MAX;
  return plan;
}

// Runs one attempt of the case on every peer (one thread each); the results, after
// checking every status and that restore() gives back the input.
std::vector<std::vector<float>> run_case(const Case& c) {
  const auto input = inputs(c.world, c.count);
  auto data = input;
  std::vector<Hop> hops;
  for (std::size_t i = 0; i < c.world; ++i) hops.emplace_back(c.streams.empty() ? 1 : c.streams[i], c.encrypted);
  std::vector<RingPlan> plans(c.world);
  std::vector<RingScratch> scratch(c.world);
  std::vector<Status> status(c.world);
  std::vector<std::thread> peers;
  for (std::size_t i = 0; i < c.world; ++i) plans[i] = plan_of(c, i, data[i]);
  for (std::size_t i = 0; i < c.world; ++i) {
    peers.emplace_back([&, i] {
      RingIo io;
      attach(io, hops[i], hops[(i + c.world - 1) % c.world]);
      io.stall_timeout_ms = 30'000;
      status[i] = lockstep::coll::run_ring_all_reduce(plans[i], io, scratch[i], nullptr);
    });
  }
  for (auto& t : peers) t.join();
  for (std::size_t i = 0; i < c.world; ++i) {
    EXPECT_TRUE(status[i].is_ok()) << "peer " << i << ": " << status[i].to_string();
    EXPECT_EQ(std::memcmp(data[i].data(), data[0].data(), c.count * sizeof(float)), 0) << "peer " << i;
  }
  auto results = data;
  for (std::size_t i = 0; i < c.world; ++i) {
    lockstep::coll::restore(plans[i], scratch[i]);
    EXPECT_EQ(std::memcmp(data[i].data(), input[i].data(), c.count * sizeof(float)), 0) << "restore, peer " << i;
  }
  return results;
}

TEST(RingStripes, StripedRingsGiveTheBitsOfTheUnstripedRing) {
  struct Shape {
    std::size_t world;
    std::vector<std::size_t> streams;
  };
  const std::vector<Shape> shapes = {{2, {2, 3}}, {3, {16, 1, 2}}, {4, {3, 2, 1, 4}}, {5, {2, 2, 2, 2, 2}}};
  for (const auto quant : {LOCKSTEP_QUANT_NONE, LOCKSTEP_QUANT_MINMAX_U8}) {
    for (const bool encrypted : {false, true}) {
      for (const bool sender_thread : {false, true}) {
        for (const auto& shape : shapes) {
          SCOPED_TRACE(std::string(quant == LOCKSTEP_QUANT_NONE ? "plain" : "quantized") +
                       (encrypted ? ", encrypted" : "") + (sender_thread ? ", sender thread" : ", one thread") +
                       ", world " + std::to_string(shape.world));
          Case unstriped{shape.world, {}, quant, encrypted, sender_thread};
          Case striped = unstriped;
          striped.streams = shape.streams;
          const auto expected = run_case(unstriped);
          const auto got = run_case(striped);
          for (std::size_t i = 0; i < shape.world; ++i) {
            ASSERT_EQ(std::memcmp(got[i].data(), expected[i].data(), unstriped.count * sizeof(float)), 0)
                << "peer " << i << ": the striped ring must give the unstriped ring's bits";
          }
        }
      }
    }
  }
}

// More streams than sub-chunks: the streams without any carry nothing, and the sum is right.
TEST(RingStripes, MoreStreamsThanSubChunks) {
  Case c{2, {16, 16}};
  c.count = 3000;  // 12000 bytes: 2 chunks of 1.5 sub-chunks
  const auto got = run_case(c);
  const auto input = inputs(2, c.count);
  for (std::size_t k = 0; k < c.count; ++k) ASSERT_EQ(got[0][k], input[0][k] + input[1][k]) << k;
}

struct AbortSignal {
  int fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  std::atomic<bool> flag{false};
  ~AbortSignal() { ::close(fd); }
  void raise() {
    flag.store(true);
    const std::uint64_t one = 1;
    EXPECT_EQ(::write(fd, &one, sizeof one), static_cast<ssize_t>(sizeof one));
  }
};

// Two peers, each hop on 4 streams; peer 1 stops after `stop_after` bytes received
// (it then reads nothing more: a stopped process), and peer 0's attempt is aborted once
// it has received `abort_after` bytes, or runs into the stall timeout. Peer 0's
// destination must be as before.
void striped_attempt_fails_and_restores(bool sender_thread, bool abort) {
  Case c{2, {4, 4}};
  c.sender_thread = sender_thread;
  c.count = 1'000'000;
  auto input = inputs(2, c.count);
  auto a = input[0];
  Hop a_to_b(4, false), b_to_a(4, false);
  // Peer 1 plays its part by hand: it sends its step-0 frames on every stream and then
  // goes silent, so peer 0 has received part of its chunk when it fails.
  RingPlan plan = plan_of(c, 0, a);
  const std::size_t half = c.count / 2;  // peer 0 receives chunk 1 at step 0
  const std::size_t sub_elems = plan.subchunk_bytes / sizeof(float);
  for (std::size_t j = 0; j * sub_elems < half && j < 8; ++j) {
    std::uint8_t header[lockstep::coll::kRingHeaderBytes];
    lockstep::coll::put_ring_header(header, {static_cast<std::uint8_t>(j % 4), 4, static_cast<std::uint32_t>(j / 4),
                                             plan.attempt});
    ASSERT_EQ(::write(b_to_a.links[j % 4]->fds[0], header, sizeof header), static_cast<ssize_t>(sizeof header));
    const float* part = input[1].data() + half + j * sub_elems;
    ASSERT_EQ(::write(b_to_a.links[j % 4]->fds[0], part, plan.subchunk_bytes),
              static_cast<ssize_t>(plan.subchunk_bytes));
  }
  AbortSignal signal;
  RingIo io;
  attach(io, a_to_b, b_to_a);
  io.abort_fd = signal.fd;
  io.abort_flag = &signal.flag;
  io.stall_timeout_ms = abort ? 30'000 : 300;
  RingScratch scratch;
  std::thread aborter;
  if (abort) {
    aborter = std::thread([&] {
      // Once peer 0 has sent what its socket buffers take, it waits; abort it then.
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      signal.raise();
    });
  }
  const auto start = std::chrono::steady_clock::now();
  const Status s = lockstep::coll::run_ring_all_reduce(plan, io, scratch, nullptr);
  const auto took = std::chrono::steady_clock::now() - start;
  if (aborter.joinable()) aborter.join();
  EXPECT_EQ(s.code(), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << s.to_string();
  EXPECT_EQ(a, input[0]) << "the destination must be restored";
  if (!abort) {
    EXPECT_LT(took, std::chrono::seconds(10)) << "a stalled stream must fail at the stall timeout";
  }
}

TEST(RingStripes, AbortedStripedAttemptRestoresTheDestination) {
  striped_attempt_fails_and_restores(false, true);
  striped_attempt_fails_and_restores(true, true);
}

TEST(RingStripes, NeighbourStoppedMidwayFailsAtTheStallTimeoutAndRestores) {
  striped_attempt_fails_and_restores(false, false);
  striped_attempt_fails_and_restores(true, false);
}

// Peer 0 runs against a neighbour written by hand that sends `frames` (a header and
// 4096 bytes each, on the stream given) over a 4-stream hop, and whose rx_more hands
// over `opened` streams; the status.
struct Frame {
  lockstep::coll::RingHeader header;
  std::size_t stream;
};
Status against_bad_neighbour(const std::vector<Frame>& frames, std::size_t opened, bool sender_thread) {
  Case c{2, {1, 4}};
  c.sender_thread = sender_thread;
  c.count = 100'000;
  auto a = inputs(2, c.count)[0];
  const auto before = a;
  Hop a_to_b(1, false), b_to_a(4, false);
  for (const auto& f : frames) {
    std::uint8_t bytes[lockstep::coll::kRingHeaderBytes];
    lockstep::coll::put_ring_header(bytes, f.header);
    std::vector<std::uint8_t> frame(bytes, bytes + sizeof bytes);
    frame.resize(frame.size() + 4096, 0x3f);
    EXPECT_EQ(::write(b_to_a.links[f.stream]->fds[0], frame.data(), frame.size()), static_cast<ssize_t>(frame.size()));
  }
  RingPlan plan = plan_of(c, 0, a);
  RingIo io;
  attach(io, a_to_b, b_to_a);
  io.rx_more = [&](std::size_t streams, std::vector<RingStream>* out) {
    for (std::size_t k = 1; k < std::min(streams, opened); ++k) out->push_back(RingStream{b_to_a.links[k]->fds[1], nullptr});
    return Status::ok();
  };
  io.stall_timeout_ms = 5'000;
  RingScratch scratch;
  const Status s = lockstep::coll::run_ring_all_reduce(plan, io, scratch, nullptr);
  EXPECT_EQ(a, before) << "the destination must be restored";
  return s;
}

TEST(RingStripes, MisbehavingNeighbourFailsTheAttemptWithProtocolError) {
  constexpr std::uint64_t kAttempt = 3;
  for (const bool sender_thread : {false, true}) {
    SCOPED_TRACE(sender_thread ? "sender thread" : "one thread");
    const auto code = [&](const std::vector<Frame>& frames, std::size_t opened) {
      return against_bad_neighbour(frames, opened, sender_thread).code();
    };
    EXPECT_EQ(code({{{0, 4, 0, kAttempt}, 0}}, 2), LOCKSTEP_STATUS_PROTOCOL_ERROR) << "announces 4 streams, opens 2";
    EXPECT_EQ(code({{{1, 4, 0, kAttempt}, 0}}, 4), LOCKSTEP_STATUS_PROTOCOL_ERROR) << "stream 1's frame on stream 0";
    EXPECT_EQ(code({{{0, 4, 0, kAttempt}, 0}, {{2, 4, 0, kAttempt}, 1}}, 4), LOCKSTEP_STATUS_PROTOCOL_ERROR)
        << "stream 2's frame on stream 1";
    EXPECT_EQ(code({{{0, 17, 0, kAttempt}, 0}}, 4), LOCKSTEP_STATUS_PROTOCOL_ERROR) << "17 streams";
    EXPECT_EQ(code({{{0, 4, 0, kAttempt}, 0}, {{0, 2, 1, kAttempt}, 0}}, 4), LOCKSTEP_STATUS_PROTOCOL_ERROR)
        << "the count changes midway";
    EXPECT_EQ(code({{{0, 4, 0, kAttempt}, 0}, {{1, 4, 1, kAttempt}, 1}}, 4), LOCKSTEP_STATUS_PROTOCOL_ERROR)
        << "a stream's frame out of sequence";
  }
}

TEST(RingStripes, HeaderParsing) {
  std::uint8_t bytes[lockstep::coll::kRingHeaderBytes];
  lockstep::coll::put_ring_header(bytes, {3, 16, 0xdeadbeef, 0x0123456789abcdefull});
  auto h = lockstep::coll::parse_ring_header(bytes);
  ASSERT_TRUE(h.is_ok()) << h.status().to_string();
  EXPECT_EQ(h.value().stream, 3);
  EXPECT_EQ(h.value().streams, 16);
  EXPECT_EQ(h.value().seq, 0xdeadbeefu);
  EXPECT_EQ(h.value().attempt, 0x0123456789abcdefull);
  for (const auto& bad : std::vector<lockstep::coll::RingHeader>{{0, 0, 0, 1}, {0, 17, 0, 1}, {4, 4, 0, 1}}) {
    lockstep::coll::put_ring_header(bytes, bad);
    EXPECT_FALSE(lockstep::coll::parse_ring_header(bytes).is_ok()) << int{bad.stream} << " of " << int{bad.streams};
  }
  lockstep::coll::put_ring_header(bytes, {0, 1, 0, 1});
  bytes[1] ^= 1;
  EXPECT_FALSE(lockstep::coll::parse_ring_header(bytes).is_ok()) << "bad magic";
}

}  // namespace
