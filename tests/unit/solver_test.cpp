// Ring-topology solver tests: the exact search against brute force over every ring,
// constructed cases where the join order is a bad ring (two sites, a slow link,
// asymmetric links, unknown links), the heuristic on planted instances, budget
// exhaustion, and the Improver's determinism and monotonicity.
#include "topology/solver.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace lockstep::topo {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::string show(const std::vector<int>& ring) {
  std::ostringstream s;
  s << "[";
  for (std::size_t k = 0; k < ring.size(); ++k) s << (k == 0 ? "" : " ") << ring[k];
  s << "]";
  return s.str();
}

std::size_t sz(int x) { return static_cast<std::size_t>(x); }

Matrix filled(int n, double value) { return Matrix(sz(n), std::vector<double>(sz(n), value)); }

// Uniform values in [lo, hi).
Matrix random_matrix(int n, std::uint64_t seed, double lo, double hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  Matrix bw = filled(n, 0.0);
  for (auto& row : bw) {
    for (auto& v : row) v = dist(rng);
  }
  return bw;
}

// Few distinct values, so that many rings share the best bottleneck and the per-byte
// time has to decide; some entries unknown (0 or negative) when unknown_percent > 0.
Matrix tied_matrix(int n, std::uint64_t seed, int unknown_percent) {
  std::mt19937_64 rng(seed);
  Matrix bw = filled(n, 0.0);
  for (auto& row : bw) {
    for (auto& v : row) {
      v = static_cast<double>(1 + rng() % 4) * 25.0;
      if (static_cast<int>(rng() % 100) < unknown_percent) v = (rng() % 2 == 0) ? 0.0 : -1.0;
    }
  }
  return bw;
}

int unknown_edges(const Matrix& bw, const std::vector<int>& ring) {
  int count = 0;
  for (std::size_t k = 0; k < ring.size(); ++k) {
    if (!(bw[sz(ring[k])][sz(ring[(k + 1) % ring.size()])] > 0)) ++count;
  }
  return count;
}

double known_time(const Matrix& bw, const std::vector<int>& ring) {
  double total = 0;
  for (std::size_t k = 0; k < ring.size(); ++k) {
    const double v = bw[sz(ring[k])][sz(ring[(k + 1) % ring.size()])];
    if (v > 0) total += 1.0 / v;
  }
  return total;
}

bool near(double a, double b) { return a == b || std::fabs(a - b) <= 1e-9 * std::max(std::fabs(a), std::fabs(b)); }

// The optimum over every ring starting at 0: the best bottleneck, then among the
// rings with that bottleneck the fewest unknown edges, then the least per-byte time.
struct Optimum {
  double bottleneck = 0;
  int unknown = 0;
  double time = kInf;
};

Optimum brute_force(const Matrix& bw) {
  const int n = static_cast<int>(bw.size());
  std::vector<int> ring(sz(n));
  std::iota(ring.begin(), ring.end(), 0);
  Optimum best;
  best.bottleneck = -1;
  do {
    best.bottleneck = std::max(best.bottleneck, ring_bottleneck(bw, ring));
  } while (std::next_permutation(ring.begin() + 1, ring.end()));
  best.unknown = n + 1;
  std::iota(ring.begin(), ring.end(), 0);
  do {
    if (!same_bottleneck(ring_bottleneck(bw, ring), best.bottleneck)) continue;
    const int unknown = unknown_edges(bw, ring);
    const double time = known_time(bw, ring);
    if (unknown < best.unknown || (unknown == best.unknown && time < best.time)) {
      best.unknown = unknown;
      best.time = time;
    }
  } while (std::next_permutation(ring.begin() + 1, ring.end()));
  return best;
}

