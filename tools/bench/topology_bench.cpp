// lockstep-bench topology: see topology_bench.h. One JSON line per instance:
// the solver's bottleneck and per-byte time against their bounds, and its wall time.
#include "topology_bench.h"

#include "coordinator/coordinator.h"
#include "topology/solver.h"

#include <nlohmann/json.hpp>

#include <array>
#include <chrono>
#include <cstdio>
#include <random>

namespace lockstep::bench {
namespace {

constexpr double kMbit = 125'000.0;  // bytes per second

topo::Matrix make_instance(const std::string& kind, int n, std::uint64_t seed) {
  const auto size = static_cast<std::size_t>(n);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> rate(25.0, 400.0);
  topo::Matrix bw(size, std::vector<double>(size, 0.0));
  constexpr std::size_t kRegions = 8;
  std::vector<std::size_t> region(size);
  std::array<double, kRegions * kRegions> between{};
  if (kind == "regions") {
    for (auto& r : region) r = static_cast<std::size_t>(rng() % kRegions);
    for (auto& v : between) v = rate(rng);
  }
  constexpr std::array<double, 5> kLevels{25, 50, 100, 200, 400};
  std::uniform_real_distribution<double> within(1000.0, 10000.0);
  std::uniform_real_distribution<double> spread(0.9, 1.1);
  for (std::size_t i = 0; i < size; ++i) {
    for (std::size_t j = 0; j < size; ++j) {
      if (i == j) continue;
      double mbit = 0;
      if (kind == "levels") {
        mbit = kLevels[static_cast<std::size_t>(rng() % kLevels.size())];
      } else if (kind == "uniform") {
        mbit = rate(rng);
      } else {
        mbit = region[i] == region[j] ? within(rng) : between[region[i] * kRegions + region[j]] * spread(rng);
      }
      bw[i][j] = mbit * kMbit;
    }
  }
  return bw;
}

double ms_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

int run_topology(const TopologySettings& s) {
  const std::uint64_t steps = s.steps != 0 ? s.steps : coord::Config{}.solver_steps;
  for (const auto& kind : s.kinds) {
    for (const int n : s.peers) {
      for (const std::uint64_t seed : s.seeds) {
        const topo::Matrix bw = make_instance(kind, n, seed);
        auto start = std::chrono::steady_clock::now();
        const topo::Solution sol = topo::solve_ring(bw, topo::Budget{steps});
        const double solve_ms = ms_since(start);
        start = std::chrono::steady_clock::now();
        const double bound = topo::bottleneck_bound(bw);
        const double bound_ms = ms_since(start);
        const double cost_bound = topo::cost_bound(bw, sol.bottleneck);
        nlohmann::json line{{"bench", "topology"},
                            {"kind", kind},
                            {"peers", n},
                            {"seed", seed},
                            {"steps", sol.steps},
                            {"solve_ms", solve_ms},
                            {"bottleneck_mbit", sol.bottleneck / kMbit},
                            {"bound_mbit", bound / kMbit},
                            {"of_bound", sol.bottleneck / bound},
                            {"nearest_neighbour_of_bound",
                             topo::ring_bottleneck(bw, topo::nearest_neighbour_ring(bw, 0)) / bound},
                            {"cost_over_bound", sol.cost / cost_bound},
                            {"bound_ms", bound_ms}};
        if (s.background_steps != 0 && !sol.optimal) {
          // The master's background search, slice by slice as its ticks give it.
          topo::Improver improver(bw, seed);
          const std::uint64_t slice = coord::Config{}.background_solver_steps_per_tick;
          start = std::chrono::steady_clock::now();
          while (improver.steps() < s.background_steps && !improver.done()) improver.step(topo::Budget{slice});
          const topo::Solution& best = topo::better_ring(bw, improver.best().ring, sol.ring) ? improver.best() : sol;
          line["background_steps"] = improver.steps();
          line["background_ms"] = ms_since(start);
          line["background_of_bound"] = best.bottleneck / bound;
          line["background_cost_over_bound"] = best.cost / topo::cost_bound(bw, best.bottleneck);
        }
        std::printf("%s\n", line.dump().c_str());
        std::fflush(stdout);
      }
    }
  }
  return 0;
}

}  // namespace lockstep::bench
