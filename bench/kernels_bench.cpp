// Throughput of the all-reduce kernels on 64 MiB buffers, against memcpy of the same size
// on the same machine. The counters count the bytes of ONE 64 MiB buffer per iteration
// for every benchmark (for a reduce that is the destination; it also reads the
// source, so memory traffic is 3x that, against 2x for memcpy). Buffers are written
// before timing, so no page faults are measured. One case, BM_CoreToCoreHandoff,
// probes the host rather than a kernel.
//
// Medians as BENCHMARKS.md reports them:
//   lockstep-kernels-bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include "collectives/quantize.h"
#include "kernels/reduce.h"
#include "security/crypto.h"

#include <benchmark/benchmark.h>

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {

namespace coll = lockstep::coll;

constexpr std::size_t kBytes = std::size_t{64} << 20;

// A buffer of kBytes filled with values of the dtype that stay normal and finite over
// many accumulations (no subnormal slow paths, no overflow to inf for f32/f64).
std::vector<std::uint8_t> make_buffer(lockstep_dtype_t dtype, std::uint64_t seed) {
  std::vector<std::uint8_t> buf(kBytes);
  std::mt19937_64 rng(seed);
  if (!coll::is_float(dtype)) {
    for (std::size_t i = 0; i < kBytes; i += 8) {
      const std::uint64_t r = rng();
      std::memcpy(buf.data() + i, &r, 8);
    }
    return buf;
  }
  std::uniform_real_distribution<double> d(0.5, 1.0);
  const std::size_t n = kBytes / coll::dtype_size(dtype);
  for (std::size_t i = 0; i < n; ++i) {
    const double x = d(rng);
    if (dtype == LOCKSTEP_F16 || dtype == LOCKSTEP_BF16) {
      const std::uint16_t h = dtype == LOCKSTEP_F16 ? coll::f64_to_f16(x) : coll::f64_to_bf16(x);
      std::memcpy(buf.data() + 2 * i, &h, 2);
    } else if (dtype == LOCKSTEP_F32) {
      const auto f = static_cast<float>(x);
      std::memcpy(buf.data() + 4 * i, &f, 4);
    } else {
      std::memcpy(buf.data() + 8 * i, &x, 8);
    }
  }
  return buf;
}

// bytes_per_second (binary prefixes, as Google Benchmark prints it) and GB_s (10^9 bytes
// per second, the unit of BENCHMARKS.md), both for one kBytes buffer per iteration.
void count_bytes(benchmark::State& state) {
  const auto bytes =
      static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(kBytes);
  state.SetBytesProcessed(bytes);
  state.counters["GB_s"] = benchmark::Counter(
      static_cast<double>(bytes), benchmark::Counter::kIsRate, benchmark::Counter::kIs1000);
}

void BM_Memcpy(benchmark::State& state) {
  auto src = make_buffer(LOCKSTEP_U8, 1);
  std::vector<std::uint8_t> dst(kBytes, 1);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), kBytes);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  count_bytes(state);
}

// The optional finiteness check of a contribution (check_finite): one read of a clean
// buffer.
template <lockstep_dtype_t D>
void BM_FirstNonFinite(benchmark::State& state) {
  const auto buf = make_buffer(D, 1);
  const std::size_t n = kBytes / coll::dtype_size(D);
  for (auto _ : state) {
    const std::size_t at = coll::first_non_finite(buf.data(), n, D);
    if (at != n) state.SkipWithError("a finite buffer was flagged");
    benchmark::DoNotOptimize(at);
  }
  count_bytes(state);
}