void expect_matches_brute_force(const Matrix& bw, const std::string& what) {
  SCOPED_TRACE(what);
  const int n = static_cast<int>(bw.size());
  const Budget budget{exact_step_bound(n)};
  const Solution sol = solve_ring(bw, budget);
  const Optimum best = brute_force(bw);
  ASSERT_TRUE(is_valid_ring(sol.ring, n)) << show(sol.ring);
  EXPECT_TRUE(sol.optimal);
  EXPECT_LE(sol.steps, budget.steps_max);
  EXPECT_TRUE(same_bottleneck(sol.bottleneck, best.bottleneck)) << sol.bottleneck << " vs " << best.bottleneck;
  EXPECT_EQ(unknown_edges(bw, sol.ring), best.unknown) << show(sol.ring);
  EXPECT_TRUE(near(known_time(bw, sol.ring), best.time)) << known_time(bw, sol.ring) << " vs " << best.time;
  EXPECT_EQ(sol.bottleneck, ring_bottleneck(bw, sol.ring));
  EXPECT_EQ(sol.cost, ring_cost(bw, sol.ring));
  if (best.unknown == 0) {
    EXPECT_TRUE(near(sol.cost, best.time)) << sol.cost << " vs " << best.time;
  } else {
    EXPECT_EQ(sol.cost, kInf);
  }
}

// Peers crossing from one site to the other along the ring.
int crossings(const std::vector<int>& ring, const std::vector<int>& site) {
  int count = 0;
  for (std::size_t k = 0; k < ring.size(); ++k) {
    if (site[sz(ring[k])] != site[sz(ring[(k + 1) % ring.size()])]) ++count;
  }
  return count;
}

// A random Hamiltonian cycle of fast edges in [fast_min, fast_max) (one of them exactly
// fast_min) among slow edges in [1, slow_max), plus `decoys` extra fast edges out of
// every peer so that the greedy construction gets lost. Returns the planted cycle.
std::vector<int> plant_cycle(Matrix& bw, std::uint64_t seed, double fast_min, double fast_max, int decoys) {
  const int n = static_cast<int>(bw.size());
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> fast(fast_min, fast_max);
  std::vector<int> cycle(sz(n));
  std::iota(cycle.begin(), cycle.end(), 0);
  std::shuffle(cycle.begin() + 1, cycle.end(), rng);
  for (int v = 0; v < n; ++v) {
    for (int d = 0; d < decoys; ++d) {
      const auto to = static_cast<std::size_t>(rng() % static_cast<std::uint64_t>(n));
      if (to != sz(v)) bw[sz(v)][to] = fast(rng);
    }
  }
  for (std::size_t k = 0; k < cycle.size(); ++k) bw[sz(cycle[k])][sz(cycle[(k + 1) % cycle.size()])] = fast(rng);
  bw[sz(cycle[0])][sz(cycle[1])] = fast_min;
  return cycle;
}

// ---------------------------------------------------------------- scoring

TEST(SolverTest, ScoresRings) {
  Matrix bw = filled(3, 0.0);
  bw[0][1] = 100;
  bw[1][2] = 50;
  bw[2][0] = 200;
  bw[1][0] = -5;
  EXPECT_EQ(ring_bottleneck(bw, {0, 1, 2}), 50);
  EXPECT_DOUBLE_EQ(ring_cost(bw, {0, 1, 2}), 1.0 / 100 + 1.0 / 50 + 1.0 / 200);
  // The reversal uses unknown edges.
  EXPECT_EQ(ring_bottleneck(bw, {0, 2, 1}), 0);
  EXPECT_EQ(ring_cost(bw, {0, 2, 1}), kInf);
  EXPECT_TRUE(better_ring(bw, {0, 1, 2}, {0, 2, 1}));
  EXPECT_FALSE(better_ring(bw, {0, 2, 1}, {0, 1, 2}));
  EXPECT_EQ(ring_bottleneck(bw, {0}), kInf);
  EXPECT_EQ(ring_cost(bw, {0}), 0);

  EXPECT_TRUE(same_bottleneck(1e9, 1e9 * (1 + 1e-10)));
  EXPECT_FALSE(same_bottleneck(1e9, 1e9 * (1 + 1e-8)));
  EXPECT_FALSE(same_bottleneck(kInf, 1e300));

  EXPECT_TRUE(is_valid_ring({0, 2, 1}, 3));
  EXPECT_FALSE(is_valid_ring({1, 0, 2}, 3));
  EXPECT_FALSE(is_valid_ring({0, 1, 1}, 3));
  EXPECT_FALSE(is_valid_ring({0, 1}, 3));
  EXPECT_FALSE(is_valid_ring({0, 1, 3}, 3));
}

