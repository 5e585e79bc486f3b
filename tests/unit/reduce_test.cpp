// Reduction kernels against straightforward references: every op x every dtype, on
// counts 0, 1, 7, 1000, 4097, with element-offset pointers and every aliasing the API
// allows; edge values (integer extremes, -0.0, NaN, inf, subnormals, f16 overflow);
// finalize(AVG); and the f16/bf16 conversions, exhaustively over all 65536 patterns.
//
// The references work in wider types: integers exactly in 128 bits, then reduced modulo
// 2^bits; f16/bf16/f32 in double, rounded to the dtype by a table search (a correctly
// rounded double result rounded again to f32, f16 or bf16 is the correctly rounded
// result, since double has more than twice their precision plus two bits).
#include "kernels/reduce.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using lockstep::coll::bf16_to_f32;
using lockstep::coll::f16_to_f32;
using lockstep::coll::f32_to_bf16;
using lockstep::coll::f32_to_f16;
using lockstep::coll::f64_to_bf16;
using lockstep::coll::f64_to_f16;

__extension__ typedef __int128 i128;
__extension__ typedef unsigned __int128 u128;

// Widens a 16-bit pattern for comparisons with 32-bit expectations.
std::uint32_t u32(std::uint16_t v) { return v; }

// ---------------------------------------------------------------- reference values

// The value of an f16 / bf16 bit pattern, decoded field by field.
double ref_f16_value(std::uint16_t h) {
  const int s = h >> 15;
  const int e = (h >> 10) & 0x1f;
  const int m = h & 0x3ff;
  double v = 0;
  if (e == 31) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(m, -24);
  } else {
    v = std::ldexp(1024 + m, e - 25);
  }
  return s ? -v : v;
}

double ref_bf16_value(std::uint16_t b) {
  const int s = b >> 15;
  const int e = (b >> 7) & 0xff;
  const int m = b & 0x7f;
  double v = 0;
  if (e == 255) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(m, -133);
  } else {
    v = std::ldexp(128 + m, e - 134);
  }
  return s ? -v : v;
}

// Rounds a double to a 16-bit format, nearest, ties to the even pattern, by searching the
// ascending table of its non-negative finite values. The entry past the largest finite
// value is 2^emax with the infinity pattern, so overflow is rounded like any other value.
class Rounder16 {
 public:
  Rounder16(double (*value)(std::uint16_t), std::uint16_t inf_bits, std::uint16_t quiet_bit,
            double past_max) {
    for (std::uint32_t k = 0; k < inf_bits; ++k) {
      values_.push_back(value(static_cast<std::uint16_t>(k)));
    }
    values_.push_back(past_max);
    inf_bits_ = inf_bits;
    quiet_bit_ = quiet_bit;
  }
  std::uint16_t round(double x) const {
    if (std::isnan(x)) return static_cast<std::uint16_t>(inf_bits_ | quiet_bit_);
    const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
    const double a = std::fabs(x);
    std::uint32_t bits = 0;
    if (a >= values_.back()) {
      bits = inf_bits_;
    } else {
      // values_[k] <= a < values_[k + 1]
      const auto it = std::upper_bound(values_.begin(), values_.end(), a);
      const auto k = static_cast<std::uint32_t>(it - values_.begin() - 1);
      const double lo = values_[k];
      const double hi = values_[k + 1];
      const double mid = lo + (hi - lo) / 2;  // exact: one bit more than the format
      if (a < mid) {
        bits = k;
      } else if (a > mid) {
        bits = k + 1;
      } else {
        bits = (k % 2 == 0) ? k : k + 1;
      }
    }
    return static_cast<std::uint16_t>(bits | sign);
  }
  double value_at(std::uint32_t k) const { return values_[k]; }

 private:
  std::vector<double> values_;
  std::uint32_t inf_bits_ = 0;
  std::uint32_t quiet_bit_ = 0;
};

const Rounder16& f16_rounder() {
  static const Rounder16 r(ref_f16_value, 0x7c00, 0x0200, 65536.0);
  return r;
}
const Rounder16& bf16_rounder() {
  static const Rounder16 r(ref_bf16_value, 0x7f80, 0x0040, std::ldexp(1.0, 128));
  return r;
}

// Rounds a double to f32 (the conversion itself, guarded against overflow, which is UB).
float ref_round_f32(double x) {
  constexpr double kMax = static_cast<double>(std::numeric_limits<float>::max());
  const double limit = kMax + std::ldexp(1.0, 103);  // midpoint to 2^128
  if (x >= limit) return std::numeric_limits<float>::infinity();
  if (x <= -limit) return -std::numeric_limits<float>::infinity();
  if (x > kMax) return std::numeric_limits<float>::max();
  if (x < -kMax) return -std::numeric_limits<float>::max();
  return static_cast<float>(x);
}

// max/min with NaN propagation and -0 < +0, in double (NaN returned as NaN).
double ref_max(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  if (a == b) return (std::signbit(a) && std::signbit(b)) ? a : std::fabs(a) == 0 ? 0.0 : a;
  return a > b ? a : b;
}
double ref_min(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<double>::quiet_NaN();
  if (a == b) return (std::signbit(a) || std::signbit(b)) ? (a == 0 ? -0.0 : a) : a;
  return a < b ? a : b;
}

// ---------------------------------------------------------------- per-dtype traits

template <typename T>
struct IntTraits {
  using S = T;
  static constexpr lockstep_dtype_t kDtype = [] {
    if constexpr (std::is_same_v<T, std::uint8_t>) return LOCKSTEP_U8;
    if constexpr (std::is_same_v<T, std::int8_t>) return LOCKSTEP_I8;
    if constexpr (std::is_same_v<T, std::uint16_t>) return LOCKSTEP_U16;
    if constexpr (std::is_same_v<T, std::int16_t>) return LOCKSTEP_I16;
    if constexpr (std::is_same_v<T, std::uint32_t>) return LOCKSTEP_U32;
    if constexpr (std::is_same_v<T, std::int32_t>) return LOCKSTEP_I32;
    if constexpr (std::is_same_v<T, std::uint64_t>) return LOCKSTEP_U64;
    return LOCKSTEP_I64;
  }();