template <lockstep_dtype_t D, lockstep_reduce_op_t Op>
void BM_Reduce(benchmark::State& state) {
  auto dst = make_buffer(D, 2);
  const auto src = make_buffer(D, 3);
  const std::size_t n = kBytes / coll::dtype_size(D);
  for (auto _ : state) {
    coll::reduce(dst.data(), src.data(), n, D, Op);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  count_bytes(state);
}

// As the ring's reduce-scatter runs it: each received 256 KiB sub-chunk (in cache)
// reduced into the next part of the destination (from memory), the old destination
// saved on the way (arg 1) or not (arg 0).
template <lockstep_dtype_t D>
void BM_RingReduce(benchmark::State& state) {
  auto dst = make_buffer(D, 2);
  std::vector<std::uint8_t> saved(kBytes, 1);
  constexpr std::size_t kSub = std::size_t{256} << 10;
  const auto received = make_buffer(D, 3);
  const std::size_t esize = coll::dtype_size(D);
  const bool saving = state.range(0) != 0;
  for (auto _ : state) {
    for (std::size_t at = 0; at < kBytes; at += kSub) {
      if (saving) {
        coll::reduce3_saving(dst.data() + at, saved.data() + at, dst.data() + at, received.data(), kSub / esize, D,
                             LOCKSTEP_SUM);
      } else {
        coll::reduce(dst.data() + at, received.data(), kSub / esize, D, LOCKSTEP_SUM);
      }
    }
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  count_bytes(state);
}

// The division of avg, over the whole buffer.
template <lockstep_dtype_t D>
void BM_FinalizeAvg(benchmark::State& state) {
  auto data = make_buffer(D, 2);
  const std::size_t n = kBytes / coll::dtype_size(D);
  for (auto _ : state) {
    coll::finalize(data.data(), n, D, LOCKSTEP_AVG, 4);
    benchmark::DoNotOptimize(data.data());
    benchmark::ClobberMemory();
  }
  count_bytes(state);
}

template <lockstep_dtype_t D, lockstep_quantization_t Q, lockstep_distribution_t H = LOCKSTEP_DIST_NONE>
void BM_Quantize(benchmark::State& state) {
  const auto src = make_buffer(D, 4);
  const std::size_t n = kBytes / coll::dtype_size(D);
  std::vector<std::uint8_t> out(coll::quantized_bytes(n, Q), 1);
  for (auto _ : state) {
    coll::quantize(src.data(), n, D, Q, H, out.data());
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  count_bytes(state);
}

template <lockstep_dtype_t D, lockstep_quantization_t Q>
void BM_Dequantize(benchmark::State& state) {
  const auto src = make_buffer(D, 5);
  const std::size_t n = kBytes / coll::dtype_size(D);
  std::vector<std::uint8_t> enc(coll::quantized_bytes(n, Q));
  coll::quantize(src.data(), n, D, Q, enc.data());
  std::vector<std::uint8_t> dst(kBytes, 1);
  for (auto _ : state) {
    coll::dequantize(enc.data(), n, D, Q, dst.data());
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  count_bytes(state);
}

template <lockstep_dtype_t D, lockstep_quantization_t Q>
void BM_DequantizeReduce(benchmark::State& state) {
  const auto src = make_buffer(D, 6);
  const std::size_t n = kBytes / coll::dtype_size(D);
  std::vector<std::uint8_t> enc(coll::quantized_bytes(n, Q));
  coll::quantize(src.data(), n, D, Q, enc.data());
  auto dst = make_buffer(D, 7);
  for (auto _ : state) {
    coll::dequantize_reduce(dst.data(), enc.data(), n, D, Q, LOCKSTEP_SUM);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  count_bytes(state);
}

BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_FirstNonFinite<LOCKSTEP_F32>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_FirstNonFinite<LOCKSTEP_BF16>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Reduce<LOCKSTEP_F32, LOCKSTEP_SUM>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Reduce<LOCKSTEP_F64, LOCKSTEP_SUM>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Reduce<LOCKSTEP_I32, LOCKSTEP_SUM>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Reduce<LOCKSTEP_F16, LOCKSTEP_SUM>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Reduce<LOCKSTEP_BF16, LOCKSTEP_SUM>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Reduce<LOCKSTEP_F32, LOCKSTEP_MAX>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Reduce<LOCKSTEP_I64, LOCKSTEP_PROD>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_RingReduce<LOCKSTEP_F32>)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_RingReduce<LOCKSTEP_BF16>)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_RingReduce<LOCKSTEP_F16>)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_FinalizeAvg<LOCKSTEP_F32>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_FinalizeAvg<LOCKSTEP_BF16>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_FinalizeAvg<LOCKSTEP_F16>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Quantize<LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U8>)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Quantize<LOCKSTEP_F32, LOCKSTEP_QUANT_ZERO_POINT_U8>)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Dequantize<LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U8>)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Dequantize<LOCKSTEP_F32, LOCKSTEP_QUANT_ZERO_POINT_U8>)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_DequantizeReduce<LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U8>)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Quantize<LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U4>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Quantize<LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U4, LOCKSTEP_DIST_NORMAL>)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Dequantize<LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U4>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DequantizeReduce<LOCKSTEP_F32, LOCKSTEP_QUANT_MINMAX_U4>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Quantize<LOCKSTEP_F32, LOCKSTEP_QUANT_CAST_BF16>)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Dequantize<LOCKSTEP_F32, LOCKSTEP_QUANT_CAST_BF16>)->Unit(benchmark::kMillisecond)->UseRealTime();

