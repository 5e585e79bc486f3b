// A private one-member etcd for the hot standby's tests and benchmark: Debian's
// /usr/bin/etcd (package etcd-server) on ephemeral ports of loopback, with a data
// directory of its own; killed and its directory removed when it goes out of scope.
#pragma once

#include "subprocess.h"

#include <memory>
#include <string>

namespace lockstep::tools {

class EtcdProcess {
 public:
  // Throws std::runtime_error if etcd cannot be started or does not serve within
  // timeout.
  explicit EtcdProcess(std::chrono::milliseconds timeout = std::chrono::seconds(30));
  ~EtcdProcess();
  EtcdProcess(const EtcdProcess&) = delete;
  EtcdProcess& operator=(const EtcdProcess&) = delete;
  // http://127.0.0.1:PORT
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  // SIGKILL (the directory stays until destruction).
  void kill() { proc_->kill(); }

 private:
  std::string dir_;
  std::unique_ptr<Subprocess> proc_;
  int port_ = 0;
  bool serving_ = false;
};

}  // namespace lockstep::tools
