// Ring all-reduce correctness in one process: an embedded master and N peer threads.
// Every op x dtype, counts 1, world-1, odd and large, in place and out of place,
// against a reference computed independently in wide arithmetic; results must be
// bit-identical on every peer. LOCKSTEP_FULL_MATRIX=1 adds 8 peers and larger sizes.
#include "cluster.h"

#include "kernels/reduce.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <barrier>
#include <chrono>
#include <future>
#include <limits>
#include <mutex>
#include <random>
#include <algorithm>
#include <string>
#include <thread>

namespace lockstep::testing {
namespace {

// Whether ASan or TSan instruments this build: GCC says so with __SANITIZE_*__, Clang
// through __has_feature.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif
#else
constexpr bool kSanitized = false;
#endif

const lockstep_dtype_t kDtypes[] = {LOCKSTEP_U8,  LOCKSTEP_I8,  LOCKSTEP_U16,  LOCKSTEP_I16,
                                    LOCKSTEP_U32, LOCKSTEP_I32, LOCKSTEP_U64,  LOCKSTEP_I64,
                                    LOCKSTEP_F16, LOCKSTEP_BF16, LOCKSTEP_F32, LOCKSTEP_F64};
const lockstep_reduce_op_t kOps[] = {LOCKSTEP_SUM, LOCKSTEP_AVG, LOCKSTEP_PROD, LOCKSTEP_MAX, LOCKSTEP_MIN};

bool full_matrix() {
  const char* env = std::getenv("LOCKSTEP_FULL_MATRIX");
  return env != nullptr && std::string(env) == "1";
}

bool is_signed(lockstep_dtype_t t) { return t == LOCKSTEP_I8 || t == LOCKSTEP_I16 || t == LOCKSTEP_I32 || t == LOCKSTEP_I64; }
bool is_float(lockstep_dtype_t t) { return coll::is_float(t); }

// Element value of peer p at index i, as a double that the dtype represents exactly
// (floats near 1 so that products stay finite; integers anywhere in range).
double input_value(lockstep_dtype_t t, std::size_t p, std::size_t i) {
  const std::uint64_t h = (p + 1) * 0x9E3779B97F4A7C15ull ^ (i * 0xBF58476D1CE4E5B9ull);
  const std::uint64_t mixed = (h ^ (h >> 29)) * 0x94D049BB133111EBull;
  if (is_float(t)) return 0.5 + static_cast<double>(mixed % 64) / 64.0;  // 0.5 .. 1.484, exact in bf16
  return static_cast<double>(mixed % 200) - (is_signed(t) ? 100.0 : 0.0);
}

void store(void* buf, lockstep_dtype_t t, std::size_t i, double v) {
  switch (t) {
    case LOCKSTEP_U8: static_cast<std::uint8_t*>(buf)[i] = static_cast<std::uint8_t>(v); break;
    case LOCKSTEP_I8: static_cast<std::int8_t*>(buf)[i] = static_cast<std::int8_t>(v); break;
    case LOCKSTEP_U16: static_cast<std::uint16_t*>(buf)[i] = static_cast<std::uint16_t>(v); break;
    case LOCKSTEP_I16: static_cast<std::int16_t*>(buf)[i] = static_cast<std::int16_t>(v); break;
    case LOCKSTEP_U32: static_cast<std::uint32_t*>(buf)[i] = static_cast<std::uint32_t>(v); break;
    case LOCKSTEP_I32: static_cast<std::int32_t*>(buf)[i] = static_cast<std::int32_t>(v); break;
    case LOCKSTEP_U64: static_cast<std::uint64_t*>(buf)[i] = static_cast<std::uint64_t>(v); break;
    case LOCKSTEP_I64: static_cast<std::int64_t*>(buf)[i] = static_cast<std::int64_t>(v); break;
    case LOCKSTEP_F16: static_cast<std::uint16_t*>(buf)[i] = coll::f64_to_f16(v); break;
    case LOCKSTEP_BF16: static_cast<std::uint16_t*>(buf)[i] = coll::f64_to_bf16(v); break;
    case LOCKSTEP_F32: static_cast<float*>(buf)[i] = static_cast<float>(v); break;
    case LOCKSTEP_F64: static_cast<double*>(buf)[i] = v; break;
  }
}

double load_float(const void* buf, lockstep_dtype_t t, std::size_t i) {
  switch (t) {
    case LOCKSTEP_F16: return static_cast<double>(coll::f16_to_f32(static_cast<const std::uint16_t*>(buf)[i]));
    case LOCKSTEP_BF16: return static_cast<double>(coll::bf16_to_f32(static_cast<const std::uint16_t*>(buf)[i]));
    case LOCKSTEP_F32: return static_cast<double>(static_cast<const float*>(buf)[i]);
    default: return static_cast<const double*>(buf)[i];
  }
}

std::uint64_t load_bits(const void* buf, lockstep_dtype_t t, std::size_t i) {
  std::uint64_t out = 0;
  std::memcpy(&out, static_cast<const std::uint8_t*>(buf) + i * coll::dtype_size(t), coll::dtype_size(t));
  return out;
}

// The reference for integers: wrapped arithmetic in 64 bits, truncated to the width;
// avg divides the wrapped sum (as the signed or unsigned type) truncating toward zero.
std::uint64_t int_reference(lockstep_dtype_t t, lockstep_reduce_op_t op, std::size_t world, std::size_t i) {
  const unsigned bits = static_cast<unsigned>(coll::dtype_size(t) * 8);
  const std::uint64_t mask = bits == 64 ? ~0ull : ((1ull << bits) - 1);
  auto as_signed = [&](std::uint64_t v) -> std::int64_t {
    if (bits == 64) return static_cast<std::int64_t>(v);
    const std::uint64_t sign = 1ull << (bits - 1);
    return static_cast<std::int64_t>((v ^ sign) - sign);
  };
  std::uint64_t acc = 0;
  std::int64_t best = 0;
  for (std::size_t p = 0; p < world; ++p) {
    const double v = input_value(t, p, i);
    const auto bitsv = static_cast<std::uint64_t>(static_cast<std::int64_t>(v)) & mask;
    if (p == 0) {
      acc = bitsv;
      best = static_cast<std::int64_t>(v);
      continue;
    }
    switch (op) {
      case LOCKSTEP_SUM:
      case LOCKSTEP_AVG: acc = (acc + bitsv) & mask; break;
      case LOCKSTEP_PROD: acc = (acc * bitsv) & mask; break;
      case LOCKSTEP_MAX: best = std::max(best, static_cast<std::int64_t>(v)); break;
      case LOCKSTEP_MIN: best = std::min(best, static_cast<std::int64_t>(v)); break;
    }
  }
  if (op == LOCKSTEP_MAX || op == LOCKSTEP_MIN) return static_cast<std::uint64_t>(best) & mask;
  if (op == LOCKSTEP_AVG) {
    if (is_signed(t)) return static_cast<std::uint64_t>(as_signed(acc) / static_cast<std::int64_t>(world)) & mask;
    return (acc / world) & mask;
  }
  return acc;
}

double float_reference(lockstep_dtype_t t, lockstep_reduce_op_t op, std::size_t world, std::size_t i) {
  double acc = input_value(t, 0, i);
  for (std::size_t p = 1; p < world; ++p) {
    const double v = input_value(t, p, i);
    switch (op) {
      case LOCKSTEP_SUM:
      case LOCKSTEP_AVG: acc += v; break;
      case LOCKSTEP_PROD: acc *= v; break;
      case LOCKSTEP_MAX: acc = std::max(acc, v); break;
      case LOCKSTEP_MIN: acc = std::min(acc, v); break;
    }
  }
  return op == LOCKSTEP_AVG ? acc / static_cast<double>(world) : acc;
}

double tolerance(lockstep_dtype_t t, std::size_t world) {
  const double steps = static_cast<double>(world);
  switch (t) {
    case LOCKSTEP_F16: return 1e-3 * steps;
    case LOCKSTEP_BF16: return 8e-3 * steps;
    case LOCKSTEP_F32: return 1e-6 * steps;
    default: return 1e-14 * steps;
  }
}

struct Case {
  lockstep_dtype_t dtype;
  lockstep_reduce_op_t op;
  std::size_t count;
  bool in_place;
};

// Every thread runs the same cases in the same order; results are compared across
// peers through a shared table of checksums.
void run_matrix(std::size_t world, const std::vector<std::size_t>& counts, bool secret = false) {
  std::vector<Case> cases;
  for (auto t : kDtypes) {
    for (auto op : kOps) {
      for (auto count : counts) {
        cases.push_back({t, op, count, true});
        cases.push_back({t, op, count, false});
      }
    }
  }
  std::mutex mutex;
  std::vector<std::vector<std::uint8_t>> first_result(cases.size());
  std::optional<security::Key> key;
  if (secret) key = security::derive_secret_key("the all-reduce matrix run's secret").value();
  Cluster cluster(5000 * LOCKSTEP_TEST_TIME_SCALE, key);
  cluster.run(world, [&](peer::Communicator& comm, std::size_t) {
    auto rank = comm.rank();
    ASSERT_TRUE(rank.is_ok());
    const std::size_t me = rank.value();
    for (std::size_t k = 0; k < cases.size(); ++k) {
      const Case& c = cases[k];
      const std::size_t esize = coll::dtype_size(c.dtype);
      std::vector<std::uint8_t> src(c.count * esize);
      for (std::size_t i = 0; i < c.count; ++i) store(src.data(), c.dtype, i, input_value(c.dtype, me, i));
      std::vector<std::uint8_t> dst(c.in_place ? 0 : c.count * esize, 0x5a);
      std::vector<std::uint8_t>& out = c.in_place ? src : dst;
      peer::ReduceDescriptor d;
      d.src = src.data();
      d.dst = out.data();
      d.count = c.count;
      d.dtype = c.dtype;
      d.op = c.op;
      d.tag = k;
      auto r = comm.all_reduce(d);
      ASSERT_TRUE(r.is_ok()) << "case " << k << ": " << r.status().to_string();
      EXPECT_EQ(r.value().world_size, world);
      if (!c.in_place) {
        // The input is untouched.
        for (std::size_t i = 0; i < c.count; ++i) {
          std::vector<std::uint8_t> expect(esize);
          store(expect.data(), c.dtype, 0, input_value(c.dtype, me, i));
          ASSERT_EQ(std::memcmp(expect.data(), src.data() + i * esize, esize), 0) << "input modified";
        }
      }
      for (std::size_t i = 0; i < c.count; ++i) {
        if (is_float(c.dtype)) {
          const double got = load_float(out.data(), c.dtype, i);
          const double want = float_reference(c.dtype, c.op, world, i);
          ASSERT_NEAR(got, want, tolerance(c.dtype, world) * std::max(1.0, std::fabs(want)))
              << "case " << k << " dtype " << c.dtype << " op " << c.op << " count " << c.count << " i " << i;
        } else {
          ASSERT_EQ(load_bits(out.data(), c.dtype, i), int_reference(c.dtype, c.op, world, i))
              << "case " << k << " dtype " << c.dtype << " op " << c.op << " count " << c.count << " i " << i;
        }
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (first_result[k].empty()) {
        first_result[k] = out;
      } else {
        ASSERT_EQ(first_result[k], out) << "case " << k << ": results differ between peers";
      }
    }
  });
}

TEST(AllReduce, EveryOpAndDtypeTwoPeers) { run_matrix(2, {1, 3, 1001, 100'003}); }
TEST(AllReduce, EveryOpAndDtypeThreePeers) { run_matrix(3, {1, 2, 1001, 100'003}); }
// The same over authenticated connections (a run secret: sealed control frames, pair keys).
TEST(AllReduce, EveryOpAndDtypeThreePeersWithSecret) { run_matrix(3, {1, 2, 1001, 100'003}, /*secret=*/true); }
TEST(AllReduce, EveryOpAndDtypeFourPeers) { run_matrix(4, {1, 3, 1001, 100'003}); }
TEST(AllReduce, EveryOpAndDtypeEightPeers) {
  if (!full_matrix()) GTEST_SKIP() << "set LOCKSTEP_FULL_MATRIX=1 for 8 peers";
  run_matrix(8, {1, 7, 1001, 3'000'001});
}

TEST(AllReduce, LargeBufferFourPeersIsBitIdentical) {
  const std::size_t count = (full_matrix() ? 64u : 8u) << 20;  // f32 elements: 32 or 256 MiB
  std::mutex mutex;
  std::vector<float> reference;
  Cluster cluster;
  cluster.run(4, [&](peer::Communicator& comm, std::size_t index) {
    std::vector<float> data(count);
    for (std::size_t i = 0; i < count; ++i) data[i] = static_cast<float>((i * 7 + index * 13) % 1000) * 0.25f;
    peer::ReduceDescriptor d{data.data(), data.data(), count, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, 1};
    auto r = comm.all_reduce(d);
    ASSERT_TRUE(r.is_ok()) << r.status().to_string();
    // Sums of quarters below 2^24 are exact in f32 whatever the order.
    for (std::size_t i = 0; i < count; i += 4099) {
      float want = 0;
      for (std::size_t p = 0; p < 4; ++p) want += static_cast<float>((i * 7 + p * 13) % 1000) * 0.25f;
      ASSERT_EQ(data[i], want) << i;
    }
    EXPECT_GT(r.value().bytes_sent, count * 4 * 3 / 2);  // 2(n-1)/n of the buffer
    std::lock_guard<std::mutex> lock(mutex);
    if (reference.empty()) {
      reference = data;
    } else {
      ASSERT_TRUE(reference == data) << "peers disagree";
    }
  });
}

// Quantized: every peer ends with the same bits, within the error the encodings allow.
// Inputs lie in [0.5, 1.5), so a partial sum of k contributions spans at most k and its
// min-max encoding with L levels errs by at most k/(2L) (scale/2); the n-1
// reduce-scatter hops and the one all-gather encoding add up to (n(n-1)/2 + n)/(2L),
// plus the dtype's own rounding. The zero-point encoding widens each range to include 0
// ([0, 1.5k)): x1.5. A cast errs by at most its relative rounding of a value below 1.5k.
struct QuantSet {
  std::vector<lockstep_dtype_t> dtypes;
  std::vector<lockstep_quantization_t> quants;
  std::vector<std::size_t> counts;
};

double levels(lockstep_quantization_t q) {
  return q == LOCKSTEP_QUANT_MINMAX_U4 || q == LOCKSTEP_QUANT_ZERO_POINT_U4 ? 15.0 : 255.0;
}
bool is_cast(lockstep_quantization_t q) { return q == LOCKSTEP_QUANT_CAST_F16 || q == LOCKSTEP_QUANT_CAST_BF16; }
// Wire bytes per element of each encoding (headers aside).
double wire_bytes_per_element(lockstep_quantization_t q) {
  if (is_cast(q)) return 2.0;
  return levels(q) == 15.0 ? 0.5 : 1.0;
}

void run_quantized(std::size_t world, const QuantSet& set) {
  const lockstep_reduce_op_t ops[] = {LOCKSTEP_SUM, LOCKSTEP_AVG, LOCKSTEP_MAX, LOCKSTEP_MIN};
  struct QCase {
    lockstep_dtype_t t;
    lockstep_reduce_op_t op;
    lockstep_quantization_t q;
    std::size_t count;
  };
  std::vector<QCase> cases;
  for (auto t : set.dtypes) {
    for (auto op : ops) {
      for (auto q : set.quants) {
        for (auto c : set.counts) cases.push_back({t, op, q, c});
      }
    }
  }
  std::mutex mutex;
  std::vector<std::vector<std::uint8_t>> first(cases.size());
  Cluster cluster;
  cluster.run(world, [&](peer::Communicator& comm, std::size_t) {
    const std::size_t me = comm.rank().value();
    for (std::size_t k = 0; k < cases.size(); ++k) {
      const QCase& c = cases[k];
      const std::size_t esize = coll::dtype_size(c.t);
      std::vector<std::uint8_t> buf(c.count * esize);
      for (std::size_t i = 0; i < c.count; ++i) store(buf.data(), c.t, i, input_value(c.t, me, i));
      peer::ReduceDescriptor d{buf.data(), buf.data(), c.count, c.t, c.op, c.q, 1000 + k};
      auto r = comm.all_reduce(d);
      ASSERT_TRUE(r.is_ok()) << "case " << k << ": " << r.status().to_string();
      if (c.count > 1000) {
        // The encoding's bytes per element on the wire, not esize.
        const double per_element = wire_bytes_per_element(c.q);
        EXPECT_LT(static_cast<double>(r.value().bytes_sent),
                  static_cast<double>(c.count) * per_element * 2.0 * static_cast<double>(world - 1) /
                          static_cast<double>(world) * 1.1 + 4096.0)
            << "case " << k;
      }
      const double n = static_cast<double>(world);
      double bound = 0;
      if (is_cast(c.q)) {
        const double rel = c.q == LOCKSTEP_QUANT_CAST_F16 ? 0x1p-11 : 0x1p-8;
        bound = 1.5 * (n * (n - 1) / 2 + n) * rel * 1.01 + tolerance(c.t, world) * 1.5 * n;
        if (c.op == LOCKSTEP_AVG) bound /= n;
        if (c.op == LOCKSTEP_MAX || c.op == LOCKSTEP_MIN) bound = 1.5 * n * rel * 1.01 + tolerance(c.t, world) * 1.5;
      } else {
        const double half_step = 2.0 * levels(c.q);
        bound = (n * (n - 1) / 2 + n) / half_step * 1.01 + tolerance(c.t, world) * 1.5 * n;
        if (c.op == LOCKSTEP_AVG) bound /= n;
        if (c.op == LOCKSTEP_MAX || c.op == LOCKSTEP_MIN) bound = n / half_step * 1.01 + tolerance(c.t, world) * 1.5;
        if (c.q == LOCKSTEP_QUANT_ZERO_POINT_U8 || c.q == LOCKSTEP_QUANT_ZERO_POINT_U4) bound *= 1.5;
      }
      for (std::size_t i = 0; i < c.count; ++i) {
        const double got = load_float(buf.data(), c.t, i);
        const double want = float_reference(c.t, c.op, world, i);
        ASSERT_NEAR(got, want, bound) << "case " << k << " dtype " << c.t << " op " << c.op << " quant " << c.q
                                      << " count " << c.count << " i " << i;
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (first[k].empty()) {
        first[k] = buf;
      } else {
        ASSERT_EQ(first[k], buf) << "case " << k << ": quantized results differ between peers";
      }
    }
  });
}

const QuantSet kEightBit{{LOCKSTEP_F16, LOCKSTEP_BF16, LOCKSTEP_F32, LOCKSTEP_F64},
                         {LOCKSTEP_QUANT_MINMAX_U8, LOCKSTEP_QUANT_ZERO_POINT_U8},
                         {1, 3, 1001, 300'007}};
const QuantSet kFourBitAndCasts{{LOCKSTEP_F32, LOCKSTEP_F64},
                                {LOCKSTEP_QUANT_MINMAX_U4, LOCKSTEP_QUANT_ZERO_POINT_U4, LOCKSTEP_QUANT_CAST_F16,
                                 LOCKSTEP_QUANT_CAST_BF16},
                                {3, 300'007}};

TEST(AllReduce, QuantizedTwoPeers) { run_quantized(2, kEightBit); }
TEST(AllReduce, QuantizedFourPeers) { run_quantized(4, kEightBit); }
TEST(AllReduce, FourBitAndCastsTwoPeers) { run_quantized(2, kFourBitAndCasts); }
TEST(AllReduce, FourBitAndCastsFourPeers) { run_quantized(4, kFourBitAndCasts); }

// Error feedback: over three rounds in which every peer adds its residual to its next
// input, the residuals of all peers sum to what the quantized result lacks of the exact
// sum of the contributions (src + residual), to the dtype's rounding (1e-5 here, where
// the 4-bit codes lose up to 0.2 and bf16 up to 0.01): every encoding's loss is kept,
// none twice. The results stay bit-identical on all peers.
TEST(AllReduce, ErrorFeedbackResidualsSumToWhatTheResultLacks) {
  constexpr std::size_t kWorld = 3;
  constexpr std::size_t kRounds = 3;
  constexpr std::size_t kCount = 300'007;
  struct Round {
    std::vector<float> contribution, residual_after, result;
  };
  for (const auto op : {LOCKSTEP_SUM, LOCKSTEP_AVG}) {
    for (const auto q : {LOCKSTEP_QUANT_MINMAX_U4, LOCKSTEP_QUANT_ZERO_POINT_U8, LOCKSTEP_QUANT_CAST_BF16}) {
      SCOPED_TRACE("op " + std::to_string(op) + " quant " + std::to_string(q));
      std::vector<std::vector<Round>> seen(kWorld, std::vector<Round>(kRounds));
      Cluster cluster;
      cluster.run(kWorld, [&](peer::Communicator& comm, std::size_t index) {
        std::mt19937 rng(static_cast<unsigned>(index * 7 + 1));
        std::uniform_real_distribution<float> value(-1.0f, 1.0f);
        std::vector<float> residual(kCount, 0.0f);  // a newcomer's: zeros
        for (std::size_t r = 0; r < kRounds; ++r) {
          std::vector<float> src(kCount);
          for (auto& x : src) x = value(rng);
          Round& out = seen[index][r];
          out.contribution.resize(kCount);
          for (std::size_t i = 0; i < kCount; ++i) out.contribution[i] = src[i] + residual[i];
          std::vector<float> dst(kCount, 0.0f);
          peer::ReduceDescriptor d{src.data(), dst.data(), kCount, LOCKSTEP_F32, op, q, 10 + r};
          d.residual = residual.data();
          auto result = comm.all_reduce(d);
          ASSERT_TRUE(result.is_ok()) << result.status().to_string();
          out.residual_after = residual;
          out.result = dst;
        }
      });
      const float scale = op == LOCKSTEP_AVG ? static_cast<float>(kWorld) : 1.0f;
      for (std::size_t r = 0; r < kRounds; ++r) {
        for (std::size_t p = 1; p < kWorld; ++p) {
          ASSERT_EQ(seen[p][r].result, seen[0][r].result) << "round " << r << ": peers disagree";
        }
        double lost = 0;
        for (std::size_t i = 0; i < kCount; ++i) {
          double exact = 0;
          double kept = 0;
          for (std::size_t p = 0; p < kWorld; ++p) {
            exact += static_cast<double>(seen[p][r].contribution[i]);
            kept += static_cast<double>(seen[p][r].residual_after[i]);
          }
          const double missing = exact - static_cast<double>(scale * seen[0][r].result[i]);
          lost = std::max(lost, std::fabs(missing));
          ASSERT_NEAR(kept, missing, 1e-5) << "round " << r << " element " << i;
        }
        EXPECT_GT(lost, 1e-3) << "round " << r << ": the encoding lost nothing, the test proves nothing";
      }
    }
  }
}

// The NORMAL distribution hint on bell-shaped gradients: all peers hinted lowers the
// error of the 4-bit result against the exact sum (quantize.h: 3.7x for one encoding),
// and whatever each peer chose, hinted or not, the results are bit-identical.
TEST(AllReduce, NormalHintLowersTheErrorAndKeepsParityWhateverEachPeerChose) {
  constexpr std::size_t kWorld = 3;
  constexpr std::size_t kCount = 300'007;
  // Round 0: no peer hints; 1: every peer; 2: peer 1 only.
  constexpr std::size_t kRounds = 3;
  std::vector<std::vector<std::vector<float>>> src(kRounds, std::vector<std::vector<float>>(kWorld));
  std::vector<std::vector<std::vector<float>>> got(kRounds, std::vector<std::vector<float>>(kWorld));
  for (std::size_t r = 0; r < kRounds; ++r) {
    for (std::size_t p = 0; p < kWorld; ++p) {
      std::mt19937 rng(static_cast<unsigned>(r * 10 + p));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      src[r][p].resize(kCount);
      for (auto& x : src[r][p]) x = normal(rng);
    }
  }
  Cluster cluster;
  cluster.run(kWorld, [&](peer::Communicator& comm, std::size_t index) {
    for (std::size_t r = 0; r < kRounds; ++r) {
      got[r][index].assign(kCount, 0.0f);
      peer::ReduceDescriptor d{src[r][index].data(), got[r][index].data(), kCount, LOCKSTEP_F32, LOCKSTEP_SUM,
                               LOCKSTEP_QUANT_MINMAX_U4, 20 + r};
      const bool hinted = r == 1 || (r == 2 && index == 1);
      d.distribution = hinted ? LOCKSTEP_DIST_NORMAL : LOCKSTEP_DIST_NONE;
      auto result = comm.all_reduce(d);
      ASSERT_TRUE(result.is_ok()) << result.status().to_string();
    }
  });
  std::vector<double> mse(kRounds, 0.0);
  for (std::size_t r = 0; r < kRounds; ++r) {
    for (std::size_t p = 1; p < kWorld; ++p) ASSERT_EQ(got[r][p], got[r][0]) << "round " << r << ": peers disagree";
    for (std::size_t i = 0; i < kCount; ++i) {
      double exact = 0;
      for (std::size_t p = 0; p < kWorld; ++p) exact += static_cast<double>(src[r][p][i]);
      const double e = exact - static_cast<double>(got[r][0][i]);
      mse[r] += e * e / kCount;
    }
  }
  EXPECT_GT(mse[0] / mse[1], 2.0) << "unhinted " << mse[0] << ", hinted " << mse[1];
}

TEST(AllReduce, ErrorFeedbackNeedsAQuantizedSumOrAvgAndItsOwnBuffer) {
  Cluster cluster;
  cluster.run(1, [&](peer::Communicator& comm, std::size_t) {
    float x[4] = {1, 2, 3, 4};
    float y[4] = {};
    float residual[4] = {};
    peer::ReduceDescriptor d{x, y, 4, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_MINMAX_U4, 3};
    d.residual = residual;
    auto bad = d;
    bad.op = LOCKSTEP_MAX;
    EXPECT_EQ(comm.all_reduce(bad).status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
    bad = d;
    bad.quantization = LOCKSTEP_QUANT_NONE;
    EXPECT_EQ(comm.all_reduce(bad).status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
    bad = d;
    bad.residual = y + 3;  // shares dst's last element
    EXPECT_EQ(comm.all_reduce(bad).status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
    bad = d;
    bad.residual = x;
    EXPECT_EQ(comm.all_reduce(bad).status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
    // Alone in the group: the usual TOO_FEW_PEERS, the residual untouched.
    residual[0] = 0.5f;
    EXPECT_EQ(comm.all_reduce(d).status().code(), LOCKSTEP_STATUS_TOO_FEW_PEERS);
    EXPECT_EQ(residual[0], 0.5f);
  });
}

TEST(AllReduce, QuantizationNeedsAFloatDtype) {
  Cluster cluster;
  cluster.run(1, [&](peer::Communicator& comm, std::size_t) {
    std::int32_t x[2] = {1, 2};
    peer::ReduceDescriptor d{x, x, 2, LOCKSTEP_I32, LOCKSTEP_SUM, LOCKSTEP_QUANT_MINMAX_U8, 1};
    EXPECT_EQ(comm.all_reduce(d).status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
    // A cast to a 16-bit float needs a wider float: not f16 or bf16 data.
    std::uint16_t h[2] = {0x3c00, 0x3c00};
    peer::ReduceDescriptor c{h, h, 2, LOCKSTEP_F16, LOCKSTEP_SUM, LOCKSTEP_QUANT_CAST_BF16, 2};
    EXPECT_EQ(comm.all_reduce(c).status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
    c.quantization = static_cast<lockstep_quantization_t>(7);
    EXPECT_EQ(comm.all_reduce(c).status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
  });
}

TEST(AllReduce, InvalidArgumentsGiveSpecificErrors) {
  Cluster cluster;
  // Peer 1 starts its part of tag 7 only after peer 0 has checked what a tag in flight
  // forbids: until then the collective cannot complete (a 16-byte one otherwise may,
  // before peer 0's next call).
  std::promise<void> checked;
  const std::shared_future<void> checked_by_peer0 = checked.get_future().share();
  cluster.run(2, [&](peer::Communicator& comm, std::size_t index) {
    float x[4] = {1, 2, 3, 4};
    peer::ReduceDescriptor d{x, x, 4, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, 7};
    auto bad = d;
    bad.src = nullptr;
    EXPECT_EQ(comm.all_reduce(bad).status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
    bad = d;
    bad.count = 0;
    EXPECT_EQ(comm.all_reduce(bad).status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
    bad = d;
    bad.dtype = static_cast<lockstep_dtype_t>(15);  // in the enum's range, not a dtype
    EXPECT_EQ(comm.all_reduce(bad).status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
    bad = d;
    bad.op = static_cast<lockstep_reduce_op_t>(7);  // in the enum's range, not an op
    EXPECT_EQ(comm.all_reduce(bad).status().code(), LOCKSTEP_STATUS_INVALID_ARGUMENT);
    if (index == 1) {
      ASSERT_EQ(checked_by_peer0.wait_for(std::chrono::seconds(30)), std::future_status::ready);
    }
    auto first = comm.all_reduce_async(d);
    ASSERT_TRUE(first.is_ok());
    if (index == 0) {
      // A tag still in flight cannot be started again.
      EXPECT_EQ(comm.all_reduce_async(d).status().code(), LOCKSTEP_STATUS_INVALID_USAGE);
      // The topology cannot change under a collective in flight.
      EXPECT_EQ(comm.update_topology().code(), LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS);
      checked.set_value();
    }
    auto done = comm.await(first.value());
    ASSERT_TRUE(done.is_ok()) << done.status().to_string();
    EXPECT_EQ(x[0], 2.0f);
    // Descriptors that differ between peers fail on every peer.
    auto mismatch = d;
    mismatch.tag = 8;
    mismatch.count = index == 0 ? 4 : 3;
    EXPECT_EQ(comm.all_reduce(mismatch).status().code(), LOCKSTEP_STATUS_OPERATION_MISMATCH);
  });
  // Before accepted.
  peer::Options options;
  options.master_port = cluster.port();
  options.base_port = 0;
  auto comm = peer::Communicator::create(options);
  ASSERT_TRUE(comm.is_ok());
  float y = 1;
  peer::ReduceDescriptor d{&y, &y, 1, LOCKSTEP_F32, LOCKSTEP_SUM, LOCKSTEP_QUANT_NONE, 1};
  EXPECT_EQ(comm.value()->all_reduce(d).status().code(), LOCKSTEP_STATUS_NOT_INITIALIZED);
}

TEST(AllReduce, ManyConcurrentOverAPool) {
  constexpr std::size_t kOpsInFlight = 32;
  constexpr std::size_t kCount = 50'000;
  Cluster cluster;
  cluster.run(
      3,
      [&](peer::Communicator& comm, std::size_t index) {
        std::vector<std::vector<std::int32_t>> buffers(kOpsInFlight, std::vector<std::int32_t>(kCount));
        std::vector<std::shared_ptr<peer::AsyncReduce>> handles;
        if (index == 0) {
          // Thread 0 launches last, once the master holds the others' votes for all 32:
          // the 32 then start together, four times the pool, however slowly the build
          // runs (under ThreadSanitizer the threads' launches could spread so far apart
          // that no more than 7 ran at once, and slot 7 carried nothing).
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60 * LOCKSTEP_TEST_TIME_SCALE);
          for (;;) {
            auto state = cluster.master().render(master::View::kStateJson, 5000);
            ASSERT_TRUE(state.is_ok()) << state.status().to_string();
            const auto json = nlohmann::json::parse(state.value());
            std::size_t two_voted = 0;
            for (const auto& op : json["operations"]) if (op["done"].size() == 2) ++two_voted;
            if (two_voted == kOpsInFlight) break;
            ASSERT_LT(std::chrono::steady_clock::now(), deadline) << state.value();
            std::this_thread::sleep_for(std::chrono::milliseconds(5));
          }
        }
        for (std::size_t k = 0; k < kOpsInFlight; ++k) {
          for (std::size_t i = 0; i < kCount; ++i) buffers[k][i] = static_cast<std::int32_t>(k * 1000 + index + i);
          peer::ReduceDescriptor d{buffers[k].data(), buffers[k].data(), kCount, LOCKSTEP_I32, LOCKSTEP_SUM,
                                   LOCKSTEP_QUANT_NONE, 100 + k};
          auto h = comm.all_reduce_async(d);
          ASSERT_TRUE(h.is_ok()) << h.status().to_string();
          handles.push_back(h.value());
        }
        for (std::size_t k = 0; k < kOpsInFlight; ++k) {
          auto r = comm.await(handles[k]);
          ASSERT_TRUE(r.is_ok()) << r.status().to_string();
          for (std::size_t i = 0; i < kCount; i += 997) {
            ASSERT_EQ(buffers[k][i], static_cast<std::int32_t>(3 * (k * 1000 + i) + 0 + 1 + 2));
          }
        }
        // The 32 were launched at once: every connection of the pool carried a share.
        // Under ThreadSanitizer, and at times under AddressSanitizer, thread 0's launches
        // themselves can take longer than a collective, so that fewer than 8 run at once
        // however they are started (7 of 8 seen under ASan in CI); there (passes for races
        // and memory errors, not for the slot rule, which the Release pass and the
        // coordinator's tests hold) several slots must carry a share.
        constexpr bool kEverySlot = !kSanitized;
        const auto counters = comm.counters();
        ASSERT_EQ(counters.slot_bytes_sent.size(), 8u);
        std::uint64_t total = 0;
        std::size_t used = 0;
        for (std::size_t slot = 0; slot < 8; ++slot) {
          if (kEverySlot) {
            EXPECT_GT(counters.slot_bytes_sent[slot], 0u) << "slot " << slot;
            EXPECT_GT(counters.slot_bytes_received[slot], 0u) << "slot " << slot;
          }
          if (counters.slot_bytes_sent[slot] > 0 && counters.slot_bytes_received[slot] > 0) ++used;
          total += counters.slot_bytes_sent[slot];
        }
        EXPECT_GE(used, kEverySlot ? 8u : 4u);
        EXPECT_EQ(total, counters.all_reduce_bytes_sent);
      },
      /*pool_size=*/8);
}

// The master accounts the ring bytes peers report per (group, pool slot): /metrics and
// /api/state show every slot of the pool carrying a share, adding up to what the peers
// counted on each slot.
TEST(AllReduce, TheMasterShowsTheBytesOfEachPoolSlot) {
  constexpr std::uint32_t kPool = 4;
  constexpr std::size_t kOpsInFlight = 8;
  constexpr std::size_t kCount = 1u << 20;
  constexpr std::size_t kPeers = 2;
  Cluster cluster;
  std::mutex mutex;
  std::vector<std::uint64_t> peer_sent(kPool, 0), peer_received(kPool, 0);
  std::barrier reported(kPeers), checked(kPeers);
  cluster.run(
      kPeers,
      [&](peer::Communicator& comm, std::size_t index) {
        std::vector<std::vector<float>> buffers(kOpsInFlight, std::vector<float>(kCount, static_cast<float>(index)));
        std::vector<std::shared_ptr<peer::AsyncReduce>> handles;
        for (std::size_t k = 0; k < kOpsInFlight; ++k) {
          peer::ReduceDescriptor d{buffers[k].data(), buffers[k].data(), kCount, LOCKSTEP_F32, LOCKSTEP_SUM,
                                   LOCKSTEP_QUANT_NONE, 200 + k};
          auto h = comm.all_reduce_async(d);
          EXPECT_TRUE(h.is_ok()) << h.status().to_string();
          if (h.is_ok()) handles.push_back(h.value());
        }
        // (No ASSERT before the barriers: a thread that left early would leave the other waiting.)
        for (auto& h : handles) EXPECT_TRUE(comm.await(h).is_ok());
        {
          const auto counters = comm.counters();
          std::lock_guard<std::mutex> lock(mutex);
          for (std::uint32_t k = 0; k < kPool; ++k) {
            peer_sent[k] += counters.slot_bytes_sent[k];
            peer_received[k] += counters.slot_bytes_received[k];
          }
        }
        // Every peer sent its reports before its call returned; a peer that returned on
        // its ring's commit did not wait for the master to read the others' reports.
        reported.arrive_and_wait();
        if (index == 0) {
          Result<std::string> metrics = Status(LOCKSTEP_STATUS_INTERNAL_ERROR, "not rendered");
          Result<std::string> state = metrics;
          nlohmann::json slots = nlohmann::json::array();
          const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
          for (;;) {
            // (the state first: once it shows every report, so do the metrics rendered after it)
            state = cluster.master().render(master::View::kStateJson, 5000);
            metrics = cluster.master().render(master::View::kMetricsText, 5000);
            const auto json = nlohmann::json::parse(state.is_ok() ? state.value() : std::string("{}"));
            slots = json.contains("groups") && json["groups"].size() == 1 ? json["groups"][0]["slots"]
                                                                           : nlohmann::json::array();
            bool all = slots.size() == kPool;
            for (std::uint32_t k = 0; all && k < kPool; ++k) {
              all = slots[k]["bytes_sent"] == peer_sent[k] && slots[k]["bytes_received"] == peer_received[k];
            }
            if (all || std::chrono::steady_clock::now() > deadline) break;
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
          }
          EXPECT_TRUE(metrics.is_ok() && state.is_ok());
          EXPECT_EQ(slots.size(), kPool) << (state.is_ok() ? state.value() : state.status().to_string());
          for (std::uint32_t k = 0; k < kPool && k < slots.size() && metrics.is_ok(); ++k) {
            EXPECT_GT(peer_sent[k], 0u) << "slot " << k;
            EXPECT_EQ(slots[k]["slot"], k);
            EXPECT_EQ(slots[k]["bytes_sent"], peer_sent[k]) << "slot " << k;
            EXPECT_EQ(slots[k]["bytes_received"], peer_received[k]) << "slot " << k;
            const std::string series = "lockstep_slot_bytes_total{group=\"0\",slot=\"" + std::to_string(k) +
                                       "\",direction=\"sent\"} " + std::to_string(peer_sent[k]) + "\n";
            EXPECT_NE(metrics.value().find(series), std::string::npos) << series << metrics.value();
          }
        }
        checked.arrive_and_wait();
      },
      kPool);
}

}  // namespace
}  // namespace lockstep::testing
