// Reduction kernels: one loop per (dtype, op), instantiated from templates, over
// __restrict pointers so that GCC vectorizes them. Compiled with -ffp-contract=off and
// without -ffast-math (see reduce.h).
#include "kernels/reduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if LOCKSTEP_KERNEL_X86_DISPATCH
#include <immintrin.h>
#endif

namespace lockstep::coll {
namespace {

// ---------------------------------------------------------------- element types
// Storage is what the buffer holds; Compute is what the arithmetic runs in. store()
// turns a result into storage, making a NaN the canonical NaN (reduce.h). (For f16/bf16
// that is done on the 16-bit pattern after rounding: a float select in front of the
// conversion would let GCC thread the NaN case through it and stop vectorizing.)

template <typename T>
struct Native {
  using Storage = T;
  using Compute = T;
  static T load(T x) { return x; }
  static T store(T x) {
    if constexpr (std::is_floating_point_v<T>) {
      return x != x ? std::numeric_limits<T>::quiet_NaN() : x;
    } else {
      return x;
    }
  }
};

struct Half {
  using Storage = std::uint16_t;
  using Compute = float;
  static float load(std::uint16_t x) { return f16_to_f32(x); }
  static std::uint16_t store(float x) {
    const std::uint16_t h = f32_to_f16(x);
    return (h & 0x7fffu) > 0x7c00u ? std::uint16_t{0x7e00} : h;
  }
};

struct BHalf {
  using Storage = std::uint16_t;
  using Compute = float;
  static float load(std::uint16_t x) { return bf16_to_f32(x); }
  static std::uint16_t store(float x) {
    const std::uint16_t h = f32_to_bf16(x);
    return (h & 0x7fffu) > 0x7f80u ? std::uint16_t{0x7fc0} : h;
  }
};

// At least as wide as T and at least unsigned int, so that no operand is promoted to a
// signed int (u16 * u16 could overflow int).
template <typename T>
using WideUnsigned =
    std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

// ---------------------------------------------------------------- ops

struct OpSum {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      using U = WideUnsigned<T>;
      // Unsigned arithmetic wraps; the conversion back to T is modular (C++20).
      return static_cast<T>(static_cast<U>(a) + static_cast<U>(b));
    } else {
      return a + b;
    }
  }
};

struct OpProd {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      using U = WideUnsigned<T>;
      return static_cast<T>(static_cast<U>(static_cast<U>(a) * static_cast<U>(b)));
    } else {
      return a * b;
    }
  }
};

// Floating max/min: a NaN operand gives a NaN (a + b; store() makes it canonical);
// numerically equal operands are either the same value (either one will do) or zeros,
// where a + b is +0 and -(-a + -b) is -0 unless both are -0 / both are +0.
struct OpMax {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      return a < b ? b : a;
    } else {
      const T eq = a == T(0) ? a + b : a;
      const T ordered = a > b ? a : (b > a ? b : eq);
      return (a != a || b != b) ? a + b : ordered;
    }
  }
};

struct OpMin {
  template <typename T>
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      return b < a ? b : a;
    } else {
      const T eq = a == T(0) ? -(-a + -b) : a;
      const T ordered = a < b ? a : (b < a ? b : eq);
      return (a != a || b != b) ? a + b : ordered;
    }
  }
};

// ---------------------------------------------------------------- loops
// Each loop walks its buffers a cache line at a time and asks for the line kAhead bytes
// further on before it is needed (for writing where it will be written). Measured on the
// 2-core host of BENCHMARKS.md, 64 MiB f32 through 256 KiB sub-chunks as the ring feeds
// them: the reduce went from 5.8 to 2.1 ms and the reduce that also saves the old
// destination from 8.6 to 4.5 ms; the hardware prefetcher alone did not keep these
// read-modify-write streams busy. A prefetch never faults, so running past the end of a
// buffer is harmless; the address is formed as an integer for that reason.

constexpr std::size_t kLineBytes = 64;
constexpr std::size_t kAhead = 8192;

inline void ahead_for_read(const void* p) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(p) + kAhead), 0);
}
inline void ahead_for_write(const void* p) {
  __builtin_prefetch(reinterpret_cast<const void*>(reinterpret_cast<std::uintptr_t>(p) + kAhead), 1);
}

