// Element sizes of the public dtypes, constexpr and in common/ so that every layer may
// use them (the coordinator and the peer size shared-state transfers with them).
// kernels/reduce.h has its own dtype_size, with the same values, beside the kernels.
#pragma once

#include <lockstep/lockstep.h>

#include <cstdint>

namespace lockstep {

// Bytes per element; 0 for a value that is not a dtype.
constexpr std::uint64_t dtype_bytes(std::uint32_t dtype) {
  switch (dtype) {
    case LOCKSTEP_U8:
    case LOCKSTEP_I8: return 1;
    case LOCKSTEP_U16:
    case LOCKSTEP_I16:
    case LOCKSTEP_F16:
    case LOCKSTEP_BF16: return 2;
    case LOCKSTEP_U32:
    case LOCKSTEP_I32:
    case LOCKSTEP_F32: return 4;
    case LOCKSTEP_U64:
    case LOCKSTEP_I64:
    case LOCKSTEP_F64: return 8;
    default: return 0;
  }
}

// Largest tensor (in bytes) a shared state may hold: keeps every offset computation
// far from overflow.
inline constexpr std::uint64_t kTensorBytesMax = std::uint64_t{1} << 48;

}  // namespace lockstep
