// Element-wise reduction kernels of the ring all-reduce, and the f16/bf16 conversions
// they use. Pure functions: no IO, no threads, no allocation.
//
// A bottom layer (src/kernels/, with vote_carried.h): the collectives use it and so does
// the coordinator, which reduces the small all-reduces that travel with the votes; it
// includes neither. Its names are in lockstep::coll, beside the collectives' own.
//
// Arithmetic (PRODUCT.md, binding semantics rule 8):
//  - Integer sum and prod wrap around modulo 2^bits. The arithmetic is done in an
//    unsigned type of at least the same width (at least `unsigned int`, so that u8/u16
//    operands are not promoted to a signed int that could overflow), then truncated.
//  - Integer max/min are the usual ones.
//  - Floating-point max and min propagate NaN: if either operand is NaN the result is
//    NaN. Otherwise they order -0.0 below +0.0 (IEEE 754-2019 maximum/minimum), so that
//    max(-0, +0) = +0 and min(-0, +0) = -0 whatever the operand order.
//  - Every floating-point result that is NaN (of any op, and of finalize) is the
//    canonical quiet NaN: sign 0, payload 0 (f16 0x7e00, bf16 0x7fc0, f32 0x7fc00000,
//    f64 0x7ff8000000000000). IEEE leaves open which operand's payload survives and
//    compilers may swap the operands of a commutative operation, so without this the
//    NaN bits would depend on the code path.
//  - f16 and bf16 operands are converted to f32 (exactly), the operation is done in
//    f32, and the result is rounded to nearest-even when stored. Because f32 carries
//    at least 2p+2 bits for both (p = 11 and 8), this double rounding is innocuous:
//    sum, prod and the avg division come out correctly rounded in f16/bf16.
//  - AVG: reduce() accumulates the sum exactly as SUM does; finalize() divides by the
//    world size once all contributions are in.
//
// Buffers: pointers must be aligned to the element size (any element offset is fine);
// buffers passed together are either the same pointer or do not overlap at all.
// An unknown dtype or op makes every function here a no-op (callers validate raw values
// from the API or the wire with dtype_valid()/op_valid() first).
//
// Determinism: results depend only on the operand bits. The kernels are compiled without
// -ffast-math and with -ffp-contract=off (no fused multiply-add) and run in the default
// floating-point environment (round to nearest-even, no flush-to-zero: a process that
// sets FTZ/DAZ changes f32/f64 results on subnormals); the conversions below are pure
// bit manipulation plus exact or correctly rounded IEEE operations, and NaN results are
// canonical, so every code path on every peer computes the same bits.
#pragma once

#include <lockstep/lockstep.h>

#include <bit>
#include <cstddef>
#include <cstdint>

// The kernel loops are compiled twice on x86-64 Linux with GCC, for AVX2 and for the
// baseline, and the dynamic loader picks one per process (ifunc); f16 and bf16 reduce
// and avg use hand-written AVX2 loops (F16C conversions for f16, integer rounding for
// bf16) where the CPU has them. Every variant gives the same bits: the operations are
// element-wise IEEE and integer operations, AVX2 brings no fused multiply-add, and the
// F16C conversions equal f16_to_f32/f32_to_f16 below on all 2^16 and 2^32 inputs
// (checked, with and without DAZ/FTZ). Define LOCKSTEP_NO_KERNEL_CLONES
// to build only the baseline (to test that path on an AVX2 machine).
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(LOCKSTEP_NO_KERNEL_CLONES)
#define LOCKSTEP_KERNEL_X86_DISPATCH 1
#define LOCKSTEP_KERNEL_CLONES gnu::target_clones("avx2", "default"),
#else
#define LOCKSTEP_KERNEL_X86_DISPATCH 0
#define LOCKSTEP_KERNEL_CLONES
#endif