template <typename E>
inline constexpr std::size_t kLine = kLineBytes / sizeof(typename E::Storage);

// One element: a OP b, stored.
template <typename E, typename Op>
inline typename E::Storage combine(typename E::Storage a, typename E::Storage b) {
  return E::store(Op::apply(E::load(a), E::load(b)));
}

// Every loop below runs whole cache lines (a fixed inner trip count, which GCC
// vectorizes), then the tail element by element.

template <typename E, typename Op>
[[LOCKSTEP_KERNEL_CLONES gnu::noinline]] void loop2(typename E::Storage* __restrict dst,
                                                    const typename E::Storage* __restrict src,
                                                    std::size_t n) {
  std::size_t i = 0;
  for (; i + kLine<E> <= n; i += kLine<E>) {
    ahead_for_write(dst + i);
    ahead_for_read(src + i);
    for (std::size_t k = i; k < i + kLine<E>; ++k) dst[k] = combine<E, Op>(dst[k], src[k]);
  }
  for (; i < n; ++i) dst[i] = combine<E, Op>(dst[i], src[i]);
}

// dst[i] = src[i] OP dst[i]: the out == b case of reduce3, keeping the operand order.
template <typename E, typename Op>
[[LOCKSTEP_KERNEL_CLONES gnu::noinline]] void loop2_swapped(
    typename E::Storage* __restrict dst, const typename E::Storage* __restrict src, std::size_t n) {
  std::size_t i = 0;
  for (; i + kLine<E> <= n; i += kLine<E>) {
    ahead_for_write(dst + i);
    ahead_for_read(src + i);
    for (std::size_t k = i; k < i + kLine<E>; ++k) dst[k] = combine<E, Op>(src[k], dst[k]);
  }
  for (; i < n; ++i) dst[i] = combine<E, Op>(src[i], dst[i]);
}

// dst[i] = dst[i] OP dst[i]: both operands are the same buffer (no __restrict).
template <typename E, typename Op>
[[LOCKSTEP_KERNEL_CLONES gnu::noinline]] void loop_self(typename E::Storage* dst, std::size_t n) {
  std::size_t i = 0;
  for (; i + kLine<E> <= n; i += kLine<E>) {
    ahead_for_write(dst + i);
    for (std::size_t k = i; k < i + kLine<E>; ++k) dst[k] = combine<E, Op>(dst[k], dst[k]);
  }
  for (; i < n; ++i) dst[i] = combine<E, Op>(dst[i], dst[i]);
}

template <typename E, typename Op>
[[LOCKSTEP_KERNEL_CLONES gnu::noinline]] void loop3(typename E::Storage* __restrict out,
                                                    const typename E::Storage* __restrict a,
                                                    const typename E::Storage* __restrict b,
                                                    std::size_t n) {
  std::size_t i = 0;
  for (; i + kLine<E> <= n; i += kLine<E>) {
    ahead_for_write(out + i);
    ahead_for_read(a + i);
    ahead_for_read(b + i);
    for (std::size_t k = i; k < i + kLine<E>; ++k) out[k] = combine<E, Op>(a[k], b[k]);
  }
  for (; i < n; ++i) out[i] = combine<E, Op>(a[i], b[i]);
}

// The two loops below copy and reduce in one pass; GCC would otherwise split the copy
// out into a memcpy call (loop distribution), reading the destination twice.
#if defined(__GNUC__) && !defined(__clang__)
#define LOCKSTEP_ONE_PASS gnu::optimize("no-tree-loop-distribute-patterns"),
#else
#define LOCKSTEP_ONE_PASS
#endif

// saved[i] = dst[i]; dst[i] = dst[i] OP src[i]: reduce3_saving with out == a.
template <typename E, typename Op>
[[LOCKSTEP_KERNEL_CLONES LOCKSTEP_ONE_PASS gnu::noinline]] void loop2_saving(
    typename E::Storage* __restrict dst, typename E::Storage* __restrict saved,
    const typename E::Storage* __restrict src, std::size_t n) {
  std::size_t i = 0;
  for (; i + kLine<E> <= n; i += kLine<E>) {
    ahead_for_write(dst + i);
    ahead_for_write(saved + i);
    ahead_for_read(src + i);
    for (std::size_t k = i; k < i + kLine<E>; ++k) {
      const typename E::Storage old = dst[k];
      saved[k] = old;
      dst[k] = combine<E, Op>(old, src[k]);
    }
  }
  for (; i < n; ++i) {
    const typename E::Storage old = dst[i];
    saved[i] = old;
    dst[i] = combine<E, Op>(old, src[i]);
  }
}

