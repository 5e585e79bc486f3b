// lockstep-status: the run as the master's status page shows it, in a terminal
// (docs/operations.md). It reads the master's /api/state over HTTP (the endpoint of
// lockstep-master --http, with its access token if it has one) and prints the peers of
// every group with rank, state and address, the ring, the open votes and whom they wait
// for, and the throughput; once, or refreshing in place (--watch); --json prints the
// document as served, for scripts. --evict PEER asks the master to remove a peer.
//
// Exit codes (every failure also prints one line on stderr saying why):
//   0 done; 2 bad usage or an unreadable token file; 3 the master's HTTP endpoint cannot
//   be reached; 4 refused: no token or a wrong one (401); 5 an answer that is not what a
//   lockstep master sends (another HTTP status, malformed JSON); 6 the eviction was
//   refused (no such peer: 404; the master has no token: 403).
#include "security/crypto.h"
#include "transport/socket.h"

#include <CLI/CLI.hpp>
#include <httplib.h>
#include <nlohmann/json.hpp>

#include <cctype>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using nlohmann::json;

enum Exit : int {
  kOk = 0,
  kUsage = 2,
  kUnreachable = 3,
  kUnauthorized = 4,
  kBadAnswer = 5,
  kEvictRefused = 6,
};

// Every wait of this tool is bounded.
constexpr auto kConnectTimeout = std::chrono::seconds(5);
constexpr auto kReadTimeout = std::chrono::seconds(10);
// The largest /api/state this tool accepts (a run of thousands of peers stays far below).
constexpr std::size_t kStateBytesMax = 64u << 20;

struct Failure {
  int code = kOk;
  std::string message;
};

struct Endpoint {
  std::string host;
  int port = 0;
  std::string token;
};

std::optional<Endpoint> parse_endpoint(std::string text) {
  if (text.rfind("http://", 0) == 0) text = text.substr(7);
  while (!text.empty() && text.back() == '/') text.pop_back();
  const auto split = lockstep::transport::split_host_port(text);
  if (!split || split->second == 0) return std::nullopt;
  Endpoint e;
  e.host = split->first;
  e.port = split->second;
  return e;
}

httplib::Client client_for(const Endpoint& e) {
  httplib::Client client(e.host, e.port);
  client.set_connection_timeout(kConnectTimeout);
  client.set_read_timeout(kReadTimeout);
  client.set_write_timeout(kReadTimeout);
  client.set_keep_alive(false);
  if (!e.token.empty()) client.set_bearer_token_auth(e.token);
  return client;
}

std::string where(const Endpoint& e) { return lockstep::transport::join_host_port(e.host, static_cast<std::uint16_t>(e.port)); }

// What the master said when it was not 200, as one line.
std::string error_text(const httplib::Result& r) {
  try {
    const json j = json::parse(r->body);
    if (j.is_object() && j.contains("error") && j["error"].is_string()) return j["error"].get<std::string>();
  } catch (const json::exception&) {
  }
  return r->body.substr(0, 200);
}

Failure http_failure(const Endpoint& e, const httplib::Result& r, const std::string& what) {
  if (!r) {
    return {kUnreachable, "cannot reach the master's HTTP endpoint at " + where(e) + ": " + httplib::to_string(r.error())};
  }
  if (r->status == 401) {
    return {kUnauthorized, where(e) + " refused " + what + " (401): " +
                               (e.token.empty() ? "it requires an access token (--token-file)" : "the access token is wrong")};
  }
  return {kBadAnswer, where(e) + " answered " + what + " with HTTP " + std::to_string(r->status) + ": " + error_text(r)};
}

// The /api/state document: its text as served, and parsed.
struct State {
  std::string body;
  json doc;
};

std::optional<State> fetch_state(const Endpoint& e, Failure* failure) {
  auto client = client_for(e);
  auto r = client.Get("/api/state");
  if (!r || r->status != 200) {
    *failure = http_failure(e, r, "GET /api/state");
    return std::nullopt;
  }
  if (r->body.size() > kStateBytesMax) {
    *failure = {kBadAnswer, where(e) + ": /api/state is larger than " + std::to_string(kStateBytesMax) + " bytes"};
    return std::nullopt;
  }
  State s;
  s.body = r->body;
  try {
    s.doc = json::parse(s.body);
  } catch (const json::exception& ex) {
    *failure = {kBadAnswer, where(e) + ": /api/state is not JSON (" + std::string(ex.what()) + ")"};
    return std::nullopt;
  }
  for (const char* field : {"peers", "groups", "operations"}) {
    if (!s.doc.is_object() || !s.doc.contains(field) || !s.doc[field].is_array()) {
      *failure = {kBadAnswer, where(e) + ": /api/state has no '" + std::string(field) +
                                  "' list; is this a lockstep master's HTTP endpoint?"};
      return std::nullopt;
    }
  }
  return s;
}

// ---------------------------------------------------------------- the text view