// ---------------------------------------------------------------- exact search

TEST(SolverTest, MatchesBruteForceOnSmallGroups) {
  for (int n = 2; n <= 8; ++n) {
    for (std::uint64_t seed = 1; seed <= 4; ++seed) {
      const std::string tag = "n=" + std::to_string(n) + " seed=" + std::to_string(seed);
      expect_matches_brute_force(random_matrix(n, seed, 1.0, 1000.0), "continuous " + tag);
      expect_matches_brute_force(tied_matrix(n, seed, 0), "tied " + tag);
      expect_matches_brute_force(tied_matrix(n, seed, 25), "tied with unknown edges " + tag);
    }
  }
}

TEST(SolverTest, MatchesBruteForceOnHundredsOfInstancesUpToNinePeers) {
  int instances = 0;
  for (int n = 3; n <= 9; ++n) {
    const std::uint64_t seeds = n == 9 ? 20 : 40;
    for (std::uint64_t seed = 100; seed < 100 + seeds; ++seed, ++instances) {
      expect_matches_brute_force(random_matrix(n, seed, 1.0, 1000.0), "n=" + std::to_string(n) + " seed=" + std::to_string(seed));
      if (::testing::Test::HasFailure()) return;
    }
  }
  EXPECT_EQ(instances, 260);
}

// The heuristic (a budget far below what the exact search needs, so that only nearest
// neighbour and the local search run): on random instances of 7 to 10 peers it finds
// the optimal bottleneck in at least 90% of them and is never below half of it.
TEST(SolverTest, HeuristicIsWithinItsStatedBound) {
  // The sanitizer builds (LOCKSTEP_TEST_TIME_SCALE above 1) stop at 9 peers: the brute
  // force over 10 peers was 60 % of this test's time under ASan+UBSan at -O0.
  constexpr bool kSanitized = LOCKSTEP_TEST_TIME_SCALE > 1;
  int heuristic = 0;
  int optimal = 0;
  double worst = 1.0;
  for (int n = 7; n <= (kSanitized ? 9 : 10); ++n) {
    for (std::uint64_t seed = 500; seed < 525; ++seed) {
      const Matrix bw = random_matrix(n, seed, 1.0, 1000.0);
      const Solution sol = solve_ring(bw, Budget{2000});
      ASSERT_TRUE(is_valid_ring(sol.ring, n));
      EXPECT_LE(sol.steps, 2000u);
      if (sol.optimal) continue;  // proven optimal by the heuristic's own bound
      ++heuristic;
      const double ratio = sol.bottleneck / brute_force(bw).bottleneck;
      worst = std::min(worst, ratio);
      if (same_bottleneck(ratio, 1.0)) ++optimal;
    }
  }
  std::printf("heuristic: optimal bottleneck in %d of %d instances, worst ratio %.3f\n", optimal, heuristic, worst);
  EXPECT_GE(heuristic, 50);
  EXPECT_GE(optimal * 10, heuristic * 9);
  EXPECT_GE(worst, 0.5);
}

