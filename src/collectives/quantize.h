// Quantization of floating-point chunks on the wire (f16, bf16, f32, f64): 8-bit and
// 4-bit codes under two algorithms, and plain casts to a 16-bit float type.
// Pure functions: no IO, no threads, no heap allocation (the 4-bit codes and
// dequantize_reduce go through stack buffers of at most 16 KiB).
//
// One call encodes ONE chunk with one set of parameters. Encoded chunk layout of the
// code kinds (quantized_bytes(count) = 16 + count bytes for 8-bit codes, 16 +
// ceil(count / 2) for 4-bit codes):
//   bytes 0..7   p0, IEEE-754 binary64, little-endian
//   bytes 8..15  p1, IEEE-754 binary64, little-endian
//   bytes 16..   one 8-bit code per element, or two 4-bit codes per byte: element 2i in
//                the low nibble, 2i+1 in the high one (an odd count leaves the last
//                high nibble 0)
// The parameters are kept in f64 so that every dtype's min is stored exactly and the
// decoder computes in double from exactly the bits that were sent. L below is the
// largest code: 255 for the 8-bit kinds, 15 for the 4-bit ones.
//
// Rounding of codes is to nearest, halves up: round(v) = floor(v + 0.5).
//
// MINMAX (U8, U4): p0 = min, p1 = scale = (max - min) / L over the chunk.
//   code = clamp(round((x - min) / scale), 0, L); decode = min + code * scale.
//   A chunk whose values are all equal (scale 0) has all codes 0 and decodes to exactly
//   min, bit for bit (-0.0 included).
// ZERO_POINT (U8, U4): p0 = scale, p1 = zero_point (an integer 0..L held in the f64).
//   The range is first widened to contain 0 (lo = min(min, 0), hi = max(max, 0), as
//   affine quantization usually does), scale = (hi - lo) / L,
//   zero_point = round(-lo / scale), code = clamp(round(x / scale) + zero_point, 0, L),
//   decode = (code - zero_point) * scale. Unlike min-max, 0 is exactly representable
//   (code == zero_point decodes to exactly 0, so zeros and sparse data stay exactly
//   zero); the price is a coarser scale for a chunk that lies on one side of 0 (its
//   scale covers [0, max] or [min, 0] instead of [min, max]). The sign of a zero is not
//   kept (-0.0 decodes as +0.0).
//
// The NORMAL distribution hint (lockstep_distribution_t; code kinds only): before the
//   above, the range [min, max] is narrowed to [max(min, mean - k*sd), min(max, mean +
//   k*sd)], mean and sd being the chunk's mean and standard deviation (computed in
//   double; skipped if they are not finite), k = kNormalClip4 for 4-bit codes,
//   kNormalClip8 for 8-bit ones (the values of least mean squared error for normally
//   distributed chunks of 64 Ki to 256 Ki elements). Values outside the narrowed range get code 0 or L.
//   The decoder is unchanged: it reads the parameters, whatever range they came from.
//
// CAST_F16, CAST_BF16 (f32 and f64 dtypes only): no header; each element as the 16-bit
//   value nearest to it (IEEE round-to-nearest-even), little-endian, 2 bytes per
//   element; decoded exactly back into the dtype. Error per element: at most half a unit
//   in the last place of the 16-bit type (relative 2^-11 for f16, 2^-8 for bf16) plus half
//   its smallest subnormal (f16 2^-25, bf16 2^-134); a value beyond the 16-bit type's
//   finite range (f16: 65504; bf16 has f32's range) becomes an infinity of its sign, as
//   a cast does, and NaN stays NaN.
//
// Error bound of the code kinds, per element of a chunk of finite values (with the
// NORMAL hint: per element inside the narrowed range; one outside it errs by its
// distance to the range's nearer end more):
//   |x - decode(encode(x))| <= scale / 2 + (u + 2^-47) * M + t
// where scale is the chunk's scale (as stored in the header), M = max |x| over the
// chunk, u is the unit roundoff of the dtype (f16 2^-11, bf16 2^-8, f32 2^-24, f64 0:
// the rounding of the decoded double to the dtype), 2^-47 covers the double arithmetic
// of encoder and decoder, and t covers rounding at the bottom of the range: half the
// smallest subnormal of the dtype (f16 2^-25, bf16 2^-134, f32 2^-150), for f64 2^-1066
// (a subnormal scale). Decoded f32/f64 values are clamped to the dtype's finite range:
// min + L * scale may round past the largest finite value for a chunk that reaches it.
//
// Non-finite values: a chunk that contains a NaN or an infinity (or, for f64 only,
// whose range max - min overflows to infinity) is encoded with p0 = p1 = NaN and all
// codes 0, and every element of it decodes to the canonical quiet NaN (see reduce.h).
// The blow-up therefore shows in the all-reduce result (as NaN over the whole chunk
// rather than element-wise, and an infinity becomes NaN), so a training loop that checks
// gradients for non-finite values reacts as it would without quantization. No input
// makes any function here crash or invoke undefined behaviour.
//
// Determinism: dequantize() and dequantize_reduce() are pure functions of the encoded
// bytes (and, for the latter, of dst): the decoder runs in double from the stored
// parameters and rounds to the dtype with IEEE round-to-nearest-even. This file is
// compiled without -ffast-math and with -ffp-contract=off, so no fused multiply-add
// changes a result: every peer decodes the same bits. That is what keeps a quantized
// all-reduce bit-identical on all peers when a peer uses only the dequantized form of
// its own contribution. (The encoder needs no such property: only its bytes travel.)
//
// The decoder accepts any bytes: an invalid header (as a misbehaving peer could send)
// decodes to some values without undefined behaviour; quantized_header_valid() tells
// whether a header is one that quantize() can produce, for protocol checks.
#pragma once