  // The exact value v reduced modulo 2^bits into T.
  static T wrap(i128 v) {
    constexpr int kBits = 8 * sizeof(T);
    const i128 mod = static_cast<i128>(1) << kBits;
    i128 r = v % mod;
    if (r < 0) r += mod;
    if (std::is_signed_v<T> && r >= mod / 2) r -= mod;
    return static_cast<T>(r);
  }
  static T wrap_unsigned(u128 v) {
    constexpr int kBits = 8 * sizeof(T);
    const u128 mask = (static_cast<u128>(1) << kBits) - 1;
    return static_cast<T>(v & mask);
  }

  static T ref(T a, T b, lockstep_reduce_op_t op) {
    switch (op) {
      case LOCKSTEP_SUM:
      case LOCKSTEP_AVG: return wrap(static_cast<i128>(a) + static_cast<i128>(b));
      case LOCKSTEP_PROD:
        if constexpr (std::is_signed_v<T>) {
          return wrap(static_cast<i128>(a) * static_cast<i128>(b));  // |a*b| <= 2^126
        } else {
          return wrap_unsigned(static_cast<u128>(a) * static_cast<u128>(b));  // < 2^128
        }
      case LOCKSTEP_MAX: return std::max(a, b);
      case LOCKSTEP_MIN: return std::min(a, b);
    }
    return 0;
  }

  // The wrapped sum, read as T, divided by w, truncated toward zero (by magnitude).
  static T ref_avg(T v, std::uint32_t w) {
    const i128 x = static_cast<i128>(v);
    const i128 mag = x < 0 ? -x : x;
    const i128 q = mag / w;
    return static_cast<T>(x < 0 ? -q : q);
  }

  static bool same(T expected, T got) { return expected == got; }
  static std::uint64_t bits(T v) { return static_cast<std::make_unsigned_t<T>>(v); }
  static std::string show(T v) {
    if constexpr (std::is_signed_v<T>) return std::to_string(static_cast<std::int64_t>(v));
    return std::to_string(static_cast<std::uint64_t>(v));
  }

  static std::vector<T> edges() {
    using L = std::numeric_limits<T>;
    std::vector<T> e = {0,        1,
                        2,        3,
                        L::max(), static_cast<T>(L::max() - 1),
                        L::min(), static_cast<T>(L::max() / 2 + 1),
                        0x7f};
    if constexpr (std::is_signed_v<T>) {
      e.push_back(-1);
      e.push_back(-2);
      e.push_back(static_cast<T>(L::min() + 1));
    }
    return e;
  }
  static T random(std::mt19937_64& rng) { return static_cast<T>(rng()); }
};

// Floating types: storage S, value(S) as double, round(double) to S.
template <typename S_, lockstep_dtype_t D>
struct FloatTraitsBase {
  using S = S_;
  static constexpr lockstep_dtype_t kDtype = D;
};

struct F32Traits : FloatTraitsBase<float, LOCKSTEP_F32> {
  static double value(float s) { return static_cast<double>(s); }
  static float round(double x) { return ref_round_f32(x); }
  static bool is_canonical_nan(float s) { return std::bit_cast<std::uint32_t>(s) == 0x7fc00000u; }
  static std::uint64_t bits(float s) { return std::bit_cast<std::uint32_t>(s); }
  static float from_bits(std::uint64_t b) {
    return std::bit_cast<float>(static_cast<std::uint32_t>(b));
  }
  static std::vector<float> edges() {
    using L = std::numeric_limits<float>;
    return {0.0f,
            -0.0f,
            1.0f,
            -1.0f,
            0.5f,
            3.0f,
            L::max(),
            -L::max(),
            L::min(),
            L::denorm_min(),
            -L::denorm_min(),
            std::ldexp(1.0f, -127),
            L::infinity(),
            -L::infinity(),
            L::quiet_NaN(),
            from_bits(0x7f800001u) /* signaling */,
            from_bits(0xffc12345u),
            1e30f,
            -1e30f,
            1e-30f};
  }
  static float random(std::mt19937_64& rng) {
    std::uniform_real_distribution<float> d(-100.0f, 100.0f);
    return (rng() % 4 == 0) ? from_bits(rng()) : d(rng);
  }
};

struct F64Traits : FloatTraitsBase<double, LOCKSTEP_F64> {
  static double value(double s) { return s; }
  static double round(double x) { return x; }
  static bool is_canonical_nan(double s) {
    return std::bit_cast<std::uint64_t>(s) == 0x7ff8000000000000u;
  }
  static std::uint64_t bits(double s) { return std::bit_cast<std::uint64_t>(s); }
  static double from_bits(std::uint64_t b) { return std::bit_cast<double>(b); }
  static std::vector<double> edges() {
    using L = std::numeric_limits<double>;
    return {0.0,
            -0.0,
            1.0,
            -1.0,
            0.5,
            3.0,
            L::max(),
            -L::max(),
            L::min(),
            L::denorm_min(),
            -L::denorm_min(),
            L::infinity(),
            -L::infinity(),
            L::quiet_NaN(),
            from_bits(0x7ff0000000000001u),
            from_bits(0xfff8000000abcdefu),
            1e300,
            -1e300,
            1e-300};
  }
  static double random(std::mt19937_64& rng) {
    std::uniform_real_distribution<double> d(-100.0, 100.0);
    return (rng() % 4 == 0) ? from_bits(rng()) : d(rng);
  }
};

