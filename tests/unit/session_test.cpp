// peer::Session with injected time: heartbeats and the silence check, what each of the
// master's messages means (Goodbye, routing by tag, the slots' turns, the mailbox and
// its bound, the establishment's cancellation, pair keys), the sticky first fatal status
// and the forward-only lifecycle. Links lockstep_session only: no Asio, no threads.
#include "common/limits.h"
#include "peer/session.h"
#include "protocol/codec.h"

#include <gtest/gtest.h>

#include <chrono>
#include <span>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace lockstep::peer {
namespace {

namespace p = lockstep::proto;
using std::chrono::milliseconds;
using State = Session::State;
using Turn = Session::Turn;

// An arbitrary origin: the session never reads a clock, so any time point will do.
const Session::Time kT0 = Session::Time{} + std::chrono::hours(1);
Session::Time at(std::int64_t ms) { return kT0 + milliseconds(ms); }

template <typename T>
std::vector<T> all_of(const Commands& commands) {
  std::vector<T> out;
  for (const auto& c : commands) {
    if (const auto* t = std::get_if<T>(&c)) out.push_back(*t);
  }
  return out;
}

// The heartbeat frame the session sends.
bool is_heartbeat(const cmd::SendFrame& send) { return send.frame == p::encode_frame(p::Heartbeat{}); }

// A session attached at kT0 with this heartbeat timeout.
Session attached(std::uint32_t heartbeat_timeout_ms, bool learns_pair_keys = false) {
  Session s(learns_pair_keys);
  s.set_identity(PeerId{1, 2});
  const Commands c = s.attach(kT0, heartbeat_timeout_ms);
  EXPECT_EQ(s.state(), State::kConnected);
  EXPECT_EQ(c.size(), 1u);
  return s;
}

p::MemberInfo member(std::uint64_t lo, std::uint8_t key_byte) {
  p::MemberInfo m;
  m.id = PeerId{7, lo};
  m.key = std::vector<std::uint8_t>(32, key_byte);
  return m;
}

TEST(SessionTest, HeartbeatsEveryQuarterOfTheTimeout) {
  Session s(false);
  const Commands first = s.attach(kT0, 400);
  ASSERT_EQ(all_of<cmd::ArmTimer>(first).size(), 1u);
  EXPECT_EQ(all_of<cmd::ArmTimer>(first)[0].at, at(100));
  EXPECT_TRUE(all_of<cmd::SendFrame>(first).empty());

  // Each tick sends one heartbeat and arms the next a quarter of the timeout later,
  // counted from when the tick ran.
  for (std::int64_t tick : {100, 203, 305}) {
    const Commands c = s.on_message(at(tick - 1), p::HeartbeatAck{});
    EXPECT_TRUE(c.empty());
    const Commands t = s.on_timer(at(tick));
    ASSERT_EQ(all_of<cmd::SendFrame>(t).size(), 1u) << tick;
    EXPECT_TRUE(is_heartbeat(all_of<cmd::SendFrame>(t)[0]));
    ASSERT_EQ(all_of<cmd::ArmTimer>(t).size(), 1u);
    EXPECT_EQ(all_of<cmd::ArmTimer>(t)[0].at, at(tick + 100));
  }
  EXPECT_EQ(s.state(), State::kConnected);
}

TEST(SessionTest, HeartbeatIntervalHasAFloorOfTenMilliseconds) {
  Session s(false);
  const Commands c = s.attach(kT0, 20);
  ASSERT_EQ(all_of<cmd::ArmTimer>(c).size(), 1u);
  EXPECT_EQ(all_of<cmd::ArmTimer>(c)[0].at, at(10));
}

TEST(SessionTest, SilenceIsSuspectedThenFailsAfterTheRecheck) {
  Session s = attached(100);
  // Silent for exactly the timeout: not yet silence.
  Commands c = s.on_timer(at(100));
  EXPECT_EQ(all_of<cmd::SendFrame>(c).size(), 1u);
  // Silent for longer: suspected, no heartbeat, looked at again 20 ms later.
  c = s.on_timer(at(101));
  EXPECT_TRUE(all_of<cmd::SendFrame>(c).empty());
  EXPECT_TRUE(all_of<cmd::CloseMaster>(c).empty());
  ASSERT_EQ(all_of<cmd::ArmTimer>(c).size(), 1u);
  EXPECT_EQ(all_of<cmd::ArmTimer>(c)[0].at, at(121));
  EXPECT_EQ(s.state(), State::kConnected);
  // Still silent at the recheck: the link fails.
  c = s.on_timer(at(121));
  ASSERT_EQ(all_of<cmd::CloseMaster>(c).size(), 1u);
  EXPECT_TRUE(all_of<cmd::SendFrame>(c).empty());
  EXPECT_TRUE(all_of<cmd::ArmTimer>(c).empty());
  EXPECT_EQ(s.state(), State::kEnded);
  EXPECT_EQ(s.status().code(), LOCKSTEP_STATUS_MASTER_CONNECTION_LOST);
  EXPECT_EQ(s.status().message(), "no message from the master for 121 ms");
  EXPECT_EQ(all_of<cmd::CloseMaster>(c)[0].status.message(), s.status().message());
}

// The session driven as its shell drives it (each on_timer at the time it armed), the
// master answering every heartbeat 3 ms later until it goes silent at `stop`: the link
// fails at the timeout after the last answer, plus the recheck, whatever the phase of the
// heartbeat ticks; never a heartbeat interval later, never before the timeout.
TEST(SessionTest, ASilentMasterIsNoticedAtTheTimeoutWhateverThePhase) {
  constexpr std::int64_t kTimeout = 1000;
  for (std::int64_t stop = 2000; stop < 2300; stop += 7) {
    SCOPED_TRACE("master silent from " + std::to_string(stop) + " ms");
    Session s(false);
    Session::Time wake = all_of<cmd::ArmTimer>(s.attach(kT0, kTimeout)).at(0).at;
    Session::Time last_answer = kT0;
    std::vector<Session::Time> answers;  // heartbeat answers due, in order
    while (s.state() == State::kConnected) {
      ASSERT_LT(wake, at(stop + 10 * kTimeout)) << "the silence was never noticed";
      // Answers due before the next wake arrive first.
      while (!answers.empty() && answers.front() <= wake) {
        EXPECT_TRUE(s.on_message(answers.front(), p::HeartbeatAck{}).empty());
        last_answer = answers.front();
        answers.erase(answers.begin());
      }
      const Commands c = s.on_timer(wake);
      for (const auto& send : all_of<cmd::SendFrame>(c)) {
        EXPECT_TRUE(is_heartbeat(send));
        if (wake + milliseconds(3) < at(stop)) answers.push_back(wake + milliseconds(3));
      }
      if (s.state() != State::kConnected) break;
      ASSERT_EQ(all_of<cmd::ArmTimer>(c).size(), 1u);
      wake = all_of<cmd::ArmTimer>(c)[0].at;
    }
    EXPECT_EQ(s.status().code(), LOCKSTEP_STATUS_MASTER_CONNECTION_LOST);
    EXPECT_GT(wake - last_answer, milliseconds(kTimeout));
    EXPECT_LE(wake - last_answer, milliseconds(kTimeout) + milliseconds(1) + Session::kSilenceRecheck);
  }
}

TEST(SessionTest, AFrameDuringTheSuspicionSavesTheLink) {
  Session s = attached(100);
  Commands c = s.on_timer(at(150));
  ASSERT_EQ(all_of<cmd::ArmTimer>(c).size(), 1u);
  EXPECT_TRUE(all_of<cmd::SendFrame>(c).empty());
  // Any frame counts, even one that is dropped.
  EXPECT_TRUE(s.on_message(at(160), p::HeartbeatAck{}).empty());
  c = s.on_timer(at(170));
  EXPECT_EQ(s.state(), State::kConnected);
  ASSERT_EQ(all_of<cmd::SendFrame>(c).size(), 1u);
  EXPECT_TRUE(is_heartbeat(all_of<cmd::SendFrame>(c)[0]));
  EXPECT_EQ(all_of<cmd::ArmTimer>(c)[0].at, at(195));
  // The suspicion was cleared: a new silence is suspected afresh before it fails.
  c = s.on_timer(at(261));
  EXPECT_TRUE(all_of<cmd::CloseMaster>(c).empty());
  EXPECT_EQ(all_of<cmd::ArmTimer>(c)[0].at, at(281));
  c = s.on_timer(at(281));
  EXPECT_EQ(all_of<cmd::CloseMaster>(c).size(), 1u);
  EXPECT_EQ(s.status().message(), "no message from the master for 121 ms");
}

TEST(SessionTest, GoodbyeEndsWithItsStatus) {
  Session s = attached(1000);
  s.register_op(3);
  const Commands c = s.on_message(at(5), p::Goodbye{LOCKSTEP_STATUS_KICKED, "removed by the operator"});
  EXPECT_EQ(s.state(), State::kEnded);
  EXPECT_EQ(s.status().code(), LOCKSTEP_STATUS_KICKED);
  EXPECT_EQ(s.status().message(), "master: removed by the operator");
  ASSERT_EQ(all_of<cmd::CloseMaster>(c).size(), 1u);
  ASSERT_EQ(all_of<cmd::AbortOp>(c).size(), 1u);
  EXPECT_EQ(all_of<cmd::AbortOp>(c)[0].status.code(), LOCKSTEP_STATUS_KICKED);
  EXPECT_EQ(s.mailbox_size(), 0u);
}

TEST(SessionTest, HeartbeatAckIsDroppedOtherMessagesWaitInTheMailbox) {
  Session s = attached(1000);
  EXPECT_TRUE(s.on_message(at(1), p::HeartbeatAck{}).empty());
  EXPECT_EQ(s.mailbox_size(), 0u);
  EXPECT_TRUE(s.on_message(at(2), p::PeersPendingResult{LOCKSTEP_OK, true, ""}).empty());
  EXPECT_TRUE(s.on_message(at(3), p::AgreeResult{LOCKSTEP_OK, true, ""}).empty());
  EXPECT_EQ(s.mailbox_size(), 2u);
  // A call takes the first message its predicate accepts; the others stay.
  auto agree = s.take([](const p::Message& m) { return std::holds_alternative<p::AgreeResult>(m); });
  ASSERT_TRUE(agree.has_value());
  EXPECT_TRUE(std::get<p::AgreeResult>(*agree).value);
  EXPECT_FALSE(s.take([](const p::Message& m) { return std::holds_alternative<p::AgreeResult>(m); }).has_value());
  EXPECT_EQ(s.mailbox_size(), 1u);
}

TEST(SessionTest, CollectiveMessagesAreRoutedByTag) {
  Session s = attached(1000);
  EXPECT_TRUE(s.register_op(7).empty());

  Commands c = s.on_message(at(1), p::CollectiveGo{7, 1, 0, 0, {}});
  ASSERT_EQ(all_of<cmd::RouteToOp>(c).size(), 1u);
  EXPECT_EQ(all_of<cmd::RouteToOp>(c)[0].tag, 7u);
  EXPECT_TRUE(std::holds_alternative<p::CollectiveGo>(all_of<cmd::RouteToOp>(c)[0].message));

  p::CollectiveResult result;
  result.tag = 7;
  result.attempt = 1;
  c = s.on_message(at(2), result);
  ASSERT_EQ(all_of<cmd::RouteToOp>(c).size(), 1u);
  EXPECT_EQ(all_of<cmd::RouteToOp>(c)[0].tag, 7u);

  c = s.on_message(at(3), p::Refused{p::MsgType::kCollectiveInit, 7, LOCKSTEP_STATUS_INVALID_USAGE, "no"});
  ASSERT_EQ(all_of<cmd::RouteToOp>(c).size(), 1u);
  EXPECT_EQ(all_of<cmd::RouteToOp>(c)[0].tag, 7u);
  EXPECT_EQ(s.mailbox_size(), 0u);

  // A refusal of anything else is for the mailbox, whatever its tag field says.
  c = s.on_message(at(4), p::Refused{p::MsgType::kVoteAgree, 7, LOCKSTEP_STATUS_INVALID_USAGE, "no"});
  EXPECT_TRUE(all_of<cmd::RouteToOp>(c).empty());
  EXPECT_EQ(s.mailbox_size(), 1u);

  // Nobody waits for tag 8: dropped, neither routed nor queued.
  c = s.on_message(at(5), p::CollectiveGo{8, 2, 0, 0, {}});
  EXPECT_TRUE(c.empty());
  result.tag = 8;
  EXPECT_TRUE(s.on_message(at(6), result).empty());
  EXPECT_EQ(s.mailbox_size(), 1u);

  // Unregistered: dropped from then on.
  s.unregister_op(7);
  EXPECT_TRUE(s.on_message(at(7), p::CollectiveGo{7, 3, 0, 0, {}}).empty());
  EXPECT_EQ(s.slot_turn(0, 3), Turn::kNotQueued);
}

// A collective that returned on its ring's commit: the master's outcome and any abort of
// that attempt are dropped when they come, even while a later collective of the same tag
// waits (they would end it wrongly); the later attempt's own messages still reach it.
TEST(SessionTest, TheOutcomeOfAnAttemptSettledByItsCommitNeverReachesTheNextCollective) {
  Session s = attached(1000);
  s.register_op(7);
  s.on_message(at(1), p::CollectiveGo{7, 1, 0, 0, {}});
  ASSERT_TRUE(s.settled_early(7, 1, 2));
  s.unregister_op(7);
  s.register_op(7);  // the same tag, called again at once
  EXPECT_TRUE(s.on_message(at(2), p::CollectiveAbort{7, 1}).empty());
  p::CollectiveResult result;
  result.tag = 7;
  result.attempt = 1;
  EXPECT_TRUE(s.on_message(at(3), result).empty());
  // Its outcome ended the watch: a (wrong) second one would be routed.
  Commands c = s.on_message(at(4), result);
  EXPECT_EQ(all_of<cmd::RouteToOp>(c).size(), 1u);
  c = s.on_message(at(5), p::CollectiveAbort{7, 2});
  ASSERT_EQ(all_of<cmd::RouteToOp>(c).size(), 1u);
  EXPECT_TRUE(std::holds_alternative<p::CollectiveAbort>(all_of<cmd::RouteToOp>(c)[0].message));
  result.attempt = 2;
  EXPECT_EQ(all_of<cmd::RouteToOp>(s.on_message(at(6), result)).size(), 1u);
  // Bounded: the oldest is forgotten first.
  for (std::uint64_t k = 0; k < Session::kSettledEarlyMax + 1; ++k) s.settled_early(9, 100 + k, 2);
  s.register_op(9);
  result.tag = 9;
  result.attempt = 100;
  EXPECT_EQ(all_of<cmd::RouteToOp>(s.on_message(at(7), result)).size(), 1u);
  result.attempt = 101;
  EXPECT_TRUE(s.on_message(at(8), result).empty());
}

TEST(SessionTest, SlotsAreTakenInTheOrderOfTheGoMessages) {
  Session s = attached(1000);
  (void)s.register_op(1);
  (void)s.register_op(2);
  (void)s.on_message(at(1), p::CollectiveGo{2, 11, 3, 0, {}});
  (void)s.on_message(at(2), p::CollectiveGo{1, 10, 3, 0, {}});
  (void)s.on_message(at(3), p::CollectiveGo{1, 12, 4, 0, {}});
  // A Go for an op nobody registered does not queue its attempt.
  (void)s.on_message(at(4), p::CollectiveGo{9, 13, 3, 0, {}});

  EXPECT_EQ(s.slot_turn(3, 11), Turn::kMine);
  EXPECT_EQ(s.slot_turn(3, 10), Turn::kWaiting);
  EXPECT_EQ(s.slot_turn(4, 12), Turn::kMine);  // another slot: its own queue
  EXPECT_EQ(s.slot_turn(3, 13), Turn::kNotQueued);
  EXPECT_EQ(s.slot_turn(5, 10), Turn::kNotQueued);

  s.release_slot(3, 11);
  EXPECT_EQ(s.slot_turn(3, 11), Turn::kNotQueued);
  EXPECT_EQ(s.slot_turn(3, 10), Turn::kMine);
  s.release_slot(3, 10);
  EXPECT_EQ(s.slot_turn(3, 10), Turn::kNotQueued);
}

TEST(SessionTest, TheMailboxIsBounded) {
  Session s = attached(1000);
  for (std::size_t i = 0; i < limits::kMailboxMessagesMax; ++i) {
    ASSERT_TRUE(s.on_message(at(1), p::AgreeResult{LOCKSTEP_OK, true, ""}).empty()) << i;
  }
  EXPECT_EQ(s.mailbox_size(), limits::kMailboxMessagesMax);
  EXPECT_EQ(s.state(), State::kConnected);
  const Commands c = s.on_message(at(2), p::AgreeResult{LOCKSTEP_OK, true, ""});
  ASSERT_EQ(all_of<cmd::CloseMaster>(c).size(), 1u);
  EXPECT_EQ(s.state(), State::kEnded);
  EXPECT_EQ(s.status().code(), LOCKSTEP_STATUS_PROTOCOL_ERROR);
  EXPECT_EQ(s.status().message(), "the master sent more unanswered messages than allowed");
  EXPECT_EQ(s.mailbox_size(), 0u);
}

TEST(SessionTest, TheFirstFatalStatusSticksAndAbortsEverything) {
  Session s = attached(1000);
  (void)s.register_op(1);
  (void)s.register_op(2);
  EXPECT_TRUE(s.set_establishment(5, true).empty());

  Commands c = s.fail(Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "the master closed the connection"));
  const auto aborts = all_of<cmd::AbortOp>(c);
  ASSERT_EQ(aborts.size(), 2u);
  EXPECT_EQ(aborts[0].tag, 1u);
  EXPECT_EQ(aborts[1].tag, 2u);
  for (const auto& a : aborts) EXPECT_EQ(a.status.code(), LOCKSTEP_STATUS_MASTER_CONNECTION_LOST);
  EXPECT_EQ(all_of<cmd::CancelEstablishment>(c).size(), 1u);
  ASSERT_EQ(all_of<cmd::CloseMaster>(c).size(), 1u);
  // Closing comes last, after every waiter has its status.
  EXPECT_TRUE(std::holds_alternative<cmd::CloseMaster>(c.back()));

