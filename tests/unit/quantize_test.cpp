// Chunk quantization (8-bit and 4-bit codes, 16-bit casts): the documented error bound
// on random data of every float dtype (several distributions, one-sided and tiny and
// huge ranges), exact all-equal chunks, exact zeros with a zero point, determinism of
// the decoder, the wire size and layout, the fused dequantize-and-reduce against
// dequantize-then-reduce, non-finite or garbage input handled as quantize.h documents,
// and the NORMAL distribution hint (its bound, its gain, and where it changes nothing).
#include "collectives/quantize.h"
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
#include <vector>

namespace {

namespace coll = lockstep::coll;

// ---------------------------------------------------------------- dtype traits

struct F16 {
  using S = std::uint16_t;
  static constexpr lockstep_dtype_t kDtype = LOCKSTEP_F16;
  static constexpr double kMax = 65504.0;
  static double value(S s) { return static_cast<double>(coll::f16_to_f32(s)); }
  static S make(double d) { return coll::f64_to_f16(d); }
  static double u() { return std::ldexp(1.0, -11); }
  static double t() { return std::ldexp(1.0, -25); }
  static double tiny() { return 1e-6; }  // within the f16 subnormal range
};

struct BF16 {
  using S = std::uint16_t;
  static constexpr lockstep_dtype_t kDtype = LOCKSTEP_BF16;
  static constexpr double kMax = 0x1.fep127;
  static double value(S s) { return static_cast<double>(coll::bf16_to_f32(s)); }
  static S make(double d) { return coll::f64_to_bf16(d); }
  static double u() { return std::ldexp(1.0, -8); }
  static double t() { return std::ldexp(1.0, -134); }
  static double tiny() { return 1e-39; }
};

struct F32 {
  using S = float;
  static constexpr lockstep_dtype_t kDtype = LOCKSTEP_F32;
  static constexpr double kMax = static_cast<double>(std::numeric_limits<float>::max());
  static double value(S s) { return static_cast<double>(s); }
  static S make(double d) { return static_cast<float>(d); }
  static double u() { return std::ldexp(1.0, -24); }
  static double t() { return std::ldexp(1.0, -150); }
  static double tiny() { return 1e-39; }
};

struct F64 {
  using S = double;
  static constexpr lockstep_dtype_t kDtype = LOCKSTEP_F64;
  static constexpr double kMax = std::numeric_limits<double>::max();
  static double value(S s) { return s; }
  static S make(double d) { return d; }
  static double u() { return 0.0; }
  static double t() { return std::ldexp(1.0, -1066); }
  static double tiny() { return 1e-310; }  // a subnormal scale: the encoder divides
};

// The code kinds (a header of parameters, then codes).
const lockstep_quantization_t kQuants[] = {LOCKSTEP_QUANT_MINMAX_U8, LOCKSTEP_QUANT_ZERO_POINT_U8,
                                           LOCKSTEP_QUANT_MINMAX_U4, LOCKSTEP_QUANT_ZERO_POINT_U4};
// Every kind, casts included (f32 and f64 only).
const lockstep_quantization_t kAllQuants[] = {LOCKSTEP_QUANT_MINMAX_U8, LOCKSTEP_QUANT_ZERO_POINT_U8,
                                              LOCKSTEP_QUANT_MINMAX_U4, LOCKSTEP_QUANT_ZERO_POINT_U4,
                                              LOCKSTEP_QUANT_CAST_F16,  LOCKSTEP_QUANT_CAST_BF16};

bool four_bit(lockstep_quantization_t q) {
  return q == LOCKSTEP_QUANT_MINMAX_U4 || q == LOCKSTEP_QUANT_ZERO_POINT_U4;
}
bool minmax(lockstep_quantization_t q) { return q == LOCKSTEP_QUANT_MINMAX_U8 || q == LOCKSTEP_QUANT_MINMAX_U4; }
// Bytes of the codes of n elements, as quantize.h lays them out.
std::size_t code_bytes(std::size_t n, lockstep_quantization_t q) { return four_bit(q) ? (n + 1) / 2 : n; }
// The code of element i of an encoded chunk.
unsigned code_at(const std::vector<std::uint8_t>& bytes, std::size_t i, lockstep_quantization_t q) {
  const std::uint8_t b = bytes[coll::kQuantHeaderBytes + (four_bit(q) ? i / 2 : i)];
  if (!four_bit(q)) return b;
  return i % 2 == 0 ? (b & 0x0fu) : (b >> 4u);
}
const std::size_t kCounts[] = {1, 2, 7, 1000, 4097};

template <typename D>
std::vector<typename D::S> make_values(const std::vector<double>& v) {
  std::vector<typename D::S> out;
  out.reserve(v.size());
  for (double x : v) out.push_back(D::make(x));
  return out;
}

template <typename D>
std::vector<std::uint8_t> encode(const std::vector<typename D::S>& v, lockstep_quantization_t q) {
  std::vector<std::uint8_t> bytes(coll::quantized_bytes(v.size(), q));
  coll::quantize(v.data(), v.size(), D::kDtype, q, bytes.data());
  return bytes;
}

template <typename D>
std::vector<typename D::S> decode(const std::vector<std::uint8_t>& bytes, std::size_t n,
                                  lockstep_quantization_t q) {
  std::vector<typename D::S> out(n);
  coll::dequantize(bytes.data(), n, D::kDtype, q, out.data());
  return out;
}

double chunk_scale(const std::vector<std::uint8_t>& bytes, lockstep_quantization_t q) {
  const coll::QuantParams p = coll::read_quant_params(bytes.data());
  return minmax(q) ? p.p1 : p.p0;
}

// The error bound of quantize.h for a chunk of values v with this scale.
template <typename D>
double error_bound(const std::vector<typename D::S>& v, double scale) {
  double m = 0;
  for (auto s : v) m = std::max(m, std::fabs(D::value(s)));
  return scale / 2 + (D::u() + std::ldexp(1.0, -47)) * m + D::t();
}

// Encodes, decodes and checks every element against the bound of quantize.h. Returns
// the largest error over scale (to check that the bound is not vacuous).
template <typename D>
double check_round_trip(const std::vector<double>& raw, lockstep_quantization_t q) {
  const auto v = make_values<D>(raw);
  const auto bytes = encode<D>(v, q);
  EXPECT_EQ(bytes.size(), coll::kQuantHeaderBytes + code_bytes(v.size(), q));
  EXPECT_TRUE(coll::quantized_header_valid(bytes.data(), D::kDtype, q));
  const auto back = decode<D>(bytes, v.size(), q);
  const double scale = chunk_scale(bytes, q);
  EXPECT_TRUE(std::isfinite(scale));
  EXPECT_GE(scale, 0.0);
  const double bound = error_bound<D>(v, scale);
  double worst = 0;
  std::size_t failures = 0;
  for (std::size_t i = 0; i < v.size() && failures < 5; ++i) {
    const double x = D::value(v[i]);
    const double y = D::value(back[i]);
    const double err = std::fabs(x - y);
    if (!(err <= bound)) {
      ++failures;
      ADD_FAILURE() << "element " << i << ": " << x << " decoded as " << y << ", error " << err
                    << " > bound " << bound << " (scale " << scale << ")";
    }
    if (scale > 0) worst = std::max(worst, err / scale);
  }
  return worst;
}

// With the NORMAL hint: the header is valid, every element inside the coded range
// [lo, hi] keeps the bound, and every element beyond it gets the end code.
template <typename D>
void check_hinted_round_trip(const std::vector<double>& raw, lockstep_quantization_t q) {
  const auto v = make_values<D>(raw);
  std::vector<std::uint8_t> bytes(coll::quantized_bytes(v.size(), q));
  coll::quantize(v.data(), v.size(), D::kDtype, q, LOCKSTEP_DIST_NORMAL, bytes.data());
  ASSERT_TRUE(coll::quantized_header_valid(bytes.data(), D::kDtype, q));
  const coll::QuantParams p = coll::read_quant_params(bytes.data());
  if (p.non_finite()) return;
  const double top = four_bit(q) ? 15.0 : 255.0;
  const double scale = minmax(q) ? p.p1 : p.p0;
  const double lo = minmax(q) ? p.p0 : -p.p1 * scale;
  const double hi = lo + top * scale;
  const auto back = decode<D>(bytes, v.size(), q);
  const double bound = error_bound<D>(v, scale);
  std::size_t failures = 0;
  for (std::size_t i = 0; i < v.size() && failures < 5; ++i) {
    const double x = D::value(v[i]);
    const double err = std::fabs(x - D::value(back[i]));
    const unsigned code = code_at(bytes, i, q);
    // Beyond the range: the end code, off by the distance to that end more.
    const bool ok = x < lo   ? code == 0 && err <= lo - x + bound
                    : x > hi ? code == top && err <= x - hi + bound
                             : err <= bound;
    if (!ok) {
      ++failures;
      ADD_FAILURE() << "element " << i << ": " << x << " coded " << code << ", decoded with error " << err
                    << " (range " << lo << " .. " << hi << ", bound " << bound << ")";
    }
  }
}

template <typename D>
void check_distributions() {
  std::mt19937_64 rng(99);
  for (const auto q : kQuants) {
    for (const std::size_t n : kCounts) {
      SCOPED_TRACE("quant " + std::to_string(q) + " count " + std::to_string(n));
      std::normal_distribution<double> normal(0.0, 1.0);
      std::uniform_real_distribution<double> unit(0.0, 1.0);
      std::vector<std::vector<double>> sets(7);
      for (std::size_t i = 0; i < n; ++i) {
        sets[0].push_back(normal(rng));
        sets[1].push_back(100.0 + unit(rng));         // one-sided, away from 0
        sets[2].push_back(-5e-3 + 4e-3 * unit(rng));  // one-sided negative
        sets[3].push_back(normal(rng) * std::pow(10.0, 6 * unit(rng) - 3));
        sets[4].push_back((2 * unit(rng) - 1) * 0.45 * D::kMax);  // range just below overflow
        sets[5].push_back((2 * unit(rng) - 1) * D::tiny());
        sets[6].push_back(i % 3 == 0 ? 0.0 : normal(rng));
      }
      for (std::size_t s = 0; s < sets.size(); ++s) {
        SCOPED_TRACE("distribution " + std::to_string(s));
        const double worst = check_round_trip<D>(sets[s], q);
        check_hinted_round_trip<D>(sets[s], q);
        // With many well-spread values some error comes near half a step: the bound
        // is not met by accident of a zero scale.
        // (Only where the dtype's own rounding is much finer than a step.)
        // (Not for one-sided data under a 4-bit zero point either: the range widened to 0
        // puts every value within a step or two of the top code.)
        const bool one_sided_zp4 = q == LOCKSTEP_QUANT_ZERO_POINT_U4 && (s == 1 || s == 2);
        if (n >= 1000 && s != 5 && D::u() < 1e-6 && !one_sided_zp4) {
          EXPECT_GT(worst, 0.3);
        }
      }
    }
  }
}

TEST(Quantize, RoundTripWithinBoundF16) { check_distributions<F16>(); }
TEST(Quantize, RoundTripWithinBoundBF16) { check_distributions<BF16>(); }
TEST(Quantize, RoundTripWithinBoundF32) { check_distributions<F32>(); }
TEST(Quantize, RoundTripWithinBoundF64) { check_distributions<F64>(); }

// ---------------------------------------------------------------- distribution hint

// Mean squared error of a round trip of f32 values under a hint.
double round_trip_mse(const std::vector<float>& v, lockstep_quantization_t q, lockstep_distribution_t hint) {
  std::vector<std::uint8_t> bytes(coll::quantized_bytes(v.size(), q));
  coll::quantize(v.data(), v.size(), LOCKSTEP_F32, q, hint, bytes.data());
  std::vector<float> back(v.size());
  coll::dequantize(bytes.data(), v.size(), LOCKSTEP_F32, q, back.data());
  double sum = 0;
  for (std::size_t i = 0; i < v.size(); ++i) {
    const double e = static_cast<double>(v[i]) - static_cast<double>(back[i]);
    sum += e * e;
  }
  return sum / static_cast<double>(v.size());
}

// On normally distributed values (a chunk of 64 Ki, as the ring's sub-chunks are) the
// hint's narrower range lowers the mean squared error: docs/collectives.md's figures are
// 2.2-2.7x for 4-bit codes and 1.04-1.3x for 8-bit ones at this size; asserted with a
// margin.
TEST(Quantize, NormalHintLowersTheErrorOnBellShapedValues) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> normal(0.25f, 2.0f);
  std::vector<float> v(65536);
  for (auto& x : v) x = normal(rng);
  for (const auto q : kQuants) {
    SCOPED_TRACE("quant " + std::to_string(q));
    const double plain = round_trip_mse(v, q, LOCKSTEP_DIST_NONE);
    const double hinted = round_trip_mse(v, q, LOCKSTEP_DIST_NORMAL);
    EXPECT_EQ(round_trip_mse(v, q, LOCKSTEP_DIST_UNIFORM), plain);
    EXPECT_GT(plain / hinted, four_bit(q) ? 2.0 : 1.05) << plain << " against " << hinted;
  }
}