template <lockstep_dtype_t D>
struct Half16Traits : FloatTraitsBase<std::uint16_t, D> {
  static constexpr bool kF16 = D == LOCKSTEP_F16;
  static double value(std::uint16_t s) { return kF16 ? ref_f16_value(s) : ref_bf16_value(s); }
  static std::uint16_t round(double x) {
    return kF16 ? f16_rounder().round(x) : bf16_rounder().round(x);
  }
  static bool is_canonical_nan(std::uint16_t s) { return s == (kF16 ? 0x7e00u : 0x7fc0u); }
  static std::uint64_t bits(std::uint16_t s) { return s; }
  static std::vector<std::uint16_t> edges() {
    if (kF16) {
      return {0x0000,
              0x8000,
              0x3c00 /* 1 */,
              0xbc00,
              0x3800 /* 0.5 */,
              0x7bff /* 65504 */,
              0xfbff,
              0x7bfe,
              0x0400 /* min normal */,
              0x0001 /* min subnormal */,
              0x8001,
              0x03ff,
              0x7c00,
              0xfc00,
              0x7e00,
              0x7d01 /* signaling */,
              0xfe55,
              0x5bff,
              0x1001};
    }
    return {0x0000,
            0x8000,
            0x3f80 /* 1 */,
            0xbf80,
            0x3f00,
            0x7f7f /* max */,
            0xff7f,
            0x7f7e,
            0x0080 /* min normal */,
            0x0001,
            0x8001,
            0x007f,
            0x7f80,
            0xff80,
            0x7fc0,
            0x7f81 /* signaling */,
            0xffd5,
            0x4b80,
            0x3f81};
  }
  static std::uint16_t random(std::mt19937_64& rng) {
    if (rng() % 4 == 0) return static_cast<std::uint16_t>(rng());
    std::uniform_real_distribution<double> d(-100.0, 100.0);
    return round(d(rng));
  }
};
using F16Traits = Half16Traits<LOCKSTEP_F16>;
using BF16Traits = Half16Traits<LOCKSTEP_BF16>;

template <typename Tr>
constexpr bool kIsFloat = !std::is_integral_v<typename Tr::S> || Tr::kDtype == LOCKSTEP_F16 ||
                          Tr::kDtype == LOCKSTEP_BF16;

// Reference of one element for floating types.
template <typename Tr>
typename Tr::S float_ref(typename Tr::S a, typename Tr::S b, lockstep_reduce_op_t op) {
  const double x = Tr::value(a);
  const double y = Tr::value(b);
  switch (op) {
    case LOCKSTEP_SUM:
    case LOCKSTEP_AVG:
      if constexpr (std::is_same_v<typename Tr::S, double>) return a + b;
      return Tr::round(x + y);  // exact in double for f16, bf16 (and rounded once for f32)
    case LOCKSTEP_PROD:
      if constexpr (std::is_same_v<typename Tr::S, double>) return a * b;
      return Tr::round(x * y);  // exact in double: at most 48 significant bits
    case LOCKSTEP_MAX: return Tr::round(ref_max(x, y));
    case LOCKSTEP_MIN: return Tr::round(ref_min(x, y));
  }
  return typename Tr::S{};
}

