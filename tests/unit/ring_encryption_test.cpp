// The ring driver with the data plane encrypted (RingIo's seal and open), over socket
// pairs and without a master:
//  - encrypted and unencrypted rings give the same bits for several dtypes, ops, world
//    sizes and both quantizations, and the wire carries exactly one tag more per frame;
//  - connections reused by a second attempt keep their counters in step, and a receiver
//    whose counter is not the sender's (a replayed or re-keyed stream) fails;
//  - a relay between two neighbours that flips one byte of one frame: with encryption the
//    receiver fails with PROTOCOL_ERROR and both destinations are restored; without it
//    the same flip goes unnoticed and corrupts the sum (what the encryption is for).
#include "collectives/ring.h"
#include "kernels/reduce.h"
#include "security/crypto.h"

#include <gtest/gtest.h>

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
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
using lockstep::coll::RingStats;
using lockstep::security::Aead;
using Bytes = std::vector<std::uint8_t>;

struct SocketPair {
  int fds[2] = {-1, -1};
  SocketPair() { EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, fds), 0); }
  ~SocketPair() { close_all(); }
  void close_all() {
    for (int& fd : fds) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  }
};

// The cipher state of one ring connection: the sender's and the receiver's Aead under
// one fresh key, as a p2p handshake would leave them.
struct Channel {
  std::unique_ptr<Aead> seal;
  std::unique_ptr<Aead> open;
  Channel() {
    const auto key = lockstep::security::random_key();
    seal = std::make_unique<Aead>(key);
    open = std::make_unique<Aead>(key);
  }
};

struct Config {
  std::size_t world = 2;
  lockstep_dtype_t dtype = LOCKSTEP_F32;
  lockstep_reduce_op_t op = LOCKSTEP_SUM;
  lockstep_quantization_t quant = LOCKSTEP_QUANT_NONE;
  std::size_t count = 10'000;
  std::size_t subchunk_bytes = 4096;
};

// Deterministic input of peer `rank`: small values, so that sums and products stay finite.
Bytes input(const Config& c, std::size_t rank) {
  const std::size_t size = lockstep::coll::dtype_size(c.dtype);
  Bytes out(c.count * size);
  std::mt19937 rng(static_cast<unsigned>(1000 * rank) + static_cast<unsigned>(c.dtype) * 31u + static_cast<unsigned>(c.op));
  for (std::size_t i = 0; i < c.count; ++i) {
    const double v = static_cast<double>(rng() % 7) + 0.25 * static_cast<double>(rank) + 1.0;
    std::uint8_t* p = out.data() + i * size;
    switch (c.dtype) {
      case LOCKSTEP_F32: { const float f = static_cast<float>(v); std::memcpy(p, &f, 4); break; }
      case LOCKSTEP_F64: std::memcpy(p, &v, 8); break;
      case LOCKSTEP_I32: { const std::int32_t x = static_cast<std::int32_t>(v * 4); std::memcpy(p, &x, 4); break; }
      case LOCKSTEP_U8: *p = static_cast<std::uint8_t>(v); break;
      case LOCKSTEP_BF16: {  // the top half of the float's bits
        const float f = static_cast<float>(v);
        std::uint32_t bits = 0;
        std::memcpy(&bits, &f, 4);
        const auto h = static_cast<std::uint16_t>(bits >> 16);
        std::memcpy(p, &h, 2);
        break;
      }
      default: std::memset(p, static_cast<int>(rng() % 5), size); break;
    }
  }
  return out;
}

struct Outcome {
  std::vector<Bytes> buffers;
  std::vector<Status> status;
  std::vector<RingStats> stats;
};