// Where the values are spread evenly (or all equal, or not finite) the hint narrows
// nothing: the bytes are those without it. Casts ignore it.
TEST(Quantize, NormalHintChangesNothingWhereNothingIsGained) {
  std::mt19937_64 rng(6);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::vector<float> uniform(5000);
  for (auto& x : uniform) x = unit(rng);
  const std::vector<float> equal(100, 3.5f);
  std::vector<float> with_nan = uniform;
  with_nan[17] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<const std::vector<float>*> sets = {&uniform, &equal, &with_nan};
  for (const auto* v : sets) {
    for (const auto q : kAllQuants) {
      SCOPED_TRACE("quant " + std::to_string(q));
      std::vector<std::uint8_t> plain(coll::quantized_bytes(v->size(), q));
      std::vector<std::uint8_t> hinted(plain.size());
      coll::quantize(v->data(), v->size(), LOCKSTEP_F32, q, plain.data());
      coll::quantize(v->data(), v->size(), LOCKSTEP_F32, q, LOCKSTEP_DIST_NORMAL, hinted.data());
      EXPECT_EQ(hinted, plain);
    }
  }
}

// ---------------------------------------------------------------- exact cases

template <typename D>
void check_all_equal() {
  const double values[] = {3.14, -2.5, 1.0, -0.0, 0.0, D::kMax, -D::kMax, D::tiny(), 1e-3};
  for (const double c : values) {
    for (const std::size_t n : {std::size_t{1}, std::size_t{5}, std::size_t{1000}}) {
      SCOPED_TRACE("value " + std::to_string(c) + " count " + std::to_string(n));
      const std::vector<typename D::S> v(n, D::make(c));
      // Min-max: scale 0, codes 0, bit-exact.
      for (const auto q : {LOCKSTEP_QUANT_MINMAX_U8, LOCKSTEP_QUANT_MINMAX_U4}) {
        const auto bytes = encode<D>(v, q);
        EXPECT_EQ(coll::read_quant_params(bytes.data()).p1, 0.0);
        for (std::size_t i = coll::kQuantHeaderBytes; i < bytes.size(); ++i) EXPECT_EQ(bytes[i], 0);
        const auto back = decode<D>(bytes, n, q);
        EXPECT_EQ(0, std::memcmp(back.data(), v.data(), n * sizeof(typename D::S)));
      }
      // Zero point: exact in value for f16, bf16 and f32 (for f64 within the rounding of
      // the double arithmetic, and the t term of a subnormal scale); a zero decodes as +0.
      for (const auto q : {LOCKSTEP_QUANT_ZERO_POINT_U8, LOCKSTEP_QUANT_ZERO_POINT_U4}) {
        const auto bytes = encode<D>(v, q);
        const auto back = decode<D>(bytes, n, q);
        for (std::size_t i = 0; i < n; ++i) {
          const double x = D::value(v[i]);
          const double y = D::value(back[i]);
          if (D::kDtype == LOCKSTEP_F64) {
            EXPECT_LE(std::fabs(x - y), std::fabs(x) * std::ldexp(1.0, -50) + D::t());
          } else {
            EXPECT_EQ(x, y);
          }
          if (x == 0) {
            EXPECT_FALSE(std::signbit(y));
          }
        }
      }
    }
  }
}