std::string str(const json& j, const char* key, const std::string& fallback = "-") {
  if (!j.is_object() || !j.contains(key) || j[key].is_null()) return fallback;
  const json& v = j[key];
  if (v.is_string()) return v.get<std::string>();
  return v.dump();
}

double num(const json& j, const char* key) {
  if (!j.is_object() || !j.contains(key) || !j[key].is_number()) return 0;
  return j[key].get<double>();
}

std::string bytes_per_s(double rate) {
  const char* units[] = {"B/s", "kB/s", "MB/s", "GB/s", "TB/s"};
  std::size_t u = 0;
  while (rate >= 1000 && u + 1 < std::size(units)) {
    rate /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", rate, units[u]);
  return buf;
}

std::string seconds(double ms) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", ms / 1000);
  return buf;
}

std::string join_ids(const json& list, std::size_t shown_max = 16) {
  std::string out;
  std::size_t n = 0;
  for (const auto& id : list) {
    if (n == shown_max) {
      out += " ... (" + std::to_string(list.size() - shown_max) + " more)";
      break;
    }
    out += (n++ == 0 ? "" : " ") + (id.is_string() ? id.get<std::string>() : id.dump());
  }
  return out;
}

std::string pad(std::string text, std::size_t width) {
  if (text.size() < width) text.append(width - text.size(), ' ');
  return text;
}

std::string render_text(const State& s, const Endpoint& e) {
  const json& d = s.doc;
  std::ostringstream out;
  std::size_t accepted = 0;
  std::size_t waiting = 0;
  for (const auto& p : d["peers"]) (str(p, "phase") == "ACCEPTED" ? accepted : waiting) += 1;
  out << "lockstep run at " << where(e) << ": epoch " << str(d, "epoch") << ", topology " << str(d, "topology_phase")
      << ", master up " << seconds(num(d, "now_ms")) << "\n";
  const json counters = d.value("counters", json::object());
  const json ops = counters.value("operations", json::object());
  const auto outcome = [&](const char* op) {
    const json o = ops.value(op, json::object());
    return std::to_string(static_cast<long long>(num(o, "succeeded"))) + " ok / " +
           std::to_string(static_cast<long long>(num(o, "failed"))) + " failed";
  };
  out << "peers: " << accepted << " accepted, " << waiting << " waiting; all-reduces " << outcome("all_reduce")
      << "; syncs " << outcome("shared_state_sync") << "\n";
  // Throughput over the last ten seconds of the history (one entry per second).
  if (d.contains("throughput") && d["throughput"].is_array() && !d["throughput"].empty()) {
    const json& t = d["throughput"];
    const std::size_t n = std::min<std::size_t>(10, t.size());
    double reduce = 0;
    double sync = 0;
    for (std::size_t i = t.size() - n; i < t.size(); ++i) {
      reduce += num(t[i], "all_reduce");
      sync += num(t[i], "shared_state_sync");
    }
    out << "throughput (last " << n << " s): all-reduce " << bytes_per_s(reduce / static_cast<double>(n))
        << ", shared-state sync " << bytes_per_s(sync / static_cast<double>(n)) << "\n";
  }

  // Peers by group: the ring in rank order, then those waiting to join.
  std::map<long long, std::vector<json>> by_group;
  for (const auto& p : d["peers"]) by_group[static_cast<long long>(num(p, "group"))].push_back(p);
  std::map<long long, json> groups;
  for (const auto& g : d["groups"]) groups[static_cast<long long>(num(g, "group"))] = g;
  for (const auto& [id, g] : groups) by_group[id];  // a group with a revision but no peer
  for (auto& [group, peers] : by_group) {
    const json g = groups.count(group) != 0 ? groups[group] : json::object();
    out << "\ngroup " << group;
    if (g.contains("ring") && g["ring"].is_array() && !g["ring"].empty()) {
      out << ": ring " << join_ids(g["ring"], 32) << " (back to the first)";
    } else {
      out << ": no ring";
    }
    out << "; revision " << str(g, "revision", "none") << "; major operation " << str(g, "major_operation", "NONE");
    if (g.contains("bottleneck_bytes_per_s") && g["bottleneck_bytes_per_s"].is_number()) {
      out << "; bottleneck " << bytes_per_s(num(g, "bottleneck_bytes_per_s"));
    }
    out << "\n";
    std::stable_sort(peers.begin(), peers.end(), [](const json& a, const json& b) {
      const bool ra = a.contains("rank") && a["rank"].is_number();
      const bool rb = b.contains("rank") && b["rank"].is_number();
      if (ra != rb) return ra;
      return ra && a["rank"].get<long long>() < b["rank"].get<long long>();
    });
    out << "  " << pad("RANK", 6) << pad("PEER", 18) << pad("STATE", 24) << pad("PHASE", 12) << pad("ADDRESS", 24)
        << "LAST SEEN\n";
    for (const auto& p : peers) {
      std::string state = str(p, "state");
      if (p.value("collective_in_flight", false)) state += "+collective";
      out << "  " << pad(str(p, "rank"), 6) << pad(str(p, "id"), 18) << pad(state, 24) << pad(str(p, "phase"), 12)
          << pad(str(p, "host") + ":" + str(p, "p2p_port"), 24) << seconds(num(p, "last_seen_ms_ago")) << " ago\n";
    }
  }

  out << "\nopen votes and operations:";
  if (d["operations"].empty()) out << " none";
  out << "\n";
  for (const auto& o : d["operations"]) {
    out << "  " << str(o, "operation");
    if (o.contains("group") && o["group"].is_number()) out << " (group " << str(o, "group") << ")";
    else out << " (run-wide)";
    if (num(o, "tag") != 0) out << " tag " << str(o, "tag");
    out << ", " << str(o, "phase") << ", " << seconds(num(o, "age_ms")) << ", " << o.value("done", json::array()).size()
        << " done";
    const json waiting_for = o.value("waiting", json::array());
    if (!waiting_for.empty()) out << ", waiting for " << join_ids(waiting_for);
    if (o.value("stalled", false)) out << "  [STALLED]";
    out << "\n";
  }
  return out.str();
}

