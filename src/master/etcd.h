// The hot standby's election on etcd (docs/operations.md, "Hot standby"), over etcd's
// v3 JSON gateway (HTTP POST of JSON to /v3/...; keys and values in base64, 64-bit
// numbers as decimal strings). Every master of a run competes for one key: it grants
// itself a lease, then creates the key under that lease in a transaction that succeeds
// only while the key does not exist. The winner serves; its term is the revision at
// which the key was created (etcd's revisions only grow, so every later winner's term is
// higher); it renews the lease every third of the TTL and checks that the key is still
// its own. The others poll the key and compete when it is gone: when the serving master
// revokes its lease (a clean stop), or when the lease expires (a crash, a partition).
//
// The functions of etcd:: build the requests and read the answers, without IO, for the
// unit tests; EtcdElection does the HTTP, on cpp-httplib, from a thread of its own.
#pragma once

#include "common/status.h"
#include "master/election.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lockstep::master {

struct EtcdOptions {
  // Base URLs of the cluster's members ("http://10.0.0.5:2379"), tried in turn.
  std::vector<std::string> endpoints;
  // The key the masters of one run compete for: one key per run.
  std::string key = "/lockstep/master";
  std::uint32_t lease_ttl_s = 5;
};

// Checks the options (the endpoints' form, the key's length, the TTL's bounds);
// INVALID_ARGUMENT naming what is wrong.
Status check_etcd_options(const EtcdOptions& options);
// Splits "http://h1:2379,http://h2:2379" into endpoints.
std::vector<std::string> split_endpoints(std::string_view list);
// The election (unstarted); the options must have passed check_etcd_options.
std::shared_ptr<Election> make_etcd_election(EtcdOptions options);

namespace etcd {

std::string base64(std::string_view bytes);
// INVALID_ARGUMENT if `text` is not base64.
Result<std::string> unbase64(std::string_view text);

struct Lease {
  std::int64_t id = 0;
  std::int64_t ttl_s = 0;  // as granted
};
struct KeyValue {
  std::string value;
  std::int64_t create_revision = 0;
};
struct Campaign {
  bool won = false;
  std::int64_t revision = 0;  // won: the revision that created the key (the term)
  KeyValue holder;            // lost: the key as it is
};

// The body of each request; the path is the constant beside it.
inline constexpr const char* kGrantPath = "/v3/lease/grant";
inline constexpr const char* kCampaignPath = "/v3/kv/txn";
inline constexpr const char* kKeepAlivePath = "/v3/lease/keepalive";
inline constexpr const char* kRevokePath = "/v3/lease/revoke";
inline constexpr const char* kRangePath = "/v3/kv/range";
std::string grant_request(std::uint32_t ttl_s);
std::string campaign_request(const std::string& key, const std::string& value, std::int64_t lease);
std::string lease_request(std::int64_t lease);  // keep-alive and revoke
std::string range_request(const std::string& key);

// Each answer read; a body that is not such an answer, or etcd's error object, is an
// error naming what etcd said.
Result<Lease> parse_grant(std::string_view body);
Result<Campaign> parse_campaign(std::string_view body);
// The lease's remaining TTL in seconds; 0: it has expired.
Result<std::int64_t> parse_keep_alive(std::string_view body);
// The key, or none if it does not exist.
Result<std::optional<KeyValue>> parse_range(std::string_view body);

}  // namespace etcd
}  // namespace lockstep::master