TEST(Quantize, AllEqualChunkIsExact) {
  check_all_equal<F16>();
  check_all_equal<BF16>();
  check_all_equal<F32>();
  check_all_equal<F64>();
}

template <typename D>
void check_zero_exact() {
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal(0.0, 3.0);
  std::vector<double> raw(3000);
  for (std::size_t i = 0; i < raw.size(); ++i) raw[i] = i % 4 == 0 ? 0.0 : normal(rng) + 1.0;
  const auto v = make_values<D>(raw);
  for (const auto q : {LOCKSTEP_QUANT_ZERO_POINT_U8, LOCKSTEP_QUANT_ZERO_POINT_U4}) {
    const auto bytes = encode<D>(v, q);
    const auto back = decode<D>(bytes, v.size(), q);
    const double zp = coll::read_quant_params(bytes.data()).p1;
    EXPECT_EQ(zp, std::floor(zp));
    for (std::size_t i = 0; i < v.size(); i += 4) {
      EXPECT_EQ(code_at(bytes, i, q), static_cast<unsigned>(zp));
      EXPECT_EQ(D::value(back[i]), 0.0) << i;
    }
  }
}

TEST(Quantize, ZeroPointKeepsZerosExact) {
  check_zero_exact<F16>();
  check_zero_exact<BF16>();
  check_zero_exact<F32>();
  check_zero_exact<F64>();
}

