#include "peer/streams.h"

#include <algorithm>

namespace lockstep::peer {

StreamTuner::StreamTuner(std::uint32_t fixed, std::uint32_t max)
    : max_(std::max<std::uint32_t>(1, max)), fixed_(fixed != 0), streams_(fixed != 0 ? std::min(fixed, max_) : 1) {}

void StreamTuner::start(Phase phase, std::uint32_t streams) {
  phase_ = phase;
  streams_ = streams;
  samples_ = 0;
  sum_ = 0;
}

void StreamTuner::on_attempt(std::uint32_t streams, std::uint64_t bytes, std::uint64_t micros) {
  if (fixed_ || streams != streams_ || bytes < kSampleBytesMin || micros == 0) return;
  ++samples_;
  sum_ += static_cast<double>(bytes) / static_cast<double>(micros);
  if (phase_ == Phase::kHold) {
    if (samples_ >= kHoldSamples) {
      down_first_ = true;
      start(Phase::kMeasure, streams_);
    }
    return;
  }
  if (samples_ < kSamples) return;
  finish_measure(sum_ / samples_);
}

void StreamTuner::finish_measure(double rate) {
  switch (phase_) {
    case Phase::kMeasure:
      base_rate_ = rate;
      base_streams_ = streams_;
      if (down_first_ && streams_ > 1) {
        start(Phase::kProbeDown, streams_ / 2);
      } else if (streams_ < max_) {
        start(Phase::kProbeUp, std::min(max_, streams_ * 2));
      } else {
        start(Phase::kHold, streams_);
      }
      down_first_ = false;
      return;
    case Phase::kProbeUp:
      if (rate >= kGainMin * base_rate_) {
        // It helped: keep it and try more.
        base_rate_ = rate;
        base_streams_ = streams_;
        if (streams_ < max_) start(Phase::kProbeUp, std::min(max_, streams_ * 2));
        else start(Phase::kHold, streams_);
      } else {
        start(Phase::kHold, base_streams_);
      }
      return;
    case Phase::kProbeDown:
      if (rate >= kKeepMin * base_rate_) {
        // As good with fewer: keep it and try fewer still.
        base_rate_ = rate;
        base_streams_ = streams_;
        if (streams_ > 1) start(Phase::kProbeDown, streams_ / 2);
        else start(Phase::kHold, streams_);
      } else if (base_streams_ < max_) {
        // Fewer lost: back, and see whether more would help.
        start(Phase::kProbeUp, std::min(max_, base_streams_ * 2));
      } else {
        start(Phase::kHold, base_streams_);
      }
      return;
    case Phase::kHold: return;
  }
}

}  // namespace lockstep::peer
