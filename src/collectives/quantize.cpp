// Chunk quantization: 8-bit and 4-bit codes, 16-bit casts (see quantize.h for the
// formats, the error bounds and the determinism rule). Compiled with -ffp-contract=off and without -ffast-math: the
// decoder's "min + code * scale" must not become a fused multiply-add on some builds.
#include "collectives/quantize.h"

#include "kernels/reduce.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

namespace lockstep::coll {
namespace {

// ---------------------------------------------------------------- element types
// Compute: the type the chunk scan runs in (exact for every value of the dtype).

struct QF16 {
  using Storage = std::uint16_t;
  using Compute = float;
  static float load(std::uint16_t x) { return f16_to_f32(x); }
  static std::uint16_t from_double(double d) { return f64_to_f16(d); }
  static constexpr double kMax = 65504.0;
};

struct QBF16 {
  using Storage = std::uint16_t;
  using Compute = float;
  static float load(std::uint16_t x) { return bf16_to_f32(x); }
  static std::uint16_t from_double(double d) { return f64_to_bf16(d); }
  static constexpr double kMax = 0x1.fep127;
};

struct QF32 {
  using Storage = float;
  using Compute = float;
  static float load(float x) { return x; }
  static constexpr double kMax = static_cast<double>(std::numeric_limits<float>::max());
  // The clamp keeps the conversion defined for any double (a garbage header); a valid
  // chunk never decodes beyond FLT_MAX by more than rounding, which rounds to FLT_MAX
  // anyway, so the clamp changes no valid result. NaN passes through.
  static float from_double(double d) {
    const double c = d < -kMax ? -kMax : (d > kMax ? kMax : d);
    return static_cast<float>(c);
  }
};

struct QF64 {
  using Storage = double;
  using Compute = double;
  static double load(double x) { return x; }
  static constexpr double kMax = std::numeric_limits<double>::max();
  // min + 255 * scale can round past DBL_MAX for a chunk reaching it; clamp back (a
  // valid chunk never decodes farther from DBL_MAX than that rounding).
  static double from_double(double d) { return d < -kMax ? -kMax : (d > kMax ? kMax : d); }
};

template <typename F>
bool with_qdtype(lockstep_dtype_t dtype, F&& f) {
  switch (dtype) {
    case LOCKSTEP_F16: f.template operator()<QF16>(); return true;
    case LOCKSTEP_BF16: f.template operator()<QBF16>(); return true;
    case LOCKSTEP_F32: f.template operator()<QF32>(); return true;
    case LOCKSTEP_F64: f.template operator()<QF64>(); return true;
    default: return false;
  }
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------- header

void put_f64(std::uint8_t* out, double v) {
  const std::uint64_t bits = std::bit_cast<std::uint64_t>(v);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::uint8_t>(bits >> (8 * i));
}

double get_f64(const std::uint8_t* in) {
  std::uint64_t bits = 0;
  for (int i = 0; i < 8; ++i) bits |= static_cast<std::uint64_t>(in[i]) << (8 * i);
  return std::bit_cast<double>(bits);
}

// ---------------------------------------------------------------- scan
// min, max and whether any value is NaN or infinite. Independent lanes so that GCC
// vectorizes the reduction without -ffast-math; NaN is excluded from min/max by the
// comparisons and detected from the exponent bits.

struct Range {
  double lo = 0.0;
  double hi = 0.0;
  bool non_finite = false;
};

template <typename E>
[[LOCKSTEP_KERNEL_CLONES gnu::noinline]] Range scan(const typename E::Storage* __restrict src,
                                                    std::size_t n) {
  using C = typename E::Compute;
  using Bits = std::conditional_t<sizeof(C) == 4, std::uint32_t, std::uint64_t>;
  constexpr Bits kAbs = std::numeric_limits<Bits>::max() >> 1;
  constexpr Bits kExp = std::bit_cast<Bits>(std::numeric_limits<C>::infinity());
  constexpr std::size_t kLanes = 16;
  C mn[kLanes];
  C mx[kLanes];
  Bits worst[kLanes];
  for (std::size_t j = 0; j < kLanes; ++j) {
    mn[j] = std::numeric_limits<C>::infinity();
    mx[j] = -std::numeric_limits<C>::infinity();
    worst[j] = 0;
  }
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (std::size_t j = 0; j < kLanes; ++j) {
      const C x = E::load(src[i + j]);
      mn[j] = x < mn[j] ? x : mn[j];
      mx[j] = x > mx[j] ? x : mx[j];
      const Bits b = std::bit_cast<Bits>(x) & kAbs;
      worst[j] = b > worst[j] ? b : worst[j];
    }
  }
  for (std::size_t j = 0; i < n; ++i, ++j) {
    const C x = E::load(src[i]);
    mn[j] = x < mn[j] ? x : mn[j];
    mx[j] = x > mx[j] ? x : mx[j];
    const Bits b = std::bit_cast<Bits>(x) & kAbs;
    worst[j] = b > worst[j] ? b : worst[j];
  }
  C lo = mn[0];
  C hi = mx[0];
  Bits w = worst[0];
  for (std::size_t j = 1; j < kLanes; ++j) {
    lo = mn[j] < lo ? mn[j] : lo;
    hi = mx[j] > hi ? mx[j] : hi;
    w = worst[j] > w ? worst[j] : w;
  }
  Range r;
  r.non_finite = w >= kExp;
  r.lo = static_cast<double>(lo);
  r.hi = static_cast<double>(hi);
  return r;
}

// The mean and standard deviation of a chunk of range [lo, hi] (lo < hi, hi - lo
// finite), for the NORMAL hint: sums of u = (x - c) / h and of u^2 in double, c the
// middle of the range and h half its width, so that u lies in [-1, 1] and neither sum
// overflows, underflows or cancels, whatever the scale of the values; in independent
// lanes so that GCC vectorizes them. NaN for a range of f64 subnormals.
struct Moments {
  double mean = 0.0;
  double sd = 0.0;
};

template <typename E>
[[LOCKSTEP_KERNEL_CLONES gnu::noinline]] Moments moments(const typename E::Storage* __restrict src, std::size_t n,
                                                         double lo, double hi) {
  const double c = 0.5 * lo + 0.5 * hi;
  const double h = 0.5 * hi - 0.5 * lo;
  // A range so narrow that 1 / h overflows (f64 subnormals): no moments, no narrowing.
  const double inv = 1.0 / h;
  if (!std::isfinite(inv)) return Moments{kNaN, kNaN};
  constexpr std::size_t kLanes = 8;
  double sum[kLanes] = {};
  double squares[kLanes] = {};
  std::size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (std::size_t j = 0; j < kLanes; ++j) {
      const double u = (static_cast<double>(E::load(src[i + j])) - c) * inv;
      sum[j] += u;
      squares[j] += u * u;
    }
  }
  for (std::size_t j = 0; i < n; ++i, ++j) {
    const double u = (static_cast<double>(E::load(src[i])) - c) * inv;
    sum[j] += u;
    squares[j] += u * u;
  }
  double s = 0.0;
  double q = 0.0;
  for (std::size_t j = 0; j < kLanes; ++j) {
    s += sum[j];
    q += squares[j];
  }
  const double count = static_cast<double>(n);
  const double m = s / count;
  const double variance = q / count - m * m;
  return Moments{c + m * h, std::sqrt(variance > 0.0 ? variance : 0.0) * h};
}

// ---------------------------------------------------------------- encode
// v = (x - off) * mul + add, clamped to [0, top], truncated: with add = 0.5 that is
// round-half-up of (x - off) * mul. kDivide divides by `scale` instead of multiplying
// by its reciprocal (for a subnormal f64 scale, whose reciprocal overflows).

template <typename E, bool kDivide>
[[LOCKSTEP_KERNEL_CLONES gnu::noinline]] void encode(const typename E::Storage* __restrict src,
                                                     std::size_t n, std::uint8_t* __restrict out,
                                                     double off, double mul_or_scale, double add,
                                                     double top) {
  for (std::size_t i = 0; i < n; ++i) {
    const double x = static_cast<double>(E::load(src[i])) - off;
    double v = (kDivide ? x / mul_or_scale : x * mul_or_scale) + add;
    v = v < 0.0 ? 0.0 : v;
    v = v > top ? top : v;
    out[i] = static_cast<std::uint8_t>(static_cast<std::int32_t>(v));
  }
}

bool four_bit(lockstep_quantization_t q) {
  return q == LOCKSTEP_QUANT_MINMAX_U4 || q == LOCKSTEP_QUANT_ZERO_POINT_U4;
}
bool minmax(lockstep_quantization_t q) { return q == LOCKSTEP_QUANT_MINMAX_U8 || q == LOCKSTEP_QUANT_MINMAX_U4; }
bool code_kind(lockstep_quantization_t q) {
  return q == LOCKSTEP_QUANT_MINMAX_U8 || q == LOCKSTEP_QUANT_ZERO_POINT_U8 || four_bit(q);
}
bool cast_kind(lockstep_quantization_t q) { return q == LOCKSTEP_QUANT_CAST_F16 || q == LOCKSTEP_QUANT_CAST_BF16; }
// The largest code.
double top_code(lockstep_quantization_t q) { return four_bit(q) ? 15.0 : 255.0; }

// 4-bit codes go through blocks of one-byte codes on the stack: kBlock is even, so a
// block starts on a whole byte of the packed codes.
constexpr std::size_t kBlock = 2048;

void pack_nibbles(const std::uint8_t* __restrict codes, std::size_t n, std::uint8_t* __restrict out) {
  std::size_t i = 0;
  for (; i + 2 <= n; i += 2) out[i / 2] = static_cast<std::uint8_t>(codes[i] | (codes[i + 1] << 4));
  if (i < n) out[i / 2] = codes[i];
}
void unpack_nibbles(const std::uint8_t* __restrict in, std::size_t n, std::uint8_t* __restrict codes) {
  std::size_t i = 0;
  for (; i + 2 <= n; i += 2) {
    codes[i] = in[i / 2] & 0x0f;
    codes[i + 1] = static_cast<std::uint8_t>(in[i / 2] >> 4);
  }
  if (i < n) codes[i] = in[i / 2] & 0x0f;
}

// Codes of n elements into `codes`: one byte each, or packed two a byte.
template <typename E>
void encode_codes(const typename E::Storage* src, std::size_t n, std::uint8_t* codes, bool divide, double off,
                  double mul, double add, double top, bool packed) {
  auto one = [&](const typename E::Storage* s, std::size_t m, std::uint8_t* out) {
    if (divide) {
      encode<E, true>(s, m, out, off, mul, add, top);
    } else {
      encode<E, false>(s, m, out, off, mul, add, top);
    }
  };
  if (!packed) {
    one(src, n, codes);
    return;
  }
  std::uint8_t block[kBlock];
  for (std::size_t at = 0; at < n; at += kBlock) {
    const std::size_t m = std::min(kBlock, n - at);
    one(src + at, m, block);
    pack_nibbles(block, m, codes + at / 2);
  }
}

std::size_t code_bytes(std::size_t n, lockstep_quantization_t q) { return four_bit(q) ? (n + 1) / 2 : n; }

template <typename E>
void quantize_chunk(const typename E::Storage* src, std::size_t n, lockstep_quantization_t quant,
                    lockstep_distribution_t distribution, std::uint8_t* out) {
  std::uint8_t* codes = out + kQuantHeaderBytes;
  const std::size_t ncode = code_bytes(n, quant);
  const double top = top_code(quant);
  const Range r = n == 0 ? Range{} : scan<E>(src, n);
  double lo = r.lo;
  double hi = r.hi;
  if (distribution == LOCKSTEP_DIST_NORMAL && n > 0 && !r.non_finite && hi > lo && std::isfinite(hi - lo)) {
    const Moments m = moments<E>(src, n, lo, hi);
    const double k = four_bit(quant) ? kNormalClip4 : kNormalClip8;
    if (std::isfinite(m.mean) && std::isfinite(m.sd) && std::isfinite(k * m.sd)) {
      lo = std::max(lo, m.mean - k * m.sd);
      hi = std::min(hi, m.mean + k * m.sd);
    }
  }
  if (!minmax(quant)) {
    lo = lo < 0.0 ? lo : 0.0;
    hi = hi > 0.0 ? hi : 0.0;
  }
  const double range = hi - lo;
  if (r.non_finite || !std::isfinite(range)) {
    put_f64(out, kNaN);
    put_f64(out + 8, kNaN);
    if (ncode > 0) std::memset(codes, 0, ncode);
    return;
  }
  const double scale = range / top;
  if (scale == 0.0) {
    // All values equal (MINMAX) or all zero (ZERO_POINT): every code is 0.
    put_f64(out, minmax(quant) ? lo : 0.0);
    put_f64(out + 8, 0.0);
    if (ncode > 0) std::memset(codes, 0, ncode);
    return;
  }
  // Below 2^-1000 the reciprocal could overflow: divide instead.
  const bool divide = scale < 0x1p-1000;
  const double mul = divide ? scale : 1.0 / scale;
  if (minmax(quant)) {
    put_f64(out, lo);
    put_f64(out + 8, scale);
    encode_codes<E>(src, n, codes, divide, lo, mul, 0.5, top, four_bit(quant));
  } else {
    // -lo / scale is in [0, top]: the zero point is a valid code.
    double zp = std::floor(-lo / scale + 0.5);
    zp = zp < 0.0 ? 0.0 : (zp > top ? top : zp);
    put_f64(out, scale);
    put_f64(out + 8, zp);
    encode_codes<E>(src, n, codes, divide, 0.0, mul, zp + 0.5, top, four_bit(quant));
  }
}

// Casts: 16-bit values, little-endian. Only f32 and f64 are cast (quantization_supported).
// An f32 value is exact in f64, so rounding it to 16 bits from f32 or from f64 gives the
// same value; the f32 loop converts from f32, which vectorizes.
template <bool kHalf, typename E>
[[LOCKSTEP_KERNEL_CLONES gnu::noinline]] void cast_loop(const typename E::Storage* __restrict src, std::size_t n,
                                                       std::uint8_t* __restrict out) {
  for (std::size_t i = 0; i < n; ++i) {
    std::uint16_t v = 0;
    if constexpr (std::is_same_v<typename E::Storage, float>) {
      v = kHalf ? f32_to_f16(src[i]) : f32_to_bf16(src[i]);
    } else {
      const double x = static_cast<double>(E::load(src[i]));
      v = kHalf ? f64_to_f16(x) : f64_to_bf16(x);
    }
    out[2 * i] = static_cast<std::uint8_t>(v);
    out[2 * i + 1] = static_cast<std::uint8_t>(v >> 8);
  }
}

template <typename E>
void cast_chunk(const typename E::Storage* src, std::size_t n, lockstep_quantization_t quant, std::uint8_t* out) {
  if (quant == LOCKSTEP_QUANT_CAST_F16) {
    cast_loop<true, E>(src, n, out);
  } else {
    cast_loop<false, E>(src, n, out);
  }
}

template <typename E>
[[LOCKSTEP_KERNEL_CLONES gnu::noinline]] void uncast(const std::uint8_t* __restrict in, std::size_t n,
                                                     typename E::Storage* __restrict dst, bool half) {
  using S = typename E::Storage;
  for (std::size_t i = 0; i < n; ++i) {
    const auto v = static_cast<std::uint16_t>(in[2 * i] | (in[2 * i + 1] << 8));
    dst[i] = static_cast<S>(half ? f16_to_f32(v) : bf16_to_f32(v));
  }
}

// ---------------------------------------------------------------- decode

template <typename E>
[[LOCKSTEP_KERNEL_CLONES gnu::noinline]] void decode_minmax(const std::uint8_t* __restrict codes,
                                                            std::size_t n,
                                                            typename E::Storage* __restrict dst,
                                                            double min, double scale) {
  for (std::size_t i = 0; i < n; ++i) {
    dst[i] = E::from_double(min + static_cast<double>(codes[i]) * scale);
  }
}

template <typename E>
[[LOCKSTEP_KERNEL_CLONES gnu::noinline]] void decode_zero_point(
    const std::uint8_t* __restrict codes, std::size_t n, typename E::Storage* __restrict dst,
    double scale, double zero_point) {
  for (std::size_t i = 0; i < n; ++i) {
    dst[i] = E::from_double((static_cast<double>(codes[i]) - zero_point) * scale);
  }
}

template <typename E>
void fill(typename E::Storage* dst, std::size_t n, double v) {
  const typename E::Storage s = E::from_double(v);
  for (std::size_t i = 0; i < n; ++i) dst[i] = s;
}

// Decodes n one-byte codes with the given header parameters.
template <typename E>
void decode_codes(const std::uint8_t* codes, std::size_t n, lockstep_quantization_t quant, const QuantParams& p,
                  typename E::Storage* dst) {
  if (p.non_finite()) {
    fill<E>(dst, n, kNaN);
  } else if (minmax(quant)) {
    if (p.p1 == 0.0) {
      fill<E>(dst, n, p.p0);  // all equal: exactly min, bit for bit
    } else {
      decode_minmax<E>(codes, n, dst, p.p0, p.p1);
    }
  } else {
    decode_zero_point<E>(codes, n, dst, p.p0, p.p1);
  }
}

// Decodes elements [at, at + n) of the encoded chunk `in` (its header included); `at`
// is even where the codes are 4-bit.
template <typename E>
void decode_range(const std::uint8_t* in, std::size_t at, std::size_t n, lockstep_quantization_t quant,
                  typename E::Storage* dst) {
  if (cast_kind(quant)) {
    uncast<E>(in + 2 * at, n, dst, quant == LOCKSTEP_QUANT_CAST_F16);
    return;
  }
  const QuantParams p = read_quant_params(in);
  const std::uint8_t* codes = in + kQuantHeaderBytes;
  if (!four_bit(quant)) {
    decode_codes<E>(codes + at, n, quant, p, dst);
    return;
  }
  std::uint8_t block[kBlock];
  for (std::size_t off = 0; off < n; off += kBlock) {
    const std::size_t m = std::min(kBlock, n - off);
    unpack_nibbles(codes + (at + off) / 2, m, block);
    decode_codes<E>(block, m, quant, p, dst + off);
  }
}

}  // namespace

