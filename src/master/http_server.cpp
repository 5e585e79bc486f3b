// HttpServer implementation on cpp-httplib. Bounded in every direction: request bodies
// (kHttpRequestBytesMax), worker threads (kHttpWorkerThreads), connections waiting for a
// worker (kHttpQueuedConnectionsMax: beyond it the accept loop waits and the kernel's
// backlog holds the rest), socket timeouts, one request per connection (so that a
// browser's keep-alive connection cannot hold a worker), and the wait for the master's
// loop (kHttpRenderTimeoutMs; 503 after it).
#include "master/http_server.h"

#include "common/limits.h"
#include "common/log.h"
#include "master/status_page.h"
#include "security/crypto.h"

#include <httplib.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lockstep::master {
namespace {

constexpr const char* kLog = "http";

// httplib's own pool queues without bound; this one makes the accept loop wait instead.
class BoundedPool : public httplib::TaskQueue {
 public:
  BoundedPool(std::size_t threads, std::size_t queued_max) : queued_max_(queued_max) {
    for (std::size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { work(); });
  }
  ~BoundedPool() override = default;

  void enqueue(std::function<void()> fn) override {
    std::unique_lock<std::mutex> lock(mutex_);
    space_.wait(lock, [this] { return jobs_.size() < queued_max_ || shutdown_; });
    jobs_.push_back(std::move(fn));  // also after shutdown: the workers drain the queue
    ready_.notify_one();
  }

  void shutdown() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      shutdown_ = true;
    }
    ready_.notify_all();
    space_.notify_all();
    for (auto& t : threads_) t.join();
  }

 private:
  void work() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return !jobs_.empty() || shutdown_; });
        if (jobs_.empty()) return;  // shut down and drained
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      space_.notify_one();
      job();
    }
  }

  std::size_t queued_max_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::condition_variable space_;
  std::deque<std::function<void()>> jobs_;
  bool shutdown_ = false;
  std::vector<std::thread> threads_;
};

// Logs refused requests at most once per interval, with how many were not logged.
class RefusalLog {
 public:
  void refused(const std::string& what) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto now = std::chrono::steady_clock::now();
    if (logged_ && now - last_ < std::chrono::milliseconds(kRefusalLogIntervalMs)) {
      ++unlogged_;
      return;
    }
    LOG_WARN(kLog, "refused " << what
                              << (unlogged_ > 0 ? " (and " + std::to_string(unlogged_) + " more refusals not logged)" : ""));
    logged_ = true;
    last_ = now;
    unlogged_ = 0;
  }

 private:
  std::mutex mutex_;
  bool logged_ = false;
  std::chrono::steady_clock::time_point last_{};
  std::uint64_t unlogged_ = 0;
};

void set_json_error(httplib::Response& response, int status, const std::string& message) {
  response.status = status;
  std::string escaped;
  for (const char c : message) {
    if (c == '"' || c == '\\') escaped += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) escaped += c;
  }
  response.set_content("{\"error\": \"" + escaped + "\"}\n", "application/json");
}

}  // namespace

struct HttpServer::Impl {
  Impl(MasterServer& m, HttpOptions o) : master(m), options(std::move(o)) {}
  MasterServer& master;
  HttpOptions options;
  RefusalLog refusals;
  httplib::Server server;
  std::thread thread;
};

bool is_loopback_host(const std::string& host) {
  return host.rfind("127.", 0) == 0 || host == "localhost" || host == "::1" || host == "[::1]";
}

HttpServer::HttpServer(MasterServer& master, HttpOptions options)
    : impl_(std::make_unique<Impl>(master, std::move(options))) {}

HttpServer::~HttpServer() { stop(); }