// saved[i] = out[i]; out[i] = a[i] OP b[i]: reduce3_saving with four distinct buffers.
template <typename E, typename Op>
[[LOCKSTEP_KERNEL_CLONES LOCKSTEP_ONE_PASS gnu::noinline]] void loop3_saving(
    typename E::Storage* __restrict out, typename E::Storage* __restrict saved,
    const typename E::Storage* __restrict a, const typename E::Storage* __restrict b,
    std::size_t n) {
  std::size_t i = 0;
  for (; i + kLine<E> <= n; i += kLine<E>) {
    ahead_for_write(out + i);
    ahead_for_write(saved + i);
    ahead_for_read(a + i);
    ahead_for_read(b + i);
    for (std::size_t k = i; k < i + kLine<E>; ++k) {
      saved[k] = out[k];
      out[k] = combine<E, Op>(a[k], b[k]);
    }
  }
  for (; i < n; ++i) {
    saved[i] = out[i];
    out[i] = combine<E, Op>(a[i], b[i]);
  }
}

template <typename E>
[[LOCKSTEP_KERNEL_CLONES gnu::noinline]] void avg_loop(typename E::Storage* __restrict data,
                                                       std::size_t n, std::uint32_t world_size) {
  using C = typename E::Compute;
  if constexpr (std::is_integral_v<C>) {
    // The widest type of the same signedness: the division of the wrapped sum,
    // truncated toward zero (C++ integer division), cannot overflow for a divisor >= 1.
    using W = std::conditional_t<std::is_signed_v<C>, std::int64_t, std::uint64_t>;
    const W w = static_cast<W>(world_size);
    for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<C>(static_cast<W>(data[i]) / w);
  } else {
    const C w = static_cast<C>(world_size);
    for (std::size_t i = 0; i < n; ++i) data[i] = E::store(E::load(data[i]) / w);
  }
}

// ---------------------------------------------------------------- f16 and bf16 with AVX2
// Hand-written because GCC does not vectorize the 16-bit conversions of the loops above
// (bf16 ran at a quarter of f32's speed). Same bits as those loops: the conversions to
// f32 are exact, the f32 operations are the same IEEE operations, and the way back
// rounds to nearest-even after a NaN is made canonical (the canonical f32 NaN rounds to
// the canonical f16 and bf16 NaN, so a NaN operand's payload never matters).
#if LOCKSTEP_KERNEL_X86_DISPATCH

bool cpu_has_avx2_f16c() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return has;
}

#define LOCKSTEP_AVX2 gnu::target("avx2,f16c")

[[LOCKSTEP_AVX2]] inline __m256 canonical8(__m256 f) {
  return _mm256_blendv_ps(f, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()),
                          _mm256_cmp_ps(f, f, _CMP_UNORD_Q));
}