// Large groups: the solver stays within its step budget (the coordinator's default) and
// returns within a generous wall-clock bound.
TEST(SolverTest, StopsWithinItsBudgetFor64And256Peers) {
  for (const int n : {64, 256}) {
    const Matrix bw = random_matrix(n, 7, 1.0, 1000.0);
    const Budget budget{20'000'000};
    const auto start = std::chrono::steady_clock::now();
    const Solution sol = solve_ring(bw, budget);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("n=%d: %llu steps, %.3f s, bottleneck %.1f (nearest neighbour %.1f)\n", n,
                static_cast<unsigned long long>(sol.steps), seconds, sol.bottleneck,
                ring_bottleneck(bw, nearest_neighbour_ring(bw, 0)));
    ASSERT_TRUE(is_valid_ring(sol.ring, n));
    EXPECT_LE(sol.steps, budget.steps_max);
    EXPECT_GE(sol.bottleneck, ring_bottleneck(bw, nearest_neighbour_ring(bw, 0)));
    EXPECT_LT(seconds, 60.0);
  }
}

TEST(SolverTest, TwoSitesCrossOnlyTwice) {
  // Peers join alternately from two sites, so the join order crosses sites at every
  // edge. Fast links inside a site (about 1000), 10 between the sites.
  const int n = 6;
  std::vector<int> site(sz(n));
  for (int v = 0; v < n; ++v) site[sz(v)] = v % 2;
  Matrix bw = filled(n, 0.0);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      bw[sz(i)][sz(j)] = site[sz(i)] == site[sz(j)] ? 1000.0 + (i * 7 + j * 3) % 11 : 10.0;
    }
  }
  std::vector<int> join(sz(n));
  std::iota(join.begin(), join.end(), 0);
  ASSERT_EQ(crossings(join, site), 6);

  const Solution sol = solve_ring(bw, Budget{exact_step_bound(n)});
  ASSERT_TRUE(is_valid_ring(sol.ring, n)) << show(sol.ring);
  EXPECT_TRUE(sol.optimal);
  EXPECT_EQ(crossings(sol.ring, site), 2) << show(sol.ring);
  EXPECT_EQ(sol.bottleneck, 10.0);
  EXPECT_LT(sol.cost, ring_cost(bw, join));
}

TEST(SolverTest, AvoidsSlowLinkOfJoinOrder) {
  // One congested link, 2 -> 3, on the join order; every other link is fast.
  const int n = 7;
  Matrix bw = random_matrix(n, 7, 900.0, 1100.0);
  bw[2][3] = 5.0;
  std::vector<int> join(sz(n));
  std::iota(join.begin(), join.end(), 0);
  ASSERT_EQ(ring_bottleneck(bw, join), 5.0);

  const Solution sol = solve_ring(bw, Budget{exact_step_bound(n)});
  ASSERT_TRUE(is_valid_ring(sol.ring, n)) << show(sol.ring);
  EXPECT_TRUE(sol.optimal);
  EXPECT_GE(sol.bottleneck, 900.0) << show(sol.ring);
}

TEST(SolverTest, AsymmetryMatters) {
  // A directed cycle of fast links whose reverse links are slow; the rest in between.
  const int n = 5;
  Matrix bw = filled(n, 20.0);
  const std::vector<int> cycle = {0, 2, 4, 1, 3};
  for (std::size_t k = 0; k < cycle.size(); ++k) {
    const auto from = sz(cycle[k]);
    const auto to = sz(cycle[(k + 1) % cycle.size()]);
    bw[from][to] = 100.0;
    bw[to][from] = 1.0;
  }
  const Solution sol = solve_ring(bw, Budget{exact_step_bound(n)});
  EXPECT_TRUE(sol.optimal);
  EXPECT_EQ(sol.ring, cycle);
  EXPECT_EQ(sol.bottleneck, 100.0);
  std::vector<int> reversed = {0, 3, 1, 4, 2};
  EXPECT_EQ(ring_bottleneck(bw, reversed), 1.0);
  EXPECT_TRUE(better_ring(bw, sol.ring, reversed));
}

