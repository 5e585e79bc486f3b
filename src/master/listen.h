// Listening sockets of the master's loops (its control port and its relay).
#pragma once

#include "common/status.h"

#include <asio.hpp>

#include <cstdint>
#include <string>

namespace lockstep::master {

// Opens, binds and listens: host is an IPv4 or IPv6 literal ("::" is dual-stack), port 0
// an ephemeral one. INVALID_ARGUMENT for a host that is no literal or an IPv4-mapped one,
// MASTER_CONNECTION_FAILED when the system refuses.
Status listen_on(asio::ip::tcp::acceptor& acceptor, const std::string& host, std::uint16_t port);

}  // namespace lockstep::master
