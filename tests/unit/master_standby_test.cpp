// The MasterServer's half of the hot standby (master_server.h, Options::election), with
// an election the test drives: a master refuses peers with NOT_SERVING until it is
// elected; elected, it serves with the election's term; it keeps serving while the
// lease is renewed, and stops serving by itself (telling its peers, and resigning) a
// fifth of the TTL before a lease that was not renewed would end. The election on etcd
// is tested against a real etcd in tests/e2e/standby_e2e_test.cpp.
#include "master/master_server.h"
#include "peer/communicator.h"
#include "security/crypto.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <mutex>
#include <thread>

namespace lockstep::master {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;

class FakeElection final : public Election {
 public:
  explicit FakeElection(std::chrono::milliseconds ttl) : ttl_(ttl) {}
  void start(const std::string& self, Handlers handlers) override {
    std::lock_guard<std::mutex> lock(mutex_);
    self_ = self;
    handlers_ = std::move(handlers);
  }
  void resign() override { ++resigned; }
  void stop() override {}
  std::string holder() const override {
    std::lock_guard<std::mutex> lock(mutex_);
    return holder_;
  }
  std::string describe() const override { return "a fake election"; }
  std::chrono::milliseconds lease_ttl() const override { return ttl_; }

  void set_holder(const std::string& holder) {
    std::lock_guard<std::mutex> lock(mutex_);
    holder_ = holder;
  }
  Handlers handlers() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return handlers_;
  }
  std::string self() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return self_;
  }
  std::atomic<int> resigned{0};

 private:
  const std::chrono::milliseconds ttl_;
  mutable std::mutex mutex_;
  std::string self_;
  std::string holder_;
  Handlers handlers_;
};

struct Fixture {
  explicit Fixture(std::chrono::milliseconds ttl, std::optional<security::Key> run_secret = std::nullopt)
      : election(std::make_shared<FakeElection>(ttl)), secret(run_secret) {
    Options options;
    options.secret = secret;
    options.listen_host = "127.0.0.1";
    options.listen_port = 0;
    options.election = election;
    server = std::make_unique<MasterServer>(options);
    EXPECT_TRUE(server->start().is_ok());
    // The election is started on the server's thread.
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (!election->handlers().elected && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  }
  json state() const {
    auto text = server->render(View::kStateJson, 5000);
    return text.is_ok() ? json::parse(text.value()) : json();
  }
  bool wait_serving(bool serving, std::chrono::milliseconds timeout) const {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      const json s = state();
      if (s.is_object() && s["ha"]["serving"].get<bool>() == serving) return true;
      std::this_thread::sleep_for(5ms);
    }
    return false;
  }
  Status connect(std::unique_ptr<peer::Communicator>* out) const { return connect(out, secret); }
  Status connect(std::unique_ptr<peer::Communicator>* out, const std::optional<security::Key>& peer_secret) const {
    peer::Options options;
    options.master_port = server->port();
    options.base_port = 0;
    options.secret = peer_secret;
    auto created = peer::Communicator::create(options);
    if (!created.is_ok()) return created.status();
    *out = std::move(created.value());
    return (*out)->connect();
  }
  std::shared_ptr<FakeElection> election;
  std::optional<security::Key> secret;
  std::unique_ptr<MasterServer> server;
};

TEST(MasterStandby, AStandbyRefusesPeersNamingTheServingMasterThenServesWithTheElectionsTerm) {
  Fixture f(60s);
  EXPECT_EQ(f.election->self(), "127.0.0.1:" + std::to_string(f.server->port()));
  std::unique_ptr<peer::Communicator> comm;
  Status refused = f.connect(&comm);
  EXPECT_EQ(refused.code(), LOCKSTEP_STATUS_NOT_SERVING) << refused.to_string();
  EXPECT_NE(refused.message().find("no master holds the run's lease yet"), std::string::npos) << refused.message();
  f.election->set_holder("10.9.8.7:48148");
  refused = f.connect(&comm);
  EXPECT_EQ(refused.code(), LOCKSTEP_STATUS_NOT_SERVING);
  EXPECT_NE(refused.message().find("served by 10.9.8.7:48148"), std::string::npos) << refused.message();
  EXPECT_FALSE(f.state()["ha"]["serving"].get<bool>());

  f.election->handlers().elected(77, Election::Clock::now() + 60s);
  ASSERT_TRUE(f.wait_serving(true, 10s));
  Status joined = f.connect(&comm);
  ASSERT_TRUE(joined.is_ok()) << joined.to_string();
  const json state = f.state();
  EXPECT_EQ(state["term"].get<int>(), 77) << state.dump();
  EXPECT_EQ(state["ha"]["elections"].get<int>(), 1);
  EXPECT_EQ(state["peers"].size(), 1u);
}