TEST(Quantize, HeaderLayoutAndCodes) {
  const float v[] = {1.0f, 2.0f, 3.5f};
  std::uint8_t out[coll::kQuantHeaderBytes + 3];
  coll::quantize(v, 3, LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U8, out);
  // p0 = 1.0 as little-endian binary64.
  const std::uint8_t one[8] = {0, 0, 0, 0, 0, 0, 0xf0, 0x3f};
  EXPECT_EQ(0, std::memcmp(out, one, 8));
  const coll::QuantParams p = coll::read_quant_params(out);
  EXPECT_EQ(p.p0, 1.0);
  EXPECT_EQ(p.p1, 2.5 / 255.0);
  EXPECT_EQ(out[16], 0);
  EXPECT_EQ(out[17], 102);  // (2 - 1) / (2.5 / 255)
  EXPECT_EQ(out[18], 255);

  const float w[] = {-1.0f, 0.0f, 3.0f, 1.0f};
  std::uint8_t zout[coll::kQuantHeaderBytes + 4];
  coll::quantize(w, 4, LOCKSTEP_F32, LOCKSTEP_QUANT_ZERO_POINT_U8, zout);
  const coll::QuantParams z = coll::read_quant_params(zout);
  EXPECT_EQ(z.p0, 4.0 / 255.0);
  EXPECT_EQ(z.p1, 64.0);     // round(63.75)
  EXPECT_EQ(zout[16], 0);    // round(-63.75) + 64
  EXPECT_EQ(zout[17], 64);   // zero is the zero point
  EXPECT_EQ(zout[18], 255);  // round(191.25) + 64
  EXPECT_EQ(zout[19], 128);  // round(63.75) + 64
  float back[4];
  coll::dequantize(zout, 4, LOCKSTEP_F32, LOCKSTEP_QUANT_ZERO_POINT_U8, back);
  EXPECT_EQ(back[1], 0.0f);
}

TEST(Quantize, HeaderLayoutAndCodes4Bit) {
  // Min-max: min 1, scale 2.5 / 15; element 2i in the low nibble, an odd count leaves
  // the last high nibble 0.
  const float v[] = {1.0f, 2.0f, 3.5f};
  std::uint8_t out[coll::kQuantHeaderBytes + 2];
  std::memset(out, 0xee, sizeof out);
  coll::quantize(v, 3, LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U4, out);
  const coll::QuantParams p = coll::read_quant_params(out);
  EXPECT_EQ(p.p0, 1.0);
  EXPECT_EQ(p.p1, 2.5 / 15.0);
  EXPECT_EQ(out[16], 6 << 4);  // codes 0 and round(1 / (2.5 / 15)) = 6
  EXPECT_EQ(out[17], 15);      // code 15, high nibble 0
  float back[3];
  coll::dequantize(out, 3, LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U4, back);
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], static_cast<float>(1.0 + 6.0 * (2.5 / 15.0)));
  EXPECT_EQ(back[2], 3.5f);

  const float w[] = {-1.0f, 0.0f, 3.0f, 1.0f};
  std::uint8_t zout[coll::kQuantHeaderBytes + 2];
  coll::quantize(w, 4, LOCKSTEP_F32, LOCKSTEP_QUANT_ZERO_POINT_U4, zout);
  const coll::QuantParams z = coll::read_quant_params(zout);
  EXPECT_EQ(z.p0, 4.0 / 15.0);
  EXPECT_EQ(z.p1, 4.0);                 // round(3.75)
  EXPECT_EQ(zout[16], 0 | (4 << 4));    // round(-3.75) + 4 = 0, zero is the zero point
  EXPECT_EQ(zout[17], 15 | (8 << 4));   // round(11.25) + 4 clamped to 15, round(3.75) + 4
}