TEST(SolverTest, AvoidsUnknownEdgesWhenPossible) {
  // The join order is all fast links but two that were never measured (0 and NaN);
  // treated as fast they would win. Every other link is a modest 10. Exact for 6
  // peers, heuristic for 24.
  for (int n : {6, 24}) {
    SCOPED_TRACE(n);
    Matrix bw = filled(n, 10.0);
    for (int v = 0; v < n; ++v) bw[sz(v)][sz((v + 1) % n)] = 1000.0;
    bw[2][3] = 0.0;
    bw[4][5] = std::numeric_limits<double>::quiet_NaN();
    const Solution sol = solve_ring(bw, Budget{1'000'000});
    ASSERT_TRUE(is_valid_ring(sol.ring, n)) << show(sol.ring);
    EXPECT_EQ(sol.optimal, n <= kExactPeersMax);
    EXPECT_EQ(unknown_edges(bw, sol.ring), 0) << show(sol.ring);
    EXPECT_EQ(sol.bottleneck, 10.0);
    EXPECT_LT(sol.cost, kInf);
  }
}

TEST(SolverTest, UsesFewestUnknownEdgesWhenUnavoidable) {
  // Nothing out of peer 3 was measured: every ring has one unknown edge, and no more.
  {
    const int n = 6;
    Matrix bw = random_matrix(n, 3, 1.0, 100.0);
    for (auto& v : bw[3]) v = -1.0;
    const Solution sol = solve_ring(bw, Budget{exact_step_bound(n)});
    ASSERT_TRUE(is_valid_ring(sol.ring, n));
    EXPECT_TRUE(sol.optimal);
    EXPECT_EQ(sol.bottleneck, 0.0);
    EXPECT_EQ(sol.cost, kInf);
    EXPECT_EQ(unknown_edges(bw, sol.ring), 1) << show(sol.ring);
    const Optimum best = brute_force(bw);
    EXPECT_TRUE(near(known_time(bw, sol.ring), best.time));
  }
  {
    const int n = 30;
    Matrix bw = random_matrix(n, 4, 1.0, 100.0);
    for (auto& v : bw[7]) v = 0.0;
    const Solution sol = solve_ring(bw, Budget{5'000'000});
    ASSERT_TRUE(is_valid_ring(sol.ring, n));
    EXPECT_FALSE(sol.optimal);
    EXPECT_EQ(sol.bottleneck, 0.0);
    EXPECT_EQ(unknown_edges(bw, sol.ring), 1) << show(sol.ring);
  }
}

TEST(SolverTest, OneAndTwoPeers) {
  const Solution none = solve_ring(Matrix{}, Budget{0});
  EXPECT_TRUE(none.ring.empty());

  const Solution one = solve_ring(filled(1, 0.0), Budget{0});
  EXPECT_EQ(one.ring, std::vector<int>{0});
  EXPECT_TRUE(one.optimal);
  EXPECT_EQ(one.bottleneck, kInf);
  EXPECT_EQ(one.cost, 0.0);

  Matrix bw = filled(2, 0.0);
  bw[0][1] = 30.0;
  bw[1][0] = 70.0;
  const Solution two = solve_ring(bw, Budget{0});
  EXPECT_EQ(two.ring, (std::vector<int>{0, 1}));
  EXPECT_TRUE(two.optimal);
  EXPECT_EQ(two.bottleneck, 30.0);
  EXPECT_DOUBLE_EQ(two.cost, 1.0 / 30 + 1.0 / 70);

  Improver improver(bw, 1);
  EXPECT_TRUE(improver.done());
  EXPECT_EQ(improver.step(Budget{100}).ring, (std::vector<int>{0, 1}));
}