// Runs one attempt over `world` peers on the given connections (pairs[i]: i -> i+1). With
// channels, encrypted. In place: each peer's buffer is its input.
// With `commit`, each peer then runs the commit exchange (peer 0 with its outcome already
// in when `settled0`), and its end goes to `ends`.
Outcome run_ring(const Config& c, std::vector<SocketPair>& pairs, std::vector<Channel>* channels,
                 std::vector<RingScratch>& scratch, std::uint64_t attempt, std::vector<Bytes> buffers,
                 std::vector<lockstep::Result<lockstep::coll::CommitEnd>>* ends = nullptr,
                 const std::atomic<bool>* settled0 = nullptr) {
  Outcome out;
  out.buffers = std::move(buffers);
  out.status.resize(c.world);
  out.stats.resize(c.world);
  std::vector<std::thread> threads;
  for (std::size_t r = 0; r < c.world; ++r) {
    threads.emplace_back([&, r] {
      RingPlan plan;
      plan.world = c.world;
      plan.rank = r;
      plan.src = out.buffers[r].data();
      plan.dst = out.buffers[r].data();
      plan.count = c.count;
      plan.dtype = c.dtype;
      plan.op = c.op;
      plan.quantization = c.quant;
      plan.attempt = attempt;
      plan.subchunk_bytes = c.subchunk_bytes;
      RingIo io;
      io.tx_fd = pairs[r].fds[0];
      io.rx_fd = pairs[(r + c.world - 1) % c.world].fds[1];
      io.stall_timeout_ms = 20'000;
      if (channels != nullptr) {
        io.seal = (*channels)[r].seal.get();
        io.open = (*channels)[(r + c.world - 1) % c.world].open.get();
      }
      out.status[r] = lockstep::coll::run_ring_all_reduce(plan, io, scratch[r], &out.stats[r]);
      if (out.status[r].is_ok() && ends != nullptr) {
        if (r == 0) io.settled_flag = settled0;
        (*ends)[r] = lockstep::coll::run_ring_commit(plan, io, nullptr);
      }
      if (!out.status[r].is_ok()) {  // the neighbours fail at once instead of at the stall timeout
        ::shutdown(io.tx_fd, SHUT_RDWR);
        ::shutdown(io.rx_fd, SHUT_RDWR);
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

Outcome run_fresh(const Config& c, bool encrypted) {
  std::vector<SocketPair> pairs(c.world);
  std::vector<Channel> channels(c.world);
  std::vector<RingScratch> scratch(c.world);
  std::vector<Bytes> inputs;
  for (std::size_t r = 0; r < c.world; ++r) inputs.push_back(input(c, r));
  return run_ring(c, pairs, encrypted ? &channels : nullptr, scratch, 1, inputs);
}

TEST(RingEncryption, SameBitsAsUnencryptedAcrossDtypesOpsWorldsAndQuantization) {
  std::vector<Config> configs;
  for (std::size_t world : {std::size_t{2}, std::size_t{3}, std::size_t{4}}) {
    for (auto dtype : {LOCKSTEP_F32, LOCKSTEP_F64, LOCKSTEP_I32, LOCKSTEP_U8, LOCKSTEP_BF16}) {
      for (auto op : {LOCKSTEP_SUM, LOCKSTEP_AVG, LOCKSTEP_MAX}) {
        configs.push_back(Config{world, dtype, op, LOCKSTEP_QUANT_NONE, 10'007, 4096});
      }
    }
    for (auto quant : {LOCKSTEP_QUANT_MINMAX_U8, LOCKSTEP_QUANT_ZERO_POINT_U8}) {
      configs.push_back(Config{world, LOCKSTEP_F32, LOCKSTEP_SUM, quant, 10'007, 4096});
      configs.push_back(Config{world, LOCKSTEP_BF16, LOCKSTEP_SUM, quant, 5'001, 1024});
    }
  }
  configs.push_back(Config{3, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, 2, 4096});  // empty chunks
  configs.push_back(Config{5, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, 300'000, 1 << 20});
  for (const auto& c : configs) {
    SCOPED_TRACE("world " + std::to_string(c.world) + " dtype " + std::to_string(c.dtype) + " op " +
                 std::to_string(c.op) + " quant " + std::to_string(c.quant) + " count " + std::to_string(c.count));
    const Outcome plain = run_fresh(c, false);
    const Outcome sealed = run_fresh(c, true);
    for (std::size_t r = 0; r < c.world; ++r) {
      ASSERT_TRUE(plain.status[r].is_ok()) << plain.status[r].to_string();
      ASSERT_TRUE(sealed.status[r].is_ok()) << sealed.status[r].to_string();
      EXPECT_EQ(sealed.buffers[r], plain.buffers[r]) << "rank " << r;
      EXPECT_EQ(sealed.buffers[r], sealed.buffers[0]) << "rank " << r << " differs from rank 0";
      // One tag more per frame, nothing else.
      EXPECT_GT(sealed.stats[r].bytes_sent, plain.stats[r].bytes_sent);
      EXPECT_EQ((sealed.stats[r].bytes_sent - plain.stats[r].bytes_sent) % lockstep::security::kTagBytes, 0u);
    }
  }
}

// Two attempts over the same connections: the counters go on from where they were on
// both ends. Counters out of step (a frame dropped, or one replayed) fail.
TEST(RingEncryption, ReusedConnectionsKeepCountersInStepAndAResetCounterFails) {
  Config c{3, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, 20'000, 4096};
  std::vector<SocketPair> pairs(c.world);
  std::vector<Channel> channels(c.world);
  std::vector<RingScratch> scratch(c.world);
  std::vector<Bytes> inputs;
  for (std::size_t r = 0; r < c.world; ++r) inputs.push_back(input(c, r));
  const Outcome expected = run_fresh(c, false);
  for (std::uint64_t attempt = 1; attempt <= 2; ++attempt) {
    const Outcome got = run_ring(c, pairs, &channels, scratch, attempt, inputs);
    for (std::size_t r = 0; r < c.world; ++r) {
      ASSERT_TRUE(got.status[r].is_ok()) << "attempt " << attempt << ": " << got.status[r].to_string();
      EXPECT_EQ(got.buffers[r], expected.buffers[r]);
    }
  }
  // Connection 0 -> 1 with a new key whose sender is one frame ahead of its receiver
  // (as if a frame had been dropped on the way): peer 1's first frame does not open.
  const auto key = lockstep::security::random_key();
  channels[0].seal = std::make_unique<Aead>(key);
  channels[0].open = std::make_unique<Aead>(key);
  Bytes advance(64);
  Bytes box(advance.size() + lockstep::security::kTagBytes);
  channels[0].seal->seal(advance, {}, box.data());  // the sender is one frame ahead
  std::vector<SocketPair> fresh(c.world);
  const Outcome got = run_ring(c, fresh, &channels, scratch, 3, inputs);
  EXPECT_EQ(got.status[1].code(), LOCKSTEP_STATUS_PROTOCOL_ERROR) << got.status[1].to_string();
  EXPECT_NE(got.status[1].message().find("does not verify"), std::string::npos) << got.status[1].message();
  EXPECT_EQ(got.buffers[1], inputs[1]) << "the failed peer's buffer must be restored";
}

// Sealed commit tokens: they keep each connection's counters in step, also where a peer
// whose outcome came first left its previous peer's tokens unread and the next attempt
// skipped them (opening each, so the counter moves on): the next attempts verify.
TEST(RingEncryption, SealedCommitTokensKeepCountersInStepWhenSkipped) {
  Config c{3, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, 20'000, 4096};
  std::vector<SocketPair> pairs(c.world);
  std::vector<Channel> channels(c.world);
  std::vector<RingScratch> scratch(c.world);
  std::vector<Bytes> inputs;
  for (std::size_t r = 0; r < c.world; ++r) inputs.push_back(input(c, r));
  const Outcome expected = run_fresh(c, false);
  const std::atomic<bool> settled{true};
  for (std::uint64_t attempt = 1; attempt <= 3; ++attempt) {
    SCOPED_TRACE("attempt " + std::to_string(attempt));
    std::vector<lockstep::Result<lockstep::coll::CommitEnd>> ends(
        c.world, lockstep::Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "not run"));
    const Outcome got = run_ring(c, pairs, &channels, scratch, attempt, inputs, &ends, attempt == 1 ? &settled : nullptr);
    for (std::size_t r = 0; r < c.world; ++r) {
      ASSERT_TRUE(got.status[r].is_ok()) << r << ": " << got.status[r].to_string();
      ASSERT_TRUE(ends[r].is_ok()) << r << ": " << ends[r].status().to_string();
      EXPECT_EQ(ends[r].value(), attempt == 1 && r == 0 ? lockstep::coll::CommitEnd::kSettled
                                                         : lockstep::coll::CommitEnd::kCommitted);
      EXPECT_EQ(got.buffers[r], expected.buffers[r]);
    }
  }
}

// Copies a_to_b's stream from `from` to `to`, flipping the byte at stream offset `flip`.
// Ends at EOF on `from`, on an error, or when stop is set.
void relay(int from, int to, std::uint64_t flip, const std::atomic<bool>& stop) {
  std::uint8_t buf[65536];
  std::uint64_t offset = 0;
  while (!stop.load()) {
    pollfd p{from, POLLIN, 0};
    if (::poll(&p, 1, 20) <= 0) continue;
    const ssize_t n = ::read(from, buf, sizeof buf);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      break;
    }
    if (flip >= offset && flip < offset + static_cast<std::uint64_t>(n)) buf[flip - offset] ^= 0x01;
    offset += static_cast<std::uint64_t>(n);
    for (ssize_t done = 0; done < n && !stop.load();) {
      // MSG_NOSIGNAL: the receiver may have shut its end down already (no SIGPIPE).
      const ssize_t w = ::send(to, buf + done, static_cast<std::size_t>(n - done), MSG_NOSIGNAL);
      if (w < 0) {
        if (errno == EAGAIN || errno == EINTR) {
          pollfd q{to, POLLOUT, 0};
          ::poll(&q, 1, 20);
          continue;
        }
        return;
      }
      done += w;
    }
  }
}

struct TamperResult {
  Status a, b;
  Bytes a_buffer, b_buffer;
  Bytes a_input, b_input;
};

// Two peers; a's frames to b pass a relay that flips byte `flip` of the stream. When b
// fails it closes its sockets, so that a fails too instead of waiting.
TamperResult run_tampered(bool encrypted, std::uint64_t flip) {
  Config c{2, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, 20'000, 4096};
  SocketPair a_to_relay, relay_to_b, b_to_a;
  Channel a_b, b_a;
  TamperResult out;
  out.a_input = input(c, 0);
  out.b_input = input(c, 1);
  out.a_buffer = out.a_input;
  out.b_buffer = out.b_input;
  std::atomic<bool> stop{false};
  std::thread relay_thread([&] { relay(a_to_relay.fds[1], relay_to_b.fds[0], flip, stop); });
  const auto plan = [&](std::size_t rank, Bytes& buffer) {
    RingPlan p;
    p.world = 2;
    p.rank = rank;
    p.src = buffer.data();
    p.dst = buffer.data();
    p.count = c.count;
    p.dtype = c.dtype;
    p.op = c.op;
    p.attempt = 7;
    p.subchunk_bytes = c.subchunk_bytes;
    return p;
  };
  RingScratch scratch_a, scratch_b;
  std::thread b_thread([&] {
    RingIo io;
    io.tx_fd = b_to_a.fds[0];
    io.rx_fd = relay_to_b.fds[1];
    io.stall_timeout_ms = 20'000;
    if (encrypted) {
      io.seal = b_a.seal.get();
      io.open = a_b.open.get();
    }
    out.b = lockstep::coll::run_ring_all_reduce(plan(1, out.b_buffer), io, scratch_b, nullptr);
    if (!out.b.is_ok()) {
      ::shutdown(b_to_a.fds[0], SHUT_RDWR);
      ::shutdown(relay_to_b.fds[1], SHUT_RDWR);
    }
  });
  RingIo io;
  io.tx_fd = a_to_relay.fds[0];
  io.rx_fd = b_to_a.fds[1];
  io.stall_timeout_ms = 20'000;
  if (encrypted) {
    io.seal = a_b.seal.get();
    io.open = b_a.open.get();
  }
  out.a = lockstep::coll::run_ring_all_reduce(plan(0, out.a_buffer), io, scratch_a, nullptr);
  b_thread.join();
  stop = true;
  relay_thread.join();
  return out;
}

TEST(RingEncryption, OneFlippedByteFailsTheReceiverAndBothDestinationsAreRestored) {
  // A frame is the 16-byte header, 4096 payload bytes and (encrypted) a 16-byte tag.
  const std::uint64_t frame = 16 + 4096 + 16;
  for (const std::uint64_t flip : {frame * 0 + 16 + 3,          // the first frame's payload
                                   frame * 2 + 16 + 4000,       // a later frame's payload
                                   frame * 1 + 16 + 4096 + 5}) {  // a tag
    SCOPED_TRACE("flipped byte " + std::to_string(flip));
    const TamperResult r = run_tampered(true, flip);
    EXPECT_EQ(r.b.code(), LOCKSTEP_STATUS_PROTOCOL_ERROR) << r.b.to_string();
    EXPECT_NE(r.b.message().find("does not verify"), std::string::npos) << r.b.message();
    EXPECT_FALSE(r.a.is_ok()) << "the sender must not succeed alone";
    EXPECT_EQ(r.b_buffer, r.b_input) << "the receiver's destination must be restored";
    EXPECT_EQ(r.a_buffer, r.a_input) << "the sender's destination must be restored";
  }
}

TEST(RingEncryption, WithoutEncryptionTheSameFlipCorruptsTheSumUnnoticed) {
  const TamperResult clean = run_tampered(false, ~std::uint64_t{0});
  const TamperResult r = run_tampered(false, 16 + 3);
  ASSERT_TRUE(clean.a.is_ok() && clean.b.is_ok());
  ASSERT_TRUE(r.a.is_ok()) << r.a.to_string();
  ASSERT_TRUE(r.b.is_ok()) << r.b.to_string();
  EXPECT_EQ(r.a_buffer, r.b_buffer) << "both peers end with the same (wrong) sum";
  EXPECT_NE(r.b_buffer, clean.b_buffer) << "the flipped byte should have changed the sum";
}

}  // namespace