TEST(Quantize, CastsRoundToNearestAndKeepTheirLayout) {
  // f32 -> f16: 1 + 2^-11 is a tie and rounds to even (1.0); 1 + 3 * 2^-11 rounds up.
  const float v[] = {1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, -2.0f, 70000.0f,
                     std::numeric_limits<float>::quiet_NaN()};
  std::uint8_t out[10];
  coll::quantize(v, 5, LOCKSTEP_F32, LOCKSTEP_QUANT_CAST_F16, out);
  EXPECT_EQ(out[0], 0x00);
  EXPECT_EQ(out[1], 0x3c);  // 1.0 = 0x3c00, little-endian
  EXPECT_EQ(out[2] | (out[3] << 8), 0x3c02);
  EXPECT_EQ(out[4] | (out[5] << 8), 0xc000);
  EXPECT_EQ(out[6] | (out[7] << 8), 0x7c00);  // beyond 65504: an infinity, as a cast
  float back[5];
  coll::dequantize(out, 5, LOCKSTEP_F32, LOCKSTEP_QUANT_CAST_F16, back);
  EXPECT_EQ(back[0], 1.0f);
  EXPECT_EQ(back[1], 1.0f + 0x1p-9f);
  EXPECT_EQ(back[2], -2.0f);
  EXPECT_TRUE(std::isinf(back[3]));
  EXPECT_TRUE(std::isnan(back[4]));
  EXPECT_TRUE(coll::quantized_header_valid(out, LOCKSTEP_F32, LOCKSTEP_QUANT_CAST_F16));

  // bf16 keeps f32's range: 70000 stays finite, within 2^-8 relative.
  coll::quantize(v, 5, LOCKSTEP_F32, LOCKSTEP_QUANT_CAST_BF16, out);
  coll::dequantize(out, 5, LOCKSTEP_F32, LOCKSTEP_QUANT_CAST_BF16, back);
  EXPECT_LE(std::fabs(back[3] - 70000.0f), 70000.0f * 0x1p-8f);
  EXPECT_EQ(out[4] | (out[5] << 8), 0xc000);  // -2.0 as bf16

  // The documented bound on random f32 and f64 data: half an ulp of the 16-bit type.
  std::mt19937_64 rng(3);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (const auto q : {LOCKSTEP_QUANT_CAST_F16, LOCKSTEP_QUANT_CAST_BF16}) {
    const double rel = q == LOCKSTEP_QUANT_CAST_F16 ? 0x1p-11 : 0x1p-8;
    const double t = q == LOCKSTEP_QUANT_CAST_F16 ? 0x1p-25 : 0x1p-134;
    std::vector<double> d(4097);
    for (auto& x : d) x = normal(rng) * std::pow(10.0, 4 * normal(rng) / 3);
    std::vector<float> f(d.begin(), d.end());
    std::vector<std::uint8_t> bytes(coll::quantized_bytes(d.size(), q));
    ASSERT_EQ(bytes.size(), 2 * d.size());
    std::vector<double> dback(d.size());
    coll::quantize(d.data(), d.size(), LOCKSTEP_F64, q, bytes.data());
    coll::dequantize(bytes.data(), d.size(), LOCKSTEP_F64, q, dback.data());
    std::vector<float> fback(f.size());
    coll::quantize(f.data(), f.size(), LOCKSTEP_F32, q, bytes.data());
    coll::dequantize(bytes.data(), f.size(), LOCKSTEP_F32, q, fback.data());
    for (std::size_t i = 0; i < d.size(); ++i) {
      if (q == LOCKSTEP_QUANT_CAST_F16 && std::fabs(d[i]) > 65504.0) continue;
      ASSERT_LE(std::fabs(dback[i] - d[i]), std::fabs(d[i]) * rel + t) << d[i];
      const double fx = static_cast<double>(f[i]);
      ASSERT_LE(std::fabs(static_cast<double>(fback[i]) - fx), std::fabs(fx) * rel + t) << fx;
    }
  }
}