namespace lockstep::coll {

// Size of one element in bytes; 0 for an unknown value.
std::size_t dtype_size(lockstep_dtype_t dtype);
// Whether a raw integer (from the C API or the wire) names a dtype / reduce op.
bool dtype_valid(int raw);
bool op_valid(int raw);
// f16, bf16, f32, f64.
bool is_float(lockstep_dtype_t dtype);

// dst[i] = dst[i] OP src[i] for i < count. For AVG this accumulates the sum.
void reduce(void* dst, const void* src, std::size_t count, lockstep_dtype_t dtype,
            lockstep_reduce_op_t op);

// out[i] = a[i] OP b[i] for i < count. `out` may be the same pointer as `a` or `b`.
void reduce3(void* out, const void* a, const void* b, std::size_t count, lockstep_dtype_t dtype,
             lockstep_reduce_op_t op);

// reduce3 that first hands out's previous content to `saved`: saved[i] = out[i] as it
// was, then out[i] = a[i] OP b[i], reading out once (the ring backs up the destination
// this way as it reduces into it). Same bits in out as reduce3. `a` may be the same
// pointer as `out`; `b` and `saved` overlap no other buffer.
void reduce3_saving(void* out, void* saved, const void* a, const void* b, std::size_t count,
                    lockstep_dtype_t dtype, lockstep_reduce_op_t op);

// After all contributions are summed. AVG divides every element by world_size:
// integers as the wrapped sum read as the signed/unsigned type, divided, truncated
// toward zero; f32/f64 divide in their own type; f16/bf16 divide in f32 and round to
// nearest-even. Other ops, and world_size 0, leave the data unchanged.
void finalize(void* data, std::size_t count, lockstep_dtype_t dtype, lockstep_reduce_op_t op,
              std::uint32_t world_size);

// The index of the first element of `data` that is NaN or an infinity, or `count` if
// none is (always `count` for the integer dtypes): the optional check of a collective's
// contribution (check_finite). Reads every element once at memory speed when none is.
std::size_t first_non_finite(const void* data, std::size_t count, lockstep_dtype_t dtype);

// ---------------------------------------------------------------- conversions
// Bit-exact, table-free and branch-free (selects only), so that loops over them
// vectorize. NaN stays NaN and comes out quiet (the quiet bit set, the upper payload
// bits kept); infinities stay infinities; subnormals are handled exactly; overflow
// rounds to infinity as IEEE round-to-nearest-even requires.

// f16 -> f32, exact.
inline float f16_to_f32(std::uint16_t h) noexcept {
  const std::int32_t hs = static_cast<std::int16_t>(h);
  const std::uint32_t sign = static_cast<std::uint32_t>(hs) & 0x80000000u;
  const std::int32_t em = hs & 0x7fff;
  // Normal numbers: exponent and mantissa into place, exponent rebiased 15 -> 127
  // (+112); infinity and NaN: all-ones exponent (+224); a NaN gets the quiet bit.
  const std::uint32_t normal =
      ((static_cast<std::uint32_t>(em) << 13) + (em >= 0x7c00 ? 0x70000000u : 0x38000000u)) |
      (em > 0x7c00 ? 0x00400000u : 0u);
  // Zero and subnormals: em * 2^-24, exact in f32.
  const std::uint32_t sub = std::bit_cast<std::uint32_t>(static_cast<float>(em) * 0x1p-24f);
  return std::bit_cast<float>((em < 0x0400 ? sub : normal) | sign);
}

// f32 -> f16, round to nearest-even.
inline std::uint16_t f32_to_f16(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t a = x & 0x7fffffffu;
  const std::uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
  // |f| >= 2^-14: rebias 127 -> 15 and round the 23-bit mantissa to 10 bits; a carry
  // out of the mantissa bumps the exponent, and out of the top exponent gives inf.
  const std::uint32_t normal = (a - 0x38000000u + 0x0fffu + ((a >> 13) & 1u)) >> 13;
  // |f| < 2^-14: adding 0.5 rounds to a multiple of 2^-24 (the f16 subnormal step) in
  // the current (nearest-even) mode; the low bits are then the f16 subnormal encoding.
  const std::uint32_t sub =
      std::bit_cast<std::uint32_t>(std::bit_cast<float>(a) + 0.5f) - 0x3f000000u;
  const std::uint32_t r =
      a > 0x7f800000u ? nan : (a >= 0x47800000u ? 0x7c00u : (a >= 0x38800000u ? normal : sub));
  return static_cast<std::uint16_t>(r | sign);
}

// bf16 -> f32, exact.
inline float bf16_to_f32(std::uint16_t b) noexcept {
  const std::uint32_t x = static_cast<std::uint32_t>(b) << 16;
  const std::uint32_t quiet = (x & 0x7fffffffu) > 0x7f800000u ? 0x00400000u : 0u;
  return std::bit_cast<float>(x | quiet);
}

// f32 -> bf16, round to nearest-even.
inline std::uint16_t f32_to_bf16(float f) noexcept {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const std::uint32_t nan = (x >> 16) | 0x0040u;
  return static_cast<std::uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

// f64 -> f16, round to nearest-even (one rounding, not via f32).
inline std::uint16_t f64_to_f16(double d) noexcept {
  const std::uint64_t x = std::bit_cast<std::uint64_t>(d);
  const std::uint64_t sign = (x >> 48) & 0x8000u;
  const std::uint64_t a = x & 0x7fffffffffffffffu;
  const double mag = std::bit_cast<double>(a);
  const std::uint64_t nan = 0x7e00u | ((a >> 42) & 0x3ffu);
  // Rebias 1023 -> 15, round the 52-bit mantissa to 10 bits.
  const std::uint64_t normal =
      (a - (std::uint64_t{1008} << 52) + ((std::uint64_t{1} << 41) - 1) + ((a >> 42) & 1u)) >> 42;
  // Below 2^-14: count multiples of 2^-24; adding 2^52 rounds that count to an integer
  // (nearest-even) and leaves it in the low mantissa bits.
  const std::uint64_t sub =
      std::bit_cast<std::uint64_t>(mag * 0x1p24 + 0x1p52) - std::bit_cast<std::uint64_t>(0x1p52);
  // 65520 is the midpoint between the largest f16 (65504) and 2^16; it rounds to inf.
  const std::uint64_t r =
      mag != mag ? nan : (mag >= 65520.0 ? 0x7c00u : (mag >= 0x1p-14 ? normal : sub));
  return static_cast<std::uint16_t>(r | sign);
}

// f64 -> bf16, round to nearest-even (one rounding, not via f32).
inline std::uint16_t f64_to_bf16(double d) noexcept {
  const std::uint64_t x = std::bit_cast<std::uint64_t>(d);
  const std::uint64_t sign = (x >> 48) & 0x8000u;
  const std::uint64_t a = x & 0x7fffffffffffffffu;
  const double mag = std::bit_cast<double>(a);
  const std::uint64_t nan = 0x7fc0u | ((a >> 45) & 0x7fu);
  // Rebias 1023 -> 127, round the 52-bit mantissa to 7 bits.
  const std::uint64_t normal =
      (a - (std::uint64_t{896} << 52) + ((std::uint64_t{1} << 44) - 1) + ((a >> 45) & 1u)) >> 45;
  // Below 2^-126: count multiples of 2^-133 (the bf16 subnormal step).
  const std::uint64_t sub =
      std::bit_cast<std::uint64_t>(mag * 0x1p133 + 0x1p52) - std::bit_cast<std::uint64_t>(0x1p52);
  // (2 - 2^-8) * 2^127 is the midpoint between the largest bf16 and 2^128: inf from there.
  const std::uint64_t r =
      mag != mag ? nan : (mag >= 0x1.ffp127 ? 0x7f80u : (mag >= 0x1p-126 ? normal : sub));
  return static_cast<std::uint16_t>(r | sign);
}

}  // namespace lockstep::coll