// Op::apply on eight floats: the same operations, with selects for the branches.
template <typename Op>
[[LOCKSTEP_AVX2]] inline __m256 apply8(__m256 a, __m256 b) {
  if constexpr (std::is_same_v<Op, OpSum>) {
    return _mm256_add_ps(a, b);
  } else if constexpr (std::is_same_v<Op, OpProd>) {
    return _mm256_mul_ps(a, b);
  } else {
    constexpr bool kMax = std::is_same_v<Op, OpMax>;
    static_assert(kMax || std::is_same_v<Op, OpMin>);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    // Equal operands: a, or for zeros a + b (max) / -(-a + -b) (min).
    const __m256 zeros = kMax ? _mm256_add_ps(a, b)
                              : _mm256_xor_ps(_mm256_add_ps(_mm256_xor_ps(a, sign), _mm256_xor_ps(b, sign)), sign);
    const __m256 eq = _mm256_blendv_ps(a, zeros, _mm256_cmp_ps(a, _mm256_setzero_ps(), _CMP_EQ_OQ));
    const __m256 a_wins = _mm256_cmp_ps(a, b, kMax ? _CMP_GT_OQ : _CMP_LT_OQ);
    const __m256 b_wins = _mm256_cmp_ps(b, a, kMax ? _CMP_GT_OQ : _CMP_LT_OQ);
    const __m256 ordered = _mm256_blendv_ps(_mm256_blendv_ps(eq, b, b_wins), a, a_wins);
    return _mm256_blendv_ps(ordered, _mm256_add_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
  }
}

// One 32-byte group of f16 or bf16 values as two vectors of eight floats, and back.
// f16: the F16C conversions, elements 0-7 and 8-15. bf16: without crossing 128-bit
// lanes, the even elements (low halves of 32-bit words, shifted up) and the odd ones
// (high halves, masked); back by f32_to_bf16's integer rounding.
struct Group {
  __m256 lo;
  __m256 hi;
};

template <typename E>
[[LOCKSTEP_AVX2]] inline Group load16(const std::uint16_t* p) {
  if constexpr (std::is_same_v<E, Half>) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)),
            _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xffff0000u))))};
  }
}

// f32 -> bf16 rounding (nearest-even) of eight values, left in the high halves.
[[LOCKSTEP_AVX2]] inline __m256i bf16_rounded8(__m256 f) {
  const __m256i x = _mm256_castps_si256(canonical8(f));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), odd);
}

template <typename E>
[[LOCKSTEP_AVX2]] inline void store16(std::uint16_t* p, Group g) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  if constexpr (std::is_same_v<E, Half>) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(canonical8(g.lo), kNearest));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(canonical8(g.hi), kNearest));
  } else {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    const __m256i v = _mm256_or_si256(_mm256_srli_epi32(bf16_rounded8(g.lo), 16),
                                      _mm256_and_si256(bf16_rounded8(g.hi), high));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
}

constexpr std::size_t kHalfPerLine = kLineBytes / sizeof(std::uint16_t);

// out[i] = a[i] OP b[i]. out may be a or b (each group is read before it is written); a
// non-null `saved` receives out's old values. The tail as the loops above do it.
template <typename E, typename Op>
[[LOCKSTEP_AVX2, gnu::noinline]] void half_avx2(std::uint16_t* out, const std::uint16_t* a,
                                                const std::uint16_t* b, std::size_t n, std::uint16_t* saved) {
  std::size_t i = 0;
  for (; i + kHalfPerLine <= n; i += kHalfPerLine) {
    ahead_for_read(a + i);
    ahead_for_read(b + i);
    ahead_for_write(out + i);
    if (saved != nullptr) ahead_for_write(saved + i);
    for (std::size_t k = i; k < i + kHalfPerLine; k += 16) {
      if (saved != nullptr) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(saved + k),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(out + k)));
      }
      const Group x = load16<E>(a + k);
      const Group y = load16<E>(b + k);
      store16<E>(out + k, {apply8<Op>(x.lo, y.lo), apply8<Op>(x.hi, y.hi)});
    }
  }
  for (; i < n; ++i) {
    if (saved != nullptr) saved[i] = out[i];
    out[i] = E::store(Op::apply(E::load(a[i]), E::load(b[i])));
  }
}

// data[i] = data[i] / w, as avg_loop does it.
template <typename E>
[[LOCKSTEP_AVX2, gnu::noinline]] void half_avg_avx2(std::uint16_t* data, std::size_t n, float w) {
  const __m256 vw = _mm256_set1_ps(w);
  std::size_t i = 0;
  for (; i + kHalfPerLine <= n; i += kHalfPerLine) {
    ahead_for_write(data + i);
    for (std::size_t k = i; k < i + kHalfPerLine; k += 16) {
      const Group x = load16<E>(data + k);
      store16<E>(data + k, {_mm256_div_ps(x.lo, vw), _mm256_div_ps(x.hi, vw)});
    }
  }
  for (; i < n; ++i) data[i] = E::store(E::load(data[i]) / w);
}

#undef LOCKSTEP_AVX2

template <typename E>
constexpr bool kHalfType = std::is_same_v<E, Half> || std::is_same_v<E, BHalf>;

