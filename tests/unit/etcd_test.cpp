// The hot standby's etcd requests and the reading of etcd's answers (master/etcd.h), on
// answers shaped as etcd 3.4's JSON gateway writes them; the election itself runs
// against a real etcd in tests/e2e/standby_e2e_test.cpp.
#include "master/etcd.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace lockstep::master {
namespace {

using nlohmann::json;

TEST(Etcd, Base64RoundTripsEveryByte) {
  std::string all;
  for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
  EXPECT_EQ(etcd::base64("/lockstep/master"), "L2xvY2tzdGVwL21hc3Rlcg==");
  auto back = etcd::unbase64(etcd::base64(all));
  ASSERT_TRUE(back.is_ok());
  EXPECT_EQ(back.value(), all);
  EXPECT_FALSE(etcd::unbase64("not base64!").is_ok());
  EXPECT_FALSE(etcd::unbase64("L2xv Y2tz").is_ok());
}

TEST(Etcd, TheCampaignCreatesTheKeyUnderTheLeaseOnlyIfItDoesNotExist) {
  const json request = json::parse(etcd::campaign_request("/run/a", "10.0.0.5:48148", 7587888231812345678));
  ASSERT_EQ(request["compare"].size(), 1u);
  EXPECT_EQ(request["compare"][0]["key"], etcd::base64("/run/a"));
  EXPECT_EQ(request["compare"][0]["target"], "CREATE");
  EXPECT_EQ(request["compare"][0]["create_revision"], "0");
  const json put = request["success"][0]["request_put"];
  EXPECT_EQ(put["key"], etcd::base64("/run/a"));
  EXPECT_EQ(put["value"], etcd::base64("10.0.0.5:48148"));
  EXPECT_EQ(put["lease"], "7587888231812345678");  // 64-bit: a decimal string
  EXPECT_EQ(request["failure"][0]["request_range"]["key"], etcd::base64("/run/a"));
  EXPECT_EQ(json::parse(etcd::lease_request(42)), json({{"ID", "42"}}));
  EXPECT_EQ(json::parse(etcd::grant_request(5)), json({{"TTL", 5}}));
  EXPECT_EQ(json::parse(etcd::range_request("/k")), json({{"key", etcd::base64("/k")}}));
}

TEST(Etcd, AWonCampaignGivesTheRevisionAsTheTerm) {
  const auto won = etcd::parse_campaign(
      R"({"header":{"cluster_id":"14841639068965178418","member_id":"10276657743932975437","revision":"17",)"
      R"("raft_term":"2"},"succeeded":true,"responses":[{"response_put":{"header":{"revision":"17"}}}]})");
  ASSERT_TRUE(won.is_ok()) << won.status().to_string();
  EXPECT_TRUE(won.value().won);
  EXPECT_EQ(won.value().revision, 17);
}

TEST(Etcd, ALostCampaignNamesTheHolder) {
  const std::string value = etcd::base64("10.0.0.5:48148");
  const auto lost = etcd::parse_campaign(
      R"({"header":{"revision":"18"},"responses":[{"response_range":{"header":{"revision":"18"},"kvs":[{"key":")" +
      etcd::base64("/run/a") + R"(","create_revision":"17","mod_revision":"17","version":"1","value":")" + value +
      R"(","lease":"7587888231812345678"}],"count":"1"}}]})");
  ASSERT_TRUE(lost.is_ok()) << lost.status().to_string();
  EXPECT_FALSE(lost.value().won);
  EXPECT_EQ(lost.value().holder.value, "10.0.0.5:48148");
  EXPECT_EQ(lost.value().holder.create_revision, 17);
}