bool quantization_supported(lockstep_dtype_t dtype, lockstep_quantization_t quant) {
  if (cast_kind(quant)) return dtype == LOCKSTEP_F32 || dtype == LOCKSTEP_F64;
  return code_kind(quant) && is_float(dtype);
}

bool quantization_has_header(lockstep_quantization_t quant) { return code_kind(quant); }

std::size_t quantized_bytes(std::size_t count, lockstep_quantization_t quant) {
  if (cast_kind(quant)) return 2 * count;
  return code_kind(quant) ? kQuantHeaderBytes + code_bytes(count, quant) : 0;
}

void quantize(const void* src, std::size_t count, lockstep_dtype_t dtype, lockstep_quantization_t quant,
              lockstep_distribution_t distribution, std::uint8_t* out) {
  if (!quantization_supported(dtype, quant)) return;
  with_qdtype(dtype, [&]<typename E>() {
    const auto* s = static_cast<const typename E::Storage*>(src);
    if (cast_kind(quant)) {
      cast_chunk<E>(s, count, quant, out);
    } else {
      quantize_chunk<E>(s, count, quant, distribution, out);
    }
  });
}

void dequantize(const std::uint8_t* in, std::size_t count, lockstep_dtype_t dtype,
                lockstep_quantization_t quant, void* dst) {
  if (!quantization_supported(dtype, quant)) return;
  with_qdtype(dtype, [&]<typename E>() {
    decode_range<E>(in, 0, count, quant, static_cast<typename E::Storage*>(dst));
  });
}