// NaN expected: the canonical quiet NaN (reduce.h); otherwise the bits must match.
template <typename Tr>
::testing::AssertionResult float_same(typename Tr::S expected, typename Tr::S got) {
  if (std::isnan(Tr::value(expected))) {
    if (Tr::is_canonical_nan(got)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "expected the canonical quiet NaN, got bits 0x" << std::hex << Tr::bits(got);
  }
  if (Tr::bits(expected) == Tr::bits(got)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << "expected bits 0x" << std::hex << Tr::bits(expected) << " (" << Tr::value(expected)
         << "), got 0x" << Tr::bits(got) << " (" << Tr::value(got) << ")";
}

// ---------------------------------------------------------------- the reduce matrix

// Operands: every pair of edge values first, then random values.
template <typename Tr>
void make_operands(std::size_t n, std::uint64_t seed, std::vector<typename Tr::S>& a,
                   std::vector<typename Tr::S>& b) {
  std::mt19937_64 rng(seed);
  const auto e = Tr::edges();
  a.resize(n);
  b.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (i < e.size() * e.size()) {
      a[i] = e[i % e.size()];
      b[i] = e[i / e.size()];
    } else {
      a[i] = Tr::random(rng);
      b[i] = Tr::random(rng);
    }
  }
}

template <typename Tr>
::testing::AssertionResult element_ok(typename Tr::S a, typename Tr::S b, typename Tr::S got,
                                      lockstep_reduce_op_t op) {
  if constexpr (kIsFloat<Tr>) {
    auto r = float_same<Tr>(float_ref<Tr>(a, b, op), got);
    if (!r) r << " for operands 0x" << std::hex << Tr::bits(a) << ", 0x" << Tr::bits(b);
    return r;
  } else {
    const auto expected = Tr::ref(a, b, op);
    if (Tr::same(expected, got)) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << Tr::show(a) << " op " << Tr::show(b) << ": expected "
                                         << Tr::show(expected) << ", got " << Tr::show(got);
  }
}

// Runs every entry point on count elements at element offset `offset`.
template <typename Tr>
void check_count(lockstep_reduce_op_t op, std::size_t count, std::size_t offset) {
  using S = typename Tr::S;
  namespace coll = lockstep::coll;
  SCOPED_TRACE("count " + std::to_string(count) + " offset " + std::to_string(offset));
  std::vector<S> a;
  std::vector<S> b;
  make_operands<Tr>(count, 1234 + count, a, b);
  const std::size_t len = count + offset + 1;
  auto place = [&](const std::vector<S>& v) {
    std::vector<S> buf(len);
    std::copy(v.begin(), v.end(), buf.begin() + static_cast<std::ptrdiff_t>(offset));
    return buf;
  };
  const S sentinel = Tr::edges()[2];
  auto check_all = [&](const std::vector<S>& buf, const std::vector<S>& x, const std::vector<S>& y,
                       const char* what) {
    SCOPED_TRACE(what);
    std::size_t failures = 0;
    for (std::size_t i = 0; i < count && failures < 5; ++i) {
      const auto r = element_ok<Tr>(x[i], y[i], buf[offset + i], op);
      if (!r) {
        ++failures;
        ADD_FAILURE() << "element " << i << ": " << r.message();
      }
    }
    // The element past the end is untouched.
    EXPECT_EQ(Tr::bits(buf[offset + count]), Tr::bits(sentinel));
  };

  {  // reduce(dst, src)
    auto dst = place(a);
    const auto src = place(b);
    dst[offset + count] = sentinel;
    coll::reduce(dst.data() + offset, src.data() + offset, count, Tr::kDtype, op);
    check_all(dst, a, b, "reduce");
  }
  {  // reduce(dst, dst)
    auto dst = place(a);
    dst[offset + count] = sentinel;
    coll::reduce(dst.data() + offset, dst.data() + offset, count, Tr::kDtype, op);
    check_all(dst, a, a, "reduce self");
  }
  {  // reduce3, distinct output
    const auto pa = place(a);
    const auto pb = place(b);
    auto out = place(b);
    out[offset + count] = sentinel;
    coll::reduce3(out.data() + offset, pa.data() + offset, pb.data() + offset, count, Tr::kDtype,
                  op);
    check_all(out, a, b, "reduce3");
  }
  {  // reduce3, out == a
    auto pa = place(a);
    const auto pb = place(b);
    pa[offset + count] = sentinel;
    coll::reduce3(pa.data() + offset, pa.data() + offset, pb.data() + offset, count, Tr::kDtype,
                  op);
    check_all(pa, a, b, "reduce3 out == a");
  }
  {  // reduce3, out == b
    const auto pa = place(a);
    auto pb = place(b);
    pb[offset + count] = sentinel;
    coll::reduce3(pb.data() + offset, pa.data() + offset, pb.data() + offset, count, Tr::kDtype,
                  op);
    check_all(pb, a, b, "reduce3 out == b");
  }
  {  // reduce3, out == a == b
    auto pa = place(a);
    pa[offset + count] = sentinel;
    coll::reduce3(pa.data() + offset, pa.data() + offset, pa.data() + offset, count, Tr::kDtype,
                  op);
    check_all(pa, a, a, "reduce3 out == a == b");
  }
  // reduce3_saving: out bit for bit as reduce3 leaves it, saved = out as it was, nothing
  // written past the end of either.
  auto expect_same_bits = [&](const std::vector<S>& got, const std::vector<S>& want, const char* what) {
    SCOPED_TRACE(what);
    ASSERT_EQ(got.size(), want.size());
    std::size_t failures = 0;
    for (std::size_t i = 0; i < got.size() && failures < 5; ++i) {
      if (Tr::bits(got[i]) != Tr::bits(want[i])) {
        ++failures;
        ADD_FAILURE() << "index " << i << ": 0x" << std::hex << Tr::bits(got[i]) << " instead of 0x"
                      << Tr::bits(want[i]);
      }
    }
  };
  {  // reduce3_saving, out == a
    auto pa = place(a);
    const auto pb = place(b);
    pa[offset + count] = sentinel;
    auto reference = pa;
    coll::reduce3(reference.data() + offset, reference.data() + offset, pb.data() + offset, count,
                  Tr::kDtype, op);
    std::vector<S> saved(len, sentinel);
    coll::reduce3_saving(pa.data() + offset, saved.data() + offset, pa.data() + offset,
                         pb.data() + offset, count, Tr::kDtype, op);
    expect_same_bits(pa, reference, "reduce3_saving out == a: out");
    auto old = place(a);
    old[offset + count] = sentinel;
    std::fill(old.begin(), old.begin() + static_cast<std::ptrdiff_t>(offset), sentinel);
    expect_same_bits(saved, old, "reduce3_saving out == a: saved");
  }
  {  // reduce3_saving, four buffers
    const auto pa = place(a);
    const auto pb = place(b);
    std::vector<S> previous(b.rbegin(), b.rend());
    auto out = place(previous);
    out[offset + count] = sentinel;
    auto reference = out;
    coll::reduce3(reference.data() + offset, pa.data() + offset, pb.data() + offset, count,
                  Tr::kDtype, op);
    std::vector<S> saved(len, sentinel);
    coll::reduce3_saving(out.data() + offset, saved.data() + offset, pa.data() + offset,
                         pb.data() + offset, count, Tr::kDtype, op);
    expect_same_bits(out, reference, "reduce3_saving: out");
    auto old = place(previous);
    old[offset + count] = sentinel;
    std::fill(old.begin(), old.begin() + static_cast<std::ptrdiff_t>(offset), sentinel);
    expect_same_bits(saved, old, "reduce3_saving: saved");
  }
}

template <typename Tr>
void check_op(lockstep_reduce_op_t op) {
  constexpr std::size_t kCounts[] = {0, 1, 7, 1000, 4097};
  constexpr std::size_t kOffsets[] = {0, 1};
  for (const std::size_t count : kCounts) {
    for (const std::size_t offset : kOffsets) check_count<Tr>(op, count, offset);
  }
}

template <typename F>
void with_traits(lockstep_dtype_t dtype, F&& f) {
  switch (dtype) {
    case LOCKSTEP_U8: f.template operator()<IntTraits<std::uint8_t>>(); break;
    case LOCKSTEP_I8: f.template operator()<IntTraits<std::int8_t>>(); break;
    case LOCKSTEP_U16: f.template operator()<IntTraits<std::uint16_t>>(); break;
    case LOCKSTEP_I16: f.template operator()<IntTraits<std::int16_t>>(); break;
    case LOCKSTEP_U32: f.template operator()<IntTraits<std::uint32_t>>(); break;
    case LOCKSTEP_I32: f.template operator()<IntTraits<std::int32_t>>(); break;
    case LOCKSTEP_U64: f.template operator()<IntTraits<std::uint64_t>>(); break;
    case LOCKSTEP_I64: f.template operator()<IntTraits<std::int64_t>>(); break;
    case LOCKSTEP_F16: f.template operator()<F16Traits>(); break;
    case LOCKSTEP_BF16: f.template operator()<BF16Traits>(); break;
    case LOCKSTEP_F32: f.template operator()<F32Traits>(); break;
    case LOCKSTEP_F64: f.template operator()<F64Traits>(); break;
  }
}

const char* dtype_name(lockstep_dtype_t d) {
  static const char* const kNames[] = {"u8",  "i8",  "u16", "i16",  "u32", "i32",
                                       "u64", "i64", "f16", "bf16", "f32", "f64"};
  return kNames[d];
}
const char* op_name(lockstep_reduce_op_t op) {
  static const char* const kNames[] = {"sum", "avg", "prod", "max", "min"};
  return kNames[op];
}

class ReduceMatrix
    : public ::testing::TestWithParam<std::tuple<lockstep_dtype_t, lockstep_reduce_op_t>> {};

TEST_P(ReduceMatrix, MatchesReference) {
  const lockstep_dtype_t dtype = std::get<0>(GetParam());
  const lockstep_reduce_op_t op = std::get<1>(GetParam());  // a plain variable: lambdas capture it
  with_traits(dtype, [&]<typename Tr>() { check_op<Tr>(op); });
}

INSTANTIATE_TEST_SUITE_P(
    AllDtypesAllOps, ReduceMatrix,
    ::testing::Combine(::testing::Values(LOCKSTEP_U8, LOCKSTEP_I8, LOCKSTEP_U16, LOCKSTEP_I16,
                                         LOCKSTEP_U32, LOCKSTEP_I32, LOCKSTEP_U64, LOCKSTEP_I64,
                                         LOCKSTEP_F16, LOCKSTEP_BF16, LOCKSTEP_F32, LOCKSTEP_F64),
                       ::testing::Values(LOCKSTEP_SUM, LOCKSTEP_AVG, LOCKSTEP_PROD, LOCKSTEP_MAX,
                                         LOCKSTEP_MIN)),
    [](const auto& param_info) {
      return std::string(dtype_name(std::get<0>(param_info.param))) + "_" +
             op_name(std::get<1>(param_info.param));
    });

// ---------------------------------------------------------------- named cases

TEST(Reduce, IntegerWrapAround) {
  namespace coll = lockstep::coll;
  std::int32_t a[] = {std::numeric_limits<std::int32_t>::max(),
                      std::numeric_limits<std::int32_t>::min(), 65536, -1};
  const std::int32_t b[] = {1, -1, 65536, std::numeric_limits<std::int32_t>::min()};
  coll::reduce(a, b, 4, LOCKSTEP_I32, LOCKSTEP_SUM);
  EXPECT_EQ(a[0], std::numeric_limits<std::int32_t>::min());
  EXPECT_EQ(a[1], std::numeric_limits<std::int32_t>::max());
  EXPECT_EQ(a[2], 131072);
  EXPECT_EQ(a[3], std::numeric_limits<std::int32_t>::max());

  std::uint16_t p[] = {65535, 256, 40000};
  const std::uint16_t q[] = {65535, 256, 3};
  coll::reduce(p, q, 3, LOCKSTEP_U16, LOCKSTEP_PROD);  // would overflow int if promoted
  EXPECT_EQ(p[0], 1);
  EXPECT_EQ(p[1], 0);
  EXPECT_EQ(p[2], static_cast<std::uint16_t>(120000 % 65536));

  std::int8_t c[] = {-128, 127, -128};
  const std::int8_t d[] = {-1, 127, -128};
  coll::reduce(c, d, 3, LOCKSTEP_I8, LOCKSTEP_PROD);
  EXPECT_EQ(c[0], -128);  // 128 wraps to -128
  EXPECT_EQ(c[1], 1);     // 16129 = 63 * 256 + 1
  EXPECT_EQ(c[2], 0);     // 16384 = 64 * 256

  std::int64_t e[] = {std::numeric_limits<std::int64_t>::min()};
  const std::int64_t f[] = {-1};
  coll::reduce(e, f, 1, LOCKSTEP_I64, LOCKSTEP_PROD);
  EXPECT_EQ(e[0], std::numeric_limits<std::int64_t>::min());
}

TEST(Reduce, MaxMinPropagateNaNAndOrderZeros) {
  namespace coll = lockstep::coll;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  float a[] = {nan, 1.0f, -0.0f, 0.0f, -0.0f, 2.0f};
  const float b[] = {1.0f, nan, 0.0f, -0.0f, -0.0f, nan};
  float mx[6];
  float mn[6];
  coll::reduce3(mx, a, b, 6, LOCKSTEP_F32, LOCKSTEP_MAX);
  coll::reduce3(mn, a, b, 6, LOCKSTEP_F32, LOCKSTEP_MIN);
  EXPECT_TRUE(F32Traits::is_canonical_nan(mx[0]));
  EXPECT_TRUE(F32Traits::is_canonical_nan(mx[1]));
  EXPECT_TRUE(F32Traits::is_canonical_nan(mx[5]));
  EXPECT_TRUE(F32Traits::is_canonical_nan(mn[0]));
  EXPECT_TRUE(F32Traits::is_canonical_nan(mn[1]));
  EXPECT_TRUE(F32Traits::is_canonical_nan(mn[5]));
  EXPECT_FALSE(std::signbit(mx[2]));
  EXPECT_FALSE(std::signbit(mx[3]));
  EXPECT_TRUE(std::signbit(mx[4]));
  EXPECT_TRUE(std::signbit(mn[2]));
  EXPECT_TRUE(std::signbit(mn[3]));
  EXPECT_TRUE(std::signbit(mn[4]));

  // A signaling NaN comes out as the canonical quiet NaN.
  double s[] = {std::bit_cast<double>(0x7ff0000000000001u)};
  const double t[] = {1.0};
  coll::reduce(s, t, 1, LOCKSTEP_F64, LOCKSTEP_MAX);
  EXPECT_TRUE(F64Traits::is_canonical_nan(s[0]));
}

TEST(Reduce, HalfOverflowAndRounding) {
  namespace coll = lockstep::coll;
  std::uint16_t a[] = {0x7bff, 0x3c00, 0x3c00, 0x0001, 0xfbff};
  // 65504 + 65504 -> inf; 1 + 2^-11 (a tie) -> 1 (even); 1 + 3*2^-11 -> 1 + 2^-9 (tie up to even);
  // min subnormal + min subnormal = 2 * 2^-24 exactly; -65504 - 16 (a tie) -> -inf.
  const std::uint16_t b[] = {0x7bff, 0x1000, 0x1600, 0x0001, 0xcc00};
  coll::reduce(a, b, 5, LOCKSTEP_F16, LOCKSTEP_SUM);
  EXPECT_EQ(a[0], 0x7c00);
  EXPECT_EQ(a[1], 0x3c00);
  EXPECT_EQ(a[2], 0x3c02);
  EXPECT_EQ(a[3], 0x0002);
  EXPECT_EQ(a[4], 0xfc00);

  std::uint16_t c[] = {0x7f7f, 0x3f80};
  const std::uint16_t d[] = {0x7f7f, 0x3b80};  // bf16 max + max -> inf; 1 + 2^-8 (tie) -> 1
  coll::reduce(c, d, 2, LOCKSTEP_BF16, LOCKSTEP_SUM);
  EXPECT_EQ(c[0], 0x7f80);
  EXPECT_EQ(c[1], 0x3f80);
}

TEST(Reduce, UnknownDtypeOrOpIsANoOp) {
  namespace coll = lockstep::coll;
  std::int32_t a[] = {1, 2};
  const std::int32_t b[] = {3, 4};
  coll::reduce(a, b, 2, static_cast<lockstep_dtype_t>(15), LOCKSTEP_SUM);
  coll::reduce(a, b, 2, LOCKSTEP_I32, static_cast<lockstep_reduce_op_t>(5));
  coll::reduce3(a, a, b, 2, LOCKSTEP_I32, static_cast<lockstep_reduce_op_t>(7));
  coll::finalize(a, 2, static_cast<lockstep_dtype_t>(12), LOCKSTEP_AVG, 2);
  EXPECT_EQ(a[0], 1);
  EXPECT_EQ(a[1], 2);
}

TEST(Dtype, SizesAndValidity) {
  namespace coll = lockstep::coll;
  const std::size_t sizes[] = {1, 1, 2, 2, 4, 4, 8, 8, 2, 2, 4, 8};
  for (int d = 0; d < 12; ++d) {
    EXPECT_TRUE(coll::dtype_valid(d));
    EXPECT_EQ(coll::dtype_size(static_cast<lockstep_dtype_t>(d)), sizes[d]);
    EXPECT_EQ(coll::is_float(static_cast<lockstep_dtype_t>(d)), d >= LOCKSTEP_F16);
  }
  EXPECT_FALSE(coll::dtype_valid(-1));
  EXPECT_FALSE(coll::dtype_valid(12));
  EXPECT_EQ(coll::dtype_size(static_cast<lockstep_dtype_t>(12)), 0u);
  EXPECT_EQ(coll::dtype_size(static_cast<lockstep_dtype_t>(13)), 0u);
  EXPECT_FALSE(coll::is_float(static_cast<lockstep_dtype_t>(12)));
  for (int op = 0; op < 5; ++op) EXPECT_TRUE(coll::op_valid(op));
  EXPECT_FALSE(coll::op_valid(-1));
  EXPECT_FALSE(coll::op_valid(5));
}

// ---------------------------------------------------------------- finalize

template <typename T>
void check_int_avg() {
  using Tr = IntTraits<T>;
  SCOPED_TRACE(dtype_name(Tr::kDtype));
  std::mt19937_64 rng(7);
  std::vector<T> base = Tr::edges();
  for (int i = 0; i < 500; ++i) base.push_back(Tr::random(rng));
  for (std::uint32_t w : {1u, 2u, 3u, 7u, 8u, 1000u, 0xffffffffu}) {
    std::vector<T> v = base;
    lockstep::coll::finalize(v.data(), v.size(), Tr::kDtype, LOCKSTEP_AVG, w);
    for (std::size_t i = 0; i < v.size(); ++i) {
      ASSERT_EQ(v[i], Tr::ref_avg(base[i], w)) << Tr::show(base[i]) << " / " << w;
    }
  }
}

TEST(Finalize, IntegerAverageTruncatesTowardZero) {
  check_int_avg<std::uint8_t>();
  check_int_avg<std::int8_t>();
  check_int_avg<std::uint16_t>();
  check_int_avg<std::int16_t>();
  check_int_avg<std::uint32_t>();
  check_int_avg<std::int32_t>();
  check_int_avg<std::uint64_t>();
  check_int_avg<std::int64_t>();

  // The wrapped sum is read as the signed type: contributions INT32_MAX and 2 sum to
  // INT32_MIN + 1, whose average is truncated toward zero.
  std::int32_t s[] = {std::numeric_limits<std::int32_t>::max(), -7, 7, -1};
  const std::int32_t t[] = {2, 0, 0, 0};
  lockstep::coll::reduce(s, t, 4, LOCKSTEP_I32, LOCKSTEP_AVG);
  lockstep::coll::finalize(s, 4, LOCKSTEP_I32, LOCKSTEP_AVG, 2);
  EXPECT_EQ(s[0], (std::numeric_limits<std::int32_t>::min() + 1) / 2);
  EXPECT_EQ(s[1], -3);
  EXPECT_EQ(s[2], 3);
  EXPECT_EQ(s[3], 0);
}

template <typename Tr>
void check_float_avg() {
  using S = typename Tr::S;
  SCOPED_TRACE(dtype_name(Tr::kDtype));
  std::mt19937_64 rng(11);
  std::vector<S> base = Tr::edges();
  for (int i = 0; i < 2000; ++i) base.push_back(Tr::random(rng));
  for (std::uint32_t w : {1u, 2u, 3u, 7u, 10u, 1000u, 12345u}) {
    std::vector<S> v = base;
    lockstep::coll::finalize(v.data(), v.size(), Tr::kDtype, LOCKSTEP_AVG, w);
    for (std::size_t i = 0; i < v.size(); ++i) {
      S expected{};
      if constexpr (std::is_same_v<S, double>) {
        expected = base[i] / static_cast<double>(w);
      } else {
        expected = Tr::round(Tr::value(base[i]) / static_cast<double>(w));
      }
      ASSERT_TRUE(float_same<Tr>(expected, v[i])) << "element " << i << " / " << w;
    }
  }
}

TEST(Finalize, FloatAverageDividesAndRounds) {
  check_float_avg<F32Traits>();
  check_float_avg<F64Traits>();
  check_float_avg<F16Traits>();
  check_float_avg<BF16Traits>();
}

TEST(Finalize, OtherOpsAndWorldSizeZeroLeaveDataAlone) {
  std::int32_t a[] = {10, -10};
  float f[] = {10.0f, -1.0f};
  for (lockstep_reduce_op_t op : {LOCKSTEP_SUM, LOCKSTEP_PROD, LOCKSTEP_MAX, LOCKSTEP_MIN}) {
    lockstep::coll::finalize(a, 2, LOCKSTEP_I32, op, 4);
    lockstep::coll::finalize(f, 2, LOCKSTEP_F32, op, 4);
  }
  lockstep::coll::finalize(a, 2, LOCKSTEP_I32, LOCKSTEP_AVG, 0);
  lockstep::coll::finalize(f, 2, LOCKSTEP_F32, LOCKSTEP_AVG, 0);
  EXPECT_EQ(a[0], 10);
  EXPECT_EQ(a[1], -10);
  EXPECT_EQ(f[0], 10.0f);
  EXPECT_EQ(f[1], -1.0f);
}

// ---------------------------------------------------------------- conversions

TEST(Conversion, F16ToF32ExhaustiveAndRoundTrip) {
  for (std::uint32_t k = 0; k < 65536; ++k) {
    const auto h = static_cast<std::uint16_t>(k);
    const double ref = ref_f16_value(h);
    const float f = f16_to_f32(h);
    const std::uint32_t fb = std::bit_cast<std::uint32_t>(f);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << k;
      ASSERT_NE(fb & 0x00400000u, 0u) << "not quiet: " << std::hex << k;
      ASSERT_EQ((fb >> 13) & 0x3ffu, (k & 0x3ffu) | 0x200u) << "payload: " << std::hex << k;
      ASSERT_EQ(fb >> 31, k >> 15);
      // Back to f16: still NaN, quiet, the payload kept.
      ASSERT_EQ(u32(f32_to_f16(f)), k | 0x200u) << std::hex << k;
      ASSERT_EQ(u32(f64_to_f16(static_cast<double>(f))), k | 0x200u) << std::hex << k;
    } else {
      ASSERT_EQ(fb, std::bit_cast<std::uint32_t>(static_cast<float>(ref))) << std::hex << k;
      ASSERT_EQ(f32_to_f16(f), h) << std::hex << k;
      ASSERT_EQ(f64_to_f16(ref), h) << std::hex << k;
    }
  }
}