  // A later failure changes nothing.
  EXPECT_TRUE(s.fail(Status(LOCKSTEP_STATUS_INTERRUPTED, "the communicator is being destroyed")).empty());
  EXPECT_EQ(s.status().code(), LOCKSTEP_STATUS_MASTER_CONNECTION_LOST);

  // Ops and establishments that start afterwards end at once, with the first status.
  c = s.register_op(3);
  ASSERT_EQ(all_of<cmd::AbortOp>(c).size(), 1u);
  EXPECT_EQ(all_of<cmd::AbortOp>(c)[0].tag, 3u);
  EXPECT_EQ(all_of<cmd::AbortOp>(c)[0].status.message(), "the master closed the connection");
  EXPECT_EQ(all_of<cmd::CancelEstablishment>(s.set_establishment(6, true)).size(), 1u);
  EXPECT_TRUE(s.set_establishment(0, false).empty());
}

TEST(SessionTest, AFailedTopologyResultCancelsOnlyItsOwnEstablishment) {
  Session s = attached(1000);
  (void)s.set_establishment(5, true);
  p::TopologyResult failed;
  failed.epoch = 4;
  failed.status = LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED;
  EXPECT_TRUE(all_of<cmd::CancelEstablishment>(s.on_message(at(1), failed)).empty());
  p::TopologyResult ok;
  ok.epoch = 5;
  EXPECT_TRUE(all_of<cmd::CancelEstablishment>(s.on_message(at(2), ok)).empty());
  failed.epoch = 5;
  EXPECT_EQ(all_of<cmd::CancelEstablishment>(s.on_message(at(3), failed)).size(), 1u);
  // The outcomes still reach the mailbox (the establishing call waits for its own).
  EXPECT_EQ(s.mailbox_size(), 3u);
  // No establishment in progress: nothing to cancel.
  (void)s.set_establishment(0, false);
  EXPECT_TRUE(all_of<cmd::CancelEstablishment>(s.on_message(at(4), failed)).empty());
  EXPECT_EQ(s.state(), State::kConnected);
}