// Data-plane encryption (encrypt_data): ChaCha20-Poly1305 over the buffer in 1 MiB
// sub-chunks as the ring seals them (seal), and sealing then opening each (the work one
// sub-chunk costs its sender and its receiver together on one machine).
void BM_Seal(benchmark::State& state) {
  const auto src = make_buffer(LOCKSTEP_F32, 7);
  constexpr std::size_t kSub = std::size_t{1} << 20;
  std::vector<std::uint8_t> box(kSub + lockstep::security::kTagBytes);
  std::vector<std::uint8_t> plain(kSub);
  const std::uint8_t header[16] = {};
  const auto key = lockstep::security::random_key();
  lockstep::security::Aead seal(key);
  lockstep::security::Aead open(key);
  const bool round_trip = state.range(0) != 0;
  for (auto _ : state) {
    for (std::size_t at = 0; at < kBytes; at += kSub) {
      seal.seal(std::span<const std::uint8_t>(src.data() + at, kSub), header, box.data());
      if (round_trip && !open.open(box, header, plain.data())) state.SkipWithError("does not verify");
    }
    benchmark::DoNotOptimize(box.data());
  }
  count_bytes(state);
}

BENCHMARK(BM_Seal)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

// Not a kernel but the host under them: a cache line handed from core 0 to core 1 and
// back, time per one-way hand-over. Where two cores share an L3 cache this is tens of
// nanoseconds; where they do not (a VM whose two vCPUs the hypervisor placed on
// different L3 caches) it is several times that, and every byte one peer of a ring
// receives from the other costs more (BENCHMARKS.md, "Same-host buffers").
void BM_CoreToCoreHandoff(benchmark::State& state) {
  const auto pin = [](int core) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(static_cast<std::size_t>(core), &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set) == 0;
  };
  cpu_set_t before;
  pthread_getaffinity_np(pthread_self(), sizeof before, &before);
  if (!pin(0)) {
    state.SkipWithError("cannot run on core 0");
    return;
  }
  alignas(64) std::atomic<std::uint64_t> line{0};
  std::atomic<int> echo_core{0};  // 1: the echo thread runs on core 1; -1: it cannot
  constexpr std::uint64_t kStop = ~std::uint64_t{0};
  std::thread echo([&] {
    echo_core = pin(1) ? 1 : -1;
    for (std::uint64_t seen = 0; echo_core == 1;) {
      const std::uint64_t v = line.load(std::memory_order_acquire);
      if (v == kStop) return;
      if (v != seen && v % 2 == 1) {
        seen = v + 1;
        line.store(seen, std::memory_order_release);
      }
    }
  });
  while (echo_core == 0) {
  }
  std::uint64_t v = 0;
  for (auto _ : state) {
    if (echo_core != 1) break;
    line.store(++v, std::memory_order_release);
    while (line.load(std::memory_order_acquire) != v + 1) {
    }
    ++v;
  }
  line.store(kStop, std::memory_order_release);
  echo.join();
  pthread_setaffinity_np(pthread_self(), sizeof before, &before);
  if (echo_core != 1) state.SkipWithError("cannot run on core 1");
  state.counters["per_handoff"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * 2, benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

BENCHMARK(BM_CoreToCoreHandoff)->UseRealTime()->MinTime(0.2);

}  // namespace

BENCHMARK_MAIN();