TEST(Conversion, BF16ToF32ExhaustiveAndRoundTrip) {
  for (std::uint32_t k = 0; k < 65536; ++k) {
    const auto b = static_cast<std::uint16_t>(k);
    const double ref = ref_bf16_value(b);
    const float f = bf16_to_f32(b);
    const std::uint32_t fb = std::bit_cast<std::uint32_t>(f);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << k;
      ASSERT_EQ(fb, (k << 16) | 0x00400000u) << std::hex << k;
      ASSERT_EQ(u32(f32_to_bf16(f)), k | 0x40u) << std::hex << k;
      ASSERT_EQ(u32(f64_to_bf16(static_cast<double>(f))), k | 0x40u) << std::hex << k;
    } else {
      ASSERT_EQ(fb, std::bit_cast<std::uint32_t>(static_cast<float>(ref))) << std::hex << k;
      ASSERT_EQ(fb, k << 16) << std::hex << k;
      ASSERT_EQ(f32_to_bf16(f), b) << std::hex << k;
      ASSERT_EQ(f64_to_bf16(ref), b) << std::hex << k;
    }
  }
}

// Around every pair of neighbours (including the largest finite value and the overflow
// threshold): the midpoint goes to the even pattern, one step either side goes to the
// nearer neighbour; the same for negative values. In f32 and in f64.
template <typename Narrow32, typename Narrow64>
void check_rounding_neighbours(const Rounder16& r, std::uint32_t inf_bits, Narrow32 narrow32,
                               Narrow64 narrow64) {
  for (std::uint32_t k = 0; k < inf_bits; ++k) {
    const double lo = r.value_at(k);
    const double hi = r.value_at(k + 1);
    const double mid = lo + (hi - lo) / 2;
    const std::uint32_t even = (k % 2 == 0) ? k : k + 1;
    const auto midf = static_cast<float>(mid);
    ASSERT_EQ(static_cast<double>(midf), mid) << "midpoint not exact in f32";
    for (const std::uint32_t sign : {0u, 0x8000u}) {
      const float s = sign ? -1.0f : 1.0f;
      const double sd = sign ? -1.0 : 1.0;
      ASSERT_EQ(u32(narrow32(s * midf)), even | sign) << std::hex << k;
      ASSERT_EQ(u32(narrow32(s * std::nextafter(midf, 0.0f))), k | sign) << std::hex << k;
      ASSERT_EQ(u32(narrow32(s * std::nextafter(midf, std::numeric_limits<float>::infinity()))),
                (k + 1) | sign)
          << std::hex << k;
      ASSERT_EQ(u32(narrow64(sd * mid)), even | sign) << std::hex << k;
      ASSERT_EQ(u32(narrow64(sd * std::nextafter(mid, 0.0))), k | sign) << std::hex << k;
      ASSERT_EQ(u32(narrow64(sd * std::nextafter(mid, std::numeric_limits<double>::infinity()))),
                (k + 1) | sign)
          << std::hex << k;
    }
  }
}

