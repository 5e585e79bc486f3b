// Solver implementation. Two searches, both resumable under a step budget:
//  - Exact (n <= kExactPeersMax): a binary search over the distinct bandwidth values for
//    the largest threshold that still admits a Hamiltonian cycle (a bitmask dynamic
//    program over the subsets of peers, starting at peer 0), then Held-Karp restricted
//    to the edges at or above that bottleneck, minimizing the per-byte time.
//  - Heuristic: nearest-neighbour constructions, then an orientation-preserving local
//    search (segment exchange, which includes the or-opt moves: a directed ring must
//    not have segments reversed, since every reversed edge is a different
//    measurement), iterated with double-bridge kicks and restarts.
#include "topology/solver.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <utility>

namespace lockstep::topo {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// A cost change smaller than this (relative to the costs involved) is rounding: taking
// it as an improvement could make the local search cycle between equal rings.
constexpr double kCostEpsilon = 1e-12;
// Nearest-neighbour constructions tried before the first local search.
constexpr std::size_t kConstructionStarts = 8;
// The local search's third cut follows one of this many fastest links (a candidate
// list, as in Lin-Kernighan solvers): a pass costs n * 16 * 16 moves, not n^3.
constexpr std::size_t kNeighbours = 16;
// Kicks without a better base ring after which the search restarts elsewhere.
constexpr std::uint64_t kRestartStallKicks = 40;
// solve_ring's heuristic stops after this many kicks without a better ring: beyond
// that, more work rarely pays, and a background Improver is the tool for it.
constexpr std::uint64_t kSolveStallKicks = 100;
constexpr std::uint64_t kNoStallLimit = std::numeric_limits<std::uint64_t>::max();
constexpr std::uint64_t kSolveSeed = 0x6c6f636b73746570;
constexpr std::uint8_t kUnreachable = 0xff;

std::size_t sz(int x) { return static_cast<std::size_t>(x); }

// A measured value as the solver uses it: unknown (<= 0 or NaN) is 0.
double usable(double v) { return v > 0 ? v : 0.0; }

double matrix_edge(const Matrix& bw, int from, int to) {
  if (from < 0 || to < 0 || sz(from) >= bw.size() || sz(to) >= bw[sz(from)].size()) return 0.0;
  return usable(bw[sz(from)][sz(to)]);
}

// The ranking key of a ring: bottleneck, then unknown edges, then per-byte time of the
// known edges (an unknown edge adds nothing there; it is counted instead).
struct Score {
  double bottleneck = kInf;
  int unknown = 0;
  double cost = 0;
};

template <typename EdgeValue>
Score score_with(const std::vector<int>& ring, EdgeValue edge) {
  Score s;
  if (ring.size() < 2) return s;
  for (std::size_t k = 0; k < ring.size(); ++k) {
    const double v = edge(ring[k], ring[(k + 1) % ring.size()]);
    s.bottleneck = std::min(s.bottleneck, v);
    if (v > 0) {
      s.cost += 1.0 / v;
    } else {
      s.unknown += 1;
    }
  }
  return s;
}

bool better(const Score& a, const Score& b) {
  if (!same_bottleneck(a.bottleneck, b.bottleneck)) return a.bottleneck > b.bottleneck;
  if (a.unknown != b.unknown) return a.unknown < b.unknown;
  return a.cost < b.cost;
}

// Rotates a ring so that it starts with peer 0.
void canonicalize(std::vector<int>& ring) {
  auto zero = std::find(ring.begin(), ring.end(), 0);
  if (zero != ring.end()) std::rotate(ring.begin(), zero, ring.end());
}

// A dense copy of the matrix with the values the solver uses, and the distinct values
// (the candidate bottlenecks).
struct Graph {
  explicit Graph(const Matrix& bw) : n(static_cast<int>(bw.size())) {
    val.assign(sz(n) * sz(n), 0.0);
    inv.assign(sz(n) * sz(n), 0.0);
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) {
        if (i == j) continue;
        const double v = matrix_edge(bw, i, j);
        val[index(i, j)] = v;
        inv[index(i, j)] = v > 0 ? 1.0 / v : 0.0;
        if (v > 0) levels.push_back(v);
      }
    }
    std::sort(levels.begin(), levels.end());
    levels.erase(std::unique(levels.begin(), levels.end()), levels.end());
    // A ring leaves every peer by one edge and enters it by one: no ring's bottleneck
    // exceeds the least over the peers of their fastest way out and in.
    double cap = kInf;
    for (int v = 0; v < n; ++v) {
      double out = 0;
      double in = 0;
      for (int u = 0; u < n; ++u) {
        if (u == v) continue;
        out = std::max(out, val[index(v, u)]);
        in = std::max(in, val[index(u, v)]);
      }
      cap = std::min({cap, out, in});
    }
    reachable_levels = static_cast<std::size_t>(
        std::upper_bound(levels.begin(), levels.end(), cap) - levels.begin());
    fastest.resize(sz(n));
    for (int i = 0; i < n; ++i) {
      auto& list = fastest[sz(i)];
      for (int j = 0; j < n; ++j) {
        if (j != i) list.push_back(j);
      }
      std::stable_sort(list.begin(), list.end(), [&](int a, int b) { return value(i, a) > value(i, b); });
    }
  }
  std::size_t index(int from, int to) const { return sz(from) * sz(n) + sz(to); }
  double value(int from, int to) const { return val[index(from, to)]; }
  double time(int from, int to) const { return inv[index(from, to)]; }
  Score score(const std::vector<int>& ring) const {
    return score_with(ring, [this](int a, int b) { return value(a, b); });
  }
  double bottleneck(const std::vector<int>& ring) const { return score(ring).bottleneck; }

  int n;
  std::vector<double> val;     // n*n; 0 for unknown edges and the diagonal
  std::vector<double> inv;     // 1/val, 0 where val is 0
  std::vector<double> levels;  // the distinct positive values, ascending
  std::size_t reachable_levels = 0;  // how many levels are at most the cap above
  // Each peer's out-neighbours, fastest first. Every key the local search uses ranks a
  // peer's links in this order (a class below a threshold, then 1/value).
  std::vector<std::vector<int>> fastest;
};

