// Data-plane encryption (encrypt_data, docs/security.md) with real processes: a
// lockstep-master with a run secret and lockstep-testpeer processes.
//  - all-reduces of a run with encryption give the same bits as the same run without
//    it (plain and quantized), with one 16-byte tag more per frame on the wire;
//  - a newcomer's shared-state sync works encrypted and ends bit-identical;
//  - a peer with encryption and one without cannot form a ring: the p2p connection is
//    refused and the errors name the cause;
//  - a byte altered on the way (an LD_PRELOAD shim, tests/support/tamper_shim.c, flips
//    one byte of the first ring sub-chunk a peer sends) fails the all-reduce on every
//    peer with the destination unchanged, and the retry succeeds; without encryption the
//    same shim silently corrupts the result (so the shim does tamper);
//  - a byte altered in a shared-state chunk fails the sync, and the retry succeeds;
//  - ring edges through the master's relay are sealed without encrypt_data.
#include "e2e.h"

#include <lockstep/lockstep.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace lockstep::e2e {
namespace {

constexpr const char* kCount = "1048576";  // f32 elements: 4 MiB per peer

// A run secret in a temporary file, removed at the end.
class SecretFile {
 public:
  SecretFile() {
    char path[] = "/tmp/lockstep-encryption-e2e-XXXXXX";
    const int fd = ::mkstemp(path);
    if (fd < 0) throw std::runtime_error("mkstemp");
    const std::string text = "encryption test secret " + std::to_string(::getpid());
    if (::write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) throw std::runtime_error("write");
    ::close(fd);
    path_ = path;
  }
  ~SecretFile() { std::filesystem::remove(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::vector<std::string> peer_flags(const SecretFile& secret, bool encrypt) {
  std::vector<std::string> flags = {"--secret-file", secret.path()};
  if (encrypt) flags.push_back("--encrypt");
  return flags;
}

struct Run {
  std::unique_ptr<Master> master;
  std::vector<std::unique_ptr<Peer>> peers;
  std::vector<Peer*> members;
};

// `n` peers with the secret, all with or all without encryption; peer `tampered` (if
// below n) runs with the tamper shim. `relayed`: the master runs a relay and no peer
// accepts inbound connections (every ring edge runs through the relay).
Run start(const SecretFile& secret, std::size_t n, bool encrypt, std::size_t tampered = SIZE_MAX,
          bool relayed = false) {
  Run run;
  std::vector<std::string> master_flags = {"--secret-file", secret.path()};
  std::vector<std::string> flags = peer_flags(secret, encrypt);
  if (relayed) {
    master_flags.insert(master_flags.end(), {"--relay-port", "0"});
    flags.push_back("--no-inbound");
  }
  run.master = std::make_unique<Master>(master_flags);
  std::vector<Peer*> newcomers;
  for (std::size_t i = 0; i < n; ++i) {
    run.peers.push_back(std::make_unique<Peer>(*run.master, numbered("p", i), 0, flags,
                                               i == tampered ? tamper_launcher() : std::vector<std::string>{}));
    newcomers.push_back(run.peers.back().get());
  }
  admit(run.members, newcomers);
  return run;
}

std::string all_reduce(std::size_t i, std::uint64_t tag, const std::string& quant = "none") {
  return "allreduce " + std::string(kCount) + " " + std::to_string(tag) + " " + std::to_string(i + 1) + " oop " + quant +
         " ramp";
}

// Digests of one all-reduce per peer (every peer must succeed), and bytes each sent.
std::vector<json> reduce_all(Run& run, std::uint64_t tag, const std::string& quant) {
  for (std::size_t i = 0; i < run.members.size(); ++i) run.members[i]->send(all_reduce(i, tag, quant));
  std::vector<json> out;
  for (auto* p : run.members) out.push_back(p->reply(scaled(60s)));
  return out;
}

TEST(EncryptionE2E, EncryptedAllReducesGiveTheSameBitsAsUnencrypted) {
  SecretFile secret;
  std::map<std::string, std::vector<json>> results;  // by "encrypted/quant"
  for (const bool encrypt : {false, true}) {
    auto run = start(secret, 3, encrypt);
    ASSERT_EQ(run.members.size(), 3u);
    for (const std::string quant : {"none", "minmax"}) {
      const auto replies = reduce_all(run, quant == "none" ? 1 : 2, quant);
      for (const auto& r : replies) {
        ASSERT_EQ(code(r), 0) << r.dump();
        EXPECT_EQ(r["digest"], replies[0]["digest"]) << "peers disagree: " << r.dump();
        EXPECT_EQ(r["world"], 3);
      }
      results[std::string(encrypt ? "enc/" : "plain/") + quant] = replies;
    }
  }
  for (const std::string quant : {"none", "minmax"}) {
    const auto& plain = results["plain/" + quant];
    const auto& sealed = results["enc/" + quant];
    ASSERT_EQ(plain.size(), sealed.size());
    for (std::size_t i = 0; i < plain.size(); ++i) {
      EXPECT_EQ(sealed[i]["digest"], plain[i]["digest"]) << quant << " peer " << i;
      EXPECT_EQ(sealed[i]["value"], plain[i]["value"]) << quant << " peer " << i;
      // The same frames, each with a 16-byte tag more.
      const auto extra = sealed[i]["bytes_sent"].get<std::uint64_t>() - plain[i]["bytes_sent"].get<std::uint64_t>();
      EXPECT_GT(extra, 0u) << quant;
      EXPECT_EQ(extra % 16, 0u) << quant;
    }
  }
  // The plain sum is what the fills say: element 0 of peer i is i + 1.
  EXPECT_EQ(results["plain/none"][0]["value"].get<double>(), 6.0);
}

TEST(EncryptionE2E, NewcomerSyncsSharedStateEncryptedBitIdentical) {
  SecretFile secret;
  auto run = start(secret, 2, true);
  ASSERT_EQ(run.members.size(), 2u);
  for (auto* p : run.members) {
    ASSERT_EQ(code(p->call("tensor weights 3000000")), 0);  // 3 sealed chunks of 1 MiB
    ASSERT_EQ(code(p->call("tensor bias 1000 f32")), 0);
    ASSERT_EQ(code(p->call("fill weights 11")), 0);
    ASSERT_EQ(code(p->call("fill bias 12")), 0);
    ASSERT_EQ(code(p->call("revision 1")), 0);
  }
  for (const auto& r : call_all(run.members, "sync")) ASSERT_EQ(code(r), 0) << r.dump();
  auto newcomer = std::make_unique<Peer>(*run.master, "new", 0, peer_flags(secret, true));
  ASSERT_EQ(code(newcomer->call("tensor weights 3000000")), 0);
  ASSERT_EQ(code(newcomer->call("tensor bias 1000 f32")), 0);
  auto members = run.members;
  admit(members, {newcomer.get()});
  ASSERT_EQ(members.size(), 3u);
  for (std::size_t i = 0; i < 2; ++i) ASSERT_EQ(code(members[i]->call("revision 2")), 0);
  for (std::size_t i = 0; i < 3; ++i) members[i]->send(i < 2 ? "sync popular" : "sync receive");
  std::vector<json> replies;
  for (auto* p : members) replies.push_back(p->reply(scaled(60s)));
  for (const auto& r : replies) {
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_EQ(r["revision"], 2);
    EXPECT_EQ(r["hashes"], replies[0]["hashes"]) << "not bit-identical: " << r.dump();
  }
  EXPECT_EQ(replies[2]["bytes_received"].get<std::uint64_t>(), 3000000u + 4000u);
}

TEST(EncryptionE2E, PeersThatDisagreeOnEncryptionAreRefusedWithTheCause) {
  SecretFile secret;
  Master master({"--secret-file", secret.path()});
  Peer encrypting(master, "enc", 0, peer_flags(secret, true));
  Peer plain(master, "plain", 0, peer_flags(secret, false));
  std::vector<Peer*> members;
  admit(members, {&encrypting});
  ASSERT_EQ(members.size(), 1u);
  plain.send("connect");
  // The member admits the newcomer: the ring between them cannot be made.
  json update;
  const auto deadline = std::chrono::steady_clock::now() + scaled(30s);
  while (std::chrono::steady_clock::now() < deadline) {
    json pending = encrypting.call("pending");
    ASSERT_EQ(code(pending), 0) << pending.dump();
    if (!pending.value("pending", false)) {
      std::this_thread::sleep_for(10ms);
      continue;
    }
    update = encrypting.call("update", scaled(60s));
    break;
  }
  ASSERT_TRUE(update.is_object()) << "the newcomer never became pending";
  EXPECT_NE(code(update), 0) << update.dump();
  EXPECT_NE(update.value("error", "").find("does not encrypt the data plane and this peer does"), std::string::npos)
      << update.dump();
  json connected = plain.reply(scaled(60s));
  EXPECT_NE(code(connected), 0) << connected.dump();
  EXPECT_NE(connected.value("error", "").find("encrypts the data plane and this peer does not"), std::string::npos)
      << connected.dump();
  // The member goes on alone: its update succeeds, and a collective says it is alone.
  json again = encrypting.call("update", scaled(30s));
  EXPECT_EQ(code(again), 0) << again.dump();
  json alone = encrypting.call(all_reduce(0, 5));
  EXPECT_EQ(code(alone), LOCKSTEP_STATUS_TOO_FEW_PEERS) << alone.dump();
}

TEST(EncryptionE2E, TamperedByteFailsTheAllReduceOnEveryPeerAndTheRetrySucceeds) {
  SecretFile secret;
  auto run = start(secret, 3, true, /*tampered=*/1);
  ASSERT_EQ(run.members.size(), 3u);
  const auto failed = reduce_all(run, 1, "none");
  for (const auto& r : failed) {
    EXPECT_EQ(code(r), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << r.dump();
    EXPECT_NE(r.value("error", "").find("does not verify"), std::string::npos) << r.dump();
    EXPECT_TRUE(r.value("unchanged", false)) << "a failed all-reduce modified the buffer: " << r.dump();
  }
  // The shim alters one frame only: the retry of the same tag goes through, on new connections.
  const auto retried = reduce_all(run, 1, "none");
  for (const auto& r : retried) {
    ASSERT_EQ(code(r), 0) << r.dump();
    EXPECT_EQ(r["value"].get<double>(), 6.0) << r.dump();
    EXPECT_EQ(r["digest"], retried[0]["digest"]);
  }
}

TEST(EncryptionE2E, TamperedSharedStateChunkFailsTheSyncAndTheRetrySucceeds) {
  SecretFile secret;
  Master master({"--secret-file", secret.path()});
  // The holder's sends of tensor bytes pass the shim; the newcomer receives from it alone.
  Peer holder(master, "holder", 0, peer_flags(secret, true), tamper_launcher("send"));
  Peer newcomer(master, "new", 0, peer_flags(secret, true));
  std::vector<Peer*> members;
  admit(members, {&holder});
  ASSERT_EQ(code(holder.call("tensor weights 3000000")), 0);
  ASSERT_EQ(code(holder.call("fill weights 21")), 0);
  ASSERT_EQ(code(holder.call("revision 1")), 0);
  ASSERT_EQ(code(newcomer.call("tensor weights 3000000")), 0);
  admit(members, {&newcomer});
  ASSERT_EQ(members.size(), 2u);
  const auto sync = [&] {
    holder.send("sync popular");
    newcomer.send("sync receive");
    return std::vector<json>{holder.reply(scaled(60s)), newcomer.reply(scaled(60s))};
  };
  const auto failed = sync();
  for (const auto& r : failed) EXPECT_EQ(code(r), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << r.dump();
  EXPECT_NE(failed[1].value("error", "").find("does not verify"), std::string::npos) << failed[1].dump();
  const auto retried = sync();
  for (const auto& r : retried) ASSERT_EQ(code(r), 0) << r.dump();
  EXPECT_EQ(retried[1]["hashes"], retried[0]["hashes"]);
  EXPECT_EQ(retried[1]["revision"], 1);
}

TEST(EncryptionE2E, WithoutEncryptionTheShimCorruptsTheResultUnnoticed) {
  SecretFile secret;
  std::string clean_digest;
  {
    auto run = start(secret, 3, false);
    ASSERT_EQ(run.members.size(), 3u);
    const auto replies = reduce_all(run, 1, "none");
    for (const auto& r : replies) ASSERT_EQ(code(r), 0) << r.dump();
    clean_digest = replies[0]["digest"].get<std::string>();
  }
  auto run = start(secret, 3, false, /*tampered=*/1);
  ASSERT_EQ(run.members.size(), 3u);
  const auto replies = reduce_all(run, 1, "none");
  bool corrupted = false;
  for (const auto& r : replies) {
    ASSERT_EQ(code(r), 0) << r.dump();
    corrupted = corrupted || r["digest"].get<std::string>() != clean_digest;
  }
  EXPECT_TRUE(corrupted) << "the shim did not alter the stream";
}

// Relays (docs/deployment.md, "Relays"): peers that accept no inbound connection, every
// ring edge through the master's relay, without encrypt_data. Their all-reduces give the
// bits of a direct run, with a 16-byte tag more per frame (relayed frames are sealed),
// and a byte the shim alters on its way through the relay fails the attempt on every
// peer instead of corrupting the sum; the retry succeeds.
TEST(EncryptionE2E, RelayedEdgesAreSealedWithoutEncryptData) {
  SecretFile secret;
  std::vector<json> direct;
  {
    auto run = start(secret, 3, false);
    ASSERT_EQ(run.members.size(), 3u);
    direct = reduce_all(run, 1, "none");
    for (const auto& r : direct) ASSERT_EQ(code(r), 0) << r.dump();
  }
  {
    auto run = start(secret, 3, false, SIZE_MAX, /*relayed=*/true);
    ASSERT_EQ(run.members.size(), 3u);
    const auto relayed = reduce_all(run, 1, "none");
    for (std::size_t i = 0; i < relayed.size(); ++i) {
      ASSERT_EQ(code(relayed[i]), 0) << relayed[i].dump();
      EXPECT_EQ(relayed[i]["digest"], direct[i]["digest"]);
      const auto extra =
          relayed[i]["bytes_sent"].get<std::uint64_t>() - direct[i]["bytes_sent"].get<std::uint64_t>();
      EXPECT_GT(extra, 0u);
      EXPECT_EQ(extra % 16, 0u);
    }
  }
  auto run = start(secret, 3, false, /*tampered=*/1, /*relayed=*/true);
  ASSERT_EQ(run.members.size(), 3u);
  const auto failed = reduce_all(run, 1, "none");
  for (const auto& r : failed) {
    EXPECT_EQ(code(r), LOCKSTEP_STATUS_PEER_CONNECTION_LOST) << r.dump();
    EXPECT_NE(r.value("error", "").find("does not verify"), std::string::npos) << r.dump();
  }
  const auto retried = reduce_all(run, 1, "none");
  for (std::size_t i = 0; i < retried.size(); ++i) {
    ASSERT_EQ(code(retried[i]), 0) << retried[i].dump();
    EXPECT_EQ(retried[i]["digest"], direct[i]["digest"]);
  }
}

}  // namespace
}  // namespace lockstep::e2e