Status HttpServer::start(const std::string& host, std::uint16_t port) {
  if (impl_->thread.joinable()) return Status(LOCKSTEP_STATUS_INVALID_USAGE, "the HTTP server is already started");
  if (impl_->options.token.empty() && !is_loopback_host(host)) {
    if (!impl_->options.insecure) {
      return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                    "HTTP on " + host + ", which is not a loopback address, needs an access token (or the insecure option)");
    }
    LOG_WARN(kLog, "serving HTTP on " << host << " without an access token: anyone who can reach it sees the run");
  }
  httplib::Server& server = impl_->server;
  MasterServer& master = impl_->master;
  Impl& impl = *impl_;
  server.new_task_queue = [] {
    return new BoundedPool(limits::kHttpWorkerThreads, limits::kHttpQueuedConnectionsMax);
  };
  const auto timeout = std::chrono::milliseconds(limits::kHttpSocketTimeoutMs);
  server.set_payload_max_length(limits::kHttpRequestBytesMax);
  server.set_read_timeout(timeout);
  server.set_write_timeout(timeout);
  server.set_keep_alive_max_count(1);
  const auto serve = [&master](View view, const char* content_type) {
    return [&master, view, content_type](const httplib::Request&, httplib::Response& response) {
      response.set_header("Cache-Control", "no-store");
      auto body = master.render(view, limits::kHttpRenderTimeoutMs);
      if (!body.is_ok()) {
        response.status = 503;
        response.set_content(body.status().message() + "\n", "text/plain; charset=utf-8");
        return;
      }
      response.set_content(std::move(body).value(), content_type);
    };
  };
  // Every request proves the token first (when there is one), before any route runs.
  server.set_pre_routing_handler([&impl](const httplib::Request& request, httplib::Response& response) {
    if (impl.options.token.empty()) return httplib::Server::HandlerResponse::Unhandled;
    const bool read_only = request.method == "GET" || request.method == "HEAD";
    const std::string header = request.get_header_value("Authorization");
    if (security::authorization_matches(header, impl.options.token, /*allow_basic=*/read_only)) {
      return httplib::Server::HandlerResponse::Unhandled;
    }
    impl.refusals.refused(request.method + " " + request.path + " from " + request.remote_addr + ": " +
                          (header.empty() ? "no access token" : "wrong access token"));
    response.set_header("WWW-Authenticate", "Bearer realm=\"lockstep\"");
    if (read_only) response.set_header("WWW-Authenticate", "Basic realm=\"lockstep\", charset=\"UTF-8\"");
    set_json_error(response, 401, "this endpoint requires its access token (Authorization: Bearer TOKEN)");
    return httplib::Server::HandlerResponse::Handled;
  });
  // The operator evicts a peer (lockstep-status --evict); only with a token.
  server.Post(R"(/api/peers/([^/]+)/evict)", [&impl, &master](const httplib::Request& request,
                                                              httplib::Response& response) {
    response.set_header("Cache-Control", "no-store");
    if (impl.options.token.empty()) {
      impl.refusals.refused("POST " + request.path + " from " + request.remote_addr + ": no access token is configured");
      return set_json_error(response, 403, "eviction needs the master's --http-token-file");
    }
    const std::string peer = request.matches[1];
    auto evicted = master.evict(peer, "requested over HTTP from " + request.remote_addr, limits::kHttpRenderTimeoutMs);
    if (!evicted.is_ok()) {
      const bool unknown = evicted.status().code() == LOCKSTEP_STATUS_INVALID_ARGUMENT;
      return set_json_error(response, unknown ? 404 : 503, evicted.status().message());
    }
    response.set_content("{\"evicted\": \"" + evicted.value() + "\"}\n", "application/json");
  });
  server.Get("/metrics", serve(View::kMetricsText, "text/plain; version=0.0.4; charset=utf-8"));
  server.Get("/api/state", serve(View::kStateJson, "application/json"));
  server.Get("/", [](const httplib::Request&, httplib::Response& response) {
    response.set_header("Cache-Control", "no-store");
    response.set_content(kStatusPageHtml, "text/html; charset=utf-8");
  });
  const int bound = port == 0 ? server.bind_to_any_port(host) : (server.bind_to_port(host, port) ? port : -1);
  if (bound <= 0) {
    return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT,
                  "cannot listen for HTTP on " + host + ":" + std::to_string(port));
  }
  port_ = static_cast<std::uint16_t>(bound);
  impl_->thread = std::thread([this] {
    if (!impl_->server.listen_after_bind()) LOG_WARN(kLog, "the HTTP server stopped with an error");
  });
  // stop() only acts on a running server: wait (bounded) until it runs.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!impl_->server.is_running() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  if (!impl_->server.is_running()) {
    LOG_WARN(kLog, "the HTTP server did not start");
  }
  return Status::ok();
}

void HttpServer::stop() {
  if (!impl_->thread.joinable()) return;
  impl_->server.stop();
  impl_->thread.join();
}

}  // namespace lockstep::master