Solution make_solution(const Graph& g, std::vector<int> ring, bool optimal, std::uint64_t steps) {
  const Score s = g.score(ring);
  return Solution{std::move(ring), s.bottleneck, s.unknown > 0 ? kInf : s.cost, optimal, steps};
}

struct Meter {
  std::uint64_t used = 0;
  std::uint64_t limit = 0;
  // Steps paid toward a unit of work that no slice so far could afford whole (the
  // Improver's; none for solve_ring). Without it, slices smaller than the largest unit
  // (n^2 for a construction, (n-1)^2 for a subset of Held-Karp) would never progress.
  std::uint64_t* credit = nullptr;

  // Spends k steps if the budget (with the credit) has them. Otherwise spends nothing,
  // or, with a credit, puts the rest of the budget toward this unit.
  bool take(std::uint64_t k) {
    const std::uint64_t saved = credit != nullptr ? *credit : 0;
    const std::uint64_t need = k > saved ? k - saved : 0;
    if (limit - used >= need) {
      used += need;
      if (credit != nullptr) *credit = saved - (k - need);
      return true;
    }
    if (credit != nullptr) {
      *credit += limit - used;
      used = limit;
    }
    return false;
  }
};

std::vector<int> nearest_neighbour(const Graph& g, int start) {
  std::vector<int> ring;
  if (g.n == 0) return ring;
  ring.reserve(sz(g.n));
  std::vector<char> seen(sz(g.n), 0);
  int cur = start;
  seen[sz(cur)] = 1;
  ring.push_back(cur);
  for (int k = 1; k < g.n; ++k) {
    int next = -1;
    for (int v = 0; v < g.n; ++v) {
      if (seen[sz(v)] == 0 && (next < 0 || g.value(cur, v) > g.value(cur, next))) next = v;
    }
    seen[sz(next)] = 1;
    ring.push_back(next);
    cur = next;
  }
  canonicalize(ring);
  return ring;
}

// ---------------------------------------------------------------- local search
//
// The moves change three edges each, so they are scored by an additive key instead of
// the bottleneck itself (a minimum is not additive, and on a plateau of equal
// bottlenecks no single move would ever look better). With the ring's bottleneck B:
//  - floor: edges below B (less the tolerance) would lower the bottleneck: never;
//  - target: a distinct value above B. Pushing the count of edges below it to zero
//    raises the bottleneck to at least the target; then a new target is set. Targets
//    are bisected between the next value above B and the lowest value that no ring can
//    reach (Graph::reachable_levels) or that this descent failed to reach: with
//    measured values, every edge is a level of its own, and climbing them one at a
//    time costs a pass per edge of the ring (n = 1,000: most of the budget).
// When no move lowers that count, a second descent with target = floor minimizes the
// per-byte time at the bottleneck reached. With B = 0 the target counts unknown
// edges, so that unavoidable ones are kept to the fewest.

struct Levels {
  double floor = 0;
  double target = 0;
};

using Edge = std::pair<int, int>;

bool improves(const Graph& g, const Levels& lv, const std::array<Edge, 3>& removed,
              const std::array<Edge, 3>& added) {
  int below_floor = 0;
  int below_target = 0;
  double add_time = 0;
  double remove_time = 0;
  for (const auto& [a, b] : added) {
    const double v = g.value(a, b);
    below_floor += v < lv.floor ? 1 : 0;
    below_target += v < lv.target ? 1 : 0;
    add_time += g.time(a, b);
  }
  for (const auto& [a, b] : removed) {
    const double v = g.value(a, b);
    below_floor -= v < lv.floor ? 1 : 0;
    below_target -= v < lv.target ? 1 : 0;
    remove_time += g.time(a, b);
  }
  if (below_floor != 0) return below_floor < 0;
  if (below_target != 0) return below_target < 0;
  return add_time < remove_time - kCostEpsilon * (add_time + remove_time);
}

enum class Pass { kImproved, kNone, kOutOfBudget };