TEST(SolverTest, SixteenPeersExact) {
  const int n = kExactPeersMax;
  // A planted directed cycle of fast links among slower ones is the only ring with
  // its bottleneck.
  Matrix bw = random_matrix(n, 16, 1.0, 50.0);
  const std::vector<int> planted = plant_cycle(bw, 17, 60.0, 100.0, 0);
  const Budget budget{exact_step_bound(n)};
  const Solution sol = solve_ring(bw, budget);
  EXPECT_TRUE(sol.optimal);
  EXPECT_LE(sol.steps, budget.steps_max);
  EXPECT_EQ(sol.ring, planted);
  EXPECT_EQ(sol.bottleneck, 60.0);

  // Random links: the exact ring is at least as good as the heuristic's.
  const Matrix random = random_matrix(n, 18, 1.0, 1000.0);
  const Solution exact = solve_ring(random, budget);
  const Solution heuristic = solve_ring(random, Budget{budget.steps_max / 4});
  ASSERT_TRUE(is_valid_ring(exact.ring, n));
  EXPECT_TRUE(exact.optimal);
  EXPECT_FALSE(heuristic.optimal);
  EXPECT_FALSE(better_ring(random, heuristic.ring, exact.ring))
      << show(heuristic.ring) << " " << heuristic.bottleneck << " vs " << show(exact.ring) << " " << exact.bottleneck;
}

TEST(SolverTest, TinyBudgetFallsBackToHeuristic) {
  const int n = kExactPeersMax;
  const Matrix bw = random_matrix(n, 5, 1.0, 1000.0);
  for (std::uint64_t steps : {std::uint64_t{0}, std::uint64_t{1000}, exact_step_bound(n) - 1}) {
    SCOPED_TRACE(steps);
    const Solution sol = solve_ring(bw, Budget{steps});
    ASSERT_TRUE(is_valid_ring(sol.ring, n)) << show(sol.ring);
    EXPECT_FALSE(sol.optimal);
    EXPECT_LE(sol.steps, steps);
    EXPECT_FALSE(better_ring(bw, nearest_neighbour_ring(bw, 0), sol.ring));
  }
  // A zero budget gives the construction itself.
  EXPECT_EQ(solve_ring(bw, Budget{0}).ring, nearest_neighbour_ring(bw, 0));
  // Deterministic for a budget.
  EXPECT_EQ(solve_ring(bw, Budget{20'000}).ring, solve_ring(bw, Budget{20'000}).ring);
}

// ---------------------------------------------------------------- heuristic

TEST(SolverTest, FortyPeersHeuristic) {
  const int n = 40;
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    SCOPED_TRACE(seed);
    const Matrix bw = random_matrix(n, seed, 1.0, 1000.0);
    const Solution sol = solve_ring(bw, Budget{20'000'000});
    ASSERT_TRUE(is_valid_ring(sol.ring, n)) << show(sol.ring);
    EXPECT_FALSE(sol.optimal);
    EXPECT_GE(sol.bottleneck, ring_bottleneck(bw, nearest_neighbour_ring(bw, 0)));
    EXPECT_FALSE(better_ring(bw, nearest_neighbour_ring(bw, 0), sol.ring));
  }
  // A planted cycle of fast links (60 and up), with three decoy fast links out of every
  // peer, among slow ones (below 10): the greedy construction misses it.
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    SCOPED_TRACE(seed);
    Matrix bw = random_matrix(n, 100 + seed, 1.0, 10.0);
    const std::vector<int> planted = plant_cycle(bw, 200 + seed, 60.0, 100.0, 3);
    ASSERT_EQ(ring_bottleneck(bw, planted), 60.0);
    EXPECT_LT(ring_bottleneck(bw, nearest_neighbour_ring(bw, 0)), 60.0);
    const Solution sol = solve_ring(bw, Budget{20'000'000});
    ASSERT_TRUE(is_valid_ring(sol.ring, n)) << show(sol.ring);
    EXPECT_GE(sol.bottleneck, 60.0) << show(sol.ring);
    EXPECT_LE(sol.steps, 20'000'000u);
  }
}

// ---------------------------------------------------------------- bounds

