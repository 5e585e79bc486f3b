// lockstep-bench hash: one buffer, filled with non-constant content and pre-faulted (as
// is the memcpy destination), so that page faults and zero pages do not flatter or
// penalize either side. For each size: the median of single-thread memcpy, then the
// median of hash_bytes at each thread count; one JSON object per thread count.
#include "hash_bench.h"

#include "state/hash.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <thread>

namespace lockstep::bench {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t mid = v.size() / 2;
  return v.size() % 2 == 1 ? v[mid] : (v[mid - 1] + v[mid]) / 2;
}

// Seconds taken by f, as the median of `iterations` timed runs after one untimed run
// (which also brings the code and the thread stacks in).
template <typename F>
double median_seconds(int iterations, F&& f) {
  f();
  std::vector<double> times;
  for (int i = 0; i < iterations; ++i) {
    const auto start = Clock::now();
    f();
    times.push_back(std::chrono::duration<double>(Clock::now() - start).count());
  }
  return median(times);
}

// splitmix64 words: every byte differs from its neighbours, nothing compresses or repeats.
void fill(std::vector<std::uint64_t>& words) {
  std::uint64_t state = 0x243f6a8885a308d3u;
  for (auto& w : words) {
    state += 0x9e3779b97f4a7c15u;
    std::uint64_t z = state;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9u;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebu;
    w = z ^ (z >> 31);
  }
}

}  // namespace

std::optional<std::vector<unsigned>> parse_thread_counts(const std::string& text) {
  std::vector<unsigned> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    std::size_t used = 0;
    unsigned long value = 0;
    try {
      value = std::stoul(item, &used);
    } catch (const std::exception&) {
      return std::nullopt;
    }
    if (used != item.size() || value == 0 || value > 1024) return std::nullopt;
    const auto count = static_cast<unsigned>(value);
    if (std::find(out.begin(), out.end(), count) == out.end()) out.push_back(count);
  }
  if (out.empty()) return std::nullopt;
  return out;
}

std::string default_thread_counts() {
  return "1,2," + std::to_string(std::max(1u, std::thread::hardware_concurrency()));
}

int run_hash(const HashSettings& s) {
  const std::uint64_t largest = *std::max_element(s.sizes.begin(), s.sizes.end());
  const auto bytes_max = static_cast<std::size_t>(largest);
  // Value-initialized vectors: every page is written (faulted in) before any timing.
  std::vector<std::uint64_t> source((bytes_max + 7) / 8);
  std::vector<std::uint64_t> target(source.size());
  fill(source);
  for (const std::uint64_t size : s.sizes) {
    const auto bytes = static_cast<std::size_t>(size);
    const double memcpy_s = median_seconds(s.iterations, [&] { std::memcpy(target.data(), source.data(), bytes); });
    // Reading the copy back keeps the copies observable (and checks them).
    if (std::memcmp(target.data(), source.data(), bytes) != 0) {
      std::fprintf(stderr, "lockstep-bench: memcpy mismatch\n");
      return 1;
    }
    const double memcpy_gb_s = static_cast<double>(bytes) / memcpy_s / 1e9;
    std::string first_hex;
    for (const unsigned threads : s.threads) {
      state::Digest digest;
      const double hash_s =
          median_seconds(s.iterations, [&] { digest = state::hash_bytes(source.data(), bytes, threads); });
      const double gb_s = static_cast<double>(bytes) / hash_s / 1e9;
      const std::string hex = digest.to_hex();
      if (first_hex.empty()) first_hex = hex;
      json out = {{"bench", "hash"},
                  {"bytes", size},
                  {"threads", threads},
                  {"iterations", s.iterations},
                  {"median_s", hash_s},
                  {"gb_s", gb_s},
                  {"memcpy_median_s", memcpy_s},
                  {"memcpy_gb_s", memcpy_gb_s},
                  {"ratio_to_memcpy", gb_s / memcpy_gb_s},
                  {"digest", hex}};
      std::printf("%s\n", out.dump().c_str());
      std::fflush(stdout);
      if (hex != first_hex) {
        std::fprintf(stderr, "lockstep-bench: the digest changed with the thread count\n");
        return 1;
      }
    }
  }
  return 0;
}

}  // namespace lockstep::bench