TEST(Quantize, QuantizedBytesAndSupport) {
  EXPECT_EQ(coll::quantized_bytes(0, LOCKSTEP_QUANT_MINMAX_U8), 16u);
  EXPECT_EQ(coll::quantized_bytes(1000, LOCKSTEP_QUANT_MINMAX_U8), 1016u);
  EXPECT_EQ(coll::quantized_bytes(1000, LOCKSTEP_QUANT_ZERO_POINT_U8), 1016u);
  EXPECT_EQ(coll::quantized_bytes(1000, LOCKSTEP_QUANT_MINMAX_U4), 516u);
  EXPECT_EQ(coll::quantized_bytes(1001, LOCKSTEP_QUANT_ZERO_POINT_U4), 517u);
  EXPECT_EQ(coll::quantized_bytes(1001, LOCKSTEP_QUANT_CAST_F16), 2002u);
  EXPECT_EQ(coll::quantized_bytes(1001, LOCKSTEP_QUANT_CAST_BF16), 2002u);
  EXPECT_EQ(coll::quantized_bytes(1000, LOCKSTEP_QUANT_NONE), 0u);
  EXPECT_EQ(coll::quantized_bytes(1000, static_cast<lockstep_quantization_t>(7)), 0u);
  for (int d = 0; d < 12; ++d) {
    const auto dtype = static_cast<lockstep_dtype_t>(d);
    for (const auto q : kQuants) EXPECT_EQ(coll::quantization_supported(dtype, q), coll::is_float(dtype));
    for (const auto q : {LOCKSTEP_QUANT_CAST_F16, LOCKSTEP_QUANT_CAST_BF16}) {
      EXPECT_EQ(coll::quantization_supported(dtype, q), dtype == LOCKSTEP_F32 || dtype == LOCKSTEP_F64);
    }
    EXPECT_FALSE(coll::quantization_supported(dtype, LOCKSTEP_QUANT_NONE));
    EXPECT_FALSE(coll::quantization_supported(dtype, static_cast<lockstep_quantization_t>(7)));
  }
}

TEST(Quantize, EmptyChunkAndUnsupportedCombinations) {
  std::uint8_t out[coll::kQuantHeaderBytes + 4];
  std::memset(out, 0xab, sizeof(out));
  const float v[] = {1.0f, 2.0f};
  coll::quantize(v, 0, LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U8, out);
  for (std::size_t i = coll::kQuantHeaderBytes; i < sizeof(out); ++i) EXPECT_EQ(out[i], 0xab);
  EXPECT_TRUE(coll::quantized_header_valid(out, LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U8));
  float dst[2] = {7.0f, 8.0f};
  coll::dequantize(out, 0, LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U8, dst);
  coll::dequantize_reduce(dst, out, 0, LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U8, LOCKSTEP_SUM);
  EXPECT_EQ(dst[0], 7.0f);

  // Integer dtypes, NONE and unknown values: nothing is written.
  std::memset(out, 0xab, sizeof(out));
  const std::int32_t iv[] = {1, 2};
  coll::quantize(iv, 2, LOCKSTEP_I32, LOCKSTEP_QUANT_MINMAX_U8, out);
  coll::quantize(v, 2, LOCKSTEP_F32, LOCKSTEP_QUANT_NONE, out);
  coll::quantize(v, 2, static_cast<lockstep_dtype_t>(14), LOCKSTEP_QUANT_MINMAX_U8, out);
  for (const std::uint8_t b : out) EXPECT_EQ(b, 0xab);
  coll::dequantize(out, 2, LOCKSTEP_F32, LOCKSTEP_QUANT_NONE, dst);
  coll::dequantize(out, 2, LOCKSTEP_I32, LOCKSTEP_QUANT_MINMAX_U8, dst);
  coll::dequantize_reduce(dst, out, 2, LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U8,
                          static_cast<lockstep_reduce_op_t>(6));
  EXPECT_EQ(dst[0], 7.0f);
  EXPECT_EQ(dst[1], 8.0f);
  EXPECT_FALSE(coll::quantized_header_valid(out, LOCKSTEP_I32, LOCKSTEP_QUANT_MINMAX_U8));
}

// ---------------------------------------------------------------- determinism

template <typename D>
void check_determinism() {
  std::mt19937_64 rng(17);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> raw(5000);
  for (auto& x : raw) x = normal(rng) * 1e3;
  const auto v = make_values<D>(raw);
  for (const auto q : kAllQuants) {
    if (!coll::quantization_supported(D::kDtype, q)) continue;
    const auto bytes = encode<D>(v, q);
    const auto copy = bytes;  // what another peer receives
    const auto first = decode<D>(bytes, v.size(), q);
    const auto second = decode<D>(copy, v.size(), q);
    EXPECT_EQ(0, std::memcmp(first.data(), second.data(), v.size() * sizeof(typename D::S)));
    // Decoding into an element-offset buffer gives the same bits.
    std::vector<typename D::S> shifted(v.size() + 1);
    coll::dequantize(copy.data(), v.size(), D::kDtype, q, shifted.data() + 1);
    EXPECT_EQ(0, std::memcmp(first.data(), shifted.data() + 1, v.size() * sizeof(typename D::S)));
    // Re-encoding the decoded values and decoding again is stable within the bound
    // (a peer's own contribution, taken only in its decoded form).
    const auto again = decode<D>(encode<D>(first, q), v.size(), q);
    const double step = coll::quantization_has_header(q) ? chunk_scale(bytes, q) : 0.0;
    for (std::size_t i = 0; i < v.size(); ++i) {
      EXPECT_LE(std::fabs(D::value(again[i]) - D::value(first[i])), step + D::u() * 1e4);
    }
  }
}

TEST(Quantize, DequantizeIsAPureFunctionOfTheBytes) {
  check_determinism<F16>();
  check_determinism<BF16>();
  check_determinism<F32>();
  check_determinism<F64>();
}

