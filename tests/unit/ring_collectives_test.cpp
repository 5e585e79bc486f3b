// Broadcast, all-gather (equal and per-rank counts) and reduce-scatter on the ring, over
// socket pairs and without a master, against a reference computed here:
//  - 2, 3, 4 and 8 peers; counts 1, world - 1, odd and large; every dtype for the
//    copies, every op (and both quantizations) for reduce-scatter (LOCKSTEP_FULL_MATRIX=1:
//    every op and dtype for every world size, and 4 Mi elements); plain, striped and
//    encrypted hops, one thread and a sender thread; in place where it applies;
//  - restore() gives every destination back exactly;
//  - an attempt whose neighbour stops midway fails at the stall timeout and leaves the
//    destination as it was; bad plans are refused.
#include "collectives/ring.h"
#include "ring_hops.h"
#include "kernels/reduce.h"
#include "security/crypto.h"

#include <gtest/gtest.h>

#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <thread>
#include <vector>

namespace {

using lockstep::Status;
using lockstep::coll::RingIo;
using lockstep::coll::RingKind;
using lockstep::coll::RingPlan;
using lockstep::coll::RingScratch;
using lockstep::coll::RingStream;
using Bytes = std::vector<std::uint8_t>;
using lockstep::testing::Hop;

// Every hop of these tests has a generous stall timeout.
void attach_slow_stall(RingIo& io, const Hop& to, const Hop& from) {
  lockstep::testing::attach(io, to, from);
  io.stall_timeout_ms = 30'000;
}

struct Case {
  RingKind kind = RingKind::kAllGather;
  std::size_t world = 4;
  std::size_t count = 1;              // broadcast: the buffer; all-gather and reduce-scatter: per rank
  std::vector<std::size_t> counts;    // all-gather: per rank (overrides count)
  lockstep_dtype_t dtype = LOCKSTEP_F32;
  lockstep_reduce_op_t op = LOCKSTEP_SUM;
  lockstep_quantization_t quant = LOCKSTEP_QUANT_NONE;
  std::size_t root = 0;
  std::size_t streams = 1;
  bool encrypted = false;
  bool sender_thread = false;
  bool in_place = false;
};

std::size_t esize(lockstep_dtype_t d) { return lockstep::coll::dtype_size(d); }

// Random elements that every op takes without overflow surprises: small integers, and
// floats in [-100, 100] (as bytes of the dtype).
Bytes random_elements(std::size_t count, lockstep_dtype_t dtype, std::mt19937& rng) {
  Bytes out(count * esize(dtype));
  std::uniform_int_distribution<int> small(-3, 3);
  std::uniform_real_distribution<float> real(-100.0f, 100.0f);
  for (std::size_t i = 0; i < count; ++i) {
    std::uint8_t* p = out.data() + i * esize(dtype);
    switch (dtype) {
      case LOCKSTEP_F32: { const float v = real(rng); std::memcpy(p, &v, 4); break; }
      case LOCKSTEP_F64: { const double v = static_cast<double>(real(rng)); std::memcpy(p, &v, 8); break; }
      case LOCKSTEP_F16:
      case LOCKSTEP_BF16: {
        // Exactly representable small values in either 16-bit format: sign, exponent 2^k, top mantissa bits zero.
        const float v = static_cast<float>(small(rng));
        std::uint32_t bits;
        std::memcpy(&bits, &v, 4);
        std::uint16_t h = 0;
        if (dtype == LOCKSTEP_BF16) {
          h = static_cast<std::uint16_t>(bits >> 16);
        } else {
          const int iv = static_cast<int>(v);
          const std::uint16_t table[] = {0xc200, 0xc000, 0xbc00, 0x0000, 0x3c00, 0x4000, 0x4200};  // -3..3
          h = table[iv + 3];
        }
        std::memcpy(p, &h, 2);
        break;
      }
      default: {
        const std::int64_t v = small(rng) + (dtype == LOCKSTEP_U8 || dtype == LOCKSTEP_U16 || dtype == LOCKSTEP_U32 ||
                                                     dtype == LOCKSTEP_U64
                                                 ? 3
                                                 : 0);
        std::memcpy(p, &v, esize(dtype));  // little-endian: the low bytes
      }
    }
  }
  return out;
}

struct Outcome {
  std::vector<Bytes> out;     // each peer's destination after the attempt
  std::vector<Bytes> before;  // and before it
  std::vector<Bytes> input;
};

// Runs one attempt on every peer (a thread each), checks every status and that restore()
// gives each destination back, and returns the destinations.
Outcome run_case(const Case& c) {
  std::mt19937 rng(static_cast<unsigned>(c.world * 131 + c.count + static_cast<std::size_t>(c.kind) * 7));
  const std::size_t n = c.world;
  const std::size_t es = esize(c.dtype);
  std::vector<std::size_t> counts = c.counts;
  if (counts.empty()) counts.assign(n, c.count);
  std::size_t total = 0;
  for (const std::size_t k : counts) total += k;
  Outcome o;
  std::vector<Bytes> src(n), dst(n);
  for (std::size_t i = 0; i < n; ++i) {
    switch (c.kind) {
      case RingKind::kBroadcast:
        dst[i] = random_elements(c.count, c.dtype, rng);  // the root's is the message
        break;
      case RingKind::kAllGather:
        dst[i] = random_elements(total, c.dtype, rng);
        src[i] = random_elements(counts[i], c.dtype, rng);
        if (c.in_place) {
          std::size_t at = 0;
          for (std::size_t r = 0; r < i; ++r) at += counts[r];
          if (!src[i].empty()) std::memcpy(dst[i].data() + at * es, src[i].data(), src[i].size());
        }
        break;
      case RingKind::kReduceScatter:
        src[i] = random_elements(c.count * n, c.dtype, rng);
        dst[i] = random_elements(c.count, c.dtype, rng);
        break;
      case RingKind::kAllReduce: break;
    }
  }
  o.before = dst;
  o.input = c.kind == RingKind::kBroadcast ? dst : src;
  std::vector<Hop> hops;
  for (std::size_t i = 0; i < n; ++i) hops.emplace_back(c.streams, c.encrypted);
  std::vector<RingPlan> plans(n);
  for (std::size_t i = 0; i < n; ++i) {
    RingPlan& p = plans[i];
    p.kind = c.kind;
    p.world = n;
    p.rank = i;
    p.dtype = c.dtype;
    p.op = c.op;
    p.quantization = c.quant;
    p.attempt = 9;
    p.subchunk_bytes = 4096;
    p.sender_thread_bytes_min = c.sender_thread ? 0 : SIZE_MAX;
    p.root = c.root;
    p.dst = dst[i].data();
    switch (c.kind) {
      case RingKind::kBroadcast:
        p.src = dst[i].data();
        p.count = c.count;
        break;
      case RingKind::kAllGather: {
        p.count = total;
        if (!c.counts.empty()) p.counts = c.counts;
        std::size_t at = 0;
        for (std::size_t r = 0; r < i; ++r) at += counts[r];
        p.src = c.in_place ? static_cast<const void*>(dst[i].data() + at * es) : src[i].data();
        break;
      }
      case RingKind::kReduceScatter:
        p.src = src[i].data();
        p.count = c.count * n;
        break;
      case RingKind::kAllReduce: break;
    }
  }
  std::vector<RingScratch> scratch(n);
  std::vector<Status> status(n);
  std::vector<std::thread> peers;
  for (std::size_t i = 0; i < n; ++i) {
    peers.emplace_back([&, i] {
      RingIo io;
      attach_slow_stall(io, hops[i], hops[(i + n - 1) % n]);
      status[i] = lockstep::coll::run_ring(plans[i], io, scratch[i], nullptr);
    });
  }
  for (auto& t : peers) t.join();
  for (std::size_t i = 0; i < n; ++i) EXPECT_TRUE(status[i].is_ok()) << "peer " << i << ": " << status[i].to_string();
  o.out = dst;
  for (std::size_t i = 0; i < n; ++i) {
    lockstep::coll::restore(plans[i], scratch[i]);
    if (c.in_place) continue;  // the input was part of the destination
    EXPECT_EQ(dst[i], o.before[i]) << "restore, peer " << i;
  }
  return o;
}

void expect_broadcast(const Case& c) {
  const Outcome o = run_case(c);
  for (std::size_t i = 0; i < c.world; ++i) EXPECT_EQ(o.out[i], o.input[c.root]) << "peer " << i;
}

void expect_all_gather(const Case& c) {
  const Outcome o = run_case(c);
  Bytes want;
  for (std::size_t r = 0; r < c.world; ++r) want.insert(want.end(), o.input[r].begin(), o.input[r].end());
  for (std::size_t i = 0; i < c.world; ++i) EXPECT_EQ(o.out[i], want) << "peer " << i;
}

// Reduce-scatter: rank r's chunk is folded in ring order from rank r+1: r+1, r+2, ...,
// r (the reduce-scatter half of the ring turned by one place), then finished once.
Bytes reference_chunk(const Outcome& o, const Case& c, std::size_t r) {
  const std::size_t n = c.world;
  const std::size_t bytes = c.count * esize(c.dtype);
  Bytes acc(o.input[(r + 1) % n].begin() + static_cast<std::ptrdiff_t>(r * bytes),
            o.input[(r + 1) % n].begin() + static_cast<std::ptrdiff_t>((r + 1) * bytes));
  for (std::size_t k = 2; k <= n; ++k) {
    Bytes next(o.input[(r + k) % n].begin() + static_cast<std::ptrdiff_t>(r * bytes),
               o.input[(r + k) % n].begin() + static_cast<std::ptrdiff_t>((r + 1) * bytes));
    lockstep::coll::reduce(next.data(), acc.data(), c.count, c.dtype, c.op);
    acc = next;
  }
  lockstep::coll::finalize(acc.data(), c.count, c.dtype, c.op, static_cast<std::uint32_t>(n));
  return acc;
}

void expect_reduce_scatter(const Case& c) {
  const Outcome o = run_case(c);
  for (std::size_t r = 0; r < c.world; ++r) {
    const Bytes want = reference_chunk(o, c, r);
    if (c.quant == LOCKSTEP_QUANT_NONE) {
      EXPECT_EQ(o.out[r], want) << "rank " << r;
      continue;
    }
    // Quantized: the result is the decoded form of one final encoding per sub-chunk (1024
    // f32 of 4096 bytes here), so each sub-chunk takes at most levels + 1 values.
    const bool four = c.quant == LOCKSTEP_QUANT_MINMAX_U4 || c.quant == LOCKSTEP_QUANT_ZERO_POINT_U4;
    const std::size_t levels = four ? 15 : 255;
    for (std::size_t at = 0; at < c.count; at += 1024) {
      std::set<std::uint32_t> seen;
      for (std::size_t e = at; e < std::min(c.count, at + 1024); ++e) {
        std::uint32_t bits;
        std::memcpy(&bits, o.out[r].data() + e * 4, 4);
        seen.insert(bits);
      }
      EXPECT_LE(seen.size(), levels + 1) << "rank " << r << " sub-chunk at " << at << ": not one encoding's values";
    }
    // Each of the n-1 hops and the final encoding is off by at most half a step of its
    // range; the inputs are within [-100, 100].
    const float bound = static_cast<float>(c.world) * 200.0f * static_cast<float>(c.world) / static_cast<float>(levels);
    for (std::size_t e = 0; e < c.count; ++e) {
      float got, exact;
      std::memcpy(&got, o.out[r].data() + e * 4, 4);
      std::memcpy(&exact, want.data() + e * 4, 4);
      ASSERT_LE(std::fabs(got - exact), bound) << "rank " << r << " element " << e;
    }
  }
}

const std::size_t kWorlds[] = {2, 3, 4, 8};
// LOCKSTEP_FULL_MATRIX=1 (README): every op and dtype for every world size, and larger counts.
bool full_matrix() {
  const char* env = std::getenv("LOCKSTEP_FULL_MATRIX");
  return env != nullptr && env[0] == '1';
}
std::vector<std::size_t> counts_for(std::size_t world) {
  std::vector<std::size_t> counts = {1, world - 1 == 0 ? 1 : world - 1, 1001, 40'000};
  if (full_matrix()) counts.push_back(std::size_t{4} << 20);
  return counts;
}
std::vector<std::size_t> worlds_of_the_matrix() {
  return full_matrix() ? std::vector<std::size_t>(std::begin(kWorlds), std::end(kWorlds)) : std::vector<std::size_t>{3};
}

TEST(RingCollectives, BroadcastFromEveryRootGivesEveryPeerTheRootsBytes) {
  for (const std::size_t n : kWorlds) {
    for (const std::size_t count : counts_for(n)) {
      for (std::size_t root = 0; root < n; root += (n > 4 ? 3 : 1)) {
        Case c;
        c.kind = RingKind::kBroadcast;
        c.world = n;
        c.count = count;
        c.root = root;
        expect_broadcast(c);
      }
    }
  }
}

TEST(RingCollectives, AllGatherGivesEveryPeerAllContributionsInRankOrder) {
  for (const std::size_t n : kWorlds) {
    for (const std::size_t count : counts_for(n)) {
      for (const bool in_place : {false, true}) {
        Case c;
        c.kind = RingKind::kAllGather;
        c.world = n;
        c.count = count;
        c.in_place = in_place;
        expect_all_gather(c);
      }
    }
  }
}

TEST(RingCollectives, AllGatherWithCountsPerRankIncludingEmptyOnes) {
  for (const std::size_t n : kWorlds) {
    Case c;
    c.kind = RingKind::kAllGather;
    c.world = n;
    for (std::size_t r = 0; r < n; ++r) c.counts.push_back(r == 1 ? 0 : 997 * (r + 1) + r);
    expect_all_gather(c);
    c.in_place = true;
    expect_all_gather(c);
  }
}

TEST(RingCollectives, ReduceScatterGivesEachRankItsReducedChunk) {
  for (const std::size_t n : kWorlds) {
    for (const std::size_t count : counts_for(n)) {
      Case c;
      c.kind = RingKind::kReduceScatter;
      c.world = n;
      c.count = count;
      expect_reduce_scatter(c);
    }
  }
}

TEST(RingCollectives, ReduceScatterEveryOpAndDtype) {
  for (const std::size_t world : worlds_of_the_matrix()) {
  for (const auto op : {LOCKSTEP_SUM, LOCKSTEP_AVG, LOCKSTEP_PROD, LOCKSTEP_MAX, LOCKSTEP_MIN}) {
    for (int d = LOCKSTEP_U8; d <= LOCKSTEP_F64; ++d) {
      Case c;
      c.kind = RingKind::kReduceScatter;
      c.world = world;
      c.count = 777;
      c.dtype = static_cast<lockstep_dtype_t>(d);
      c.op = op;
      SCOPED_TRACE("world " + std::to_string(world) + " op " + std::to_string(op) + " dtype " + std::to_string(d));
      expect_reduce_scatter(c);
    }
  }
  }
}

TEST(RingCollectives, QuantizedReduceScatterStaysWithinTheBound) {
  for (const auto q : {LOCKSTEP_QUANT_MINMAX_U8, LOCKSTEP_QUANT_ZERO_POINT_U8, LOCKSTEP_QUANT_MINMAX_U4,
                       LOCKSTEP_QUANT_ZERO_POINT_U4}) {
    for (const std::size_t n : {std::size_t{2}, std::size_t{4}}) {
      Case c;
      c.kind = RingKind::kReduceScatter;
      c.world = n;
      c.count = 5000;
      c.quant = q;
      expect_reduce_scatter(c);
    }
  }
}

TEST(RingCollectives, EveryDtypeIsCopiedBitForBit) {
  for (const std::size_t world : worlds_of_the_matrix()) {
  for (int d = LOCKSTEP_U8; d <= LOCKSTEP_F64; ++d) {
    SCOPED_TRACE("world " + std::to_string(world) + " dtype " + std::to_string(d));
    Case c;
    c.world = world;
    c.count = 1234;
    c.dtype = static_cast<lockstep_dtype_t>(d);
    c.kind = RingKind::kAllGather;
    expect_all_gather(c);
    c.kind = RingKind::kBroadcast;
    c.root = world - 1;
    expect_broadcast(c);
  }
  }
}

TEST(RingCollectives, StripedEncryptedAndSenderThreadHops) {
  for (const std::size_t streams : {std::size_t{1}, std::size_t{3}}) {
    for (const bool encrypted : {false, true}) {
      for (const bool sender : {false, true}) {
        SCOPED_TRACE(std::to_string(streams) + " streams, encrypted " + std::to_string(encrypted) + ", sender thread " +
                     std::to_string(sender));
        Case c;
        c.world = 4;
        c.count = 30'001;
        c.streams = streams;
        c.encrypted = encrypted;
        c.sender_thread = sender;
        c.kind = RingKind::kBroadcast;
        c.root = 1;
        expect_broadcast(c);
        c.kind = RingKind::kAllGather;
        expect_all_gather(c);
        c.kind = RingKind::kReduceScatter;
        expect_reduce_scatter(c);
      }
    }
  }
}

// Peer 1 of 3 never runs: the others fail at the stall timeout with their destinations
// as they were (a broadcast's non-root buffers unchanged).
TEST(RingCollectives, AStoppedNeighbourFailsTheAttemptAndLeavesDestinationsUnchanged) {
  for (const RingKind kind : {RingKind::kBroadcast, RingKind::kAllGather, RingKind::kReduceScatter}) {
    const std::size_t n = 3, count = 50'000;
    std::mt19937 rng(5);
    std::vector<Hop> hops;
    for (std::size_t i = 0; i < n; ++i) hops.emplace_back(1, false);
    std::vector<Bytes> src(n), dst(n);
    for (std::size_t i = 0; i < n; ++i) {
      src[i] = random_elements(kind == RingKind::kReduceScatter ? count * n : count, LOCKSTEP_F32, rng);
      dst[i] = random_elements(kind == RingKind::kAllGather ? count * n : count, LOCKSTEP_F32, rng);
    }
    const auto before = dst;
    std::vector<Status> status(n);
    std::vector<std::thread> peers;
    for (const std::size_t i : {std::size_t{0}, std::size_t{2}}) {
      peers.emplace_back([&, i] {
        RingPlan p;
        p.kind = kind;
        p.world = n;
        p.rank = i;
        p.src = kind == RingKind::kBroadcast ? dst[i].data() : src[i].data();
        p.dst = dst[i].data();
        p.count = kind == RingKind::kBroadcast ? count : count * n;
        p.root = 0;
        p.attempt = 1;
        p.subchunk_bytes = 4096;
        RingIo io;
        attach_slow_stall(io, hops[i], hops[(i + n - 1) % n]);
        io.stall_timeout_ms = 300;
        RingScratch scratch;
        status[i] = lockstep::coll::run_ring(p, io, scratch, nullptr);
      });
    }
    for (auto& t : peers) t.join();
    for (const std::size_t i : {std::size_t{0}, std::size_t{2}}) {
      EXPECT_EQ(status[i].code(), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << "peer " << i << ": " << status[i].to_string();
      EXPECT_EQ(dst[i], before[i]) << "peer " << i;
    }
  }
}

TEST(RingCollectives, PlansThatCannotBeRunAreRefused) {
  Bytes buf(64);
  RingIo io;
  RingScratch scratch;
  RingPlan p;
  p.world = 2;
  p.src = buf.data();
  p.dst = buf.data();
  p.count = 4;
  p.kind = RingKind::kBroadcast;
  p.root = 2;
  EXPECT_EQ(lockstep::coll::run_ring(p, io, scratch, nullptr).code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  p.root = 0;
  p.quantization = LOCKSTEP_QUANT_MINMAX_U8;
  EXPECT_EQ(lockstep::coll::run_ring(p, io, scratch, nullptr).code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  p.quantization = LOCKSTEP_QUANT_NONE;
  p.kind = RingKind::kAllGather;
  p.counts = {1, 2, 1};
  EXPECT_EQ(lockstep::coll::run_ring(p, io, scratch, nullptr).code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  p.counts = {1, 2};
  EXPECT_EQ(lockstep::coll::run_ring(p, io, scratch, nullptr).code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  p.counts.clear();
  p.kind = RingKind::kReduceScatter;
  p.count = 5;
  EXPECT_EQ(lockstep::coll::run_ring(p, io, scratch, nullptr).code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
}

}  // namespace