#include <lockstep/lockstep.h>

#include <cstddef>
#include <cstdint>

namespace lockstep::coll {

inline constexpr std::size_t kQuantHeaderBytes = 16;

// The parameters of one chunk, as read from its header.
struct QuantParams {
  double p0 = 0.0;  // MINMAX: min;   ZERO_POINT: scale
  double p1 = 0.0;  // MINMAX: scale; ZERO_POINT: zero point (integer 0..255)
  // The non-finite marker (quantize() writes both NaN; the decoder takes either).
  bool non_finite() const { return p0 != p0 || p1 != p1; }
};

// The last value of lockstep_quantization_t.
inline constexpr int kQuantizationLast = LOCKSTEP_QUANT_CAST_BF16;

// Whether the combination is supported: a floating dtype and a code kind, or an f32 or
// f64 dtype and a cast.
bool quantization_supported(lockstep_dtype_t dtype, lockstep_quantization_t quant);

// Whether an encoded chunk of this kind starts with the kQuantHeaderBytes parameters.
bool quantization_has_header(lockstep_quantization_t quant);

// Bytes on the wire for `count` elements (see the layouts above); 0 for
// LOCKSTEP_QUANT_NONE or an unknown value.
std::size_t quantized_bytes(std::size_t count, lockstep_quantization_t quant);

// The NORMAL hint's range: mean ± k standard deviations.
inline constexpr double kNormalClip8 = 4.0;
inline constexpr double kNormalClip4 = 2.5;

// Encodes src (count elements of dtype) into out (quantized_bytes(count, quant) bytes)
// under the distribution hint (ignored by the casts; an unknown value is NONE). An
// unsupported combination writes nothing.
void quantize(const void* src, std::size_t count, lockstep_dtype_t dtype, lockstep_quantization_t quant,
              lockstep_distribution_t distribution, std::uint8_t* out);
inline void quantize(const void* src, std::size_t count, lockstep_dtype_t dtype, lockstep_quantization_t quant,
                     std::uint8_t* out) {
  quantize(src, count, dtype, quant, LOCKSTEP_DIST_NONE, out);
}

// Decodes into dst (count elements of dtype). An unsupported combination writes nothing.
void dequantize(const std::uint8_t* in, std::size_t count, lockstep_dtype_t dtype,
                lockstep_quantization_t quant, void* dst);

// Fused: dst[i] = dst[i] OP dequantized(in)[i], bit-identical to dequantize() into a
// temporary followed by reduce() (see reduce.h). `dst` must not overlap `in`.
void dequantize_reduce(void* dst, const std::uint8_t* in, std::size_t count, lockstep_dtype_t dtype,
                       lockstep_quantization_t quant, lockstep_reduce_op_t op);

// Error feedback: err[i] = (raw[i] - decoded[i]) * factor, where decoded is the decoded
// form of `encoded` (quantize() of raw), computed in double and rounded to the dtype;
// 0 where raw[i] or decoded[i] is not finite. An unsupported combination writes nothing.
void quantization_error(const void* raw, const std::uint8_t* encoded, std::size_t count, lockstep_dtype_t dtype,
                        lockstep_quantization_t quant, double factor, void* err);

// The parameters stored in an encoded chunk's header (kQuantHeaderBytes readable; a
// code kind's only).
QuantParams read_quant_params(const std::uint8_t* in);

// Whether the header of an encoded chunk is one quantize() can produce for this dtype:
// the non-finite marker (both NaN), or finite parameters with scale >= 0 (a zero point
// that is an integer in [0, L]) whose decoded values all lie within the dtype's finite
// range. A cast has no header: true. false for an unsupported combination.
bool quantized_header_valid(const std::uint8_t* in, lockstep_dtype_t dtype,
                            lockstep_quantization_t quant);

}  // namespace lockstep::coll