// ---------------------------------------------------------------- eviction

std::string percent_encoded(const std::string& text) {
  std::string out;
  for (const char ch : text) {
    const auto c = static_cast<unsigned char>(ch);
    if (std::isalnum(c) != 0 || c == '-' || c == '_' || c == '.' || c == '~') {
      out += static_cast<char>(c);
    } else {
      char buf[4];
      std::snprintf(buf, sizeof buf, "%%%02X", c);
      out += buf;
    }
  }
  return out;
}

int evict(const Endpoint& e, const std::string& peer) {
  auto client = client_for(e);
  auto r = client.Post("/api/peers/" + percent_encoded(peer) + "/evict", "", "text/plain");
  if (r && r->status == 200) {
    std::string name = peer;
    try {
      name = json::parse(r->body).value("evicted", peer);
    } catch (const json::exception&) {
    }
    std::printf("evicted %s\n", name.c_str());
    return kOk;
  }
  if (r && (r->status == 404 || r->status == 403)) {
    std::fprintf(stderr, "lockstep-status: %s refused the eviction of %s (%d): %s\n", where(e).c_str(), peer.c_str(),
                 r->status, error_text(r).c_str());
    return kEvictRefused;
  }
  const Failure f = http_failure(e, r, "the eviction");
  std::fprintf(stderr, "lockstep-status: %s\n", f.message.c_str());
  return f.code;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"lockstep-status: the run as the master's status page shows it (lockstep-master --http)"};
  std::string http;
  std::string token_file;
  double watch_s = 2;
  bool as_json = false;
  std::string evict_peer;
  app.add_option("--http", http, "HOST:PORT of the master's HTTP endpoint (its --http)")->required();
  app.add_option("--token-file", token_file, "file holding the master's HTTP access token (its --http-token-file)")
      ->envname("LOCKSTEP_HTTP_TOKEN_FILE");
  auto* watch = app.add_option("--watch", watch_s, "refresh in place every SECONDS (default 2) until interrupted")
                    ->expected(0, 1)
                    ->default_str("2")
                    ->check(CLI::Range(0.1, 3600.0));
  app.add_flag("--json", as_json, "print the /api/state document as the master serves it (with --watch: one per line)");
  app.add_option("--evict", evict_peer, "ask the master to remove this peer (its id as shown, e.g. p3-5c1e0a); needs the token")
      ->excludes(watch);
  CLI11_PARSE(app, argc, argv);

  auto endpoint = parse_endpoint(http);
  if (!endpoint) {
    std::fprintf(stderr, "lockstep-status: --http must be HOST:PORT, got '%s'\n", http.c_str());
    return kUsage;
  }
  if (!token_file.empty()) {
    auto token = lockstep::security::load_token_file(token_file);
    if (!token.is_ok()) {
      std::fprintf(stderr, "lockstep-status: %s\n", token.status().message().c_str());
      return kUsage;
    }
    endpoint->token = token.value();
  }
  if (!evict_peer.empty()) return evict(*endpoint, evict_peer);

  const bool watching = watch->count() > 0;
  for (;;) {
    Failure failure;
    const auto state = fetch_state(*endpoint, &failure);
    if (watching && !as_json) std::fputs("\x1b[H\x1b[2J", stdout);  // home, clear
    if (state) {
      if (as_json) {
        std::string body = state->body;
        if (watching) {  // one document per line
          body = state->doc.dump();
        }
        if (body.empty() || body.back() != '\n') body += '\n';
        std::fputs(body.c_str(), stdout);
      } else {
        std::fputs(render_text(*state, *endpoint).c_str(), stdout);
      }
    } else if (!watching) {
      std::fprintf(stderr, "lockstep-status: %s\n", failure.message.c_str());
      return failure.code;
    } else {
      std::fprintf(as_json ? stderr : stdout, "lockstep-status: %s (retrying every %.1f s)\n", failure.message.c_str(),
                   watch_s);
    }
    std::fflush(stdout);
    if (!watching) return kOk;
    std::this_thread::sleep_for(std::chrono::duration<double>(watch_s));
  }
}