// A resumable state machine: when the budget runs out mid-pass it keeps its phase and
// its place in the scan, so that the next slice goes on from there (the ring is not
// touched in between). Otherwise slices smaller than one pass would never progress.
class LocalSearch {
 public:
  // Improves ring in place; false if the budget ran out first (the ring is then no
  // worse than before, and calling again with the same ring resumes the descent).
  bool run(const Graph& g, std::vector<int>& ring, Meter& meter) {
    while (true) {
      if (phase_ == Phase::kStart) {
        if (fresh_) {
          failed_ = g.reachable_levels;
          fresh_ = false;
        }
        start_ = g.bottleneck(ring);
        floor_ = start_ * (1.0 - kBottleneckTolerance);
        const auto next = static_cast<std::size_t>(
            std::upper_bound(g.levels.begin(), g.levels.end(), start_ * (1.0 + kBottleneckTolerance)) -
            g.levels.begin());
        if (next < failed_) {
          // Bisect between the next level and the lowest that failed; with unknown
          // edges in the ring, one level at a time (see above).
          aim_ = start_ > 0 ? next + (failed_ - next) / 2 : next;
          begin(Phase::kRaise, Levels{floor_, g.levels[aim_]});
        } else {
          begin_cost();
        }
      }
      const Pass pass = exchange(g, ring, meter);
      if (pass == Pass::kOutOfBudget) return false;
      if (pass == Pass::kImproved) {
        // Proving that nothing is left below the target would cost a full pass for
        // every level climbed: set the next target as soon as it is reached.
        if (phase_ == Phase::kRaise && g.bottleneck(ring) >= levels_.target) phase_ = Phase::kStart;
        continue;
      }
      if (phase_ == Phase::kRaise) {
        failed_ = aim_;  // try lower: the next kStart aims between
        phase_ = Phase::kStart;
        continue;
      }
      phase_ = Phase::kStart;
      const double after = g.bottleneck(ring);
      if (after > start_ && !same_bottleneck(after, start_)) continue;
      fresh_ = true;
      return true;
    }
  }

 private:
  enum class Phase { kStart, kRaise, kCost };

  void begin(Phase phase, Levels levels) {
    phase_ = phase;
    levels_ = levels;
    scan_ = Scan{};
  }

  // denorm_min as the target at B = 0 counts exactly the unknown edges.
  void begin_cost() {
    begin(Phase::kCost, Levels{floor_, start_ > 0 ? floor_ : std::numeric_limits<double>::denorm_min()});
  }

  // One neighbourhood: exchange two adjacent segments of any length (the only
  // reconnection of three removed edges that keeps every segment's direction):
  // a1 S1 S2 X -> a1 S2 S1 X, with S1 = a2..b1 and S2 = b2..c1. It contains every
  // or-opt move (a segment of 1..3 peers moved elsewhere, direction kept: the exchange
  // of that segment with the stretch it jumps over) and every move of longer segments.
  //
  // Three peers get a new successor (a1, b1 and c1), and the key is additive, so a
  // move can improve it only if one of them gains a faster successor. Any of the three
  // cuts can play the first, so only the moves where a1 gains are tried: b2 runs
  // through a1's links faster than the one to a2, which in a good ring are few. The
  // pass stays complete, and on a good ring costs a few n^2 evaluations instead of
  // n^3 / 6 (a plain or-opt scan alone, every short segment to every insertion point,
  // is 3 n^2). First improvement; the next pass starts where this one found it.
  Pass exchange(const Graph& g, std::vector<int>& ring, Meter& meter) {
    const std::size_t n = ring.size();
    position_.resize(n);
    for (std::size_t p = 0; p < n; ++p) position_[sz(ring[p])] = p;
    Scan& s = scan_;
    for (; s.t < n; ++s.t, s.candidate = 0, s.rc = 0) {
      const std::size_t i = (offset_ + s.t) % n;
      const int a1 = ring[i];
      const int a2 = ring[(i + 1) % n];
      const double now = g.value(a1, a2);
      // Raising, a move must remove an edge below the target, and the exchange of three
      // edges is the same move whichever of them is called a1 -> a2: scan only those.
      if (phase_ == Phase::kRaise && now >= levels_.target) continue;
      const auto& faster = g.fastest[sz(a1)];
      for (; s.candidate < faster.size(); ++s.candidate, s.rc = 0) {
        const int b2 = faster[s.candidate];
        if (!(g.value(a1, b2) > now)) break;
        // Offsets from a1: S1 is 1..rb-1, S2 is rb..rc, X the rest.
        const std::size_t rb = (position_[sz(b2)] + n - i) % n;
        if (rb < 2) continue;
        const int b1 = ring[(i + rb - 1) % n];
        // The third cut: c2 among b1's fastest (b1 -> c2 is a new edge), after b2.
        const auto& near = g.fastest[sz(b1)];
        for (const std::size_t count = std::min(near.size(), kNeighbours); s.rc < count; ++s.rc) {
          if (!meter.take(1)) return Pass::kOutOfBudget;
          const int c2 = near[s.rc];
          const std::size_t rc = (position_[sz(c2)] + n - i - 1) % n;  // c1's offset
          if (rc < rb) continue;
          const int c1 = ring[(i + rc) % n];
          if (!improves(g, levels_, {Edge{a1, a2}, Edge{b1, b2}, Edge{c1, c2}},
                        {Edge{a1, b2}, Edge{c1, a2}, Edge{b1, c2}})) {
            continue;
          }
          scratch_.assign(1, a1);
          for (std::size_t r = rb; r <= rc; ++r) scratch_.push_back(ring[(i + r) % n]);
          for (std::size_t r = 1; r < rb; ++r) scratch_.push_back(ring[(i + r) % n]);
          for (std::size_t r = rc + 1; r < n; ++r) scratch_.push_back(ring[(i + r) % n]);
          ring.swap(scratch_);
          offset_ = 0;  // a1 is at the front of the new ring
          s = Scan{};
          return Pass::kImproved;
        }
      }
    }
    s = Scan{};
    return Pass::kNone;
  }

  // Where a pass stands: the t-th cut position from offset_, the candidate b2 in
  // a1's list, the end of S2.
  struct Scan {
    std::size_t t = 0;
    std::size_t candidate = 0;
    std::size_t rc = 0;
  };