template <typename E>
bool try_half_avg_avx2(void* data, std::size_t n, std::uint32_t world_size) {
  if constexpr (kHalfType<E>) {
    if (cpu_has_avx2_f16c()) {
      half_avg_avx2<E>(static_cast<std::uint16_t*>(data), n, static_cast<float>(world_size));
      return true;
    }
  }
  return false;
}

// Runs out = a OP b with AVX2 (and F16C) if the element type is f16 or bf16 and the
// CPU has them.
template <typename E, typename Op>
bool try_half_avx2(void* out, const void* a, const void* b, std::size_t n, void* saved = nullptr) {
  if constexpr (kHalfType<E>) {
    if (cpu_has_avx2_f16c()) {
      half_avx2<E, Op>(static_cast<std::uint16_t*>(out), static_cast<const std::uint16_t*>(a),
                       static_cast<const std::uint16_t*>(b), n, static_cast<std::uint16_t*>(saved));
      return true;
    }
  }
  return false;
}

#else

template <typename E, typename Op>
bool try_half_avx2(void*, const void*, const void*, std::size_t, void* = nullptr) {
  return false;
}
template <typename E>
bool try_half_avg_avx2(void*, std::size_t, std::uint32_t) {
  return false;
}

#endif

// ---------------------------------------------------------------- dispatch
// Calls f.template operator()<E>() with the element type of `dtype`; false if unknown.
template <typename F>
bool with_dtype(lockstep_dtype_t dtype, F&& f) {
  switch (dtype) {
    case LOCKSTEP_U8: f.template operator()<Native<std::uint8_t>>(); return true;
    case LOCKSTEP_I8: f.template operator()<Native<std::int8_t>>(); return true;
    case LOCKSTEP_U16: f.template operator()<Native<std::uint16_t>>(); return true;
    case LOCKSTEP_I16: f.template operator()<Native<std::int16_t>>(); return true;
    case LOCKSTEP_U32: f.template operator()<Native<std::uint32_t>>(); return true;
    case LOCKSTEP_I32: f.template operator()<Native<std::int32_t>>(); return true;
    case LOCKSTEP_U64: f.template operator()<Native<std::uint64_t>>(); return true;
    case LOCKSTEP_I64: f.template operator()<Native<std::int64_t>>(); return true;
    case LOCKSTEP_F16: f.template operator()<Half>(); return true;
    case LOCKSTEP_BF16: f.template operator()<BHalf>(); return true;
    case LOCKSTEP_F32: f.template operator()<Native<float>>(); return true;
    case LOCKSTEP_F64: f.template operator()<Native<double>>(); return true;
  }
  return false;
}

template <typename F>
bool with_op(lockstep_reduce_op_t op, F&& f) {
  switch (op) {
    case LOCKSTEP_SUM:
    case LOCKSTEP_AVG: f.template operator()<OpSum>(); return true;
    case LOCKSTEP_PROD: f.template operator()<OpProd>(); return true;
    case LOCKSTEP_MAX: f.template operator()<OpMax>(); return true;
    case LOCKSTEP_MIN: f.template operator()<OpMin>(); return true;
  }
  return false;
}

}  // namespace

std::size_t dtype_size(lockstep_dtype_t dtype) {
  std::size_t size = 0;
  with_dtype(dtype, [&]<typename E>() { size = sizeof(typename E::Storage); });
  return size;
}

bool dtype_valid(int raw) { return raw >= LOCKSTEP_U8 && raw <= LOCKSTEP_F64; }

bool op_valid(int raw) { return raw >= LOCKSTEP_SUM && raw <= LOCKSTEP_MIN; }

bool is_float(lockstep_dtype_t dtype) {
  return dtype == LOCKSTEP_F16 || dtype == LOCKSTEP_BF16 || dtype == LOCKSTEP_F32 ||
         dtype == LOCKSTEP_F64;
}

void reduce(void* dst, const void* src, std::size_t count, lockstep_dtype_t dtype,
            lockstep_reduce_op_t op) {
  with_dtype(dtype, [&]<typename E>() {
    using S = typename E::Storage;
    with_op(op, [&]<typename Op>() {
      if (try_half_avx2<E, Op>(dst, dst, src, count)) return;
      if (dst == src) {
        loop_self<E, Op>(static_cast<S*>(dst), count);
      } else {
        loop2<E, Op>(static_cast<S*>(dst), static_cast<const S*>(src), count);
      }
    });
  });
}