TEST(SessionTest, PairKeysAreLearnedOnlyWithASecret) {
  Session s = attached(1000, true);
  p::EstablishP2P establish;
  establish.epoch = 1;
  establish.ring = {member(1, 0xa1), member(2, 0xa2)};
  Commands c = s.on_message(at(1), establish);
  ASSERT_EQ(all_of<cmd::LearnPairKeys>(c).size(), 1u);
  auto learn = all_of<cmd::LearnPairKeys>(c)[0];
  EXPECT_FALSE(learn.forget_others);
  ASSERT_EQ(learn.keys.size(), 2u);
  EXPECT_EQ(learn.keys[1].first, (PeerId{7, 2}));
  EXPECT_EQ(learn.keys[1].second, std::vector<std::uint8_t>(32, 0xa2));

  // A successful outcome names the whole view: the keys of everyone else are forgotten.
  p::TopologyResult ok;
  ok.epoch = 1;
  ok.ring = {member(2, 0xa2)};
  c = s.on_message(at(2), ok);
  ASSERT_EQ(all_of<cmd::LearnPairKeys>(c).size(), 1u);
  EXPECT_TRUE(all_of<cmd::LearnPairKeys>(c)[0].forget_others);
  EXPECT_EQ(all_of<cmd::LearnPairKeys>(c)[0].keys.size(), 1u);
  // A failed one names nobody.
  p::TopologyResult failed;
  failed.status = LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED;
  EXPECT_TRUE(all_of<cmd::LearnPairKeys>(s.on_message(at(3), failed)).empty());

  p::BandwidthTest test;
  test.partner = member(3, 0xa3);
  c = s.on_message(at(4), test);
  ASSERT_EQ(all_of<cmd::LearnPairKeys>(c).size(), 1u);
  EXPECT_EQ(all_of<cmd::LearnPairKeys>(c)[0].keys[0].first, (PeerId{7, 3}));
  p::SyncPlan plan;
  plan.sources = {member(4, 0xa4)};
  EXPECT_EQ(all_of<cmd::LearnPairKeys>(s.on_message(at(5), plan)).size(), 1u);

  Session plain = attached(1000, false);
  EXPECT_TRUE(all_of<cmd::LearnPairKeys>(plain.on_message(at(1), establish)).empty());
}