TEST(Etcd, GrantKeepAliveAndRange) {
  auto grant = etcd::parse_grant(R"({"header":{"revision":"16"},"ID":"7587888231812345678","TTL":"5"})");
  ASSERT_TRUE(grant.is_ok());
  EXPECT_EQ(grant.value().id, 7587888231812345678);
  EXPECT_EQ(grant.value().ttl_s, 5);
  EXPECT_FALSE(etcd::parse_grant(R"({"header":{"revision":"16"}})").is_ok());  // no lease

  // The gateway streams keep-alive answers, one per line; an expired lease has no TTL.
  auto alive = etcd::parse_keep_alive("{\"result\":{\"header\":{},\"ID\":\"1\",\"TTL\":\"4\"}}\n");
  ASSERT_TRUE(alive.is_ok());
  EXPECT_EQ(alive.value(), 4);
  auto expired = etcd::parse_keep_alive("{\"result\":{\"header\":{},\"ID\":\"1\"}}\n");
  ASSERT_TRUE(expired.is_ok());
  EXPECT_EQ(expired.value(), 0);

  auto absent = etcd::parse_range(R"({"header":{"revision":"20"}})");
  ASSERT_TRUE(absent.is_ok());
  EXPECT_FALSE(absent.value().has_value());
  auto present = etcd::parse_range(R"({"header":{},"kvs":[{"key":"","create_revision":"19","value":")" +
                                   etcd::base64("m2:1") + R"("}],"count":"1"})");
  ASSERT_TRUE(present.is_ok());
  ASSERT_TRUE(present.value().has_value());
  EXPECT_EQ(present.value()->value, "m2:1");
  EXPECT_EQ(present.value()->create_revision, 19);
}

TEST(Etcd, ErrorsAndGarbageAreErrorsNamingWhatEtcdSaid) {
  auto error = etcd::parse_range(R"({"error":"etcdserver: requested lease not found","code":5,)"
                                 R"("message":"etcdserver: requested lease not found"})");
  ASSERT_FALSE(error.is_ok());
  EXPECT_NE(error.status().message().find("requested lease not found"), std::string::npos) << error.status().message();
  for (const char* garbage : {"", "[]", "null", "{", R"({"kvs":"x"})", R"({"kvs":[{"value":"!!"}]})",
                              R"({"kvs":[{"create_revision":"12x"}]})", R"({"kvs":[{"create_revision":[]}]})"}) {
    EXPECT_FALSE(etcd::parse_range(garbage).is_ok()) << garbage;
  }
  EXPECT_FALSE(etcd::parse_campaign(R"({"succeeded":"yes"})").is_ok());
  EXPECT_FALSE(etcd::parse_campaign(R"({"succeeded":true})").is_ok());  // no revision: no term
  EXPECT_FALSE(etcd::parse_keep_alive(R"({"header":{}})").is_ok());
}

TEST(Etcd, OptionsAreChecked) {
  EtcdOptions options;
  options.endpoints = split_endpoints("http://127.0.0.1:2379, http://[::1]:2379,");
  ASSERT_EQ(options.endpoints, (std::vector<std::string>{"http://127.0.0.1:2379", "http://[::1]:2379"}));
  EXPECT_TRUE(check_etcd_options(options).is_ok());
  for (const char* bad : {"127.0.0.1:2379", "https://127.0.0.1:2379", "http://127.0.0.1", "http://127.0.0.1:",
                          "http://127.0.0.1:2379/v3", "http://:2379", "http://h:23x9"}) {
    EtcdOptions b = options;
    b.endpoints = {bad};
    EXPECT_EQ(check_etcd_options(b).code(), LOCKSTEP_STATUS_INVALID_ARGUMENT) << bad;
  }
  EtcdOptions none = options;
  none.endpoints.clear();
  EXPECT_FALSE(check_etcd_options(none).is_ok());
  EtcdOptions key = options;
  key.key = "";
  EXPECT_FALSE(check_etcd_options(key).is_ok());
  key.key = std::string(257, 'k');
  EXPECT_FALSE(check_etcd_options(key).is_ok());
  EtcdOptions ttl = options;
  ttl.lease_ttl_s = 1;
  EXPECT_FALSE(check_etcd_options(ttl).is_ok());
  ttl.lease_ttl_s = 61;
  EXPECT_FALSE(check_etcd_options(ttl).is_ok());
}

}  // namespace
}  // namespace lockstep::master
