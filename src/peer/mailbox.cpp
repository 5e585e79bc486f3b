// The collectives' mailboxes and abort signals (mailbox.h).
#include "peer/mailbox.h"

#include "common/limits.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <utility>

namespace lockstep::peer {

bool Mailbox::push(proto::Message message) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (messages_.size() >= limits::kMailboxMessagesMax) {
      messages_.clear();
      if (failure_.is_ok()) {
        failure_ = Status(LOCKSTEP_STATUS_PROTOCOL_ERROR, "the master sent more unanswered messages than allowed");
      }
      return false;
    }
    messages_.push_back(std::move(message));
  }
  cv_.notify_all();
  return true;
}

void Mailbox::fail(const Status& status) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.is_ok()) failure_ = status;
  }
  cv_.notify_all();
}

Result<proto::Message> Mailbox::wait(const std::function<bool(const proto::Message&)>& match) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    for (auto it = messages_.begin(); it != messages_.end(); ++it) {
      if (match(*it)) {
        proto::Message out = std::move(*it);
        messages_.erase(it);
        return out;
      }
    }
    if (!failure_.is_ok()) return failure_;
    cv_.wait(lock);
  }
}

OpChannel::OpChannel() : event_fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {}

OpChannel::~OpChannel() {
  if (event_fd_ >= 0) ::close(event_fd_);
}

void OpChannel::push(proto::Message message) {
  // CollectiveAbort: nobody waits for the message itself; its report follows (the
  // collective sends it once its ring has stopped).
  if (std::holds_alternative<proto::CollectiveAbort>(message)) return signal();
  const auto* result = std::get_if<proto::CollectiveResult>(&message);
  const bool stop = result != nullptr && result->status != LOCKSTEP_OK;
  const bool settled = result != nullptr && !stop;
  if (!messages_.push(std::move(message)) || stop) return signal();
  if (settled) {
    settled_ = true;
    const std::uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(event_fd_, &one, sizeof one);
  }
}

void OpChannel::abort(const Status& status) {
  messages_.fail(status);
  signal();
}

void OpChannel::signal() {
  aborted_ = true;
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t n = ::write(event_fd_, &one, sizeof one);
}

}  // namespace lockstep::peer