// Both bounds hold against every ring: the bottleneck bound is never below the best
// bottleneck, the cost bound never above the best per-byte time at that bottleneck.
TEST(SolverTest, BoundsNeverCutOffTheBestRing) {
  int tight = 0;
  int instances = 0;
  for (int n = 3; n <= 8; ++n) {
    for (std::uint64_t seed = 1; seed <= 12; ++seed) {
      SCOPED_TRACE(std::to_string(n) + " peers, seed " + std::to_string(seed));
      for (const Matrix& bw : {random_matrix(n, 700 + seed, 1.0, 1000.0), tied_matrix(n, 800 + seed, 0)}) {
        const Optimum best = brute_force(bw);
        const double bound = bottleneck_bound(bw);
        EXPECT_TRUE(bound > best.bottleneck || same_bottleneck(bound, best.bottleneck))
            << bound << " vs " << best.bottleneck;
        const double cost = cost_bound(bw, best.bottleneck);
        EXPECT_LE(cost, best.time * (1 + 1e-9));
        EXPECT_GT(cost, 0.0);
        ++instances;
        if (same_bottleneck(bound, best.bottleneck)) ++tight;
      }
    }
  }
  std::printf("bottleneck bound tight in %d of %d instances\n", tight, instances);
  EXPECT_GE(tight * 2, instances);  // a bound that is rarely reached proves nothing
}

// Every peer's fastest links reach 100, but peer 0 is the only fast sender into peers
// 1-4: no cycle cover, hence no ring, uses only fast links. The bound sees it.
TEST(SolverTest, BottleneckBoundNeedsACycleCover) {
  const int n = 5;
  Matrix bw = filled(n, 10.0);
  for (int i = 1; i < n; ++i) {
    bw[sz(i)][0] = 100.0;
    bw[0][sz(i)] = 100.0;
  }
  EXPECT_EQ(bottleneck_bound(bw), 10.0);
  EXPECT_EQ(solve_ring(bw, Budget{exact_step_bound(n)}).bottleneck, 10.0);
  EXPECT_EQ(cost_bound(bw, 100.0), std::numeric_limits<double>::infinity());
}

// Two sites of three peers, fast within, slow between: fast cycle covers exist (one
// cycle per site) but the fast links do not connect the sites.
TEST(SolverTest, BottleneckBoundNeedsStrongConnection) {
  const int n = 6;
  Matrix bw = filled(n, 5.0);
  for (int i = 0; i < n; ++i) {
    for (int j = 0; j < n; ++j) {
      if (i / 3 == j / 3) bw[sz(i)][sz(j)] = 100.0;
    }
  }
  EXPECT_EQ(bottleneck_bound(bw), 5.0);
  EXPECT_EQ(solve_ring(bw, Budget{exact_step_bound(n)}).bottleneck, 5.0);
  // The per-byte time at the best bottleneck: two slow crossings and four fast links
  // at best; the cycle cover may use fast links only.
  EXPECT_NEAR(cost_bound(bw, 5.0), 6 / 100.0, 1e-12);
  EXPECT_NEAR(solve_ring(bw, Budget{exact_step_bound(n)}).cost, 2 / 5.0 + 4 / 100.0, 1e-12);
}

// Large groups reach their bound: 100 peers with bandwidths drawn from five levels
// (the bound is the best possible there), and 1,000 peers with distinct measured values,
// where climbing the distinct values one at a time used to stop at a fraction of it.
TEST(SolverTest, LargeGroupsReachTheirBottleneckBound) {
  const auto levels = [](int n, std::uint64_t seed) {
    std::mt19937_64 rng(seed);
    Matrix bw = filled(n, 0.0);
    for (auto& row : bw) {
      for (auto& v : row) v = 25.0 * static_cast<double>(1 << (rng() % 5));
    }
    return bw;
  };
  for (std::uint64_t seed = 1; seed <= 10; ++seed) {
    SCOPED_TRACE(seed);
    const Matrix bw = levels(100, seed);
    const Solution sol = solve_ring(bw, Budget{20'000'000});
    ASSERT_TRUE(is_valid_ring(sol.ring, 100));
    EXPECT_EQ(sol.bottleneck, bottleneck_bound(bw));
  }
  const Matrix bw = random_matrix(1000, 1, 25.0, 400.0);
  const Solution sol = solve_ring(bw, Budget{20'000'000});
  ASSERT_TRUE(is_valid_ring(sol.ring, 1000));
  const double bound = bottleneck_bound(bw);
  std::printf("1000 peers: bottleneck %.2f of bound %.2f\n", sol.bottleneck, bound);
  EXPECT_GE(sol.bottleneck, 0.95 * bound);
}