  Phase phase_ = Phase::kStart;
  bool fresh_ = true;       // a new descent: aim as high as any ring could reach
  std::size_t failed_ = 0;  // levels at or above this index failed to be reached in this descent
  std::size_t aim_ = 0;     // the index of the raise's target
  double start_ = 0;  // the bottleneck when the phases began
  double floor_ = 0;
  Levels levels_;
  Scan scan_;
  std::size_t offset_ = 0;
  std::vector<std::size_t> position_;  // of each peer in the ring
  std::vector<int> scratch_;
};

// ---------------------------------------------------------------- heuristic

// Iterated local search as a resumable state machine: constructions, then descents
// from kicked copies of a base ring, restarting from a fresh construction when the
// base stops improving.
class Heuristic {
 public:
  Heuristic(const Graph& g, std::uint64_t seed)
      : rng_(seed), current_(nearest_neighbour(g, 0)), best_(current_), best_score_(g.score(best_)) {}

  // Works until the meter is spent, or until stall_kicks_max kicks in a row have not
  // found a better ring (0: stop at the first local optimum).
  void run(const Graph& g, Meter& meter, std::uint64_t stall_kicks_max) {
    const std::size_t n = sz(g.n);
    while (true) {
      switch (stage_) {
        case Stage::kConstruct: {
          const std::size_t starts = std::min(n, kConstructionStarts);
          for (; next_start_ < starts; ++next_start_) {
            if (!meter.take(n * n)) return;
            auto ring = nearest_neighbour(g, static_cast<int>(next_start_ * n / starts));
            if (better(g.score(ring), g.score(current_))) current_ = std::move(ring);
          }
          stage_ = Stage::kDescend;
          break;
        }
        case Stage::kDescend: {
          if (!search_.run(g, current_, meter)) return;
          canonicalize(current_);
          local_optimum_ = true;
          const Score s = g.score(current_);
          if (better(s, best_score_)) {
            best_ = current_;
            best_score_ = s;
            kicks_since_best_ = 0;
          }
          // Equal rings are accepted as the new base: a walk across a plateau of equal
          // bottlenecks is how the search gets past it.
          if (!has_base_ || !better(base_score_, s)) {
            if (!has_base_ || better(s, base_score_)) kicks_since_base_ = 0;
            base_ = current_;
            base_score_ = s;
            has_base_ = true;
          }
          stage_ = Stage::kKick;
          break;
        }
        case Stage::kKick: {
          // A double bridge needs four non-empty segments.
          if (n < 4) {
            exhausted_ = true;
            return;
          }
          if (kicks_since_best_ >= stall_kicks_max) return;
          if (kicks_since_base_ >= kRestartStallKicks) {
            if (!meter.take(n * n)) return;
            current_ = double_bridge(nearest_neighbour(g, static_cast<int>(draw(n))));
            has_base_ = false;
          } else {
            if (!meter.take(n)) return;
            // One double bridge changes only three edges of a directed ring: it is a
            // single segment exchange, which the descent would simply undo. Two in a
            // row change up to six edges, which no single move restores.
            current_ = double_bridge(double_bridge(base_));
          }
          ++kicks_since_base_;
          ++kicks_since_best_;
          stage_ = Stage::kDescend;
          break;
        }
      }
    }
  }

  const std::vector<int>& best() const { return best_; }
  const Score& best_score() const { return best_score_; }
  bool reached_local_optimum() const { return local_optimum_; }
  // Nothing is left to try (too few peers for a kick).
  bool exhausted() const { return exhausted_; }

 private:
  enum class Stage { kConstruct, kDescend, kKick };

  // Uniform enough in [0, bound); modulo keeps the sequence the same on every standard
  // library (the distributions are implementation-defined).
  std::size_t draw(std::size_t bound) { return static_cast<std::size_t>(rng_() % bound); }

  // A B C D -> A C B D, with three distinct random cut points.
  std::vector<int> double_bridge(const std::vector<int>& ring) {
    const std::size_t n = ring.size();
    std::array<std::size_t, 3> cut{};
    for (std::size_t k = 0; k < cut.size(); ++k) {
      bool fresh = false;
      while (!fresh) {
        cut[k] = 1 + draw(n - 1);
        fresh = std::find(cut.begin(), cut.begin() + static_cast<std::ptrdiff_t>(k), cut[k]) ==
                cut.begin() + static_cast<std::ptrdiff_t>(k);
      }
    }
    std::sort(cut.begin(), cut.end());
    const auto at = [&](std::size_t pos) { return ring.begin() + static_cast<std::ptrdiff_t>(pos); };
    std::vector<int> out(ring.begin(), at(cut[0]));
    out.insert(out.end(), at(cut[1]), at(cut[2]));
    out.insert(out.end(), at(cut[0]), at(cut[1]));
    out.insert(out.end(), at(cut[2]), ring.end());
    return out;
  }

  std::mt19937_64 rng_;
  Stage stage_ = Stage::kConstruct;
  std::size_t next_start_ = 1;  // start 0 is the constructor's
  LocalSearch search_;
  std::vector<int> current_;
  std::vector<int> base_;
  Score base_score_;
  bool has_base_ = false;
  std::vector<int> best_;
  Score best_score_;
  std::uint64_t kicks_since_base_ = 0;
  std::uint64_t kicks_since_best_ = 0;
  bool local_optimum_ = false;
  bool exhausted_ = false;
};

