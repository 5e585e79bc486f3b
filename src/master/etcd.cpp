#include "master/etcd.h"

#include "common/limits.h"
#include "common/log.h"

#include <httplib.h>
#include <nlohmann/json.hpp>
#include <sodium.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace lockstep::master {
namespace etcd {
namespace {

using json = nlohmann::json;

Status bad(const std::string& what) {
  return Status(LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED, "etcd: " + what);
}

// The body as a JSON object; etcd's error object ({"error": ..., "code": N}) and anything
// that is not an object are errors.
Result<json> object_of(std::string_view body) {
  json root = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) return bad("the answer is not a JSON object");
  if (const auto e = root.find("error"); e != root.end()) {
    const auto message = root.find("message");
    const json& text = message != root.end() && message->is_string() ? *message : *e;
    return bad("error: " + (text.is_string() ? text.get<std::string>() : text.dump()));
  }
  return root;
}

// A 64-bit number the gateway writes as a decimal string (or, leniently, a number);
// absent: 0 (the gateway omits zero values).
Result<std::int64_t> int_field(const json& object, const char* name) {
  const auto it = object.find(name);
  if (it == object.end()) return std::int64_t{0};
  if (it->is_number_integer()) return it->get<std::int64_t>();
  if (it->is_string()) {
    const auto& text = it->get_ref<const std::string&>();
    std::int64_t value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (ec == std::errc() && end == text.data() + text.size()) return value;
  }
  return bad(std::string("field '") + name + "' is not a 64-bit integer");
}

Result<std::string> bytes_field(const json& object, const char* name) {
  const auto it = object.find(name);
  if (it == object.end()) return std::string();
  if (!it->is_string()) return bad(std::string("field '") + name + "' is not a string");
  return unbase64(it->get_ref<const std::string&>());
}

Result<KeyValue> key_value(const json& kv) {
  if (!kv.is_object()) return bad("a key-value is not an object");
  auto value = bytes_field(kv, "value");
  if (!value.is_ok()) return value.status();
  auto revision = int_field(kv, "create_revision");
  if (!revision.is_ok()) return revision.status();
  return KeyValue{std::move(value.value()), revision.value()};
}

// The first key of a range answer, if any.
Result<std::optional<KeyValue>> first_kv(const json& range) {
  const auto kvs = range.find("kvs");
  if (kvs == range.end()) return std::optional<KeyValue>();
  if (!kvs->is_array()) return bad("'kvs' is not an array");
  if (kvs->empty()) return std::optional<KeyValue>();
  auto kv = key_value(kvs->front());
  if (!kv.is_ok()) return kv.status();
  return std::optional<KeyValue>(std::move(kv.value()));
}

}  // namespace

std::string base64(std::string_view bytes) {
  std::string out(sodium_base64_encoded_len(bytes.size(), sodium_base64_VARIANT_ORIGINAL), '\0');
  sodium_bin2base64(out.data(), out.size(), reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size(),
                    sodium_base64_VARIANT_ORIGINAL);
  out.resize(std::strlen(out.c_str()));
  return out;
}

Result<std::string> unbase64(std::string_view text) {
  std::string out(text.size() / 4 * 3 + 3, '\0');
  std::size_t length = 0;
  const char* end = nullptr;
  if (sodium_base642bin(reinterpret_cast<unsigned char*>(out.data()), out.size(), text.data(), text.size(), nullptr,
                        &length, &end, sodium_base64_VARIANT_ORIGINAL) != 0 ||
      end != text.data() + text.size()) {
    return bad("a key or value is not base64");
  }
  out.resize(length);
  return out;
}

std::string grant_request(std::uint32_t ttl_s) { return json{{"TTL", ttl_s}}.dump(); }

std::string campaign_request(const std::string& key, const std::string& value, std::int64_t lease) {
  const std::string k = base64(key);
  return json{{"compare", json::array({json{{"key", k}, {"target", "CREATE"}, {"create_revision", "0"}}})},
              {"success", json::array({json{{"request_put",
                                             json{{"key", k}, {"value", base64(value)}, {"lease", std::to_string(lease)}}}}})},
              {"failure", json::array({json{{"request_range", json{{"key", k}}}}})}}
      .dump();
}

std::string lease_request(std::int64_t lease) { return json{{"ID", std::to_string(lease)}}.dump(); }

std::string range_request(const std::string& key) { return json{{"key", base64(key)}}.dump(); }