TEST(Conversion, F16RoundsToNearestEvenAroundEveryValue) {
  check_rounding_neighbours(f16_rounder(), 0x7c00, f32_to_f16, f64_to_f16);
  // Named cases: the overflow threshold, ties, and subnormals.
  EXPECT_EQ(f32_to_f16(65519.996f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);
  EXPECT_EQ(f32_to_f16(1e10f), 0x7c00);
  EXPECT_EQ(f32_to_f16(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie -> even
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie -> even
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);             // tie -> 0
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -25)), 0x0002);             // tie -> even
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -26)), 0x0000);
  EXPECT_EQ(f32_to_f16(-std::ldexp(1.0f, -30)), 0x8000);  // -0
  EXPECT_EQ(f32_to_f16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(f64_to_f16(std::numeric_limits<double>::denorm_min()), 0x0000);
  EXPECT_EQ(f64_to_f16(1e300), 0x7c00);
  EXPECT_EQ(f64_to_f16(std::ldexp(1.0, -14) - std::ldexp(1.0, -26)),
            0x0400);                                                 // rounds up to normal
  EXPECT_EQ(f32_to_f16(std::bit_cast<float>(0x7f800001u)), 0x7e00);  // sNaN -> qNaN
  EXPECT_EQ(f32_to_f16(std::bit_cast<float>(0xffffe000u)), 0xffff);
}