// ---------------------------------------------------------------- exact search
//
// Subsets are of the peers other than 0 (bit v-1 is peer v): 2^(n-1) of them. Each
// stage walks the subsets in increasing order (every subset after its own subsets),
// one subset per budget check, so that the search can stop at any subset and resume.

class Exact {
 public:
  explicit Exact(const Graph& g) : w_(sz(g.n) - 1), subsets_(std::uint32_t{1} << (g.n - 1)) {
    assert(g.n >= 2 && g.n <= kExactPeersMax);
    // Only levels some ring could reach are candidates (see Graph::reachable_levels).
    candidates_.assign(g.levels.begin(), g.levels.begin() + static_cast<std::ptrdiff_t>(g.reachable_levels));
    const auto checks = static_cast<std::uint64_t>(std::bit_width(candidates_.size()));
    bound_ = (checks * w_ + w_ * w_) * (subsets_ - 1);
    reach_.assign(subsets_, 0);
    hi_ = static_cast<std::ptrdiff_t>(candidates_.size()) - 1;
    if (lo_ < hi_) {
      begin_check(g);
    } else {
      begin_cost(g);
    }
  }

  // An upper bound on the steps run() takes in all.
  std::uint64_t bound() const { return bound_; }
  const std::vector<int>& ring() const { return ring_; }

  // Advances while the meter allows; true once finished (ring() is then optimal).
  bool run(const Graph& g, Meter& meter) {
    while (stage_ != Stage::kDone) {
      if (stage_ == Stage::kSearch) {
        for (; cursor_ < subsets_; ++cursor_) {
          if (!meter.take(w_)) return false;
          relax_reach(cursor_);
        }
        if ((reach_[subsets_ - 1] & to0_) != 0) {
          lo_ = mid_;
        } else {
          hi_ = mid_ - 1;
        }
        if (lo_ < hi_) {
          begin_check(g);
        } else {
          begin_cost(g);
        }
      } else {
        for (; cursor_ < subsets_; ++cursor_) {
          if (!meter.take(w_ * w_)) return false;
          relax_cost(g, cursor_);
        }
        finish(g);
      }
    }
    return true;
  }

 private:
  enum class Stage { kSearch, kCost, kDone };

  // The edges with a value of at least `threshold` (0: every edge, unknown ones too).
  void allow(const Graph& g, double threshold) {
    pred_.assign(w_, 0);
    from0_ = 0;
    to0_ = 0;
    for (std::size_t vi = 0; vi < w_; ++vi) {
      const int v = static_cast<int>(vi) + 1;
      const std::uint32_t bit = std::uint32_t{1} << vi;
      if (g.value(0, v) >= threshold) from0_ |= bit;
      if (g.value(v, 0) >= threshold) to0_ |= bit;
      for (std::size_t ui = 0; ui < w_; ++ui) {
        if (ui != vi && g.value(static_cast<int>(ui) + 1, v) >= threshold) pred_[vi] |= std::uint32_t{1} << ui;
      }
    }
  }

  void begin_check(const Graph& g) {
    mid_ = lo_ + (hi_ - lo_ + 1) / 2;
    allow(g, candidates_[static_cast<std::size_t>(mid_)]);
    cursor_ = 1;
    stage_ = Stage::kSearch;
  }

  // reach_[m] bit v-1: some path from 0 through exactly the peers of m ends at v.
  void relax_reach(std::uint32_t m) {
    std::uint32_t r = 0;
    for (std::uint32_t bits = m; bits != 0; bits &= bits - 1) {
      const auto vi = static_cast<std::size_t>(std::countr_zero(bits));
      const std::uint32_t bit = std::uint32_t{1} << vi;
      const std::uint32_t rest = m ^ bit;
      const bool ok = rest == 0 ? (from0_ & bit) != 0 : (reach_[rest] & pred_[vi]) != 0;
      if (ok) r |= bit;
    }
    reach_[m] = r;
  }

  void begin_cost(const Graph& g) {
    const double b = lo_ >= 0 ? candidates_[static_cast<std::size_t>(lo_)] : 0.0;
    // Rings within the tolerance of the best bottleneck are equals; the per-byte time
    // decides among them.
    allow(g, b * (1.0 - kBottleneckTolerance));
    reach_.clear();
    reach_.shrink_to_fit();
    const std::size_t states = std::size_t{subsets_} * w_;
    time_.assign(states, 0.0);
    unknown_.assign(states, kUnreachable);
    parent_.assign(states, 0);
    cursor_ = 1;
    stage_ = Stage::kCost;
  }

  // Held-Karp: the best (fewest unknown edges, then least time) path from 0 through
  // exactly the peers of m, ending at each v of m; parent_ is the peer before v.
  void relax_cost(const Graph& g, std::uint32_t m) {
    for (std::uint32_t bits = m; bits != 0; bits &= bits - 1) {
      const auto vi = static_cast<std::size_t>(std::countr_zero(bits));
      const int v = static_cast<int>(vi) + 1;
      const std::uint32_t bit = std::uint32_t{1} << vi;
      const std::uint32_t rest = m ^ bit;
      std::uint8_t best_unknown = kUnreachable;
      double best_time = kInf;
      std::uint8_t best_parent = 0;
      if (rest == 0) {
        if ((from0_ & bit) != 0) {
          best_unknown = g.value(0, v) > 0 ? 0 : 1;
          best_time = g.time(0, v);
        }
      } else {
        for (std::uint32_t us = rest & pred_[vi]; us != 0; us &= us - 1) {
          const auto ui = static_cast<std::size_t>(std::countr_zero(us));
          const std::size_t from = std::size_t{rest} * w_ + ui;
          if (unknown_[from] == kUnreachable) continue;
          const int u = static_cast<int>(ui) + 1;
          const auto unknown = static_cast<std::uint8_t>(unknown_[from] + (g.value(u, v) > 0 ? 0 : 1));
          const double time = time_[from] + g.time(u, v);
          if (unknown < best_unknown || (unknown == best_unknown && time < best_time)) {
            best_unknown = unknown;
            best_time = time;
            best_parent = static_cast<std::uint8_t>(u);
          }
        }
      }
      const std::size_t at = std::size_t{m} * w_ + vi;
      unknown_[at] = best_unknown;
      time_[at] = best_time;
      parent_[at] = best_parent;
    }
  }