Result<Lease> parse_grant(std::string_view body) {
  auto root = object_of(body);
  if (!root.is_ok()) return root.status();
  auto id = int_field(root.value(), "ID");
  if (!id.is_ok()) return id.status();
  auto ttl = int_field(root.value(), "TTL");
  if (!ttl.is_ok()) return ttl.status();
  if (id.value() == 0 || ttl.value() <= 0) return bad("the lease grant names no lease");
  return Lease{id.value(), ttl.value()};
}

Result<Campaign> parse_campaign(std::string_view body) {
  auto root = object_of(body);
  if (!root.is_ok()) return root.status();
  const json& r = root.value();
  Campaign campaign;
  if (const auto s = r.find("succeeded"); s != r.end()) {
    if (!s->is_boolean()) return bad("'succeeded' is not a boolean");
    campaign.won = s->get<bool>();
  }
  if (campaign.won) {
    const auto header = r.find("header");
    if (header == r.end() || !header->is_object()) return bad("the transaction's answer has no header");
    auto revision = int_field(*header, "revision");
    if (!revision.is_ok()) return revision.status();
    if (revision.value() <= 0) return bad("the transaction's answer has no revision");
    campaign.revision = revision.value();
    return campaign;
  }
  // Lost: the failure branch's range names the holder (none if the key went meanwhile).
  const auto responses = r.find("responses");
  if (responses == r.end() || !responses->is_array() || responses->empty()) return campaign;
  const auto range = responses->front().find("response_range");
  if (range == responses->front().end() || !range->is_object()) return bad("the transaction's answer has no range");
  auto kv = first_kv(*range);
  if (!kv.is_ok()) return kv.status();
  if (kv.value()) campaign.holder = std::move(*kv.value());
  return campaign;
}

Result<std::int64_t> parse_keep_alive(std::string_view body) {
  // The gateway streams keep-alive answers: one object per line, here exactly one.
  while (!body.empty() && (body.back() == '\n' || body.back() == '\r')) body.remove_suffix(1);
  auto root = object_of(body);
  if (!root.is_ok()) return root.status();
  const auto result = root.value().find("result");
  if (result == root.value().end() || !result->is_object()) return bad("the keep-alive answer has no result");
  auto ttl = int_field(*result, "TTL");
  if (!ttl.is_ok()) return ttl.status();
  return std::max<std::int64_t>(ttl.value(), 0);
}

Result<std::optional<KeyValue>> parse_range(std::string_view body) {
  auto root = object_of(body);
  if (!root.is_ok()) return root.status();
  return first_kv(root.value());
}

}  // namespace etcd

std::vector<std::string> split_endpoints(std::string_view list) {
  std::vector<std::string> out;
  while (!list.empty()) {
    const auto comma = list.find(',');
    std::string_view item = list.substr(0, comma);
    while (!item.empty() && item.front() == ' ') item.remove_prefix(1);
    while (!item.empty() && item.back() == ' ') item.remove_suffix(1);
    if (!item.empty()) out.emplace_back(item);
    if (comma == std::string_view::npos) break;
    list.remove_prefix(comma + 1);
  }
  return out;
}

Status check_etcd_options(const EtcdOptions& options) {
  const auto invalid = [](const std::string& what) { return Status(LOCKSTEP_STATUS_INVALID_ARGUMENT, what); };
  if (options.endpoints.empty()) return invalid("the hot standby needs at least one etcd endpoint (http://HOST:PORT)");
  if (options.endpoints.size() > limits::kHaEndpointsMax) {
    return invalid("at most " + std::to_string(limits::kHaEndpointsMax) + " etcd endpoints");
  }
  for (const auto& endpoint : options.endpoints) {
    const std::string_view rest = std::string_view(endpoint).substr(std::min<std::size_t>(endpoint.size(), 7));
    const auto colon = rest.rfind(':');
    if (endpoint.rfind("http://", 0) != 0 || rest.empty() || colon == std::string_view::npos || colon == 0 ||
        colon + 1 == rest.size() || rest.find('/') != std::string_view::npos ||
        rest.substr(colon + 1).find_first_not_of("0123456789") != std::string_view::npos) {
      return invalid("etcd endpoint '" + endpoint + "' is not of the form http://HOST:PORT (https is not supported)");
    }
  }
  if (options.key.empty() || options.key.size() > limits::kHaKeyBytesMax) {
    return invalid("the election key must have 1 to " + std::to_string(limits::kHaKeyBytesMax) + " bytes");
  }
  if (options.lease_ttl_s < limits::kHaLeaseTtlSecondsMin || options.lease_ttl_s > limits::kHaLeaseTtlSecondsMax) {
    return invalid("the lease TTL must be " + std::to_string(limits::kHaLeaseTtlSecondsMin) + " to " +
                   std::to_string(limits::kHaLeaseTtlSecondsMax) + " s");
  }
  return Status::ok();
}