TEST(SessionTest, TheLifecycleOnlyMovesForward) {
  Session s(false);
  EXPECT_EQ(s.state(), State::kCreated);
  EXPECT_TRUE(s.identity().is_nil());
  // Before the master connection is attached there is nothing to time or receive.
  EXPECT_TRUE(s.on_timer(at(10'000)).empty());
  EXPECT_TRUE(s.on_message(at(1), p::AgreeResult{}).empty());
  EXPECT_EQ(s.mailbox_size(), 0u);
  s.set_identity(PeerId{1, 2});
  EXPECT_EQ(s.identity(), (PeerId{1, 2}));

  (void)s.attach(kT0, 1000);
  EXPECT_EQ(s.state(), State::kConnected);
  // A second attach is no way back to the start.
  EXPECT_TRUE(s.attach(at(5), 1000).empty());
  ASSERT_EQ(all_of<cmd::SendFrame>(s.send(p::VoteAgree{true})).size(), 1u);

  (void)s.on_message(at(10), p::Goodbye{LOCKSTEP_STATUS_KICKED, "bye"});
  ASSERT_EQ(s.state(), State::kEnded);
  // An ended session never sends, times, routes, queues or attaches again.
  EXPECT_TRUE(s.send(p::VoteAgree{true}).empty());
  EXPECT_TRUE(s.on_timer(at(20)).empty());
  EXPECT_TRUE(s.on_timer(at(100'000)).empty());
  EXPECT_TRUE(s.on_message(at(30), p::AgreeResult{}).empty());
  EXPECT_TRUE(s.on_message(at(31), p::Goodbye{LOCKSTEP_STATUS_INTERNAL_ERROR, "again"}).empty());
  EXPECT_EQ(s.mailbox_size(), 0u);
  EXPECT_TRUE(s.attach(at(40), 1000).empty());
  EXPECT_EQ(s.state(), State::kEnded);
  EXPECT_EQ(s.status().code(), LOCKSTEP_STATUS_KICKED);
}

TEST(SessionTest, ItCanEndBeforeItIsAttached) {
  Session s(false);
  const Commands c = s.fail(Status(LOCKSTEP_STATUS_INTERRUPTED, "the communicator is being destroyed"));
  ASSERT_EQ(all_of<cmd::CloseMaster>(c).size(), 1u);
  EXPECT_EQ(s.state(), State::kEnded);
  EXPECT_TRUE(s.attach(kT0, 1000).empty());
  EXPECT_EQ(s.state(), State::kEnded);
}


// ---------------------------------------------------------------- failover

const PeerId kSelf{1, 2};
const PeerId kOther{1, 3};
const PeerId kThird{1, 4};

// A session with failover on, a member of the view of epoch 3.
Session member_with_failover(std::chrono::milliseconds timeout = milliseconds(30'000)) {
  Session s = attached(1000);
  s.set_failover(timeout);
  p::TopologyResult view;
  view.epoch = 3;
  view.ring = {p::MemberInfo{kSelf, "a", 1, 2, 3, {}}, p::MemberInfo{kOther, "b", 1, 2, 3, {}}};
  s.on_message(at(1), view);
  EXPECT_TRUE(s.take([](const p::Message& m) { return std::holds_alternative<p::TopologyResult>(m); }).has_value());
  return s;
}

p::Welcome welcome_back(std::uint64_t term) {
  p::Welcome w;
  w.id = kSelf;
  w.heartbeat_timeout_ms = 1000;
  w.term = term;
  return w;
}

p::ResumeReport decoded_report(const Commands& c) {
  const auto frames = all_of<cmd::SendFrame>(c);
  EXPECT_EQ(frames.size(), 1u);
  if (frames.empty()) return {};
  const auto& f = frames[0].frame;
  auto header = p::decode_header(std::span<const std::uint8_t, p::kFrameHeaderBytes>(f.data(), p::kFrameHeaderBytes));
  EXPECT_TRUE(header.is_ok());
  auto m = p::decode_payload(header.value().type, std::span(f).subspan(p::kFrameHeaderBytes));
  EXPECT_TRUE(m.is_ok()) << m.status().to_string();
  return std::get<p::ResumeReport>(m.value());
}

TEST(SessionFailover, AnAcceptedPeerThatLosesItsMasterReportsWhatItKnewAndFailsWhatNobodyDecided) {
  Session s = member_with_failover();
  s.register_op(5);
  s.send(p::CollectiveInit{5, {}});
  s.on_message(at(2), p::CollectiveGo{5, 7, 0, 3, {}});
  s.register_op(6);
  s.send(p::CollectiveInit{6, {}});  // voted, no attempt yet
  s.send(p::VoteAgree{true});
  Commands c = s.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "the master closed the connection"));
  EXPECT_EQ(s.state(), State::kReconnecting);
  ASSERT_EQ(all_of<cmd::Reconnect>(c).size(), 1u);
  ASSERT_EQ(all_of<cmd::ArmTimer>(c).size(), 1u);
  EXPECT_EQ(all_of<cmd::ArmTimer>(c)[0].at, at(30'010));
  EXPECT_TRUE(all_of<cmd::AbortOp>(c).empty());  // held, not failed
  EXPECT_TRUE(s.status().is_ok());
  // Nothing goes out while the master is away.
  EXPECT_TRUE(s.send(p::CollectiveDone{5, 7, true, {}, 0, 0}).empty());
  EXPECT_TRUE(s.on_timer(at(100)).size() == 1);  // only the deadline, re-armed
  const p::Hello hello = s.resume_hello(p::Hello{});
  EXPECT_EQ(hello.resume_id, kSelf);
  EXPECT_EQ(hello.term, 0u);

  c = s.resume(at(200), welcome_back(1));
  EXPECT_EQ(s.state(), State::kResuming);
  EXPECT_EQ(s.term(), 1u);
  const p::ResumeReport report = decoded_report(c);
  EXPECT_EQ(report.epoch, 3u);
  EXPECT_EQ(report.view, (std::vector<PeerId>{kSelf, kOther}));
  EXPECT_EQ(report.attempt_seen, 7u);
  EXPECT_EQ(report.waiting, static_cast<std::uint16_t>(p::MsgType::kVoteAgree));
  EXPECT_EQ(report.ops, (std::vector<p::ResumeOp>{p::ResumeOp{5, 7}, p::ResumeOp{6, 0}}));
  // Heartbeats to the new master start with its welcome.
  ASSERT_EQ(all_of<cmd::ArmTimer>(c).size(), 1u);
  EXPECT_EQ(all_of<cmd::ArmTimer>(c)[0].at, at(450));
  const auto beat = all_of<cmd::SendFrame>(s.on_timer(at(450)));
  ASSERT_EQ(beat.size(), 1u);
  EXPECT_TRUE(is_heartbeat(beat[0]));

  c = s.on_message(at(210), p::Resumed{1, 3});
  EXPECT_EQ(s.state(), State::kConnected);
  // The started attempt fails as for a lost peer; the votes whose rounds had not started
  // go to the new master again (the peers that had not voted yet will meet them there).
  const auto routed = all_of<cmd::RouteToOp>(c);
  ASSERT_EQ(routed.size(), 1u);
  const auto* failed = std::get_if<p::CollectiveResult>(&routed[0].message);
  ASSERT_NE(failed, nullptr);
  EXPECT_EQ(failed->attempt, 7u);
  EXPECT_EQ(failed->status, LOCKSTEP_STATUS_PEER_CONNECTION_LOST);
  const auto recast = all_of<cmd::SendFrame>(c);
  ASSERT_EQ(recast.size(), 2u);
  EXPECT_EQ(recast[0].frame, p::encode_frame(p::CollectiveInit{6, {}}));
  EXPECT_EQ(recast[1].frame, p::encode_frame(p::VoteAgree{true}));
  EXPECT_EQ(s.mailbox_size(), 0u);  // the agree waits for its outcome from the new master
  // The held report of the old attempt goes nowhere; new requests go out again.
  EXPECT_TRUE(s.send(p::CollectiveDone{5, 7, true, {}, 0, 0}).empty());
  EXPECT_EQ(all_of<cmd::SendFrame>(s.send(p::VoteAgree{true})).size(), 1u);
}

// A member whose attempt 7 of tag 5 was in flight when it lost its master, welcomed
// back by a new one (term 2), its report sent.
Session resuming_with_attempt_in_flight() {
  Session s = member_with_failover();
  s.register_op(5);
  s.send(p::CollectiveInit{5, {}});
  s.on_message(at(2), p::CollectiveGo{5, 7, 0, 3, {}});
  s.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  s.resume(at(20), welcome_back(2));
  return s;
}

TEST(SessionFailover, AnOutcomeTheNewMasterForwardsIsTheOneThatCounts) {
  Session s = resuming_with_attempt_in_flight();
  Commands c = s.on_message(at(21), p::CollectiveResult{5, 7, LOCKSTEP_OK, 2, ""});
  ASSERT_EQ(all_of<cmd::RouteToOp>(c).size(), 1u);
  c = s.on_message(at(22), p::Resumed{2, 3});
  EXPECT_TRUE(all_of<cmd::RouteToOp>(c).empty());  // nothing more for tag 5
  // A control outcome forwarded while resuming answers the wait; nothing else is added.
  Session t = member_with_failover();
  t.send(p::VotePeersPending{});
  t.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  t.resume(at(20), welcome_back(2));
  t.on_message(at(21), p::PeersPendingResult{LOCKSTEP_OK, true, ""});
  t.on_message(at(22), p::Resumed{2, 3});
  EXPECT_EQ(t.mailbox_size(), 1u);
  EXPECT_TRUE(t.take([](const p::Message& m) { return std::holds_alternative<p::PeersPendingResult>(m); }).has_value());
}

TEST(SessionFailover, AMasterIsObeyedOnlyWithATermAboveEveryTermGranted) {
  Session s = member_with_failover();
  s.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  s.resume(at(20), welcome_back(3));
  EXPECT_EQ(s.state(), State::kResuming);
  s.on_message(at(21), p::Resumed{3, 3});
  s.lose(at(30), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone again"));
  EXPECT_EQ(s.resume_hello(p::Hello{}).term, 3u);
  for (const std::uint64_t stale : {1ull, 3ull}) {
    EXPECT_TRUE(s.resume(at(40), welcome_back(stale)).empty());
    EXPECT_EQ(s.state(), State::kReconnecting);
  }
  s.resume(at(50), welcome_back(4));
  EXPECT_EQ(s.state(), State::kResuming);
  // A Resumed of a higher term: the master raised its term during the recovery (a peer
  // back later had granted a higher one); this peer grants it.
  s.on_message(at(51), p::Resumed{5, 3});
  EXPECT_EQ(s.state(), State::kConnected);
  s.lose(at(60), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone a third time"));
  EXPECT_EQ(s.resume_hello(p::Hello{}).term, 5u);
  // A Resumed of a lower term than the Welcome's is not this protocol's master.
  s.resume(at(70), welcome_back(7));
  s.on_message(at(71), p::Resumed{6, 3});
  EXPECT_EQ(s.state(), State::kEnded);
  EXPECT_EQ(s.status().code(), LOCKSTEP_STATUS_PROTOCOL_ERROR);
  // The first master's term (its Welcome's) counts as granted.
  Session v = member_with_failover();
  v.grant_term(5);
  v.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  EXPECT_EQ(v.resume_hello(p::Hello{}).term, 5u);
  EXPECT_TRUE(v.resume(at(20), welcome_back(5)).empty());
  EXPECT_EQ(v.state(), State::kReconnecting);
  // Nor is a master that takes this peer back under another identity.
  Session t = member_with_failover();
  t.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  p::Welcome other = welcome_back(2);
  other.id = kOther;
  t.resume(at(20), other);
  EXPECT_EQ(t.status().code(), LOCKSTEP_STATUS_PROTOCOL_ERROR);
}

TEST(SessionFailover, NoMasterWithinTheTimeoutEndsTheLinkAsBefore) {
  Session s = member_with_failover(milliseconds(500));
  s.register_op(5);
  s.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  EXPECT_TRUE(s.on_timer(at(509)).size() == 1);
  Commands c = s.on_timer(at(510));
  EXPECT_EQ(s.state(), State::kEnded);
  EXPECT_EQ(s.status().code(), LOCKSTEP_STATUS_MASTER_CONNECTION_LOST);
  EXPECT_NE(s.status().message().find("failover timeout of 500 ms"), std::string::npos) << s.status().message();
  EXPECT_EQ(all_of<cmd::AbortOp>(c).size(), 1u);
  // A master lost while it takes the peer back does not extend the timeout.
  Session t = member_with_failover(milliseconds(500));
  t.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  t.resume(at(300), welcome_back(1));
  c = t.lose(at(400), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone again"));
  EXPECT_EQ(all_of<cmd::ArmTimer>(c)[0].at, at(510));
  // Nor does a master that takes the peer back but never resumes the run.
  Session w = member_with_failover(milliseconds(500));
  w.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  c = w.resume(at(300), welcome_back(1));
  ASSERT_EQ(all_of<cmd::ArmTimer>(c).size(), 1u);
  EXPECT_LE(all_of<cmd::ArmTimer>(c)[0].at, at(510));
  w.on_message(at(505), p::HeartbeatAck{});
  w.on_timer(at(510));
  EXPECT_EQ(w.state(), State::kEnded);
  EXPECT_NE(w.status().message().find("no master resumed the run"), std::string::npos) << w.status().message();
  // The master's silence counts as a loss too.
  Session u = member_with_failover();
  u.on_timer(at(1002));
  u.on_timer(at(1002) + Session::kSilenceRecheck);
  EXPECT_EQ(u.state(), State::kReconnecting);
}

TEST(SessionFailover, WithoutFailoverOrAViewALossEndsTheLink) {
  Session off = attached(1000);
  off.on_message(at(1), p::TopologyResult{3, LOCKSTEP_OK, "", {p::MemberInfo{kSelf, "a", 1, 2, 3, {}}}, {}});
  off.lose(at(5), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  EXPECT_EQ(off.state(), State::kEnded);
  Session newcomer = attached(1000);
  newcomer.set_failover(milliseconds(30'000));
  newcomer.lose(at(5), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  EXPECT_EQ(newcomer.state(), State::kEnded);
  // A master that says it shuts down is a loss; any other Goodbye ends the link.
  Session s = member_with_failover();
  s.on_message(at(5), p::Goodbye{LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "master shutting down"});
  EXPECT_EQ(s.state(), State::kReconnecting);
  Session k = member_with_failover();
  k.on_message(at(5), p::Goodbye{LOCKSTEP_STATUS_KICKED, "bye"});
  EXPECT_EQ(k.state(), State::kEnded);
}

TEST(SessionFailover, NoAttemptEndsByCommitWhileTheMasterIsAwayAndCommitsAreReported) {
  Session s = member_with_failover();
  s.register_op(5);
  s.send(p::CollectiveInit{5, {}});
  s.on_message(at(2), p::CollectiveGo{5, 7, 0, 3, {}});
  EXPECT_TRUE(s.settled_early(5, 7, 2));
  s.unregister_op(5);
  s.register_op(5);
  s.send(p::CollectiveInit{5, {}});
  s.on_message(at(3), p::CollectiveGo{5, 8, 0, 3, {}});
  s.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  EXPECT_FALSE(s.settled_early(5, 8, 2));
  const p::ResumeReport report = decoded_report(s.resume(at(20), welcome_back(1)));
  ASSERT_EQ(report.outcomes.size(), 1u);
  EXPECT_EQ(report.outcomes[0], (p::ResumeOutcome{5, 7, LOCKSTEP_OK, 2, "", {}}));
  EXPECT_EQ(report.ops, std::vector<p::ResumeOp>{(p::ResumeOp{5, 8})});
}

// The owner may retry a collective as soon as the forwarded outcome of its last attempt
// ends it, before the master's Resumed: the new vote, held meanwhile, goes out at the
// resume like any other vote whose round had not started.
TEST(SessionFailover, AVoteCastAfterAForwardedOutcomeGoesOutAtTheResume) {
  Session s = resuming_with_attempt_in_flight();
  Commands c = s.on_message(at(21), p::CollectiveResult{5, 7, LOCKSTEP_STATUS_PEER_CONNECTION_LOST, 0, "lost"});
  ASSERT_EQ(all_of<cmd::RouteToOp>(c).size(), 1u);
  s.unregister_op(5);
  s.register_op(5);
  EXPECT_TRUE(s.send(p::CollectiveInit{5, {}}).empty());  // held while resuming
  c = s.on_message(at(22), p::Resumed{2, 3});
  EXPECT_TRUE(all_of<cmd::RouteToOp>(c).empty());
  const auto recast = all_of<cmd::SendFrame>(c);
  ASSERT_EQ(recast.size(), 1u);
  EXPECT_EQ(recast[0].frame, p::encode_frame(p::CollectiveInit{5, {}}));
}

// A newcomer's first round of a tag has no outcome of its own before it: were the other
// members' outcomes of the rounds before it joined still in their reports, the new master
// would forward the oldest of them to the newcomer as the outcome of the round it voted in.
TEST(SessionFailover, TheOutcomesReportedAreThoseOfTheCurrentView) {
  Session s = member_with_failover();
  s.register_op(5);
  s.send(p::CollectiveInit{5, {}});
  s.on_message(at(2), p::CollectiveGo{5, 7, 0, 3, {}});
  s.on_message(at(3), p::CollectiveResult{5, 7, LOCKSTEP_OK, 2, ""});
  s.unregister_op(5);
  p::TopologyResult next;  // a newcomer joins
  next.epoch = 4;
  next.ring = {p::MemberInfo{kSelf, "a", 1, 2, 3, {}}, p::MemberInfo{kOther, "b", 1, 2, 3, {}},
               p::MemberInfo{kThird, "c", 1, 2, 3, {}}};
  s.on_message(at(4), next);
  s.register_op(5);
  s.send(p::CollectiveInit{5, {}});
  s.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  const p::ResumeReport report = decoded_report(s.resume(at(20), welcome_back(1)));
  EXPECT_EQ(report.epoch, 4u);
  EXPECT_TRUE(report.outcomes.empty());
  EXPECT_EQ(report.ops, std::vector<p::ResumeOp>{(p::ResumeOp{5, 0})});
}

// Are-peers-pending is run-wide: the report counts its rounds since the view began and
// carries the last outcome, so that a new master can give a group that missed it the
// outcome another group received (coordinator_test: AMissedPendingOutcome...).
TEST(SessionFailover, TheReportCountsThePendingRoundsOfTheViewAndCarriesTheLastOutcome) {
  Session s = member_with_failover();
  s.send(p::VotePeersPending{});
  s.on_message(at(2), p::PeersPendingResult{LOCKSTEP_OK, true, ""});
  s.send(p::VotePeersPending{});
  s.on_message(at(3), p::PeersPendingResult{LOCKSTEP_OK, false, ""});
  s.send(p::VotePeersPending{});  // waits in the third round
  s.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  p::ResumeReport report = decoded_report(s.resume(at(20), welcome_back(1)));
  EXPECT_EQ(report.pending_count, 2u);
  EXPECT_EQ(report.last_pending_status, LOCKSTEP_OK);
  EXPECT_FALSE(report.last_pending);
  EXPECT_EQ(report.waiting, static_cast<std::uint16_t>(p::MsgType::kVotePeersPending));
  // A new view starts the count again.
  Session t = member_with_failover();
  t.send(p::VotePeersPending{});
  t.on_message(at(2), p::PeersPendingResult{LOCKSTEP_STATUS_OPERATION_MISMATCH, false, "mismatch"});
  t.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  report = decoded_report(t.resume(at(20), welcome_back(1)));
  EXPECT_EQ(report.pending_count, 1u);
  EXPECT_EQ(report.last_pending_status, LOCKSTEP_STATUS_OPERATION_MISMATCH);
  Session u = member_with_failover();
  u.send(p::VotePeersPending{});
  u.on_message(at(2), p::PeersPendingResult{LOCKSTEP_OK, true, ""});
  p::TopologyResult next;
  next.epoch = 4;
  next.ring = {p::MemberInfo{kSelf, "a", 1, 2, 3, {}}, p::MemberInfo{kOther, "b", 1, 2, 3, {}}};
  u.on_message(at(3), next);
  u.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  report = decoded_report(u.resume(at(20), welcome_back(1)));
  EXPECT_EQ(report.pending_count, 0u);
  EXPECT_FALSE(report.last_pending);
}

TEST(SessionFailover, AnAnswerToTheLostMastersRequestEndsItsRoundWithTheRetryableFailure) {
  Session s = member_with_failover();
  s.send(p::VoteUpdateTopology{});
  s.on_message(at(2), p::EstablishP2P{4, {}});  // connecting to the new ring
  EXPECT_TRUE(s.take([](const p::Message& m) { return std::holds_alternative<p::EstablishP2P>(m); }).has_value());
  s.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  s.resume(at(20), welcome_back(1));
  s.on_message(at(21), p::Resumed{1, 3});
  EXPECT_EQ(s.mailbox_size(), 0u);  // the owner is not waiting yet
  EXPECT_TRUE(s.send(p::P2PReport{4, {}}).empty());
  auto refused = s.take([](const p::Message& m) { return std::holds_alternative<p::Refused>(m); });
  ASSERT_TRUE(refused.has_value());
  EXPECT_EQ(std::get<p::Refused>(*refused).request, p::MsgType::kP2PReport);
  EXPECT_EQ(std::get<p::Refused>(*refused).status, LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED);
  // A sync waiting for its outcome, and a key-value request in flight.
  Session t = member_with_failover();
  t.send(p::SyncVote{});
  t.on_message(at(2), p::SyncPlan{9, 1, {}, {}, {}, {}});
  t.send(p::SyncDone{9, LOCKSTEP_OK, "", 0, 0});
  t.send(p::KvRequest{3, p::KvOp::kGet, "k"});
  t.lose(at(10), Status(LOCKSTEP_STATUS_MASTER_CONNECTION_LOST, "gone"));
  t.resume(at(20), welcome_back(1));
  t.on_message(at(21), p::Resumed{1, 3});
  auto sync = t.take([](const p::Message& m) { return std::holds_alternative<p::Refused>(m); });
  ASSERT_TRUE(sync.has_value());
  EXPECT_EQ(std::get<p::Refused>(*sync).request, p::MsgType::kSyncDone);
  auto kv = t.take([](const p::Message& m) { return std::holds_alternative<p::KvResult>(m); });
  ASSERT_TRUE(kv.has_value());
  EXPECT_EQ(std::get<p::KvResult>(*kv).request, 3u);
  EXPECT_NE(std::get<p::KvResult>(*kv).status, LOCKSTEP_OK);
}

}  // namespace
}  // namespace lockstep::peer
