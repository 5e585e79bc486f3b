// All-reduce with real processes while peers die: a peer SIGKILLed or SIGSTOPped at
// a random moment of a 16 MiB all-reduce, on one connection per hop, striped over
// four, and by doubling among five (a fold, pair exchanges, the result given back).
// Every survivor gets the same outcome; on failure its buffer is exactly as before; the
// retry with the survivors is correct.
#include "e2e.h"

#include <lockstep/lockstep.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <random>

namespace lockstep::e2e {
namespace {

constexpr const char* kCount = "4194304";  // f32 elements: 16 MiB

struct Run {
  std::unique_ptr<Master> master;
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<Peer*> members;
};

// streams: the peers' p2p_streams (0: adaptive); algorithm: their all-reduce algorithm
// (empty: auto).
Run start(std::size_t n, std::vector<std::string> master_flags, std::uint32_t streams,
          const std::string& algorithm = {}) {
  Run run;
  run.master = std::make_unique<Master>(std::move(master_flags));
  std::vector<Peer*> newcomers;
  for (std::size_t i = 0; i < n; ++i) {
    std::vector<std::string> flags{"--streams", std::to_string(streams)};
    if (!algorithm.empty()) flags.insert(flags.end(), {"--algorithm", algorithm});
    run.peers.push_back(std::make_unique<Peer>(*run.master, numbered("r", i), 0, flags));
    newcomers.push_back(run.peers.back().get());
  }
  admit(run.members, newcomers);
  return run;
}

// Fill of peer i is i+1, so a sum over any set of peers is exact and identifies it.
std::string command(std::size_t i, std::uint64_t tag, bool out_of_place) {
  return "allreduce " + std::string(kCount) + " " + std::to_string(tag) + " " + std::to_string(i + 1) +
         (out_of_place ? " oop" : "");
}

// Returns true if the all-reduce in flight failed (the victim died mid-operation).
bool check_kill_during_all_reduce(int signo, std::uint32_t seed, std::uint32_t streams, const std::string& algorithm,
                                  std::size_t world) {
  SCOPED_TRACE("signal " + std::to_string(signo) + " seed " + std::to_string(seed) + " streams " +
               std::to_string(streams) + " algorithm " + algorithm + " world " + std::to_string(world));
  std::mt19937 random(seed);
  auto run = start(world, {"--heartbeat-timeout-ms", std::to_string(scaled(1500ms).count())}, streams, algorithm);
  EXPECT_EQ(run.members.size(), world);
  if (run.members.size() != world) return false;
  const bool oop = seed % 2 == 1;
  const std::size_t victim = random() % world;
  const double everyone = static_cast<double>(world * (world + 1) / 2);
  // Warm up: one successful all-reduce with everyone, timed as this process sees it
  // (the commands' way to the peers included), as the kill below is timed.
  const auto warmup_start = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < world; ++i) run.members[i]->send(command(i, 1, oop));
  for (auto* p : run.members) {
    auto r = p->reply();
    EXPECT_EQ(code(r), 0) << r.dump();
    if (code(r) != 0) return false;
    EXPECT_EQ(r["value"].get<double>(), everyone);
    EXPECT_EQ(r["streams"].get<std::uint32_t>(), streams) << "the all-reduce was not striped as asked: " << r.dump();
  }
  const double warmup_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - warmup_start).count();
  // The victim dies at a random moment of the next one (timed from the first).
  for (std::size_t i = 0; i < world; ++i) run.members[i]->send(command(i, 2, oop));
  const double fraction = 0.3 + 0.65 * static_cast<double>(random() % 1000) / 1000.0;
  std::this_thread::sleep_for(std::chrono::microseconds(static_cast<long>(fraction * warmup_ms * 1000.0)));
  run.members[victim]->proc().signal(signo);
  std::vector<Peer*> survivors;
  double survivors_sum = 0;
  for (std::size_t i = 0; i < world; ++i) {
    if (i == victim) continue;
    survivors.push_back(run.members[i]);
    survivors_sum += static_cast<double>(i + 1);
  }
  std::vector<json> outcome;
  for (auto* p : survivors) outcome.push_back(p->reply(scaled(30s)));
  for (const auto& r : outcome) {
    EXPECT_TRUE(r.is_object()) << "a survivor did not answer";
    if (!r.is_object()) return false;
    EXPECT_EQ(code(r), code(outcome[0])) << "survivors got different outcomes: " << r.dump();
    if (code(r) == 0) {
      // Either the victim finished its part first (all of them), or it died before it
      // voted to initiate, and the survivors did it alone.
      const auto took_part = r["world"].get<std::size_t>();
      EXPECT_TRUE(took_part == world - 1 || took_part == world) << r.dump();
      EXPECT_EQ(r["value"].get<double>(), took_part == world ? everyone : survivors_sum) << r.dump();
      EXPECT_EQ(r["world"], outcome[0]["world"]) << "survivors disagree on who took part";
    } else {
      EXPECT_EQ(code(r), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << r.dump();
      EXPECT_TRUE(r["unchanged"].get<bool>()) << "a failed all-reduce modified the buffer: " << r.dump();
    }
  }
  if (code(outcome[0]) != 0) {
    // The same call again, with the survivors.
    for (std::size_t k = 0, i = 0; i < world; ++i) {
      if (i == victim) continue;
      survivors[k++]->send(command(i, 2, oop));
    }
    for (auto* p : survivors) {
      auto r = p->reply(scaled(30s));
      EXPECT_EQ(code(r), 0) << r.dump();
      if (code(r) != 0) return true;
      EXPECT_EQ(r["world"].get<std::size_t>(), world - 1);
      EXPECT_EQ(r["value"].get<double>(), survivors_sum) << r.dump();
      EXPECT_TRUE(r["uniform"].get<bool>());
    }
  }
  if (signo == SIGSTOP) run.members[victim]->proc().signal(SIGCONT);
  return code(outcome[0]) != 0;
}

// Runs trials until at least `min_trials` ran and the failure path was taken at least
// once (a victim stopped before it voted is simply left out, which proves less), up
// to max_trials. Returns the number of all-reduces that failed mid-flight.
int run_trials(int signo, std::uint32_t first_seed, int min_trials, int max_trials, std::uint32_t streams = 1,
               const std::string& algorithm = {}, std::size_t world = 4) {
  // Under a sanitizer (a scaled build) the trials keep the same paths under its eye but
  // fewer of them run (CI time); the plain build runs them all.
  if (kTimeScale > 1) min_trials = std::min(min_trials, 3);
  int failed_in_flight = 0;
  int trials = 0;
  for (std::uint32_t seed = first_seed; trials < max_trials && (trials < min_trials || failed_in_flight == 0);
       ++seed, ++trials) {
    failed_in_flight += check_kill_during_all_reduce(signo, seed, streams, algorithm, world) ? 1 : 0;
    if (::testing::Test::HasFailure()) break;
  }
  std::printf("all-reduces failed mid-flight: %d of %d\n", failed_in_flight, trials);
  return failed_in_flight;
}

TEST(AllReduceFailure, PeerKilledAtRandomMoments) {
  // Kills land within the measured duration of an all-reduce: the failure path must
  // have been taken (the other outcomes are legal but prove less).
  EXPECT_GE(run_trials(SIGKILL, 1, 8, 24), 1);
}

TEST(AllReduceFailure, PeerStoppedAtRandomMoments) { EXPECT_GE(run_trials(SIGSTOP, 11, 4, 16), 1); }

// The same, with every hop striped over four connections.
TEST(AllReduceFailure, StripedPeerKilledAtRandomMoments) { EXPECT_GE(run_trials(SIGKILL, 101, 3, 24, 4), 1); }
TEST(AllReduceFailure, StripedPeerStoppedAtRandomMoments) { EXPECT_GE(run_trials(SIGSTOP, 111, 3, 24, 4), 1); }

// The same by doubling among five peers (one folds into another, four exchange in
// pairs, the fifth gets the result back).
TEST(AllReduceFailure, DoublingPeerKilledAtRandomMoments) {
  EXPECT_GE(run_trials(SIGKILL, 201, 3, 24, 1, "doubling", 5), 1);
}
TEST(AllReduceFailure, DoublingPeerStoppedAtRandomMoments) {
  EXPECT_GE(run_trials(SIGSTOP, 211, 3, 24, 1, "doubling", 5), 1);
}

// Doubling adds in another order than the ring: every peer must still end with the
// same bits (sums of non-integers, so any difference in order would show), forced and
// chosen by auto (a small all-reduce among five), out of place and in place.
TEST(AllReduceDoubling, ResultsAreBitIdenticalOnEveryPeer) {
  for (const std::string algorithm : {"doubling", "auto"}) {
    SCOPED_TRACE(algorithm);
    auto run = start(5, {}, 1, algorithm);
    ASSERT_EQ(run.members.size(), 5u);
    std::uint64_t tag = 1;
    for (const char* count : {"20000", "4194304"}) {  // 80 KiB (auto: doubling), 16 MiB (auto: the ring)
      for (const char* place : {"oop", "inplace"}) {
        for (std::size_t i = 0; i < 5; ++i) {
          run.members[i]->send("allreduce " + std::string(count) + " " + std::to_string(tag) + " " +
                               std::to_string(i + 1) + " " + place + " none ramp");
        }
        ++tag;
        std::string digest;
        for (auto* p : run.members) {
          auto r = p->reply(scaled(30s));
          ASSERT_EQ(code(r), 0) << r.dump();
          EXPECT_NEAR(r["value"].get<double>(), 15.0, 1e-3) << r.dump();  // element 0: the fills' sum
          if (digest.empty()) digest = r["digest"].get<std::string>();
          EXPECT_EQ(r["digest"].get<std::string>(), digest) << "peers ended with different bits: " << r.dump();
        }
      }
    }
  }
}

// Peers that choose differently are told so at the vote, not left to a ring that never
// forms: the descriptors differ, and the collective fails for all with OPERATION_MISMATCH.
TEST(AllReduceDoubling, PeersThatChooseDifferentlyGetAMismatch) {
  lockstep::e2e::Run run;
  run.master = std::make_unique<Master>(std::vector<std::string>{});
  std::vector<Peer*> newcomers;
  for (std::size_t i = 0; i < 4; ++i) {
    const std::vector<std::string> flags{"--algorithm", i == 0 ? "ring" : "doubling"};
    run.peers.push_back(std::make_unique<Peer>(*run.master, numbered("m", i), 0, flags));
    newcomers.push_back(run.peers.back().get());
  }
  admit(run.members, newcomers);
  ASSERT_EQ(run.members.size(), 4u);
  for (std::size_t i = 0; i < 4; ++i) run.members[i]->send(command(i, 1, false));
  for (auto* p : run.members) {
    auto r = p->reply(scaled(30s));
    EXPECT_EQ(code(r), LOCKSTEP_STATUS_OPERATION_MISMATCH) << r.dump();
    EXPECT_TRUE(r["unchanged"].get<bool>()) << r.dump();
  }
}

}  // namespace
}  // namespace lockstep::e2e