void dequantize_reduce(void* dst, const std::uint8_t* in, std::size_t count, lockstep_dtype_t dtype,
                       lockstep_quantization_t quant, lockstep_reduce_op_t op) {
  if (!quantization_supported(dtype, quant) || !op_valid(op)) return;
  with_qdtype(dtype, [&]<typename E>() {
    using S = typename E::Storage;
    // Decode a block into a stack buffer, then reduce it with the ordinary kernel:
    // the same bits as dequantize() followed by reduce(), no allocation.
    S tmp[kBlock];
    S* d = static_cast<S*>(dst);
    for (std::size_t off = 0; off < count; off += kBlock) {
      const std::size_t m = count - off < kBlock ? count - off : kBlock;
      decode_range<E>(in, off, m, quant, tmp);
      reduce(d + off, tmp, m, dtype, op);
    }
  });
}

void quantization_error(const void* raw, const std::uint8_t* encoded, std::size_t count, lockstep_dtype_t dtype,
                        lockstep_quantization_t quant, double factor, void* err) {
  if (!quantization_supported(dtype, quant)) return;
  with_qdtype(dtype, [&]<typename E>() {
    using S = typename E::Storage;
    S tmp[kBlock];
    const S* x = static_cast<const S*>(raw);
    S* e = static_cast<S*>(err);
    for (std::size_t off = 0; off < count; off += kBlock) {
      const std::size_t m = count - off < kBlock ? count - off : kBlock;
      decode_range<E>(encoded, off, m, quant, tmp);
      for (std::size_t i = 0; i < m; ++i) {
        const double a = static_cast<double>(E::load(x[off + i]));
        const double b = static_cast<double>(E::load(tmp[i]));
        e[off + i] = E::from_double(std::isfinite(a) && std::isfinite(b) ? (a - b) * factor : 0.0);
      }
    }
  });
}

