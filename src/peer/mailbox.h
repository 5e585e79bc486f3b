// The mailboxes of a peer's in-flight collectives: the master's messages for one
// collective wait in its OpChannel until the collective takes them, and its abort
// signal (an eventfd that the ring's poll() watches, plus a flag checked between
// sub-chunks) stops a ring in progress. The master link's own mailbox is part of
// peer::Session (session.h). Internal to the peer layer.
#pragma once

#include "common/status.h"
#include "protocol/messages.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>

namespace lockstep::peer {

// Messages waiting for the call that expects them: each waiting call takes only the
// message its predicate accepts (the "queued socket" idea). A failure ends every wait,
// now and later, with its status. Bounded (limits::kMailboxMessagesMax): a master that
// sends more unanswered messages than allowed fails it.
class Mailbox {
 public:
  // False (and the mailbox failed with PROTOCOL_ERROR) when it is full.
  bool push(proto::Message message);
  void fail(const Status& status);
  Result<proto::Message> wait(const std::function<bool(const proto::Message&)>& match);

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<proto::Message> messages_;
  Status failure_;
};

// The master's messages for one in-flight collective, and its abort signal.
class OpChannel {
 public:
  OpChannel();
  ~OpChannel();
  OpChannel(const OpChannel&) = delete;
  OpChannel& operator=(const OpChannel&) = delete;

  bool valid() const { return event_fd_ >= 0; }
  int event_fd() const { return event_fd_; }
  const std::atomic<bool>* abort_flag() const { return &aborted_; }
  bool aborted() const { return aborted_.load(); }
  // The master's successful outcome arrived (it also makes event_fd readable): the
  // ring's commit exchange stops waiting for tokens (coll::run_ring_commit).
  const std::atomic<bool>* settled_flag() const { return &settled_; }

  // Raises the abort signal without a message (the end of a p2p establishment).
  void cancel() { signal(); }
  // A failure outcome, or the master's CollectiveAbort, also stops a ring in progress.
  void push(proto::Message message);
  // The link failed: every waiting call ends with this status.
  void abort(const Status& status);
  Result<proto::Message> wait(const std::function<bool(const proto::Message&)>& match) { return messages_.wait(match); }

 private:
  void signal();

  int event_fd_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> settled_{false};
  Mailbox messages_;
};

}  // namespace lockstep::peer