  void finish(const Graph& g) {
    const std::uint32_t full = subsets_ - 1;
    std::size_t last = w_;
    std::uint8_t best_unknown = kUnreachable;
    double best_time = kInf;
    for (std::size_t vi = 0; vi < w_; ++vi) {
      const std::size_t at = std::size_t{full} * w_ + vi;
      if ((to0_ & (std::uint32_t{1} << vi)) == 0 || unknown_[at] == kUnreachable) continue;
      const int v = static_cast<int>(vi) + 1;
      const auto unknown = static_cast<std::uint8_t>(unknown_[at] + (g.value(v, 0) > 0 ? 0 : 1));
      const double time = time_[at] + g.time(v, 0);
      if (unknown < best_unknown || (unknown == best_unknown && time < best_time)) {
        best_unknown = unknown;
        best_time = time;
        last = vi;
      }
    }
    // The threshold search proved a cycle at this bottleneck, so one was found.
    assert(last < w_);
    std::vector<int> reversed;
    std::uint32_t m = full;
    std::size_t vi = last;
    while (true) {
      reversed.push_back(static_cast<int>(vi) + 1);
      const std::uint8_t before = parent_[std::size_t{m} * w_ + vi];
      m ^= std::uint32_t{1} << vi;
      if (before == 0) break;
      vi = std::size_t{before} - 1;
    }
    ring_.assign(1, 0);
    ring_.insert(ring_.end(), reversed.rbegin(), reversed.rend());
    time_ = {};
    unknown_ = {};
    parent_ = {};
    stage_ = Stage::kDone;
  }

  std::size_t w_;           // n - 1
  std::uint32_t subsets_;   // 2^(n-1)
  std::vector<double> candidates_;
  std::uint64_t bound_ = 0;
  // The binary search: the largest feasible candidate index lies in [lo_, hi_]
  // (-1: none, the bottleneck is 0); mid_ is the one being checked.
  std::ptrdiff_t lo_ = -1;
  std::ptrdiff_t hi_ = -1;
  std::ptrdiff_t mid_ = -1;
  Stage stage_ = Stage::kSearch;
  std::uint32_t cursor_ = 1;
  std::vector<std::uint32_t> pred_;  // pred_[v-1]: the u (bit u-1) with u -> v allowed
  std::uint32_t from0_ = 0;          // the v with 0 -> v allowed
  std::uint32_t to0_ = 0;            // the v with v -> 0 allowed
  std::vector<std::uint32_t> reach_;
  std::vector<double> time_;
  std::vector<std::uint8_t> unknown_;
  std::vector<std::uint8_t> parent_;
  std::vector<int> ring_;
};

std::vector<int> identity_ring(int n) {
  std::vector<int> ring(sz(n));
  std::iota(ring.begin(), ring.end(), 0);
  return ring;
}

// ---------------------------------------------------------------- bounds

// Edges at or above a threshold, as adjacency lists both ways.
struct Subgraph {
  Subgraph(const Graph& g, double threshold) : out(sz(g.n)), in(sz(g.n)) {
    for (int i = 0; i < g.n; ++i) {
      for (int j = 0; j < g.n; ++j) {
        if (i != j && g.value(i, j) > 0 && g.value(i, j) >= threshold) {
          out[sz(i)].push_back(j);
          in[sz(j)].push_back(i);
        }
      }
    }
  }
  std::vector<std::vector<int>> out;
  std::vector<std::vector<int>> in;
};

// Whether every peer reaches peer 0 and is reached from it.
bool strongly_connected(const Subgraph& s) {
  const auto reaches_all = [](const std::vector<std::vector<int>>& adj) {
    std::vector<char> seen(adj.size(), 0);
    std::vector<int> stack{0};
    seen[0] = 1;
    std::size_t count = 1;
    while (!stack.empty()) {
      const int v = stack.back();
      stack.pop_back();
      for (const int u : adj[sz(v)]) {
        if (seen[sz(u)] == 0) {
          seen[sz(u)] = 1;
          ++count;
          stack.push_back(u);
        }
      }
    }
    return count == adj.size();
  };
  return reaches_all(s.out) && reaches_all(s.in);
}

