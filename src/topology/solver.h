// The ring-topology solver: given the measured bandwidth between every ordered pair of
// peers, the order in which the peers of a group should form their ring.
//
// Why the objective is what it is. In the pipelined ring all-reduce
// (collectives/ring.h) every peer sends to its successor at the same time, and every
// edge of the ring carries the same bytes: a step ends when its slowest transfer
// ends. The ring's throughput is therefore limited by its slowest edge, whatever the
// others do, so the primary objective is to maximize the bottleneck (the minimum
// bandwidth over the ring's edges). Many rings often share the best bottleneck (one
// slow inter-site link that every ring must cross, say); among those (bottlenecks
// compared with a relative tolerance, since they are measurements) the secondary
// objective minimizes the sum over the edges of 1/bandwidth, the total per-byte
// time. It favours rings whose other edges are fast too, which keeps the ring fast
// when the measurements are noisy or a link degrades, and crosses slow links as
// rarely as possible.
//
// Bandwidth is asymmetric (bw[i][j] is measured from i sending to j), so a ring and its
// reversal are different rings. A value <= 0 (or NaN) means unknown or unreachable:
// such an edge is used only if no ring avoids it; then the bottleneck is 0 and, among
// those rings, the fewest unknown edges are used, then the least per-byte time over
// the known edges.
//
// Pure code: no IO, threads or clock. The search is bounded by a Budget, a count of
// inner-loop steps, so that the result is a deterministic function of the input and
// the budget; a caller that wants wall-time bounds runs the Improver in slices.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

namespace lockstep::topo {

// bw[i][j]: bytes per second from peer i to peer j; bw[i][i] is ignored. The number of
// peers is bw.size(); a missing entry (a row shorter than that) counts as unknown.
using Matrix = std::vector<std::vector<double>>;

// Up to this many peers the exact search is affordable (2^15 subsets times 15^2).
inline constexpr int kExactPeersMax = 16;
// Two bottlenecks within this relative distance are the same bottleneck: they are
// measurements, and the per-byte time decides between such rings.
inline constexpr double kBottleneckTolerance = 1e-9;

// A deterministic work budget: the count of inner-loop steps (one move evaluated, one
// subset-node pair of a dynamic program), not wall time.
struct Budget {
  std::uint64_t steps_max = 0;
};

struct Solution {
  std::vector<int> ring;  // a permutation of 0..n-1 starting with 0; ring[k] sends to ring[k+1]
  double bottleneck = 0;  // ring_bottleneck(bw, ring)
  double cost = 0;        // ring_cost(bw, ring)
  bool optimal = false;   // proven best for the objective above
  // Steps spent: by solve_ring (never more than its budget), or by an Improver up to
  // the step that found this ring.
  std::uint64_t steps = 0;
};

// The minimum bandwidth over the ring's edges, the last peer sending to the first;
// an unknown edge counts as 0. A ring of one peer has no edge: +infinity.
double ring_bottleneck(const Matrix& bw, const std::vector<int>& ring);
// The sum over the ring's edges of 1/bw, seconds per byte; +infinity if an edge is
// unknown. A ring of one peer costs 0.
double ring_cost(const Matrix& bw, const std::vector<int>& ring);
// Whether two bottlenecks are equal within kBottleneckTolerance.
bool same_bottleneck(double a, double b);
// Whether `ring` is a permutation of 0..n-1 starting with 0.
bool is_valid_ring(const std::vector<int>& ring, int n);
// Whether ring a is better than ring b for the objective above (bottleneck first,
// then the count of unknown edges, then the per-byte time).
bool better_ring(const Matrix& bw, const std::vector<int>& a, const std::vector<int>& b);

// The greedy construction the heuristic starts from: from `start`, always go to the
// unvisited peer with the fastest link; rotated to start with 0.
std::vector<int> nearest_neighbour_ring(const Matrix& bw, int start);

// An upper bound on the steps the exact search takes for n peers (0 for n <= 2, the
// maximum value for n > kExactPeersMax): a budget this large always makes solve_ring
// exact for n <= kExactPeersMax.
std::uint64_t exact_step_bound(int n);

// Exact when n <= kExactPeersMax and the exact search fits in the budget (optimal =
// true); otherwise the best ring of a heuristic search (optimal = false) that stops
// when the budget is spent or when perturbations stop finding better rings. The first
// construction (nearest neighbour from peer 0, n^2 work) is always made, outside the
// budget, so that even a zero budget gives a valid ring. n = 1 gives {0}, n = 2 {0, 1}.
Solution solve_ring(const Matrix& bw, Budget budget);

// Bounds that prove how good a ring is, for large groups where the exact search is out
// of reach. bottleneck_bound: no ring's bottleneck exceeds it. It is the largest value t
// such that the edges of at least t form a strongly connected graph that holds a cycle
// cover (one outgoing and one incoming edge per peer): a ring is both, so a threshold
// without them admits no ring. O(n^2.5 log n); +infinity for one peer.
double bottleneck_bound(const Matrix& bw);
// cost_bound: no ring whose edges all reach `floor` (within kBottleneckTolerance) has a
// smaller per-byte time. It is the least-cost cycle cover over those edges (an
// assignment problem, O(n^3)); +infinity if there is none. 0 for one peer.
double cost_bound(const Matrix& bw, double floor);

// Keeps improving a solution in slices, for a background search: each step spends at
// most `budget` and returns the best ring so far, which never gets worse. Deterministic
// given its seed and the sequence of budgets. Slices of any size add up: a unit of work
// larger than one slice is paid for over several. For n <= kExactPeersMax the slices go
// into the exact search (after one local search, so that a good ring is there early);
// once it has finished the solution is optimal and done() is true. For larger n the
// search goes on forever: local search, then perturbations (double-bridge kicks) and
// random restarts, keeping the best.
class Improver {
 public:
  Improver(Matrix bw, std::uint64_t seed);
  ~Improver();
  Improver(Improver&&) noexcept;
  Improver& operator=(Improver&&) noexcept;
  Improver(const Improver&) = delete;
  Improver& operator=(const Improver&) = delete;

  const Solution& step(Budget budget);
  const Solution& best() const;
  // True when more steps cannot change the solution (it is optimal, or n <= 2).
  bool done() const;
  // All steps spent so far.
  std::uint64_t steps() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace lockstep::topo