TEST(Quantize, DecoderFormulaIsFixed) {
  // A hand-made chunk: every code with min -1 and scale 2/255 decodes to
  // min + code * scale computed in double, rounded to the dtype.
  std::vector<std::uint8_t> bytes(coll::kQuantHeaderBytes + 256);
  const double min = -1.0;
  const double scale = 2.0 / 255.0;
  std::memcpy(bytes.data(), &min, 8);  // little-endian host
  std::memcpy(bytes.data() + 8, &scale, 8);
  for (int c = 0; c < 256; ++c)
    bytes[coll::kQuantHeaderBytes + static_cast<std::size_t>(c)] = static_cast<std::uint8_t>(c);
  std::vector<float> f(256);
  std::vector<double> d(256);
  std::vector<std::uint16_t> h(256);
  coll::dequantize(bytes.data(), 256, LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U8, f.data());
  coll::dequantize(bytes.data(), 256, LOCKSTEP_F64, LOCKSTEP_QUANT_MINMAX_U8, d.data());
  coll::dequantize(bytes.data(), 256, LOCKSTEP_F16, LOCKSTEP_QUANT_MINMAX_U8, h.data());
  for (int c = 0; c < 256; ++c) {
    const double prod = static_cast<double>(c) * scale;
    const double expected = min + prod;
    const auto i = static_cast<std::size_t>(c);
    EXPECT_EQ(std::bit_cast<std::uint64_t>(d[i]), std::bit_cast<std::uint64_t>(expected));
    EXPECT_EQ(std::bit_cast<std::uint32_t>(f[i]),
              std::bit_cast<std::uint32_t>(static_cast<float>(expected)));
    EXPECT_EQ(h[i], coll::f64_to_f16(expected));
  }
  EXPECT_EQ(d[0], -1.0);
}

// ---------------------------------------------------------------- fused decode + reduce

template <typename D>
void check_fused() {
  using S = typename D::S;
  std::mt19937_64 rng(23);
  std::normal_distribution<double> normal(0.0, 10.0);
  const lockstep_reduce_op_t ops[] = {LOCKSTEP_SUM, LOCKSTEP_AVG, LOCKSTEP_PROD, LOCKSTEP_MAX,
                                      LOCKSTEP_MIN};
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{2047}, std::size_t{2048},
                              std::size_t{2049}, std::size_t{5000}}) {
    std::vector<double> raw(n);
    std::vector<double> acc_raw(n);
    for (auto& x : raw) x = normal(rng);
    for (std::size_t i = 0; i < n; ++i) {
      acc_raw[i] = i % 97 == 0 ? std::numeric_limits<double>::quiet_NaN() : normal(rng);
    }
    const auto v = make_values<D>(raw);
    const auto acc = make_values<D>(acc_raw);
    for (const auto q : kAllQuants) {
      if (!coll::quantization_supported(D::kDtype, q)) continue;
      const auto bytes = encode<D>(v, q);
      for (const auto op : ops) {
        SCOPED_TRACE("count " + std::to_string(n) + " quant " + std::to_string(q) + " op " +
                     std::to_string(op));
        std::vector<S> fused = acc;
        coll::dequantize_reduce(fused.data(), bytes.data(), n, D::kDtype, q, op);
        std::vector<S> decoded(n);
        coll::dequantize(bytes.data(), n, D::kDtype, q, decoded.data());
        std::vector<S> separate = acc;
        coll::reduce(separate.data(), decoded.data(), n, D::kDtype, op);
        if (n > 0) {
          EXPECT_EQ(0, std::memcmp(fused.data(), separate.data(), n * sizeof(S)));
        }
      }
    }
  }
}

TEST(Quantize, DequantizeReduceEqualsDequantizeThenReduce) {
  check_fused<F16>();
  check_fused<BF16>();
  check_fused<F32>();
  check_fused<F64>();
}

// ---------------------------------------------------------------- non-finite input

template <typename D>
bool is_quiet_nan(typename D::S s) {
  if constexpr (D::kDtype == LOCKSTEP_F16) return (s & 0x7fff) == 0x7e00;
  if constexpr (D::kDtype == LOCKSTEP_BF16) return (s & 0x7fff) == 0x7fc0;
  if constexpr (D::kDtype == LOCKSTEP_F32) {
    return (std::bit_cast<std::uint32_t>(s) & 0x7fffffffu) == 0x7fc00000u;
  }
  if constexpr (D::kDtype == LOCKSTEP_F64) {
    return (std::bit_cast<std::uint64_t>(s) & 0x7fffffffffffffffu) == 0x7ff8000000000000u;
  }
  return false;
}

template <typename D>
void check_non_finite() {
  const double inf = std::numeric_limits<double>::infinity();
  const double specials[] = {std::numeric_limits<double>::quiet_NaN(), inf, -inf};
  for (const double special : specials) {
    for (const std::size_t pos : {std::size_t{0}, std::size_t{500}, std::size_t{999}}) {
      std::vector<double> raw(1000);
      for (std::size_t i = 0; i < raw.size(); ++i) raw[i] = static_cast<double>(i) - 400.0;
      raw[pos] = special;
      const auto v = make_values<D>(raw);
      for (const auto q : kQuants) {
        SCOPED_TRACE("special " + std::to_string(special) + " at " + std::to_string(pos));
        const auto bytes = encode<D>(v, q);
        EXPECT_TRUE(coll::read_quant_params(bytes.data()).non_finite());
        EXPECT_TRUE(coll::quantized_header_valid(bytes.data(), D::kDtype, q));
        const auto back = decode<D>(bytes, v.size(), q);
        for (const auto s : back) ASSERT_TRUE(is_quiet_nan<D>(s));
        // Reduced into an accumulator, the chunk makes every element NaN.
        auto acc = make_values<D>(std::vector<double>(v.size(), 1.0));
        coll::dequantize_reduce(acc.data(), bytes.data(), v.size(), D::kDtype, q, LOCKSTEP_SUM);
        for (const auto s : acc) ASSERT_TRUE(std::isnan(D::value(s)));
      }
    }
  }
}