// Whether the edges hold a cycle cover (every peer one outgoing and one incoming edge):
// a perfect bipartite matching of senders to receivers, by Hopcroft-Karp.
bool has_cycle_cover(const Subgraph& s) {
  const std::size_t n = s.out.size();
  constexpr int kFree = -1;
  std::vector<int> match_out(n, kFree);  // sender -> receiver
  std::vector<int> match_in(n, kFree);   // receiver -> sender
  std::vector<int> dist(n);
  std::vector<int> queue;
  const auto layer = [&] {
    queue.clear();
    bool found = false;
    for (std::size_t v = 0; v < n; ++v) {
      dist[v] = match_out[v] == kFree ? 0 : -1;
      if (match_out[v] == kFree) queue.push_back(static_cast<int>(v));
    }
    for (std::size_t head = 0; head < queue.size(); ++head) {
      const int v = queue[head];
      for (const int u : s.out[sz(v)]) {
        const int w = match_in[sz(u)];
        if (w == kFree) {
          found = true;
        } else if (dist[sz(w)] < 0) {
          dist[sz(w)] = dist[sz(v)] + 1;
          queue.push_back(w);
        }
      }
    }
    return found;
  };
  // Iterative depth-first augmentation along the layers (no recursion n deep).
  std::vector<std::size_t> next(n);
  std::vector<int> path;
  const auto augment = [&](int root) {
    path.assign(1, root);
    next[sz(root)] = 0;
    while (!path.empty()) {
      const int v = path.back();
      auto& k = next[sz(v)];
      if (k == s.out[sz(v)].size()) {
        dist[sz(v)] = -1;  // a dead end for this phase
        path.pop_back();
        continue;
      }
      const int u = s.out[sz(v)][k++];
      const int w = match_in[sz(u)];
      if (w == kFree) {
        // Flip the path: each sender on it takes the receiver it went through.
        int receiver = u;
        for (auto it = path.rbegin(); it != path.rend(); ++it) {
          const int sender = *it;
          const int previous = match_out[sz(sender)];
          match_out[sz(sender)] = receiver;
          match_in[sz(receiver)] = sender;
          receiver = previous;
        }
        return true;
      }
      if (dist[sz(w)] == dist[sz(v)] + 1) {
        next[sz(w)] = 0;
        path.push_back(w);
      }
    }
    return false;
  };
  std::size_t matched = 0;
  while (layer()) {
    for (std::size_t v = 0; v < n; ++v) {
      if (match_out[v] == kFree && augment(static_cast<int>(v))) ++matched;
    }
  }
  return matched == n;
}

}  // namespace

// ---------------------------------------------------------------- public functions

bool same_bottleneck(double a, double b) {
  if (a == b) return true;
  if (std::isinf(a) || std::isinf(b)) return false;
  return std::fabs(a - b) <= kBottleneckTolerance * std::max(std::fabs(a), std::fabs(b));
}

double ring_bottleneck(const Matrix& bw, const std::vector<int>& ring) {
  return score_with(ring, [&bw](int a, int b) { return matrix_edge(bw, a, b); }).bottleneck;
}

double ring_cost(const Matrix& bw, const std::vector<int>& ring) {
  const Score s = score_with(ring, [&bw](int a, int b) { return matrix_edge(bw, a, b); });
  return s.unknown > 0 ? kInf : s.cost;
}

bool is_valid_ring(const std::vector<int>& ring, int n) {
  if (n < 0 || ring.size() != sz(n)) return false;
  if (n > 0 && ring.front() != 0) return false;
  std::vector<char> seen(sz(n), 0);
  for (int v : ring) {
    if (v < 0 || v >= n || seen[sz(v)] != 0) return false;
    seen[sz(v)] = 1;
  }
  return true;
}

bool better_ring(const Matrix& bw, const std::vector<int>& a, const std::vector<int>& b) {
  const auto edge = [&bw](int x, int y) { return matrix_edge(bw, x, y); };
  return better(score_with(a, edge), score_with(b, edge));
}

std::vector<int> nearest_neighbour_ring(const Matrix& bw, int start) {
  const Graph g(bw);
  if (start < 0 || start >= g.n) start = 0;
  return nearest_neighbour(g, start);
}

std::uint64_t exact_step_bound(int n) {
  if (n <= 2) return 0;
  if (n > kExactPeersMax) return std::numeric_limits<std::uint64_t>::max();
  const auto w = static_cast<std::uint64_t>(n - 1);
  const auto checks = static_cast<std::uint64_t>(std::bit_width(static_cast<std::uint64_t>(n) * w));
  return (checks * w + w * w) * ((std::uint64_t{1} << w) - 1);
}

Solution solve_ring(const Matrix& bw, Budget budget) {
  const Graph g(bw);
  // One or two peers: a single ring exists.
  if (g.n <= 2) return make_solution(g, identity_ring(g.n), true, 0);
  Meter meter{0, budget.steps_max};
  if (g.n <= kExactPeersMax) {
    Exact exact(g);
    // Started only when it can finish: a partial exact search gives no ring at all.
    if (exact.bound() <= budget.steps_max && exact.run(g, meter)) {
      return make_solution(g, exact.ring(), true, meter.used);
    }
  }
  Heuristic heuristic(g, kSolveSeed);
  heuristic.run(g, meter, kSolveStallKicks);
  return make_solution(g, heuristic.best(), false, meter.used);
}