TEST(Conversion, BF16RoundsToNearestEvenAroundEveryValue) {
  check_rounding_neighbours(bf16_rounder(), 0x7f80, f32_to_bf16, f64_to_bf16);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::max()), 0x7f80);
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(f32_to_bf16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_EQ(f64_to_bf16(1e300), 0x7f80);
  EXPECT_EQ(f64_to_bf16(-1e-300), 0x8000);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0x7f800001u)), 0x7fc0);
  EXPECT_EQ(f32_to_bf16(std::bit_cast<float>(0xff80ffffu)), 0xffc0);
}

TEST(Conversion, RandomPatternsMatchTheReference) {
  std::mt19937_64 rng(2024);
  for (int i = 0; i < 300000; ++i) {
    const auto bits32 = static_cast<std::uint32_t>(rng());
    const float f = std::bit_cast<float>(bits32);
    std::uint64_t u64 = rng();
    // Keep most doubles in a range where the 16-bit formats are interesting.
    if (i % 2 == 0) {
      u64 = (u64 & 0x800fffffffffffffu) |
            (static_cast<std::uint64_t>(1023 - 140 + rng() % 160) << 52);
    }
    const double d = std::bit_cast<double>(u64);
    if (std::isnan(f)) {
      ASSERT_TRUE(std::isnan(ref_f16_value(f32_to_f16(f))));
      ASSERT_TRUE(std::isnan(ref_bf16_value(f32_to_bf16(f))));
    } else {
      ASSERT_EQ(f32_to_f16(f), f16_rounder().round(static_cast<double>(f))) << std::hex << bits32;
      ASSERT_EQ(f32_to_bf16(f), bf16_rounder().round(static_cast<double>(f))) << std::hex << bits32;
    }
    if (std::isnan(d)) {
      ASSERT_TRUE(std::isnan(ref_f16_value(f64_to_f16(d))));
      ASSERT_TRUE(std::isnan(ref_bf16_value(f64_to_bf16(d))));
    } else {
      ASSERT_EQ(f64_to_f16(d), f16_rounder().round(d)) << std::hex << u64;
      ASSERT_EQ(f64_to_bf16(d), bf16_rounder().round(d)) << std::hex << u64;
    }
  }
}

}  // namespace

