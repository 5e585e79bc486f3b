#include "etcd_process.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

namespace lockstep::tools {

namespace {

// A port of loopback that is free now: the kernel's choice for a socket bound to port 0,
// closed again. (etcd must be told its ports: its JSON gateway dials the client URL as
// given, so port 0 there does not work.)
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  int port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    port = ntohs(address.sin_port);
  }
  ::close(fd);
  return port;
}

}  // namespace

EtcdProcess::EtcdProcess(std::chrono::milliseconds timeout) {
  char dir[] = "/tmp/lockstep-etcd-XXXXXX";
  if (::mkdtemp(dir) == nullptr) throw std::runtime_error("mkdtemp failed");
  dir_ = dir;
  const std::string log = dir_ + "/etcd.log";
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // Another process may take a port between free_port() and etcd's bind: then etcd
  // exits, and it is started again on others.
  for (int attempt = 0; attempt < 5 && !serving_ && std::chrono::steady_clock::now() < deadline; ++attempt) {
    port_ = free_port();
    const int peer_port = free_port();
    const std::string client = "http://127.0.0.1:" + std::to_string(port_);
    const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port);
    std::filesystem::remove_all(dir_ + "/data");
    auto p = Subprocess::spawn({"/usr/bin/etcd", "--name", "t", "--data-dir", dir_ + "/data", "--listen-client-urls",
                                client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
                                "--initial-advertise-peer-urls", peer, "--initial-cluster", "t=" + peer},
                               log);
    if (!p) break;
    proc_ = std::make_unique<Subprocess>(std::move(*p));
    const std::string marker = "serving insecure client requests on " + client.substr(7);
    while (!serving_ && proc_->running() && std::chrono::steady_clock::now() < deadline) {
      std::ifstream in(log);
      for (std::string line; std::getline(in, line);) serving_ = serving_ || line.find(marker) != std::string::npos;
      if (!serving_) std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  if (!serving_) {
    std::string tail;
    std::ifstream in(log);
    for (std::string line; std::getline(in, line);) tail = line;
    proc_.reset();
    std::filesystem::remove_all(dir_);
    throw std::runtime_error("cannot start /usr/bin/etcd (scripts/install-deps.sh installs Debian's etcd-server): " +
                             tail);
  }
}

EtcdProcess::~EtcdProcess() {
  proc_.reset();  // killed and reaped
  std::error_code ignored;
  std::filesystem::remove_all(dir_, ignored);
}

}  // namespace lockstep::tools