double bottleneck_bound(const Matrix& bw) {
  const Graph g(bw);
  if (g.n <= 1) return kInf;
  // Both properties only get lost as the threshold rises: binary search over the
  // distinct values for the last one that has them.
  std::ptrdiff_t lo = -1;  // the highest level known to pass (-1: none yet)
  auto hi = static_cast<std::ptrdiff_t>(g.levels.size()) - 1;
  while (lo < hi) {
    const std::ptrdiff_t mid = lo + (hi - lo + 1) / 2;
    const Subgraph s(g, g.levels[static_cast<std::size_t>(mid)]);
    if (strongly_connected(s) && has_cycle_cover(s)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo >= 0 ? g.levels[static_cast<std::size_t>(lo)] : 0.0;
}

double cost_bound(const Matrix& bw, double floor) {
  const Graph g(bw);
  if (g.n <= 1) return 0;
  const double threshold = floor * (1.0 - kBottleneckTolerance);
  const auto allowed = [&](int i, int j) { return i != j && g.value(i, j) > 0 && g.value(i, j) >= threshold; };
  // The least-cost assignment of a receiver to every sender (Hungarian method with
  // potentials, O(n^3)); a forbidden edge costs more than any n allowed ones together.
  double most = 0;
  for (int i = 0; i < g.n; ++i) {
    for (int j = 0; j < g.n; ++j) {
      if (allowed(i, j)) most = std::max(most, g.time(i, j));
    }
  }
  const double forbidden = (most + 1.0) * static_cast<double>(g.n + 1) * 4.0;
  const std::size_t n = sz(g.n);
  // 1-based rows and columns; column 0 is the virtual start of each augmentation.
  std::vector<double> u(n + 1, 0), v(n + 1, 0), way_min(n + 1);
  std::vector<std::size_t> owner(n + 1, 0), way(n + 1, 0);
  std::vector<char> used(n + 1);
  for (std::size_t row = 1; row <= n; ++row) {
    owner[0] = row;
    std::size_t col0 = 0;
    std::fill(way_min.begin(), way_min.end(), kInf);
    std::fill(used.begin(), used.end(), 0);
    do {
      used[col0] = 1;
      const std::size_t r = owner[col0];
      double delta = kInf;
      std::size_t col1 = 0;
      for (std::size_t c = 1; c <= n; ++c) {
        if (used[c] != 0) continue;
        const int i = static_cast<int>(r) - 1;
        const int j = static_cast<int>(c) - 1;
        const double cost = (allowed(i, j) ? g.time(i, j) : forbidden) - u[r] - v[c];
        if (cost < way_min[c]) {
          way_min[c] = cost;
          way[c] = col0;
        }
        if (way_min[c] < delta) {
          delta = way_min[c];
          col1 = c;
        }
      }
      for (std::size_t c = 0; c <= n; ++c) {
        if (used[c] != 0) {
          u[owner[c]] += delta;
          v[c] -= delta;
        } else {
          way_min[c] -= delta;
        }
      }
      col0 = col1;
    } while (owner[col0] != 0);
    do {
      const std::size_t col1 = way[col0];
      owner[col0] = owner[col1];
      col0 = col1;
    } while (col0 != 0);
  }
  double total = 0;
  for (std::size_t c = 1; c <= n; ++c) {
    const int i = static_cast<int>(owner[c]) - 1;
    const int j = static_cast<int>(c) - 1;
    if (!allowed(i, j)) return kInf;
    total += g.time(i, j);
  }
  return total;
}

// ---------------------------------------------------------------- Improver

struct Improver::State {
  State(const Matrix& bw, std::uint64_t seed) : graph(bw), heuristic(graph, seed) {
    if (graph.n <= 2) {
      best = make_solution(graph, identity_ring(graph.n), true, 0);
      done = true;
      return;
    }
    best = make_solution(graph, heuristic.best(), false, 0);
    if (graph.n <= kExactPeersMax) exact.emplace(graph);
  }

  void adopt_heuristic(std::uint64_t now) {
    if (better(heuristic.best_score(), graph.score(best.ring))) {
      best = make_solution(graph, heuristic.best(), false, now);
    }
  }

  Graph graph;
  Heuristic heuristic;
  std::optional<Exact> exact;
  Solution best;
  std::uint64_t steps = 0;
  std::uint64_t credit = 0;  // see Meter
  bool done = false;
};

Improver::Improver(Matrix bw, std::uint64_t seed) : state_(std::make_unique<State>(bw, seed)) {}
Improver::~Improver() = default;
Improver::Improver(Improver&&) noexcept = default;
Improver& Improver::operator=(Improver&&) noexcept = default;

const Solution& Improver::step(Budget budget) {
  State& s = *state_;
  if (s.done) return s.best;
  Meter meter{0, budget.steps_max, &s.credit};
  if (s.exact) {
    // One local search first, so that a good ring is there while the exact search runs.
    if (!s.heuristic.reached_local_optimum()) s.heuristic.run(s.graph, meter, 0);
    s.adopt_heuristic(s.steps + meter.used);
    if (s.exact->run(s.graph, meter)) {
      Solution exact = make_solution(s.graph, s.exact->ring(), true, s.steps + meter.used);
      // The heuristic ring can only win within the bottleneck tolerance; it is then
      // just as optimal.
      if (better(s.graph.score(s.best.ring), s.graph.score(exact.ring))) {
        s.best.optimal = true;
      } else {
        s.best = std::move(exact);
      }
      s.exact.reset();
      s.done = true;
    }
  } else {
    s.heuristic.run(s.graph, meter, kNoStallLimit);
    s.adopt_heuristic(s.steps + meter.used);
    if (s.heuristic.exhausted()) s.done = true;
  }
  s.steps += meter.used;
  return s.best;
}

const Solution& Improver::best() const { return state_->best; }
bool Improver::done() const { return state_->done; }
std::uint64_t Improver::steps() const { return state_->steps; }

}  // namespace lockstep::topo
