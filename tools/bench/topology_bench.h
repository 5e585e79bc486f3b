// lockstep-bench topology: the ring solver on large groups, against the bounds that
// prove how good its rings are (src/topology/solver.h). In this process; no master or
// workers. See main.cpp for the command line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lockstep::bench {

struct TopologySettings {
  std::vector<int> peers{100, 1000};
  std::vector<std::uint64_t> seeds{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  // levels: every ordered pair drawn from {25, 50, 100, 200, 400} Mbit/s; uniform: drawn
  // from [25, 400) Mbit/s, every value distinct as measurements are; regions: 8 regions,
  // 1-10 Gbit/s within one, a drawn rate per ordered pair of regions (25-400 Mbit/s)
  // +-10 % per pair of peers between them.
  std::vector<std::string> kinds{"levels", "uniform", "regions"};
  std::uint64_t steps = 0;             // 0: the master's default budget per optimization
  std::uint64_t background_steps = 0;  // 0: no background search after the solve
};

int run_topology(const TopologySettings& s);

}  // namespace lockstep::bench