TEST(Quantize, NonFiniteChunkDecodesToNaN) {
  check_non_finite<F16>();
  check_non_finite<BF16>();
  check_non_finite<F32>();
  check_non_finite<F64>();

  // f64 only: a finite chunk whose range overflows is treated as non-finite.
  const double v[] = {-1e308, 1e308, 0.0};
  for (const auto q : kQuants) {
    std::uint8_t out[coll::kQuantHeaderBytes + 3];
    coll::quantize(v, 3, LOCKSTEP_F64, q, out);  // at most 3 code bytes
    EXPECT_TRUE(coll::read_quant_params(out).non_finite());
    double back[3];
    coll::dequantize(out, 3, LOCKSTEP_F64, q, back);
    for (const double x : back) EXPECT_TRUE(std::isnan(x));
  }
}

template <typename D>
void decode_garbage(const std::uint8_t* bytes, std::size_t n) {
  for (const auto q : kAllQuants) {
    if (!coll::quantization_supported(D::kDtype, q)) continue;
    std::vector<typename D::S> out(n);
    coll::dequantize(bytes, n, D::kDtype, q, out.data());
    std::vector<typename D::S> acc(n, D::make(1.0));
    coll::dequantize_reduce(acc.data(), bytes, n, D::kDtype, q, LOCKSTEP_PROD);
    (void)coll::quantized_header_valid(bytes, D::kDtype, q);
  }
}

TEST(Quantize, GarbageHeadersDecodeWithoutHarm) {
  // Whatever a misbehaving peer sends, decoding is defined (the sanitizer builds check
  // that there is no undefined behaviour); only valid headers pass the check.
  std::mt19937_64 rng(31);
  constexpr std::size_t kN = 300;
  std::vector<std::uint8_t> bytes(coll::kQuantHeaderBytes + 2 * kN);  // room for a cast
  auto set = [&](double p0, double p1) {
    std::memcpy(bytes.data(), &p0, 8);
    std::memcpy(bytes.data() + 8, &p1, 8);
  };
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double big = std::numeric_limits<double>::max();
  const double invalid[][2] = {{inf, 1.0},     {1.0, inf},   {-inf, -inf}, {big, big},
                               {-big, big},    {1.0, -1.0},  {nan, 1.0},   {1.0, nan},
                               {1e300, 1e300}, {0.0, 1e306}, {-1e40, 1.0}, {1.0, 1e37}};
  for (auto& b : bytes) b = static_cast<std::uint8_t>(rng());
  for (const auto& p : invalid) {
    set(p[0], p[1]);
    EXPECT_FALSE(coll::quantized_header_valid(bytes.data(), LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U8))
        << p[0] << " " << p[1];
    decode_garbage<F16>(bytes.data(), kN);
    decode_garbage<BF16>(bytes.data(), kN);
    decode_garbage<F32>(bytes.data(), kN);
    decode_garbage<F64>(bytes.data(), kN);
  }
  // Zero points that quantize() never writes (for 4-bit codes: above 15 too).
  set(0.01, 16.0);
  EXPECT_FALSE(coll::quantized_header_valid(bytes.data(), LOCKSTEP_F32, LOCKSTEP_QUANT_ZERO_POINT_U4));
  set(0.01, 15.0);
  EXPECT_TRUE(coll::quantized_header_valid(bytes.data(), LOCKSTEP_F32, LOCKSTEP_QUANT_ZERO_POINT_U4));
  for (const double zp : {-1.0, 3.5, 256.0, 1e300}) {
    set(0.01, zp);
    EXPECT_FALSE(
        coll::quantized_header_valid(bytes.data(), LOCKSTEP_F32, LOCKSTEP_QUANT_ZERO_POINT_U8))
        << zp;
    decode_garbage<F32>(bytes.data(), kN);
  }
  set(0.01, 12.0);
  EXPECT_TRUE(
      coll::quantized_header_valid(bytes.data(), LOCKSTEP_F32, LOCKSTEP_QUANT_ZERO_POINT_U8));
  set(-3.0, 0.01);
  EXPECT_TRUE(coll::quantized_header_valid(bytes.data(), LOCKSTEP_F16, LOCKSTEP_QUANT_MINMAX_U8));
  set(-70000.0, 0.01);  // min beyond the f16 range
  EXPECT_FALSE(coll::quantized_header_valid(bytes.data(), LOCKSTEP_F16, LOCKSTEP_QUANT_MINMAX_U8));
  // Random headers.
  for (int i = 0; i < 2000; ++i) {
    for (std::size_t k = 0; k < coll::kQuantHeaderBytes; ++k)
      bytes[k] = static_cast<std::uint8_t>(rng());
    decode_garbage<F16>(bytes.data(), kN);
    decode_garbage<BF16>(bytes.data(), kN);
    decode_garbage<F32>(bytes.data(), kN);
    decode_garbage<F64>(bytes.data(), kN);
  }
}

}  // namespace
