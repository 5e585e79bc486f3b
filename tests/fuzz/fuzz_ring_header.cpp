// fuzz_ring_header: the quantized sub-chunk a ring peer receives (collectives/quantize.h):
// a 16-byte parameter header and 8-bit or 4-bit codes, or 16-bit casts, from a possibly
// misbehaving neighbour.
// The same 16 bytes are also read as a ring frame header (collectives/ring.h:
// magic, stream, stream count, sequence, attempt): parse_ring_header accepts only a
// stream below a count of 1 to kRingStreamsMax, and what it accepts writes back to the
// same bytes.
//
// Input: dtype, quantization and op selectors (one byte each), the 16-byte header,
// then n codes and n elements of the destination, n as large as the rest allows.
// Properties, for any bytes:
//  - quantized_header_valid, dequantize and dequantize_reduce neither crash nor invoke
//    undefined behaviour (ASan, UBSan with float-cast-overflow);
//  - an unsupported combination is never valid and decodes to nothing;
//  - the non-finite marker decodes every element to the canonical quiet NaN;
//  - a valid finite header decodes to finite values only (a code kind's: a cast has no
//    header, and its infinities and NaNs are values);
//  - dequantize_reduce gives exactly the bits of dequantize followed by reduce.
#include "collectives/quantize.h"
#include "collectives/ring.h"
#include "fuzz_support.h"
#include "kernels/reduce.h"

#include <array>
#include <cstring>
#include <limits>

