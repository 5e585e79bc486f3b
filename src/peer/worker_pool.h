// Threads that run async collectives. Starting a thread per all-reduce costs tens of
// microseconds, a visible part of a small collective; finished workers wait here for the
// next one instead. The pool grows to the number of collectives in flight (bounded by the
// caller: tags in flight) and keeps at most kIdleWorkersMax idle threads.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <list>
#include <mutex>
#include <thread>

namespace lockstep::peer {

class WorkerPool {
 public:
  static constexpr std::size_t kIdleWorkersMax = 16;

  WorkerPool() = default;
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;
  ~WorkerPool() { stop(); }

  // Runs `task` on an idle worker, or on a new one when none is idle.
  void submit(std::function<void()> task) {
    std::unique_lock<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
    if (idle_ >= tasks_.size()) {
      lock.unlock();
      cv_.notify_one();
      return;
    }
    reap_locked();
    threads_.emplace_back([this] { work(); });
  }

  // Waits for every submitted task to finish and joins every worker.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    std::list<std::thread> threads;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      threads.swap(threads_);
      threads.splice(threads.end(), exited_);
    }
    for (auto& t : threads) t.join();
  }

 private:
  void work() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      if (!tasks_.empty()) {
        auto task = std::move(tasks_.front());
        tasks_.pop_front();
        lock.unlock();
        task();
        lock.lock();
        continue;
      }
      if (stopping_ || idle_ >= kIdleWorkersMax) break;
      ++idle_;
      cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
      --idle_;
    }
    // Hand this thread to the next submit() or stop() to join.
    for (auto it = threads_.begin(); it != threads_.end(); ++it) {
      if (it->get_id() == std::this_thread::get_id()) {
        exited_.splice(exited_.end(), threads_, it);
        break;
      }
    }
  }
  // Joins workers that left (they hold no lock and return at once).
  void reap_locked() {
    for (auto& t : exited_) t.join();
    exited_.clear();
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  std::list<std::thread> threads_;
  std::list<std::thread> exited_;
  std::size_t idle_ = 0;
  bool stopping_ = false;
};

}  // namespace lockstep::peer