void reduce3(void* out, const void* a, const void* b, std::size_t count, lockstep_dtype_t dtype,
             lockstep_reduce_op_t op) {
  with_dtype(dtype, [&]<typename E>() {
    using S = typename E::Storage;
    with_op(op, [&]<typename Op>() {
      if (try_half_avx2<E, Op>(out, a, b, count)) return;
      S* o = static_cast<S*>(out);
      const S* pa = static_cast<const S*>(a);
      const S* pb = static_cast<const S*>(b);
      if (o == pa && o == pb) {
        loop_self<E, Op>(o, count);
      } else if (o == pa) {
        loop2<E, Op>(o, pb, count);
      } else if (o == pb) {
        loop2_swapped<E, Op>(o, pa, count);
      } else {
        loop3<E, Op>(o, pa, pb, count);
      }
    });
  });
}

void reduce3_saving(void* out, void* saved, const void* a, const void* b, std::size_t count,
                    lockstep_dtype_t dtype, lockstep_reduce_op_t op) {
  with_dtype(dtype, [&]<typename E>() {
    using S = typename E::Storage;
    with_op(op, [&]<typename Op>() {
      if (try_half_avx2<E, Op>(out, a, b, count, saved)) return;
      S* o = static_cast<S*>(out);
      S* sv = static_cast<S*>(saved);
      const S* pa = static_cast<const S*>(a);
      const S* pb = static_cast<const S*>(b);
      if (o == pa) {
        loop2_saving<E, Op>(o, sv, pb, count);
      } else {
        loop3_saving<E, Op>(o, sv, pa, pb, count);
      }
    });
  });
}

namespace {
// Whether any of n elements has every exponent bit set (NaN or an infinity): an OR over
// all of them without a branch, which GCC vectorizes (the caller passes blocks of 64 KiB,
// so a bad element costs at most one block read in vain).
template <typename U, U kExponent>
[[LOCKSTEP_KERNEL_CLONES gnu::noinline]] bool any_exponent_full(const U* p, std::size_t n) {
  U full = 0;
  for (std::size_t i = 0; i < n; ++i) full |= static_cast<U>((p[i] & kExponent) == kExponent);
  return full != 0;
}

template <typename U, U kExponent>
std::size_t first_exponent_full(const void* data, std::size_t count) {
  const U* p = static_cast<const U*>(data);
  // Blocks of 64 KiB: a clean block costs one vectorized pass; the first dirty one is
  // searched element by element.
  constexpr std::size_t kBlock = (64u << 10) / sizeof(U);
  for (std::size_t at = 0; at < count; at += kBlock) {
    const std::size_t n = std::min(kBlock, count - at);
    if (!any_exponent_full<U, kExponent>(p + at, n)) continue;
    for (std::size_t i = at; i < at + n; ++i) {
      if ((p[i] & kExponent) == kExponent) return i;
    }
  }
  return count;
}
}  // namespace

std::size_t first_non_finite(const void* data, std::size_t count, lockstep_dtype_t dtype) {
  switch (dtype) {
    case LOCKSTEP_F16: return first_exponent_full<std::uint16_t, 0x7c00>(data, count);
    case LOCKSTEP_BF16: return first_exponent_full<std::uint16_t, 0x7f80>(data, count);
    case LOCKSTEP_F32: return first_exponent_full<std::uint32_t, 0x7f800000u>(data, count);
    case LOCKSTEP_F64: return first_exponent_full<std::uint64_t, 0x7ff0000000000000ull>(data, count);
    default: return count;
  }
}

void finalize(void* data, std::size_t count, lockstep_dtype_t dtype, lockstep_reduce_op_t op,
              std::uint32_t world_size) {
  if (op != LOCKSTEP_AVG || world_size == 0) return;
  with_dtype(dtype, [&]<typename E>() {
    if (try_half_avg_avx2<E>(data, count, world_size)) return;
    avg_loop<E>(static_cast<typename E::Storage*>(data), count, world_size);
  });
}

}  // namespace lockstep::coll