QuantParams read_quant_params(const std::uint8_t* in) {
  QuantParams p;
  p.p0 = get_f64(in);
  p.p1 = get_f64(in + 8);
  return p;
}

bool quantized_header_valid(const std::uint8_t* in, lockstep_dtype_t dtype,
                            lockstep_quantization_t quant) {
  if (!quantization_supported(dtype, quant)) return false;
  if (cast_kind(quant)) return true;
  const QuantParams p = read_quant_params(in);
  if (p.p0 != p.p0 && p.p1 != p.p1) return true;  // the non-finite marker
  if (!std::isfinite(p.p0) || !std::isfinite(p.p1)) return false;
  double max = 0.0;
  with_qdtype(dtype, [&]<typename E>() { max = E::kMax; });
  // Decoded values may exceed the largest finite value by rounding only.
  const double limit = max + max * 0x1p-40;
  const double codes = top_code(quant);
  if (minmax(quant)) {
    const double min = p.p0;
    const double scale = p.p1;
    if (scale < 0.0 || std::fabs(min) > max) return false;
    const double top = min + codes * scale;
    return std::isfinite(top) && std::fabs(top) <= limit;
  }
  const double scale = p.p0;
  const double zp = p.p1;
  if (scale < 0.0 || zp < 0.0 || zp > codes || zp != std::floor(zp)) return false;
  return zp * scale <= limit && (codes - zp) * scale <= limit;
}

}  // namespace lockstep::coll
