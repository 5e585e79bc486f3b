// Tests of the C++ test bed fixture (tests/support/testbed_fixture.h).
#include "testbed_fixture.h"

#include <sys/stat.h>

#include <climits>
#include <string>
#include <unistd.h>

namespace {

using lockstep::testbed::CommandResult;
using lockstep::testbed::Process;
using lockstep::testbed::Testbed;
using lockstep::testbed::TestbedTest;

bool NamespaceExists(const std::string& name) {
  struct stat st {};
  return stat(("/run/netns/" + name).c_str(), &st) == 0;
}

std::string NetNsOf(pid_t pid) {
  char buf[PATH_MAX] = {};
  ssize_t n = readlink(("/proc/" + std::to_string(pid) + "/ns/net").c_str(), buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

std::string NsInode(const std::string& name) {
  struct stat st {};
  if (stat(("/run/netns/" + name).c_str(), &st) != 0) return {};
  return "net:[" + std::to_string(st.st_ino) + "]";
}

class ThreeHosts : public TestbedTest {
 protected:
  int Hosts() const override { return 3; }
};

TEST_F(ThreeHosts, HostsHaveAddressesAndReachEachOther) {
  EXPECT_EQ(bed().hosts(), 3);
  for (int i = 0; i < 3; i++) {
    EXPECT_TRUE(NamespaceExists(bed().Namespace(i))) << bed().Namespace(i);
    for (int j = 0; j < i; j++) EXPECT_NE(bed().Addr(i), bed().Addr(j));
  }
  CommandResult r = bed().Exec(0, {"ping", "-c", "2", "-i", "0.05", "-W", "1", bed().Addr(2)});
  EXPECT_TRUE(r.ok()) << r.output;
  EXPECT_NE(r.output.find("2 received"), std::string::npos) << r.output;
}

TEST_F(ThreeHosts, SpawnRunsTheProcessItselfInsideTheHost) {
  Process p = bed().Spawn(1, {"sleep", "600"});
  // Wait until the script has exec'd into the namespace.
  for (int i = 0; i < 500 && NetNsOf(p.pid()) != NsInode(bed().Namespace(1)); i++) usleep(10000);
  EXPECT_EQ(NetNsOf(p.pid()), NsInode(bed().Namespace(1)));
  EXPECT_TRUE(p.Stop());
  EXPECT_TRUE(p.Continue());
  EXPECT_TRUE(p.Kill());
  EXPECT_EQ(p.Wait(), 128 + SIGKILL);
}

TEST_F(ThreeHosts, CutAndHealThroughTheFixture) {
  auto ping = [&](int src, int dst) {
    return bed().Exec(src, {"ping", "-c", "1", "-W", "1", bed().Addr(dst)}).ok();
  };
  EXPECT_TRUE(ping(0, 1));
  bed().Cut(0, 1, /*both=*/true);
  EXPECT_FALSE(ping(0, 1));
  EXPECT_FALSE(ping(1, 0));
  EXPECT_TRUE(ping(0, 2));
  bed().Heal(0, 1, /*both=*/true);
  EXPECT_TRUE(ping(0, 1));
}

TEST_F(ThreeHosts, DelayThroughTheFixture) {
  bed().Delay(0, 1, 10, /*both=*/true);
  CommandResult r = bed().Check({"--rtt-only", "0:1"});
  EXPECT_TRUE(r.ok()) << r.output;
  EXPECT_NE(r.output.find("\"rtt_configured_ms\": 20.0"), std::string::npos) << r.output;
}

TEST(TestbedRaii, DownOnScopeExitEvenWhenUnwinding) {
  if (geteuid() != 0) GTEST_FAIL() << "the lockstep test bed needs root: run the tests as root";
  std::string prefix;
  std::string inode;
  pid_t pid = -1;
  try {
    Testbed bed(2);
    prefix = bed.prefix();
    inode = NsInode(bed.Namespace(0));
    Process p = bed.Spawn(0, {"sleep", "600"});
    pid = p.pid();
    throw std::runtime_error("a failing test");
  } catch (const std::runtime_error&) {
  }
  ASSERT_FALSE(prefix.empty());
  EXPECT_FALSE(NamespaceExists(prefix + "h0"));
  EXPECT_FALSE(NamespaceExists(prefix + "h1"));
  EXPECT_FALSE(NamespaceExists(prefix + "hub"));
  EXPECT_NE(NetNsOf(pid), inode);  // the spawned process is gone
}

TEST(TestbedRaii, ExplicitDownIsIdempotent) {
  if (geteuid() != 0) GTEST_FAIL() << "the lockstep test bed needs root: run the tests as root";
  Testbed bed(2);
  EXPECT_TRUE(bed.Down().ok());
  EXPECT_FALSE(NamespaceExists(bed.Namespace(0)));
  EXPECT_TRUE(bed.Down().ok());
}

}  // namespace