namespace {

constexpr const char* kLog = "election";

class EtcdElection final : public Election {
 public:
  explicit EtcdElection(EtcdOptions options) : options_(std::move(options)) {}
  ~EtcdElection() override { stop(); }

  void start(const std::string& self, Handlers handlers) override {
    self_ = self;
    handlers_ = std::move(handlers);
    thread_ = std::thread([this] { run(); });
  }

  void resign() override {
    std::lock_guard<std::mutex> lock(mutex_);
    resign_ = true;
    cv_.notify_all();
  }

  void stop() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  std::string holder() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return holder_;
  }

  std::string describe() const override {
    std::string endpoints;
    for (const auto& e : options_.endpoints) endpoints += (endpoints.empty() ? "" : ",") + e;
    return "etcd " + endpoints + ", key " + options_.key;
  }

  std::chrono::milliseconds lease_ttl() const override { return std::chrono::seconds(options_.lease_ttl_s); }

 private:
  // One request, to the endpoint that answered last, else to the others in turn.
  Result<std::string> post(const char* path, const std::string& body) {
    std::string failures;
    for (std::size_t i = 0; i < options_.endpoints.size(); ++i) {
      const std::size_t at = (current_ + i) % options_.endpoints.size();
      httplib::Client client(options_.endpoints[at]);
      const auto timeout = std::chrono::milliseconds(limits::kEtcdRequestTimeoutMs);
      client.set_connection_timeout(timeout);
      client.set_read_timeout(timeout);
      client.set_write_timeout(timeout);
      httplib::Request request;
      request.method = "POST";
      request.path = path;
      request.body = body;
      request.set_header("Content-Type", "application/json");
      std::string answer;
      bool too_long = false;
      request.content_receiver = [&](const char* data, std::size_t n, std::uint64_t, std::uint64_t) {
        too_long = answer.size() + n > limits::kEtcdResponseBytesMax;
        if (!too_long) answer.append(data, n);
        return !too_long;
      };
      httplib::Response response;
      httplib::Error error = httplib::Error::Success;
      const bool sent = client.send(request, response, error);
      std::string failure;
      if (too_long) {
        failure = "answer above " + std::to_string(limits::kEtcdResponseBytesMax) + " bytes";
      } else if (!sent) {
        failure = httplib::to_string(error);
      } else if (response.status != 200) {
        // etcd's error object says why; it is read (and named) by the caller's parse.
        if (answer.find("\"error\"") == std::string::npos) failure = "HTTP status " + std::to_string(response.status);
      }
      if (failure.empty()) {
        current_ = at;
        return answer;
      }
      failures += (failures.empty() ? "" : "; ") + options_.endpoints[at] + ": " + failure;
    }
    return Status(LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED, "etcd unreachable (" + failures + ")");
  }

  // Sleeps for `duration` or until stop() or resign(); false when it should stop.
  bool pause(std::chrono::milliseconds duration) {
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait_for(lock, duration, [&] { return stopping_ || (leader_ && resign_); });
    return !stopping_;
  }

  void reachable(const Status& status) {
    if (status.is_ok() == reachable_) return;
    reachable_ = status.is_ok();
    if (reachable_) {
      LOG_INFO(kLog, "etcd answers again (" << describe() << ")");
    } else {
      LOG_WARN(kLog, status.message());
    }
  }

  void set_holder(std::string holder) {
    std::lock_guard<std::mutex> lock(mutex_);
    holder_ = std::move(holder);
  }

  void revoke() {
    if (lease_ == 0) return;
    (void)post(etcd::kRevokePath, etcd::lease_request(lease_));
    lease_ = 0;
  }