// ---------------------------------------------------------------- Improver

TEST(SolverTest, ImproverIsDeterministicAndMonotone) {
  const int n = 40;
  Matrix bw = random_matrix(n, 300, 1.0, 10.0);
  plant_cycle(bw, 301, 60.0, 100.0, 3);
  Improver a(bw, 42);
  Improver b(bw, 42);
  const Budget slice{50'000};
  ASSERT_TRUE(is_valid_ring(a.best().ring, n));
  std::vector<int> previous = a.best().ring;
  for (int k = 0; k < 30; ++k) {
    SCOPED_TRACE(k);
    const std::uint64_t before = a.steps();
    const Solution& sa = a.step(slice);
    const Solution& sb = b.step(slice);
    ASSERT_TRUE(is_valid_ring(sa.ring, n)) << show(sa.ring);
    EXPECT_EQ(sa.ring, sb.ring);
    EXPECT_EQ(a.steps(), b.steps());
    EXPECT_LE(a.steps() - before, slice.steps_max);
    EXPECT_FALSE(sa.optimal);
    EXPECT_FALSE(better_ring(bw, previous, sa.ring)) << "got worse at step " << k;
    EXPECT_EQ(sa.bottleneck, ring_bottleneck(bw, sa.ring));
    previous = sa.ring;
  }
  EXPECT_FALSE(a.done());
  EXPECT_GE(a.best().bottleneck, 60.0) << show(a.best().ring);
  // A moved Improver goes on where it was.
  Improver moved = std::move(a);
  EXPECT_EQ(moved.best().ring, previous);
  EXPECT_FALSE(better_ring(bw, previous, moved.step(slice).ring));
}

TEST(SolverTest, ImproverFinishesExactSearchInSlices) {
  const int n = 10;
  const Matrix bw = tied_matrix(n, 9, 10);
  const Solution exact = solve_ring(bw, Budget{exact_step_bound(n)});
  ASSERT_TRUE(exact.optimal);
  // Slices smaller than one unit of work (a construction is n^2 steps, a subset of
  // Held-Karp (n-1)^2) still add up.
  for (std::uint64_t slice : {std::uint64_t{997}, std::uint64_t{10}}) {
    SCOPED_TRACE(slice);
    Improver improver(bw, 7);
    int calls = 0;
    while (!improver.done() && calls < 100'000) {
      const std::uint64_t before = improver.steps();
      improver.step(Budget{slice});
      EXPECT_LE(improver.steps() - before, slice);
      ++calls;
    }
    ASSERT_TRUE(improver.done());
    EXPECT_GT(calls, 1);
    const Solution& sol = improver.best();
    EXPECT_TRUE(sol.optimal);
    EXPECT_TRUE(same_bottleneck(sol.bottleneck, exact.bottleneck));
    EXPECT_EQ(unknown_edges(bw, sol.ring), unknown_edges(bw, exact.ring));
    EXPECT_TRUE(near(known_time(bw, sol.ring), known_time(bw, exact.ring)));
    // Done: more steps spend nothing and change nothing.
    const std::uint64_t spent = improver.steps();
    EXPECT_EQ(improver.step(Budget{slice}).ring, sol.ring);
    EXPECT_EQ(improver.steps(), spent);
  }
}

}  // namespace
}  // namespace lockstep::topo
