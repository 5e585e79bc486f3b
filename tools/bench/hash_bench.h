// lockstep-bench hash: throughput of the shared-state content hash (src/state/hash.h)
// against a single-thread memcpy of the same buffer. See main.cpp for the command line.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace lockstep::bench {

struct HashSettings {
  std::vector<std::uint64_t> sizes;  // bytes; one buffer of the largest, prefixes of it
  std::vector<unsigned> threads;     // thread counts to measure, in order
  int iterations = 5;                // timed repetitions per measurement (median)
};

// "1,2,16" -> {1, 2, 16}; duplicates dropped, order kept. Each count is 1..1024.
std::optional<std::vector<unsigned>> parse_thread_counts(const std::string& text);
// "1,2,N" with N = std::thread::hardware_concurrency() (at least 1).
std::string default_thread_counts();

int run_hash(const HashSettings& s);

}  // namespace lockstep::bench