TEST(MasterStandby, WithASecretAStandbyNamesTheServingMasterOnlyToPeersThatProveIt) {
  Fixture f(60s, security::derive_secret_key("the run secret of this test").value());
  f.election->set_holder("10.9.8.7:48148");
  std::unique_ptr<peer::Communicator> comm;
  Status stranger = f.connect(&comm, security::derive_secret_key("a secret of another run").value());
  EXPECT_EQ(stranger.code(), LOCKSTEP_STATUS_AUTHENTICATION_FAILED) << stranger.to_string();
  EXPECT_EQ(stranger.message().find("10.9.8.7"), std::string::npos) << stranger.message();
  Status member = f.connect(&comm);
  EXPECT_EQ(member.code(), LOCKSTEP_STATUS_NOT_SERVING) << member.to_string();
  EXPECT_NE(member.message().find("served by 10.9.8.7:48148"), std::string::npos) << member.message();
}

TEST(MasterStandby, AMasterWhoseLeaseIsNotRenewedStepsDownBeforeItEndsAndResigns) {
  // The lease's TTL (the step-down comes a fifth of it before its end), and the pause
  // between renewals, well inside it.
  const auto ttl = std::chrono::milliseconds(1000 * LOCKSTEP_TEST_TIME_SCALE);
  Fixture f(ttl);
  std::unique_ptr<peer::Communicator> comm;
  const auto elected = Election::Clock::now();
  f.election->handlers().elected(5, elected + ttl);
  ASSERT_TRUE(f.wait_serving(true, 10s));
  ASSERT_TRUE(f.connect(&comm).is_ok());
  // Renewed twice: it keeps serving past the first lease's end.
  for (int i = 1; i <= 2; ++i) {
    std::this_thread::sleep_for(ttl / 2);
    f.election->handlers().renewed(Election::Clock::now() + ttl);
  }
  EXPECT_TRUE(f.state()["ha"]["serving"].get<bool>());
  EXPECT_EQ(f.election->resigned.load(), 0);
  // Not renewed again: it steps down by itself (no word from the election), before the
  // lease would end, resigns, and its peer is told.
  const auto last_renewal = Election::Clock::now();
  ASSERT_TRUE(f.wait_serving(false, 10s));
  EXPECT_LT(Election::Clock::now() - last_renewal, ttl);
  EXPECT_EQ(f.election->resigned.load(), 1);
  const json state = f.state();
  EXPECT_EQ(state["ha"]["step_downs"].get<int>(), 1);
  EXPECT_EQ(state["peers"].size(), 0u);
  EXPECT_EQ(state["term"].get<int>(), 1) << "the run was forgotten";
  Status after = comm->agree(true).status();
  EXPECT_EQ(after.code(), LOCKSTEP_STATUS_MASTER_CONNECTION_LOST) << after.to_string();
  EXPECT_NE(after.message().find("stepped down"), std::string::npos) << after.message();
  // The election says the lease is lost: nothing more happens (it already stepped down).
  f.election->handlers().lost("the lease expired");
  EXPECT_FALSE(f.state()["ha"]["serving"].get<bool>());
  EXPECT_EQ(f.state()["ha"]["step_downs"].get<int>(), 1);
}

TEST(MasterStandby, ALostLeaseEndsServingAtOnce) {
  Fixture f(60s);
  f.election->handlers().elected(9, Election::Clock::now() + 60s);
  ASSERT_TRUE(f.wait_serving(true, 10s));
  f.election->handlers().lost("the key names 10.0.0.1:48148 now");
  ASSERT_TRUE(f.wait_serving(false, 10s));
  EXPECT_EQ(f.election->resigned.load(), 0) << "the election already knows";
}

}  // namespace
}  // namespace lockstep::master
