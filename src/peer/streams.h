// How many connections (streams) this peer stripes one all-reduce over, towards one next
// peer: a pure rule, fed with the sending rate of finished attempts (no clock, no IO).
//
// On a long or lossy path one TCP flow rarely reaches the link's speed (its window
// grows slowly and halves at each loss); several flows, each with its own window, get
// more of it. On a short clean path (loopback, a LAN) they only cost system calls. So
// the count is measured, not guessed, per next peer:
//  - it starts at 1 and doubles (a probe) once kSamples attempts at the current count
//    have given its rate;
//  - a probe is kept only if its rate beats the rate before it by kGainMin (25 %);
//    otherwise the count goes back and holds for kHoldSamples attempts;
//  - after the hold, the count is measured again and the next probe goes the other way
//    first: half the streams, kept if they do at least kKeepMin (90 %) as well (fewer
//    connections doing the same work are better), else back and a probe upwards. So the
//    count follows a path whose loss or latency changes, in both directions.
// Only attempts that send at least kSampleBytesMin count (small ones say little about
// the path), and a count is never above `max`. A fixed count (the communicator option
// p2p_streams) switches the rule off. Every concurrent all-reduce to the same peer uses
// the same count, so that they share the link fairly.
#pragma once

#include <cstddef>
#include <cstdint>

namespace lockstep::peer {

class StreamTuner {
 public:
  static constexpr std::uint32_t kSamples = 2;
  static constexpr std::uint32_t kHoldSamples = 32;
  static constexpr double kGainMin = 1.25;
  static constexpr double kKeepMin = 0.9;
  static constexpr std::uint64_t kSampleBytesMin = 4u << 20;

  // fixed: 0 adapts, else that count; max: the most streams (at least 1).
  StreamTuner(std::uint32_t fixed, std::uint32_t max);

  std::uint32_t streams() const { return streams_; }
  // A successful attempt that ran with `streams` streams sent `bytes` in `micros`.
  // Samples of another count than the current one (an attempt that began before the
  // last change) are ignored.
  void on_attempt(std::uint32_t streams, std::uint64_t bytes, std::uint64_t micros);

 private:
  enum class Phase { kMeasure, kProbeUp, kProbeDown, kHold };
  void finish_measure(double rate);
  void start(Phase phase, std::uint32_t streams);

  std::uint32_t max_;
  bool fixed_;
  std::uint32_t streams_ = 1;
  Phase phase_ = Phase::kMeasure;
  std::uint32_t samples_ = 0;
  double sum_ = 0;             // rates of this phase's samples, bytes per microsecond
  double base_rate_ = 0;       // the rate at base_streams_, before the probe
  std::uint32_t base_streams_ = 1;
  bool down_first_ = false;    // after a hold, probe downwards first
};

}  // namespace lockstep::peer