// ---- the finiteness check of a contribution (check_finite)

namespace {

// Bits of a NaN, +inf, -inf and the largest finite value per float dtype, and the
// element size.
struct FloatBits {
  lockstep_dtype_t dtype;
  std::size_t size;
  std::uint64_t nan, pos_inf, neg_inf, max_finite, signalling_nan;
};
const FloatBits kFloatBits[] = {
    {LOCKSTEP_F16, 2, 0x7e00, 0x7c00, 0xfc00, 0x7bff, 0x7c01},
    {LOCKSTEP_BF16, 2, 0x7fc0, 0x7f80, 0xff80, 0x7f7f, 0x7f81},
    {LOCKSTEP_F32, 4, 0x7fc00000, 0x7f800000, 0xff800000, 0x7f7fffff, 0x7f800001},
    {LOCKSTEP_F64, 8, 0x7ff8000000000000ull, 0x7ff0000000000000ull, 0xfff0000000000000ull, 0x7fefffffffffffffull,
     0x7ff0000000000001ull},
};

void put_bits(std::vector<std::uint8_t>& buf, std::size_t size, std::size_t i, std::uint64_t bits) {
  std::memcpy(buf.data() + i * size, &bits, size);  // little-endian: the low bytes
}

}  // namespace

TEST(FirstNonFinite, FindsTheFirstNanOrInfinityAtAnyPosition) {
  using lockstep::coll::first_non_finite;
  for (const auto& f : kFloatBits) {
    SCOPED_TRACE(f.dtype);
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}, std::size_t{70'001}}) {
      // Finite values of every kind pass: the largest, negative ones, zeros, subnormals.
      std::vector<std::uint8_t> buf(count * f.size, 0);
      for (std::size_t i = 0; i < count; ++i) {
        const std::uint64_t sign = (i % 2) << (f.size * 8 - 1);
        put_bits(buf, f.size, i, (i % 3 == 0 ? f.max_finite : i % 3 == 1 ? 1 : 0) | sign);
      }
      EXPECT_EQ(first_non_finite(buf.data(), count, f.dtype), count);
      if (count == 0) continue;
      // One bad value anywhere (first, last, across a 64 KiB block or cache line) is found;
      // with two, the first.
      for (std::size_t at : {std::size_t{0}, count / 2, count - 1, std::min(count - 1, (64u << 10) / f.size)}) {
        for (std::uint64_t bad : {f.nan, f.pos_inf, f.neg_inf, f.signalling_nan}) {
          std::vector<std::uint8_t> b = buf;
          put_bits(b, f.size, at, bad);
          EXPECT_EQ(first_non_finite(b.data(), count, f.dtype), at) << "at " << at << " count " << count;
          if (at + 1 < count) {
            put_bits(b, f.size, count - 1, f.nan);
            EXPECT_EQ(first_non_finite(b.data(), count, f.dtype), at);
          }
        }
      }
    }
  }
}

TEST(FirstNonFinite, IntegersAreNeverFlagged) {
  std::vector<std::uint8_t> all_ones(800, 0xff);
  for (lockstep_dtype_t dtype : {LOCKSTEP_U8, LOCKSTEP_I16, LOCKSTEP_U32, LOCKSTEP_I64}) {
    const std::size_t count = all_ones.size() / lockstep::coll::dtype_size(dtype);
    EXPECT_EQ(lockstep::coll::first_non_finite(all_ones.data(), count, dtype), count);
  }
}