namespace {

using namespace lockstep;
using fuzz::fail;

constexpr std::array<lockstep_dtype_t, 6> kDtypes = {LOCKSTEP_F16, LOCKSTEP_BF16, LOCKSTEP_F32,
                                                     LOCKSTEP_F64, LOCKSTEP_I32,  LOCKSTEP_U8};
constexpr std::size_t kCountMax = 4096;

// Element i of a floating-point buffer as raw bits.
std::uint64_t bits_at(const void* data, std::size_t i, lockstep_dtype_t dtype) {
  const auto* bytes = static_cast<const std::uint8_t*>(data);
  const std::size_t size = coll::dtype_size(dtype);
  std::uint64_t value = 0;
  std::memcpy(&value, bytes + i * size, size);  // little-endian
  return value;
}

bool finite_bits(std::uint64_t bits, lockstep_dtype_t dtype) {
  switch (dtype) {
    case LOCKSTEP_F16: return (bits & 0x7c00u) != 0x7c00u;
    case LOCKSTEP_BF16: return (bits & 0x7f80u) != 0x7f80u;
    case LOCKSTEP_F32: return (bits & 0x7f800000u) != 0x7f800000u;
    case LOCKSTEP_F64: return (bits & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
    default: return true;
  }
}

std::uint64_t canonical_nan(lockstep_dtype_t dtype) {
  switch (dtype) {
    case LOCKSTEP_F16: return 0x7e00u;
    case LOCKSTEP_BF16: return 0x7fc0u;
    case LOCKSTEP_F32: return 0x7fc00000u;
    default: return 0x7ff8000000000000ull;
  }
}

fuzz::Seeds make_seeds() {
  fuzz::Seeds seeds;
  const auto add = [&](const std::string& name, std::size_t dtype_index, lockstep_quantization_t quant,
                       lockstep_reduce_op_t op, const std::vector<double>& values) {
    const lockstep_dtype_t dtype = kDtypes[dtype_index];
    const std::size_t size = coll::dtype_size(dtype);
    // Typed source values (f16/bf16 through their conversions).
    std::vector<std::uint64_t> storage(values.size() + 1);
    auto* src = reinterpret_cast<std::uint8_t*>(storage.data());
    for (std::size_t i = 0; i < values.size(); ++i) {
      const auto f = static_cast<float>(values[i]);
      switch (dtype) {
        case LOCKSTEP_F16: {
          const std::uint16_t h = coll::f32_to_f16(f);
          std::memcpy(src + 2 * i, &h, 2);
          break;
        }
        case LOCKSTEP_BF16: {
          const std::uint16_t h = coll::f32_to_bf16(f);
          std::memcpy(src + 2 * i, &h, 2);
          break;
        }
        case LOCKSTEP_F32: std::memcpy(src + 4 * i, &f, 4); break;
        default: std::memcpy(src + 8 * i, &values[i], 8); break;
      }
    }
    std::vector<std::uint8_t> encoded(coll::quantized_bytes(values.size(), quant));
    coll::quantize(src, values.size(), dtype, quant, encoded.data());
    fuzz::Output out;
    out.byte(static_cast<std::uint8_t>(dtype_index));
    out.byte(static_cast<std::uint8_t>(quant));
    out.byte(static_cast<std::uint8_t>(op));
    out.append(encoded);
    out.append(std::span<const std::uint8_t>(src, values.size() * size));  // the destination: the same values
    seeds.emplace_back(name, out.bytes());
  };
  const std::vector<double> ramp = {-3.5, -1.0, -0.25, 0.0, 0.5, 1.0, 2.75, 8.0};
  const std::vector<double> flat = {1.5, 1.5, 1.5, 1.5};
  const std::vector<double> positive = {0.125, 0.5, 1.0, 64.0, 1000.0};
  const std::vector<double> with_nan = {1.0, std::numeric_limits<double>::quiet_NaN(), 2.0};
  const char* names[] = {"f16", "bf16", "f32", "f64"};
  for (std::size_t d = 0; d < 4; ++d) {
    add(std::string("minmax-") + names[d], d, LOCKSTEP_QUANT_MINMAX_U8, LOCKSTEP_SUM, ramp);
    add(std::string("zeropoint-") + names[d], d, LOCKSTEP_QUANT_ZERO_POINT_U8, LOCKSTEP_MAX, ramp);
    add(std::string("minmax4-") + names[d], d, LOCKSTEP_QUANT_MINMAX_U4, LOCKSTEP_SUM, ramp);
    add(std::string("zeropoint4-") + names[d], d, LOCKSTEP_QUANT_ZERO_POINT_U4, LOCKSTEP_MIN, ramp);
  }
  add("cast-f16-f32", 2, LOCKSTEP_QUANT_CAST_F16, LOCKSTEP_SUM, ramp);
  add("cast-bf16-f64", 3, LOCKSTEP_QUANT_CAST_BF16, LOCKSTEP_MAX, with_nan);
  add("minmax-flat-f32", 2, LOCKSTEP_QUANT_MINMAX_U8, LOCKSTEP_PROD, flat);
  add("zeropoint-positive-f64", 3, LOCKSTEP_QUANT_ZERO_POINT_U8, LOCKSTEP_AVG, positive);
  add("minmax-nan-f16", 0, LOCKSTEP_QUANT_MINMAX_U8, LOCKSTEP_MIN, with_nan);
  add("zeropoint-nan-f32", 2, LOCKSTEP_QUANT_ZERO_POINT_U8, LOCKSTEP_SUM, with_nan);
  return seeds;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  fuzz::write_seeds_if_asked(make_seeds);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  fuzz::Input in(data, size);
  const lockstep_dtype_t dtype = kDtypes[in.byte() % kDtypes.size()];
  // Every kind, and one value past the last.
  const auto quant = static_cast<lockstep_quantization_t>(in.byte() % (coll::kQuantizationLast + 2));
  const auto op = static_cast<lockstep_reduce_op_t>(in.byte() % 5);
  const std::size_t esize = coll::dtype_size(dtype);
  std::array<std::uint8_t, coll::kQuantHeaderBytes> header{};
  const auto header_bytes = in.bytes(header.size());
  std::copy(header_bytes.begin(), header_bytes.end(), header.begin());
  static_assert(coll::kQuantHeaderBytes == coll::kRingHeaderBytes);
  if (auto frame = coll::parse_ring_header(header.data()); frame.is_ok()) {
    const coll::RingHeader& h = frame.value();
    if (h.streams == 0 || h.streams > coll::kRingStreamsMax || h.stream >= h.streams) fail("ring header out of bounds");
    std::array<std::uint8_t, coll::kRingHeaderBytes> again{};
    coll::put_ring_header(again.data(), h);
    if (again != header) fail("ring header does not write back to its bytes");
  }
  const std::size_t count = std::min(in.left() / (1 + esize), kCountMax);

  // Room for any kind's encoding of count elements (a cast's: 2 x count bytes, from the
  // header's first byte on).
  std::vector<std::uint8_t> encoded(coll::kQuantHeaderBytes + 2 * count);
  std::copy(header.begin(), header.end(), encoded.begin());
  const auto codes = in.bytes(count);
  std::copy(codes.begin(), codes.end(), encoded.begin() + coll::kQuantHeaderBytes);
  // Element-aligned buffers (8-byte storage), one element spare so none is empty.
  std::vector<std::uint64_t> initial(count + 1, 0);
  const auto dst_bytes = in.bytes(count * esize);
  std::memcpy(initial.data(), dst_bytes.data(), dst_bytes.size());

  const bool supported = coll::quantization_supported(dtype, quant);
  const bool valid = coll::quantized_header_valid(encoded.data(), dtype, quant);
  if (valid && !supported) fail("an unsupported combination has a valid header");

  constexpr std::uint64_t kUntouched = 0xa5a5a5a5a5a5a5a5ull;
  std::vector<std::uint64_t> decoded(count + 1, kUntouched);
  coll::dequantize(encoded.data(), count, dtype, quant, decoded.data());
  std::vector<std::uint64_t> fused = initial;
  coll::dequantize_reduce(fused.data(), encoded.data(), count, dtype, quant, op);
  if (!supported) {
    for (const auto word : decoded) {
      if (word != kUntouched) fail("dequantize wrote for an unsupported combination");
    }
    if (fused != initial) fail("dequantize_reduce wrote for an unsupported combination");
    return 0;
  }
  const coll::QuantParams params = coll::read_quant_params(encoded.data());
  for (std::size_t i = 0; i < count && coll::quantization_has_header(quant); ++i) {
    const std::uint64_t bits = bits_at(decoded.data(), i, dtype);
    if (params.non_finite() && bits != canonical_nan(dtype)) fail("the non-finite marker decoded to a non-NaN");
    if (valid && !params.non_finite() && !finite_bits(bits, dtype)) {
      fail("a valid finite header decoded element " + std::to_string(i) + " to a non-finite value");
    }
  }
  std::vector<std::uint64_t> separate = initial;
  coll::reduce(separate.data(), decoded.data(), count, dtype, op);
  if (std::memcmp(separate.data(), fused.data(), count * esize) != 0) {
    fail("dequantize_reduce differs from dequantize followed by reduce");
  }
  return 0;
}
