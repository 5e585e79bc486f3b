"""The in-process master (:class:`Master`) and the parsing of "host:port" addresses."""

from __future__ import annotations

import threading
from typing import Any, Optional, Tuple

from . import _lockstep
from ._enums import _check_uint
from ._errors import InvalidArgumentError

DEFAULT_MASTER_PORT = 48148


def _split_address(address: str, default_port: int, what: str) -> Tuple[str, int]:
    if not isinstance(address, str):
        raise InvalidArgumentError(f"{what} must be a 'host:port' string, not {type(address).__name__}")
    if address.startswith("["):  # [IPV6] or [IPV6]:PORT
        host, sep, rest = address[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise InvalidArgumentError(f"{what} {address!r}: expected [IPV6] or [IPV6]:PORT")
        if not rest:
            return host, default_port
        port_text = rest[1:]
    elif address.count(":") > 1:  # a bare IPv6 literal: no port
        return address, default_port
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep:
            return address, default_port
    try:
        port = int(port_text)
    except ValueError:
        raise InvalidArgumentError(f"{what} {address!r}: the port is not a number") from None
    if not 0 <= port <= 65535:
        raise InvalidArgumentError(f"{what} {address!r}: the port must be in 0..65535")
    return host, port


def _join_address(host: str, port: int) -> str:
    """host:port, an IPv6 literal in brackets; a wildcard host as its loopback address."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---------------------------------------------------------------------- master


class Master:
    """An in-process master (``lockstep_master_*``). It serves on background threads.

    Use it as a context manager (``with Master() as m:``): it starts listening on
    ``__enter__`` (unless already running) and stops on ``__exit__``. Or call
    :meth:`run` and :meth:`close` yourself.

    Args:
        listen: ``"host:port"`` to listen on; port 0 picks an ephemeral port (see
            :attr:`port`); an empty host means all interfaces.
        heartbeat_timeout_ms: a peer silent this long is removed; 0 means 5000.
        vote_timeout_ms: an accepted peer that has not joined an open vote after this
            long is removed; 0 turns it off.
        peers_max: the maximum number of peers; 0 means 1024.
        secret_file: path of the run secret (at least 16 bytes; trailing line breaks
            ignored). Peers must prove the same secret; control messages are encrypted and
            p2p connections authenticated (docs/security.md). None: the environment
            variable LOCKSTEP_SECRET_FILE if set, else none (the master admits anyone who
            can reach it, and logs a warning).
        handshake_timeout_ms: a connection that has not finished its handshake after this
            long is closed; 0 means 10000.
        pending_handshakes_max: connections that may be in their handshake at once; 0
            means 256.
        http: ``"host:port"`` of the HTTP endpoint (the status page, ``/api/state`` and
            ``/metrics``; docs/observability.md); port 0 picks an ephemeral port (see
            :attr:`http_port`). None: no endpoint. A non-loopback host needs
            ``http_token_file`` or ``http_insecure``.
        http_token_file: path of the HTTP access token (16 to 4096 visible ASCII
            characters): every request must carry ``Authorization: Bearer TOKEN``
            (docs/operations.md).
        http_insecure: serve ``http`` on a non-loopback host without a token.
        kv_keys_max, kv_key_bytes_max, kv_value_bytes_max: bounds of the key-value store
            (keys held, bytes per key, bytes per value); 0 means 4096, 256 and 65536; at
            most 1048576, 1024 and 524288.
        newcomer_timeout_ms: a newcomer that has not reported its p2p connections this
            long after an update topology began connecting it is rejected, and the
            accepted peers' update fails (UPDATE_TOPOLOGY_FAILED) so that they go on
            without it; 0 means 5000 (range 100..3600000).
        relay_port: run the relay on this port of the listen address (0: an ephemeral
            one, see :attr:`relay_port`): a ring edge between two peers that both
            accept no inbound connection runs through it, sealed end to end. Needs
            ``secret_file`` (:meth:`run` raises InvalidArgumentError without one).
            None (the default): no relay (docs/deployment.md, "Relays").
        recovery_window_ms: a master asked to take back the peers of a run it does not
            know (failover) waits this long for every peer of their last view before it
            resumes with a quorum of them; 0 means 5000.
        recovery_quorum: the peers of that view that must be back after the window; 0
            (default): a strict majority (all of one or two). Lower only for a run that
            lost most of its peers with its master (docs/operations.md, "Failover").
        ha_etcd: a hot standby (docs/operations.md, "Hot standby"): etcd endpoints
            ("http://HOST:PORT", comma-separated). This master then serves only while it
            holds the run's lease in etcd, and refuses peers (NotServingError) until
            then. None (the default): it serves from the start.
        ha_key: the etcd key the run's masters compete for (None: "/lockstep/master").
        ha_advertise: "host:port" peers reach this master at, as the others name it
            (None: the listen address).
        ha_lease_ttl_s: the lease's time to live; 0 means 5 (range 2..60).
        resume_hold_ms: a master that may replace a lost one (restarted on its address,
            or a standby taking over) waits this long from its start (a standby: its
            election) before newcomers found a new run, so that the lost run's
            reconnecting peers are taken back first; 0 (the default): no wait. 2000
            covers the peers' reconnection pause.
    """

    def __init__(self, listen: str = "127.0.0.1:0", heartbeat_timeout_ms: int = 0, vote_timeout_ms: int = 0,
                 peers_max: int = 0, secret_file: Optional[str] = None, handshake_timeout_ms: int = 0,
                 pending_handshakes_max: int = 0, http: Optional[str] = None, http_token_file: Optional[str] = None,
                 http_insecure: bool = False, kv_keys_max: int = 0, kv_key_bytes_max: int = 0,
                 kv_value_bytes_max: int = 0, newcomer_timeout_ms: int = 0,
                 relay_port: Optional[int] = None, recovery_window_ms: int = 0, recovery_quorum: int = 0,
                 ha_etcd: Optional[str] = None, ha_key: Optional[str] = None, ha_advertise: Optional[str] = None,
                 ha_lease_ttl_s: int = 0, resume_hold_ms: int = 0) -> None:
        host, port = _split_address(listen, DEFAULT_MASTER_PORT, "listen")
        for name, value in (("ha_etcd", ha_etcd), ("ha_key", ha_key), ("ha_advertise", ha_advertise)):
            if value is not None and not isinstance(value, str):
                raise InvalidArgumentError(f"{name} must be a str or None")
        if secret_file is not None and not isinstance(secret_file, str):
            raise InvalidArgumentError("secret_file must be a str or None")
        if http is not None:
            http_host, http_port = _split_address(http, -1, "http")
            if http_port < 0:
                raise InvalidArgumentError(f"http {http!r}: expected 'host:port'")
            self._http_host = http_host
        else:
            self._http_host = ""
        if http_token_file is not None and not isinstance(http_token_file, str):
            raise InvalidArgumentError("http_token_file must be a str or None")
        self._host = host
        self._impl = _lockstep.Master(
            host, port, _check_uint("heartbeat_timeout_ms", heartbeat_timeout_ms, 32),
            _check_uint("vote_timeout_ms", vote_timeout_ms, 32), _check_uint("peers_max", peers_max, 32),
            secret_file or "", _check_uint("handshake_timeout_ms", handshake_timeout_ms, 32),
            _check_uint("pending_handshakes_max", pending_handshakes_max, 32), http or "", http_token_file or "",
            bool(http_insecure), _check_uint("kv_keys_max", kv_keys_max, 32),
            _check_uint("kv_key_bytes_max", kv_key_bytes_max, 32),
            _check_uint("kv_value_bytes_max", kv_value_bytes_max, 32),
            _check_uint("newcomer_timeout_ms", newcomer_timeout_ms, 32),
            -1 if relay_port is None else _check_uint("relay_port", relay_port, 16),
            _check_uint("recovery_window_ms", recovery_window_ms, 32), _check_uint("recovery_quorum", recovery_quorum, 32),
            ha_etcd or "", ha_key or "", ha_advertise or "", _check_uint("ha_lease_ttl_s", ha_lease_ttl_s, 32),
            _check_uint("resume_hold_ms", resume_hold_ms, 32))
        self._running = False

    def run(self) -> None:
        """Binds the listening socket and starts serving; returns once it listens.
        Raises MasterConnectionFailedError if it cannot bind."""
        self._impl.run()
        self._running = True

    @property
    def running(self) -> bool:
        """Whether :meth:`run` succeeded and the master was not closed."""
        return self._running and not self._impl.closed

    @property
    def port(self) -> int:
        """The port it listens on (after :meth:`run`)."""
        return self._impl.port()

    @property
    def address(self) -> str:
        """``"host:port"`` for :class:`Communicator` (``[ipv6]:port`` for IPv6; the loopback
        address when it listens on all interfaces)."""
        return _join_address(self._host, self.port)

    @property
    def http_port(self) -> int:
        """The port of the HTTP endpoint (after :meth:`run`; only with ``http``)."""
        return self._impl.http_port()

    @property
    def relay_port(self) -> int:
        """The port of the relay (after :meth:`run`; only with ``relay_port``)."""
        return self._impl.relay_port()

    @property
    def http_address(self) -> str:
        """``"host:port"`` of the HTTP endpoint (the loopback address when it listens on all
        interfaces)."""
        return _join_address(self._http_host, self.http_port)

    def interrupt(self) -> None:
        """Asks the master to stop (thread-safe, returns at once)."""
        self._impl.interrupt()

    def wait(self) -> None:
        """Blocks until the master has stopped: :meth:`interrupt` from another thread, or
        Ctrl-C (KeyboardInterrupt, which stops the master and propagates)."""
        done = threading.Event()

        def waiter() -> None:
            try:
                self._impl.wait()
            finally:
                done.set()

        # The C call runs on a helper thread so that this one stays interruptible by signals.
        threading.Thread(target=waiter, name="lockstep-master-wait", daemon=True).start()
        try:
            while not done.wait(0.2):
                pass
        except BaseException:
            self._impl.interrupt()
            raise

    def close(self) -> None:
        """Stops the master and frees it (idempotent). The peers lose their master."""
        self._impl.close()
        self._running = False

    def __enter__(self) -> "Master":
        if not self.running:
            self.run()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.running:
            return f"<lockstep.Master {self.address}>"
        return "<lockstep.Master (not running)>"