  void run() {
    LOG_INFO(kLog, "competing for the run as " << self_ << " (" << describe() << ")");
    while (true) {
      bool resigned = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopping_) break;
        resigned = std::exchange(resign_, false) && leader_;
      }
      if (resigned) {
        LOG_WARN(kLog, "resigned the lease; a standby may take the run over");
        revoke();
        set_leader(false);
        // Another master takes the key first, where there is one.
        if (!pause(lease_ttl())) break;
        continue;
      }
      if (leader()) {
        if (!pause(lease_ttl() / 3)) break;
        if (leader() && !resign_requested()) renew();
      } else {
        campaign();
        if (!leader() && !pause(std::chrono::milliseconds(limits::kHaStandbyPollMs))) break;
      }
    }
    if (leader()) {
      revoke();
      LOG_INFO(kLog, "released the lease: a standby takes the run over");
    }
  }

  bool leader() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return leader_;
  }
  bool resign_requested() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return resign_;
  }
  void set_leader(bool leader) {
    std::lock_guard<std::mutex> lock(mutex_);
    leader_ = leader;
    resign_ = false;
  }

  // A standby's round: is the key free? Then try to take it.
  void campaign() {
    auto range = post(etcd::kRangePath, etcd::range_request(options_.key));
    auto current = range.is_ok() ? etcd::parse_range(range.value()) : Result<std::optional<etcd::KeyValue>>(range.status());
    reachable(current.status());
    if (!current.is_ok()) return;
    if (current.value()) return set_holder(current.value()->value);
    const auto sent = Clock::now();
    auto granted = post(etcd::kGrantPath, etcd::grant_request(options_.lease_ttl_s));
    auto lease = granted.is_ok() ? etcd::parse_grant(granted.value()) : Result<etcd::Lease>(granted.status());
    reachable(lease.status());
    if (!lease.is_ok()) return;
    lease_ = lease.value().id;
    auto answer = post(etcd::kCampaignPath, etcd::campaign_request(options_.key, self_, lease_));
    auto campaign = answer.is_ok() ? etcd::parse_campaign(answer.value()) : Result<etcd::Campaign>(answer.status());
    reachable(campaign.status());
    if (!campaign.is_ok() || !campaign.value().won) {
      revoke();
      if (campaign.is_ok()) set_holder(campaign.value().holder.value);
      return;
    }
    term_ = campaign.value().revision;
    lease_until_ = sent + std::chrono::seconds(std::min<std::int64_t>(lease.value().ttl_s, options_.lease_ttl_s));
    set_holder(self_);
    set_leader(true);
    LOG_WARN(kLog, "won the lease: this master serves the run, term " << term_);
    handlers_.elected(static_cast<std::uint64_t>(term_), lease_until_);
  }

  // A leader's round: renew the lease, and check that the key is still this master's.
  void renew() {
    const auto sent = Clock::now();
    auto answer = post(etcd::kKeepAlivePath, etcd::lease_request(lease_));
    auto ttl = answer.is_ok() ? etcd::parse_keep_alive(answer.value()) : Result<std::int64_t>(answer.status());
    reachable(ttl.status());
    std::string why;
    if (!ttl.is_ok()) {
      if (Clock::now() < lease_until_) return;  // tried again in a third of the TTL
      why = "etcd did not renew the lease in time: " + ttl.status().message();
    } else if (ttl.value() == 0) {
      why = "the lease expired";
    } else {
      auto range = post(etcd::kRangePath, etcd::range_request(options_.key));
      auto current = range.is_ok() ? etcd::parse_range(range.value()) : Result<std::optional<etcd::KeyValue>>(range.status());
      if (!current.is_ok()) return;  // the renewal stands; the key is checked next time
      if (!current.value() || current.value()->create_revision != term_) {
        why = current.value() ? "the key names " + current.value()->value + " now" : "the key was deleted";
      } else {
        lease_until_ = sent + std::chrono::seconds(std::min<std::int64_t>(ttl.value(), options_.lease_ttl_s));
        handlers_.renewed(lease_until_);
        return;
      }
    }
    LOG_WARN(kLog, "lost the lease: " << why);
    revoke();
    set_leader(false);
    handlers_.lost(why);
  }

  const EtcdOptions options_;
  std::string self_;
  Handlers handlers_;
  std::thread thread_;
  // The election thread's own.
  std::size_t current_ = 0;  // the endpoint that answered last
  bool reachable_ = true;
  std::int64_t lease_ = 0;
  std::int64_t term_ = 0;
  Clock::time_point lease_until_{};
  // Shared with the callers.
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool resign_ = false;
  bool leader_ = false;
  std::string holder_;
};

}  // namespace

std::shared_ptr<Election> make_etcd_election(EtcdOptions options) {
  return std::make_shared<EtcdElection>(std::move(options));
}

}  // namespace lockstep::master
