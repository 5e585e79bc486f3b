/** @file
 * lockstep: fault-tolerant collective communication for distributed training
 * over unreliable networks.
 *
 * This is the whole public C API. It is C99 compatible; every handle is opaque;
 * every call returns a lockstep_status_t and never throws. A call that returns
 * an error leaves its out-parameters untouched unless it says otherwise.
 *
 * Threading: a communicator belongs to the thread that created it. Only the
 * calls documented as thread-safe may be made from other threads.
 *
 * ABI (docs/abi.md): the library reads and writes a public struct only as far as the
 * caller's sizeof of it, so that a program built against an older header keeps working
 * with a newer library of the same soname; fields are only ever appended, and the fields
 * a caller's struct lacks take their defaults. The sizeof travels with the struct where
 * the struct is handed over later (the configs' struct_size, set by their init function;
 * the counters' struct_size, set by the caller), and as an argument of the exported
 * *_sized function for the per-call structs (descriptors, results, tensors, members):
 * the functions of the documented names are static inline and pass sizeof of each
 * struct as this header declares it. A binding that cannot call inline functions calls
 * the *_sized ones with its own sizes.
 */
#ifndef LOCKSTEP_LOCKSTEP_H
#define LOCKSTEP_LOCKSTEP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LOCKSTEP_VERSION_MAJOR 0
#define LOCKSTEP_VERSION_MINOR 16
#define LOCKSTEP_VERSION_PATCH 0
#define LOCKSTEP_VERSION_HEX \
  ((LOCKSTEP_VERSION_MAJOR << 16) | (LOCKSTEP_VERSION_MINOR << 8) | LOCKSTEP_VERSION_PATCH)

#if defined(_WIN32)
#define LOCKSTEP_EXPORT __declspec(dllexport)
#else
#define LOCKSTEP_EXPORT __attribute__((visibility("default")))
#endif

/** The default port of the master (PRODUCT semantics rule 9). */
#define LOCKSTEP_DEFAULT_MASTER_PORT 48148

/**
 * Status codes. Each says what the caller may do next:
 *  - INVALID_ARGUMENT / INVALID_USAGE / NOT_INITIALIZED: a bug in the caller; fix the call.
 *  - PEER_CONNECTION_LOST / OPERATION_MISMATCH: the operation failed on every
 *    participant; retry it (with the survivors).
 *  - TOO_FEW_PEERS: a collective found one peer in its group; nothing was written. Wait
 *    for peers (are-peers-pending, update topology) or go on alone.
 *  - VIEW_CHANGED: a broadcast, all-gather or reduce-scatter failed on every participant
 *    because a peer left since the last update topology; update it, then retry.
 *  - NON_FINITE_CONTRIBUTION: a collective failed on every participant because a peer's
 *    contribution held NaN or infinity (check_finite); fix the data, then retry.
 *  - KEY_NOT_FOUND / LIMIT_EXCEEDED: a key-value store request was answered so; nothing
 *    changed.
 *  - UPDATE_TOPOLOGY_FAILED / TOPOLOGY_OPTIMIZATION_FAILED: the phase failed on every
 *    participant; the only legal action is to call it again.
 *  - NO_SHARED_STATE_AVAILABLE / HASH_MISMATCH: the sync failed on every peer of the
 *    group; retry it (after restoring a checkpoint, for the first).
 *  - MASTER_CONNECTION_FAILED / MASTER_CONNECTION_LOST / KICKED / REJECTED /
 *    REVISION_VIOLATION / SHARED_STATE_MISMATCH / AUTHENTICATION_FAILED: this
 *    communicator is finished; destroy it and create a new one (a new identity).
 */
typedef enum lockstep_status {
  LOCKSTEP_OK = 0,
  LOCKSTEP_STATUS_NOT_INITIALIZED = 1,
  LOCKSTEP_STATUS_INTERNAL_ERROR = 2,
  LOCKSTEP_STATUS_INVALID_ARGUMENT = 3,
  LOCKSTEP_STATUS_INVALID_USAGE = 4,
  LOCKSTEP_STATUS_TOO_FEW_PEERS = 5,
  LOCKSTEP_STATUS_MASTER_CONNECTION_FAILED = 6,
  LOCKSTEP_STATUS_MASTER_CONNECTION_LOST = 7,
  LOCKSTEP_STATUS_PEER_CONNECTION_FAILED = 8,
  LOCKSTEP_STATUS_PEER_CONNECTION_LOST = 9,
  LOCKSTEP_STATUS_NO_SHARED_STATE_AVAILABLE = 10,
  LOCKSTEP_STATUS_PENDING_ASYNC_OPERATIONS = 11,
  LOCKSTEP_STATUS_UPDATE_TOPOLOGY_FAILED = 12,
  LOCKSTEP_STATUS_TOPOLOGY_OPTIMIZATION_FAILED = 13,
  LOCKSTEP_STATUS_KICKED = 14,
  LOCKSTEP_STATUS_REJECTED = 15,
  LOCKSTEP_STATUS_OPERATION_MISMATCH = 16,
  LOCKSTEP_STATUS_PROTOCOL_ERROR = 17,
  LOCKSTEP_STATUS_TIMEOUT = 18,
  LOCKSTEP_STATUS_WRONG_THREAD = 19,
  LOCKSTEP_STATUS_INTERRUPTED = 20,
  /** Shared state: this peer presented a revision above the group's next one (it was
   * removed from the run). */
  LOCKSTEP_STATUS_REVISION_VIOLATION = 21,
  /** Shared state: this peer's keys, dtypes or element counts differ from the elected
   * content, or a send-only peer's content differs from it (it was removed). */
  LOCKSTEP_STATUS_SHARED_STATE_MISMATCH = 22,
  /** Shared state: a transferred tensor did not hash to the expected digest; the sync
   * failed for every peer of the group; retry it. */
  LOCKSTEP_STATUS_HASH_MISMATCH = 23,
  /** Security: the other side could not prove the run secret (the master: this peer has
   * no secret or a different one; this peer: the master runs without the secret or is not
   * this run's master). Nothing was registered; fix the secret and create a new
   * communicator. */
  LOCKSTEP_STATUS_AUTHENTICATION_FAILED = 24,
  /** Since 0.4. A broadcast, all-gather or reduce-scatter was called in a membership
   * view that has lost a peer since (their shapes depend on the world): it failed on
   * every peer before any byte moved. Call update topology, then call it again with
   * buffers sized for the new view. */
  LOCKSTEP_STATUS_VIEW_CHANGED = 25,
  /** Since 0.5. The key-value store holds no such key (lockstep_comm_kv_get). */
  LOCKSTEP_STATUS_KEY_NOT_FOUND = 26,
  /** Since 0.5. A bound of the master was reached (the key-value store's keys, key or
   * value size, or open waits per peer); the message names the bound and its flag.
   * Nothing changed. */
  LOCKSTEP_STATUS_LIMIT_EXCEEDED = 27,
  /** Since 0.5. With check_finite, a peer's contribution to a float collective held NaN
   * or infinity: the collective failed on every peer before any byte moved (buffers
   * unchanged), and the message names the peer. Fix the data, then call it again. */
  LOCKSTEP_STATUS_NON_FINITE_CONTRIBUTION = 28,
  /** Since 0.15. The master reached is a standby of a run with a hot standby (an etcd
   * lease, docs/operations.md): another master holds the lease and serves the peers. The
   * message names it where the standby knows it; a communicator given several master
   * addresses tries the next. */
  LOCKSTEP_STATUS_NOT_SERVING = 29
} lockstep_status_t;

/** A static, human-readable description of a status code (never NULL). */
LOCKSTEP_EXPORT const char* lockstep_status_string(lockstep_status_t status);
/** The status code's name without its prefix, e.g. "PEER_CONNECTION_LOST" (never NULL;
 * "UNKNOWN_STATUS" for a value that is not a status code). */
LOCKSTEP_EXPORT const char* lockstep_status_name(lockstep_status_t status);

/** The library's version at run time, encoded as LOCKSTEP_VERSION_HEX. */
LOCKSTEP_EXPORT uint32_t lockstep_version(void);
/** The library's version as "MAJOR.MINOR.PATCH". */
LOCKSTEP_EXPORT const char* lockstep_version_string(void);

/** Log levels; the default comes from the environment variable LOCKSTEP_LOG_LEVEL
 * (error, warn, info, debug, trace), or "info" when it is not set. */
typedef enum lockstep_log_level {
  LOCKSTEP_LOG_ERROR = 0,
  LOCKSTEP_LOG_WARN = 1,
  LOCKSTEP_LOG_INFO = 2,
  LOCKSTEP_LOG_DEBUG = 3,
  LOCKSTEP_LOG_TRACE = 4
} lockstep_log_level_t;

/** Sets the process-wide log level (thread-safe). */
LOCKSTEP_EXPORT lockstep_status_t lockstep_set_log_level(lockstep_log_level_t level);

/** Element types of collective operations and shared state. */
typedef enum lockstep_dtype {
  LOCKSTEP_U8 = 0,
  LOCKSTEP_I8 = 1,
  LOCKSTEP_U16 = 2,
  LOCKSTEP_I16 = 3,
  LOCKSTEP_U32 = 4,
  LOCKSTEP_I32 = 5,
  LOCKSTEP_U64 = 6,
  LOCKSTEP_I64 = 7,
  LOCKSTEP_F16 = 8,
  LOCKSTEP_BF16 = 9,
  LOCKSTEP_F32 = 10,
  LOCKSTEP_F64 = 11
} lockstep_dtype_t;

/** Reduction operations. Integer sum and prod wrap around modulo 2^bits; integer avg is
 * the wrapped sum divided by the world size, truncated toward zero; max and min
 * propagate NaN; f16 and bf16 compute in f32 and round to nearest-even when stored. */
typedef enum lockstep_reduce_op {
  LOCKSTEP_SUM = 0,
  LOCKSTEP_AVG = 1,
  LOCKSTEP_PROD = 2,
  LOCKSTEP_MAX = 3,
  LOCKSTEP_MIN = 4
} lockstep_reduce_op_t;

/** Quantization on the wire (floating-point dtypes only; docs/collectives.md has each
 * code's error bound). The 4-bit codes and the casts are since 0.7. */
typedef enum lockstep_quantization {
  LOCKSTEP_QUANT_NONE = 0,
  LOCKSTEP_QUANT_MINMAX_U8 = 1,     /**< min and (max-min)/255 per chunk, 8-bit codes */
  LOCKSTEP_QUANT_ZERO_POINT_U8 = 2, /**< scale and zero point per chunk, 8-bit codes */
  LOCKSTEP_QUANT_MINMAX_U4 = 3,     /**< min and (max-min)/15 per chunk, 4-bit codes (two a byte) */
  LOCKSTEP_QUANT_ZERO_POINT_U4 = 4, /**< scale and zero point per chunk, 4-bit codes (two a byte) */
  LOCKSTEP_QUANT_CAST_F16 = 5,      /**< each element as an IEEE half (f32 and f64 dtypes only) */
  LOCKSTEP_QUANT_CAST_BF16 = 6      /**< each element as a bfloat16 (f32 and f64 dtypes only) */
} lockstep_quantization_t;

/** Since 0.7: what a quantized all-reduce's values look like, a hint for the 8-bit and
 * 4-bit codes (the casts ignore it). With NONE or UNIFORM each chunk's codes span its
 * whole range [min, max]. With NORMAL they span the chunk's mean ± k standard deviations
 * (k = 4 for 8-bit codes, 2.5 for 4-bit; never beyond min and max), values beyond are
 * clamped to its ends: for bell-shaped data (gradients) the values inside lose less (on
 * normally distributed data the mean squared error of the ring's chunks is 2.2-2.7x
 * lower with 4-bit codes, 1.04-1.3x with 8-bit ones), a few outliers more (error
 * feedback carries that into the next call). Each peer's encodings follow its own hint:
 * the results stay bit-identical on every peer whatever the peers chose. */
typedef enum lockstep_distribution {
  LOCKSTEP_DIST_NONE = 0,
  LOCKSTEP_DIST_UNIFORM = 1,
  LOCKSTEP_DIST_NORMAL = 2
} lockstep_distribution_t;

/* ---------------------------------------------------------------- master */

typedef struct lockstep_master lockstep_master_t;

typedef struct lockstep_master_config {
  /** sizeof(lockstep_master_config_t) as the caller's header declares it; set by
   * lockstep_master_config_init. Fields beyond it take their defaults (docs/abi.md). */
  uint32_t struct_size;
  /** IP literal to listen on, IPv4 or IPv6 (no brackets); NULL or "" means 0.0.0.0;
   * "::" serves both families (IPv4 peers as their IPv4 addresses). */
  const char* listen_host;
  /** Port to listen on; 0 picks an ephemeral port (see lockstep_master_port). */
  uint16_t listen_port;
  /** A peer silent for this long is removed. 0 means the default (5000 ms). */
  uint32_t heartbeat_timeout_ms;
  /** Semantics rule 1: an accepted peer that has not joined an open vote after
   * this long is removed so the others can decide. 0 turns it off (default). */
  uint32_t vote_timeout_ms;
  /** Maximum number of peers (registered and accepted); 0 means the default (1024). */
  uint32_t peers_max;
  /** Path of a file holding the run secret (at least 16 bytes; trailing line breaks are
   * ignored). With it, every peer must prove the same secret before it is registered,
   * control messages are encrypted and authenticated, and p2p connections are
   * authenticated with keys the master hands out (docs/security.md). NULL or "": the
   * environment variable LOCKSTEP_SECRET_FILE if set, else no secret: the master admits
   * anyone who can reach it and logs a warning saying so. An unreadable or too short
   * secret makes lockstep_master_create fail with INVALID_ARGUMENT. */
  const char* secret_file;
  /** A connection that has not finished its handshake (Hello and, with a secret, the
   * proof) after this long is closed; 0 means the default (10000 ms). */
  uint32_t handshake_timeout_ms;
  /** Connections that may be in their handshake at once; beyond that each new one
   * displaces the oldest of the address holding the most. 0 means the default (256). */
  uint32_t pending_handshakes_max;
  /** Since 0.3. "HOST:PORT" of the HTTP endpoint: the status page, /api/state and
   * /metrics (docs/observability.md); port 0 picks an ephemeral port
   * (lockstep_master_http_port). NULL or "": no endpoint (the default). A host that is not
   * a loopback address needs http_token_file, or http_insecure. */
  const char* http_listen;
  /** Since 0.3. Path of a file holding the HTTP access token (16 to 4096 visible ASCII
   * characters; trailing line breaks are ignored): every request must then carry
   * "Authorization: Bearer TOKEN" (docs/operations.md). NULL or "": no token. An
   * unreadable or malformed token makes lockstep_master_create fail with INVALID_ARGUMENT. */
  const char* http_token_file;
  /** Since 0.3. Nonzero: serve http_listen on a non-loopback address without a token
   * (anyone who can reach it sees the run). 0 (the default): such an address without a
   * token makes lockstep_master_create fail with INVALID_ARGUMENT. */
  uint32_t http_insecure;
  /** Since 0.5. Bounds of the key-value store (lockstep_comm_kv_set): keys held (0 means
   * 4096, at most 1048576), bytes per key (0 means 256, at most 1024) and per value (0
   * means 65536, at most 524288). Above a maximum: INVALID_ARGUMENT. */
  uint32_t kv_keys_max;
  uint32_t kv_key_bytes_max;
  uint32_t kv_value_bytes_max;
  /** Since 0.6. Semantics rule 2 bounded in time: a newcomer that has not reported its p2p
   * connections this long after an update topology began connecting it is rejected, and
   * the accepted peers' update topology fails with UPDATE_TOPOLOGY_FAILED so that they go
   * on without it. 0 means the default (5000 ms); otherwise 100..3600000, else
   * INVALID_ARGUMENT. */
  uint32_t newcomer_timeout_ms;
  /** Since 0.12. Nonzero: run the relay (docs/deployment.md, "Relays") on relay_port of
   * listen_host (0: an ephemeral port, see lockstep_master_relay_port): a ring edge
   * between two peers that both accept no inbound connection runs through it, sealed end
   * to end with the pair's keys. Needs a run secret: without one, lockstep_master_run
   * fails with INVALID_ARGUMENT. 0 (the default): no relay. */
  uint32_t relay;
  /** Since 0.12. The relay's port (at most 65535, else INVALID_ARGUMENT). */
  uint32_t relay_port;
  /** Since 0.14 (failover, docs/operations.md): a master asked to take back the peers of
   * a run it does not know (its predecessor was lost) waits this long for every peer of
   * their last view before it resumes the run with a quorum of them; 0 means 5000. */
  uint32_t recovery_window_ms;
  /** Since 0.14. The peers of the last view that must be back to resume after the
   * window; 0 (default): a strict majority (all of a view of one or two peers). Lower
   * only for a run that lost most of its peers with its master: two masters could then
   * each resume a part of the run. */
  uint32_t recovery_quorum;
  /** Since 0.15 (hot standby, docs/operations.md): etcd endpoints, "http://HOST:PORT"
   * separated by commas. With them this master competes, with every master given the
   * same etcd and ha_key, for the run's lease: it serves only while it holds the lease
   * (its term is the etcd revision that gave it), and until then refuses every peer with
   * NOT_SERVING, naming the master that serves. NULL or "" (the default): it serves from
   * the start. An endpoint of another form: INVALID_ARGUMENT. */
  const char* ha_etcd;
  /** Since 0.15. The etcd key the run's masters compete for, one per run (at most 256
   * bytes); NULL or "": "/lockstep/master". */
  const char* ha_key;
  /** Since 0.15. HOST:PORT peers reach this master at, as the other masters name it;
   * NULL or "": the listen address, or the host's name where it listens on every
   * address. */
  const char* ha_advertise;
  /** Since 0.15. The lease's time to live in seconds: a crashed master is replaced about
   * this long after it died; 0 means 5, otherwise 2..60, else INVALID_ARGUMENT. */
  uint32_t ha_lease_ttl_s;
  /** Since 0.16 (failover, docs/operations.md): a master that may replace a lost one
   * (restarted on its address, or a hot standby taking over) waits this long from its
   * start (a standby: from its election) before newcomers found a new run, so that the
   * lost run's peers, reconnecting, are taken back first instead of being refused by a
   * run that went on without them. 0 (the default): newcomers found a run at once. At
   * most 3600000, else INVALID_ARGUMENT. */
  uint32_t resume_hold_ms;
} lockstep_master_config_t;

/** Fills the struct_size bytes of a config with the defaults (port 48148, all interfaces)
 * and sets config->struct_size = struct_size; the bytes beyond are not touched. Call it
 * through lockstep_master_config_init, which passes sizeof *config. INVALID_ARGUMENT if
 * struct_size is not the size of any version of the struct (see lockstep_master_create). */
LOCKSTEP_EXPORT lockstep_status_t lockstep_master_config_init_sized(lockstep_master_config_t* config,
                                                                    size_t struct_size);
/** Fills a config with the defaults, for the struct as this header declares it. */
static inline lockstep_status_t lockstep_master_config_init(lockstep_master_config_t* config) {
  return lockstep_master_config_init_sized(config, sizeof *config);
}

/** Creates a master; it does not listen until lockstep_master_run. Reads the config's
 * first config->struct_size bytes; fields beyond take their defaults. INVALID_ARGUMENT
 * (and a log line saying why) if struct_size is not the size of any version of the
 * struct: below the first field's end, above 65536, not a multiple of the struct's
 * alignment, or larger than this library's struct with a non-zero byte beyond it (a
 * field of a newer header that this library does not know was set). */
LOCKSTEP_EXPORT lockstep_status_t lockstep_master_create(const lockstep_master_config_t* config,
                                                          lockstep_master_t** out_master);
/** Binds the listening socket and starts serving on a background thread; returns
 * once the socket is listening. Fails with MASTER_CONNECTION_FAILED if it cannot bind
 * (the master's port, or the HTTP endpoint's; then nothing keeps running). */
LOCKSTEP_EXPORT lockstep_status_t lockstep_master_run(lockstep_master_t* master);
/** The port the master listens on (useful after listening on port 0). */
LOCKSTEP_EXPORT lockstep_status_t lockstep_master_port(const lockstep_master_t* master,
                                                        uint16_t* out_port);
/** Since 0.3. The port of the HTTP endpoint (config http_listen). INVALID_USAGE if the
 * master has no endpoint or is not running. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_master_http_port(const lockstep_master_t* master,
                                                             uint16_t* out_port);
/** Since 0.12. The port of the relay (config relay). INVALID_USAGE if the master runs no
 * relay or is not running. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_master_relay_port(const lockstep_master_t* master,
                                                              uint16_t* out_port);
/** Asks the master to stop; thread-safe and safe to call from a signal-free context
 * at any time. Returns at once. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_master_interrupt(lockstep_master_t* master);
/** Blocks until the master has stopped (after lockstep_master_interrupt). */
LOCKSTEP_EXPORT lockstep_status_t lockstep_master_await(lockstep_master_t* master);
/** Interrupts (if running), awaits and frees the master. NULL is allowed. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_master_destroy(lockstep_master_t* master);

/* ---------------------------------------------------------- communicator */

typedef struct lockstep_comm lockstep_comm_t;

typedef struct lockstep_comm_config {
  /** sizeof(lockstep_comm_config_t) as the caller's header declares it; set by
   * lockstep_comm_config_init. Fields beyond it take their defaults (docs/abi.md). */
  uint32_t struct_size;
  /** Address of the master: an IPv4 or IPv6 literal (no brackets) or a host name, whose
   * addresses of both families are tried in turn. */
  const char* master_host;
  /** Port of the master; 0 means LOCKSTEP_DEFAULT_MASTER_PORT. */
  uint16_t master_port;
  /** The peer group: collectives and shared-state syncs span one group. */
  uint32_t peer_group;
  /** Number of p2p connections per ring neighbour and direction; 0 means 1. */
  uint32_t p2p_pool_size;
  /** Semantics rule 9: -1 (default) takes the first free ports above 48148;
   * 0 puts every socket on an ephemeral port; any other value is the first port tried. */
  int32_t base_port;
  /** How long connect waits for the master's TCP connection and handshake; 0 means 10000. */
  uint32_t connect_timeout_ms;
  /** Address other peers should use to reach this one; NULL or "" means the address
   * the master sees this peer connect from. */
  const char* advertised_host;
  /** IP literal the p2p sockets bind to; NULL or "" means every address of both families
   * ("::" with IPv4 mapped in, or 0.0.0.0 on a host without IPv6). */
  const char* bind_host;
  /** An all-reduce attempt fails with PEER_CONNECTION_LOST when no byte moves to or from
   * its ring neighbours for this long (a link cut between two peers that both still
   * reach the master); 0 means 30000. Set it above the longest a slow link may pause. */
  uint32_t p2p_stall_timeout_ms;
  /** The run secret, as a file (secret_file) or as bytes (secret, secret_bytes; used if
   * secret_file is NULL or ""); at least 16 bytes, trailing line breaks ignored. With
   * it, connect joins only a master that proves the same secret (else
   * AUTHENTICATION_FAILED), and every p2p connection is authenticated. Neither given:
   * the environment variable LOCKSTEP_SECRET_FILE if set, else no secret (only a master
   * without a secret admits this peer). A bad secret makes lockstep_comm_create fail
   * with INVALID_ARGUMENT. */
  const char* secret_file;
  const void* secret;
  size_t secret_bytes;
  /** Incoming p2p connections: how long one may take to finish its handshake (0 means
   * 5000 ms) and how many may be unfinished at once (0 means 256; beyond that a new one displaces
   * the oldest of the address holding the most). */
  uint32_t inbound_handshake_timeout_ms;
  uint32_t inbound_handshakes_max;
  /** Nonzero: encrypt and authenticate the data plane (all-reduce sub-chunks and
   * shared-state transfers) with ChaCha20-Poly1305 under per-connection keys. Needs a run
   * secret (else lockstep_comm_create fails with INVALID_ARGUMENT); every peer of the
   * run must use the same setting (a p2p connection between peers that differ is
   * refused, and both log why). A sub-chunk altered on the way fails the all-reduce on
   * every peer (PEER_CONNECTION_LOST; retry it). Costs throughput: see BENCHMARKS.md.
   * 0 (default): the data plane travels in clear (docs/security.md). */
  int encrypt_data;
  /** Since 0.3. Connections one all-reduce stripes over towards each ring neighbour (streams): 0
   * (default) adapts the count to the path, from 1 up to 8, keeping more only while
   * they raise the throughput (docs/wan.md); 1 to 16 fixes it. Above 16:
   * INVALID_ARGUMENT. The results are the same bits with any count. Since 0.7 also the
   * connections a shared-state sync fetches each source's part over (0: up to 4; each
   * carries at least 16 MiB). */
  uint32_t p2p_streams;
  /** Since 0.3. TCP congestion control of the p2p connections (Linux TCP_CONGESTION, e.g. "bbr",
   * "cubic", "reno"); NULL or "" (default): the system's. A name that is not one (1 to
   * 15 of a-z, 0-9, _ and -): INVALID_ARGUMENT; one the kernel refuses (not loaded, or
   * not allowed for this user): one warning in the log and the system's default. */
  const char* tcp_congestion;
  /** Since 0.5. Nonzero: before each float collective (f16, bf16, f32, f64) this peer
   * checks its own contribution (its input; a broadcast's root its buffer) for NaN and
   * infinity; one found fails the collective on every peer with NON_FINITE_CONTRIBUTION
   * before any byte moves, naming this peer and the element. Costs one read of the
   * contribution (BENCHMARKS.md). 0 (default): no check. */
  int check_finite;
  /** Since 0.7: always 0 (it keeps the next field beyond 0.6's struct size). */
  uint32_t reserved_0_7;
  /** Since 0.7. 0 (default): this peer asks for its shared-state transfers in blocks that
   * the sending peer compresses with zstd where it measures that compressing pays (a
   * slow link and compressible data; docs/architecture.md); 1: raw bytes. Above 1:
   * INVALID_ARGUMENT. Either way every tensor is verified by its hash. */
  uint32_t state_compression;
  /** Since 0.10. Nonzero: this peer accepts no inbound connection (it sits behind a NAT
   * or a firewall that lets nothing in). It opens no listening socket; the ring
   * neighbours that do accept connections are dialled by it (connection reversal), it
   * dials its shared-state sources and bandwidth-test partners, and it serves shared
   * state only to peers that accept connections, by dialling them (since 0.11; a peer
   * that accepts none either and that only such peers could serve is removed, KICKED).
   * A ring edge between two such peers cannot be made: the master places them apart
   * where the run allows (docs/deployment.md). 0 (default): it listens on its three
   * ports. */
  int no_inbound;
  /** Since 0.10: always 0 (it keeps the struct's size a multiple of 8). */
  uint32_t reserved_0_10;
  /** Since 0.14 (failover, docs/architecture.md): more masters to try, in order, after
   * master_host:master_port when the master is lost: "HOST:PORT[,HOST:PORT...]" (at most
   * 16); NULL or "": only the master's own address. Malformed: INVALID_ARGUMENT. */
  const char* master_fallbacks;
  /** Since 0.14. Once accepted, a peer that loses its master looks for one to take it
   * back (the master's address, then master_fallbacks) for this long; operations in
   * flight are held and end with one outcome for every peer (a retryable failure where
   * no peer received one), and calls block meanwhile. Only when no master takes the peer
   * back in time does the communicator fail with MASTER_CONNECTION_LOST. Default (since
   * 0.16; before: 0): 30000 ms. 0: off, a lost master ends the communicator at once. */
  uint32_t failover_timeout_ms;
  /** Since 0.14: always 0 (it keeps the struct's size a multiple of 8). */
  uint32_t reserved_0_14;
} lockstep_comm_config_t;

/** Fills the struct_size bytes of a config with the defaults (master_host "127.0.0.1")
 * and sets config->struct_size = struct_size; the bytes beyond are not touched. Call it
 * through lockstep_comm_config_init, which passes sizeof *config. INVALID_ARGUMENT if
 * struct_size is not the size of any version of the struct (see lockstep_comm_create). */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_config_init_sized(lockstep_comm_config_t* config,
                                                                  size_t struct_size);
/** Fills a config with the defaults, for the struct as this header declares it. */
static inline lockstep_status_t lockstep_comm_config_init(lockstep_comm_config_t* config) {
  return lockstep_comm_config_init_sized(config, sizeof *config);
}

/** Creates a communicator owned by the calling thread. It binds its listening
 * sockets but does not contact the master yet. Reads the config's first
 * config->struct_size bytes; fields beyond take their defaults. INVALID_ARGUMENT (and a
 * log line saying why) for a struct_size that is not the size of any version of the
 * struct, as for lockstep_master_create. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_create(const lockstep_comm_config_t* config,
                                                        lockstep_comm_t** out_comm);
/** Connects to the master and blocks until this peer is accepted into the run
 * (the accepted peers must call lockstep_comm_update_topology for that, unless the
 * run is empty). MASTER_CONNECTION_FAILED if the master cannot be reached within
 * connect_timeout_ms; REJECTED if the master refuses this peer (the message says why). */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_connect(lockstep_comm_t* comm);
/** Votes to accept pending peers and rewires the ring. Every accepted peer of the
 * run must call it; it is a barrier. UPDATE_TOPOLOGY_FAILED: call it again. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_update_topology(lockstep_comm_t* comm);
/** Optimizes the ring of every group (a run-wide vote like update topology, which every
 * accepted peer must call): the bandwidth of every pair of a group not measured yet is
 * measured (disjoint pairs at once, both directions, about one second per round), the
 * master orders each ring for the best bottleneck (exact up to 16 peers), and every peer
 * rewires; nobody is admitted. The membership view (ranks) then follows the new ring.
 * TOPOLOGY_OPTIMIZATION_FAILED (a peer was lost, or could not connect): call it again,
 * only the edges still missing are measured. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_optimize_topology(lockstep_comm_t* comm);
/** Votes whether registered peers wait to join; every accepted peer gets the same
 * answer. May overlap collectives running on another thread. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_are_peers_pending(lockstep_comm_t* comm,
                                                                   int* out_pending);
/** Agreement for applications: every accepted peer of the group contributes a flag;
 * all get 1 only if all said non-zero. If a participant is lost during the vote,
 * every survivor gets PEER_CONNECTION_LOST. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_agree(lockstep_comm_t* comm, int flag,
                                                       int* out_result);

/** Since 0.4: how lockstep_comm_agree_value decides. */
typedef enum lockstep_agree_mode {
  /** Every peer's proposal must be byte-equal: all get it, else all get OPERATION_MISMATCH. */
  LOCKSTEP_AGREE_ALL_EQUAL = 1,
  /** The proposal of the peer of the group accepted first (the lowest id among those
   * accepted in the same update) wins; all get it. */
  LOCKSTEP_AGREE_FIRST_ACCEPTED = 2
} lockstep_agree_mode_t;
/** Since 0.4. Agreement on a value of up to 4096 bytes (a step number, a schedule's
 * state, a config): every accepted peer of the group proposes one, with the same mode,
 * and every peer gets the same value in out (out_capacity bytes; *out_size is set to the
 * value's size, and INVALID_ARGUMENT with nothing written if it does not fit). Peers that
 * use different modes, or different proposals under ALL_EQUAL, all get
 * OPERATION_MISMATCH; a participant lost during the vote: PEER_CONNECTION_LOST for all.
 * It is an agree round: it cannot overlap lockstep_comm_agree. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_agree_value(lockstep_comm_t* comm, lockstep_agree_mode_t mode,
                                                             const void* value, size_t size, void* out,
                                                             size_t out_capacity, size_t* out_size);

/* ------------------------------------------ key-value store (since 0.5) */

/** Since 0.5. The master's key-value store of run metadata (a step number, a config, a
 * checkpoint's location; docs/collectives.md), open to every connected peer, accepted or
 * not. Keys are NUL-terminated strings of 1 to 256 bytes, values byte strings of up to
 * 64 KiB (the master's --kv-key-bytes-max and --kv-value-bytes-max; at most 4096 keys,
 * --kv-keys-max); beyond a bound: LIMIT_EXCEEDED, nothing changed. The store lives as
 * long as the master; it is not part of the shared state. Calls from the thread that
 * created the communicator, one at a time like every call. */
/** Stores `size` bytes of `value` under `key`, replacing any earlier value; wakes every
 * peer waiting for the key. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_kv_set(lockstep_comm_t* comm, const char* key, const void* value,
                                                        size_t size);
/** Copies the value of `key` into out (out_capacity bytes) and sets *out_size to its
 * size: KEY_NOT_FOUND if no such key; INVALID_ARGUMENT with *out_size set and nothing
 * written if it does not fit (call again with a larger buffer). */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_kv_get(lockstep_comm_t* comm, const char* key, void* out,
                                                        size_t out_capacity, size_t* out_size);
/** As lockstep_comm_kv_get, but waits until the key is set (at once if it is):
 * TIMEOUT after timeout_ms (0: no deadline; the master checks deadlines every 20 ms). */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_kv_wait(lockstep_comm_t* comm, const char* key, uint32_t timeout_ms,
                                                         void* out, size_t out_capacity, size_t* out_size);
/** Removes `key` and its value; OK whether or not it was there. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_kv_delete(lockstep_comm_t* comm, const char* key);

typedef enum lockstep_attribute {
  LOCKSTEP_ATTR_GLOBAL_WORLD_SIZE = 0,
  LOCKSTEP_ATTR_PEER_GROUP_WORLD_SIZE = 1,
  LOCKSTEP_ATTR_NUM_DISTINCT_PEER_GROUPS = 2,
  LOCKSTEP_ATTR_LARGEST_PEER_GROUP_WORLD_SIZE = 3
} lockstep_attribute_t;

/** Reads an attribute as of the last completed update topology. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_get_attribute(const lockstep_comm_t* comm,
                                                               lockstep_attribute_t attribute,
                                                               int64_t* out_value);

/** One entry of the membership view (semantics rule 10). */
typedef struct lockstep_member {
  /** Identity: unique per connection; a restarted process is a new peer. */
  uint8_t id[16];
  /** Position in the ring of the group, 0-based. */
  uint32_t rank;
  /** Address and ports other peers use to reach it. */
  char host[64];
  uint16_t p2p_port;
  uint16_t shared_state_port;
  uint16_t benchmark_port;
} lockstep_member_t;

/** Copies the group's membership view (ordered by rank) as of the last completed
 * update topology. *out_count receives the number of members; if capacity is too
 * small, nothing is copied and INVALID_ARGUMENT is returned with *out_count set. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_get_membership_sized(const lockstep_comm_t* comm,
                                                                      lockstep_member_t* out_members,
                                                                      size_t member_size, size_t capacity,
                                                                      size_t* out_count);
static inline lockstep_status_t lockstep_comm_get_membership(const lockstep_comm_t* comm,
                                                             lockstep_member_t* out_members, size_t capacity,
                                                             size_t* out_count) {
  return lockstep_comm_get_membership_sized(comm, out_members, sizeof *out_members, capacity, out_count);
}
/** This peer's own rank in the membership view and identity. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_get_rank(const lockstep_comm_t* comm,
                                                          uint32_t* out_rank);
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_get_id(const lockstep_comm_t* comm,
                                                        uint8_t out_id[16]);
/** The message that came with the last error of this communicator ("" if none). */
LOCKSTEP_EXPORT const char* lockstep_comm_last_error(const lockstep_comm_t* comm);

/* -------------------------------------------------------------- counters */

/** The version of lockstep_counters_t this header describes. Fields are only ever
 * appended; a library fills the fields it knows within struct_size. */
#define LOCKSTEP_COUNTERS_VERSION 1

/** What a communicator did since it was created (docs/observability.md). Operations are
 * connect, update topology, optimize topology, all-reduces (each launch) and shared-state
 * syncs; are_peers_pending and agree are not counted. A retry is an operation started
 * after the previous one of its kind (for an all-reduce: of its tag) failed. Times are
 * microseconds spent in each call (concurrent all-reduces add up). */
typedef struct lockstep_counters {
  /** In: sizeof(lockstep_counters_t) as the caller knows it. Out: the bytes filled. */
  uint32_t struct_size;
  /** Out: LOCKSTEP_COUNTERS_VERSION of the library. */
  uint32_t version;
  uint64_t all_reduce_bytes_sent;     /**< ring bytes, headers (and tags) included */
  uint64_t all_reduce_bytes_received;
  uint64_t sync_bytes_sent;           /**< shared-state tensor bytes served to others */
  uint64_t sync_bytes_received;
  uint64_t operations_started;
  uint64_t operations_succeeded;
  uint64_t operations_failed;
  uint64_t all_reduces_started;
  uint64_t all_reduces_succeeded;
  uint64_t all_reduces_failed;
  uint64_t syncs_started;
  uint64_t syncs_succeeded;
  uint64_t syncs_failed;
  uint64_t retries;
  uint64_t connect_us;
  uint64_t update_topology_us;
  uint64_t optimize_topology_us;
  uint64_t sync_us;
  uint64_t all_reduce_us;
} lockstep_counters_t;

/** Copies the communicator's counters. Set out->struct_size = sizeof *out first; fields
 * beyond it are not written. Thread-safe: may be called from any thread while the
 * communicator is alive (each counter is read atomically, not all at one instant).
 * INVALID_ARGUMENT if struct_size is smaller than the first two fields. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_get_counters(const lockstep_comm_t* comm,
                                                              lockstep_counters_t* out);

/** Since 0.3. The ring bytes (headers and tags included) this communicator sent and
 * received on p2p pool slot `slot`, over every all-reduce attempt it ran there since
 * it was created, successful or not: which connections of the pool carry what.
 * Slots are 0 .. p2p_pool_size - 1 of the config (a pool size of 0 is 1 slot); the
 * master gives each all-reduce in flight its own slot while slots are free. Summed over
 * the slots they equal all_reduce_bytes_sent / _received of the counters, less the
 * data of all-reduces that travel with the votes (up to 16 KiB: no ring, no slot).
 * Thread-safe like lockstep_comm_get_counters. INVALID_ARGUMENT (outputs untouched) if
 * comm or an output is NULL or slot is not below the pool size, so that a loop from
 * slot 0 until INVALID_ARGUMENT visits every slot. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_get_slot_bytes(const lockstep_comm_t* comm, uint32_t slot,
                                                                uint64_t* out_sent, uint64_t* out_received);

/* ----------------------------------------------------------- collectives */

/** One all-reduce. Zero-initialize it (`= {0}`, memset) before setting its fields: fields
 * added by later versions are read, and zero is their default. src == dst is in place.
 * Every peer of the group must start the same
 * tag with the same count, dtype, op and quantization (else OPERATION_MISMATCH for all);
 * a tag started by only some peers waits for the others like a vote; a tag still in
 * flight cannot be started again (INVALID_USAGE). */
typedef struct lockstep_reduce_desc {
  const void* src;
  void* dst;
  uint64_t count;
  lockstep_dtype_t dtype;
  lockstep_reduce_op_t op;
  lockstep_quantization_t quantization;
  uint64_t tag;
  /** Since 0.7: error feedback, NULL for none (docs/collectives.md). For a quantized
   * all-reduce with op SUM or AVG only (else INVALID_ARGUMENT): `count` elements of
   * `dtype`, owned by the caller, all zero before the first call, sharing no byte with
   * src or dst. The call contributes src + residual instead of src; when it succeeds,
   * residual holds what this peer's encodings dropped (summed over the peers: what the
   * result lacks), to be added to the next call's contribution; when it fails, residual
   * is left as it was. The library keeps two buffers of `count` elements per all-reduce
   * in flight meanwhile. Each peer chooses alone whether to pass one (a newcomer starts
   * from zeros). */
  void* residual;
  /** Since 0.7: the distribution hint of a quantized all-reduce (NONE: none). */
  lockstep_distribution_t distribution;
} lockstep_reduce_desc_t;

typedef struct lockstep_reduce_info {
  uint32_t world_size;     /**< peers that took part in the successful attempt */
  uint64_t bytes_sent;     /**< bytes this peer put on the wire (headers and, encrypted, tags included) */
  uint64_t bytes_received;
  uint32_t streams;        /**< since 0.3: connections this peer's sends were striped over (1: one; p2p_streams) */
} lockstep_reduce_info_t;

typedef struct lockstep_async lockstep_async_t;

/** Blocking all-reduce. On success every participant holds bit-identical results.
 * A group of one peer gets TOO_FEW_PEERS (since 0.4; dst untouched).
 * On failure (PEER_CONNECTION_LOST: a participant died or went silent; every
 * survivor gets it) dst holds exactly what it held before the call, and the same
 * call can be retried with the survivors. out_info may be NULL. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_all_reduce_sized(lockstep_comm_t* comm,
                                                                  const lockstep_reduce_desc_t* desc, size_t desc_size,
                                                                  lockstep_reduce_info_t* out_info, size_t info_size);
static inline lockstep_status_t lockstep_comm_all_reduce(lockstep_comm_t* comm, const lockstep_reduce_desc_t* desc,
                                                         lockstep_reduce_info_t* out_info) {
  return lockstep_comm_all_reduce_sized(comm, desc, sizeof *desc, out_info, sizeof *out_info);
}
/** Starts an all-reduce and returns at once. May be called from the owning thread or
 * from one other thread (while the owning thread calls only are_peers_pending). The
 * buffers must stay valid until the handle is awaited. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_all_reduce_async_sized(lockstep_comm_t* comm,
                                                                        const lockstep_reduce_desc_t* desc,
                                                                        size_t desc_size,
                                                                        lockstep_async_t** out_handle);
static inline lockstep_status_t lockstep_comm_all_reduce_async(lockstep_comm_t* comm,
                                                               const lockstep_reduce_desc_t* desc,
                                                               lockstep_async_t** out_handle) {
  return lockstep_comm_all_reduce_async_sized(comm, desc, sizeof *desc, out_handle);
}
/** Non-blocking: *out_done = 1 once the operation has ended (successfully or not). */
LOCKSTEP_EXPORT lockstep_status_t lockstep_async_poll(const lockstep_async_t* handle, int* out_done);
/** Waits for the operation, returns its status, fills out_info (may be NULL) and frees
 * the handle. Must be called on the thread that launched it. (An info_size that no
 * version of the struct has: INVALID_ARGUMENT, and the handle is kept.) */
LOCKSTEP_EXPORT lockstep_status_t lockstep_async_wait_sized(lockstep_async_t* handle, lockstep_reduce_info_t* out_info,
                                                             size_t info_size);
static inline lockstep_status_t lockstep_async_wait(lockstep_async_t* handle, lockstep_reduce_info_t* out_info) {
  return lockstep_async_wait_sized(handle, out_info, sizeof *out_info);
}
/** Runs `count` all-reduces with at most max_in_flight at once; those that fail because
 * a peer was lost are retried with the survivors after every outstanding one ended.
 * Returns when all succeeded (out_infos, if not NULL, has `count` entries), or the
 * first error that is not a lost peer: TOO_FEW_PEERS once one peer is left. Since 0.4 a
 * descriptor with count 0 and both buffers NULL is a barrier of its tag. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_all_reduce_multiple_with_retry_sized(
    lockstep_comm_t* comm, const lockstep_reduce_desc_t* descs, size_t desc_size, size_t count, size_t max_in_flight,
    lockstep_reduce_info_t* out_infos, size_t info_size);
static inline lockstep_status_t lockstep_comm_all_reduce_multiple_with_retry(lockstep_comm_t* comm,
                                                                             const lockstep_reduce_desc_t* descs,
                                                                             size_t count, size_t max_in_flight,
                                                                             lockstep_reduce_info_t* out_infos) {
  return lockstep_comm_all_reduce_multiple_with_retry_sized(comm, descs, sizeof *descs, count, max_in_flight,
                                                            out_infos, sizeof *out_infos);
}

/* Since 0.4: broadcast, all-gather, reduce-scatter and barrier (docs/collectives.md).
 * They share the all-reduce's rules: a tag per call, the same descriptor on every peer
 * of the group (else OPERATION_MISMATCH for all), one outcome for all, attempts
 * numbered, async handles awaited with lockstep_async_wait, and on failure every
 * destination exactly as it was before the call. Ranks are the membership view's
 * (lockstep_comm_get_rank). Broadcast, all-gather and reduce-scatter have shapes that
 * depend on the world: they are bound to the view they were called in, and once a peer
 * has left, calling them (or retrying them) before the next update topology fails at
 * once on every peer with VIEW_CHANGED. Arguments that one peer finds unusable (a root
 * outside the view, a destination too small, counts per rank not one per rank) fail the
 * call on every peer with INVALID_ARGUMENT. A group of one peer gets TOO_FEW_PEERS. */

/** Since 0.4. `count` elements of `buf` on the peer of rank `root` are copied into
 * `buf` on every other peer, pipelined down the ring from the root. After a failed
 * attempt every buffer, the root's included, holds what it held before the call. */
typedef struct lockstep_broadcast_desc {
  void* buf;
  uint64_t count;
  lockstep_dtype_t dtype;
  uint32_t root;
  uint64_t tag;
} lockstep_broadcast_desc_t;

/** Since 0.4. Every rank's elements, in rank order, into every peer's dst: `count` from
 * each rank (dst needs world x count), or, with `counts` (all-gatherv), counts[r] from
 * rank r (counts_len = world entries, the same array on every peer; dst needs their
 * sum; a rank whose count is 0 may pass src NULL). src may point at this rank's own
 * place in dst (in place). */
typedef struct lockstep_all_gather_desc {
  const void* src;
  uint64_t count;         /**< elements of src; 0 when counts is given */
  void* dst;
  uint64_t dst_capacity;  /**< elements dst has room for */
  lockstep_dtype_t dtype;
  const uint64_t* counts; /**< NULL, or counts_len elements per rank */
  uint32_t counts_len;
  uint64_t tag;
} lockstep_all_gather_desc_t;

/** Since 0.4. src holds world x count_per_rank elements on every peer; rank r's dst
 * receives their reduction's elements [r x count_per_rank, (r+1) x count_per_rank), with
 * every op, dtype and quantization of the all-reduce (a quantized result is the decoded
 * form of one encoding, as the all-reduce's). */
typedef struct lockstep_reduce_scatter_desc {
  const void* src;
  void* dst;
  uint64_t count_per_rank;
  lockstep_dtype_t dtype;
  lockstep_reduce_op_t op;
  lockstep_quantization_t quantization;
  uint64_t tag;
} lockstep_reduce_scatter_desc_t;

LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_broadcast_sized(lockstep_comm_t* comm,
                                                                 const lockstep_broadcast_desc_t* desc, size_t desc_size,
                                                                 lockstep_reduce_info_t* out_info, size_t info_size);
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_broadcast_async_sized(lockstep_comm_t* comm,
                                                                       const lockstep_broadcast_desc_t* desc,
                                                                       size_t desc_size, lockstep_async_t** out_handle);
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_all_gather_sized(lockstep_comm_t* comm,
                                                                  const lockstep_all_gather_desc_t* desc,
                                                                  size_t desc_size, lockstep_reduce_info_t* out_info,
                                                                  size_t info_size);
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_all_gather_async_sized(lockstep_comm_t* comm,
                                                                        const lockstep_all_gather_desc_t* desc,
                                                                        size_t desc_size, lockstep_async_t** out_handle);
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_reduce_scatter_sized(lockstep_comm_t* comm,
                                                                      const lockstep_reduce_scatter_desc_t* desc,
                                                                      size_t desc_size, lockstep_reduce_info_t* out_info,
                                                                      size_t info_size);
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_reduce_scatter_async_sized(lockstep_comm_t* comm,
                                                                            const lockstep_reduce_scatter_desc_t* desc,
                                                                            size_t desc_size,
                                                                            lockstep_async_t** out_handle);
/** Since 0.4. Returns on every peer once all peers of the group have entered the
 * barrier of this tag, with the same outcome for all; one vote, no data. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_barrier(lockstep_comm_t* comm, uint64_t tag);
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_barrier_async(lockstep_comm_t* comm, uint64_t tag,
                                                               lockstep_async_t** out_handle);

static inline lockstep_status_t lockstep_comm_broadcast(lockstep_comm_t* comm, const lockstep_broadcast_desc_t* desc,
                                                        lockstep_reduce_info_t* out_info) {
  return lockstep_comm_broadcast_sized(comm, desc, sizeof *desc, out_info, sizeof *out_info);
}
static inline lockstep_status_t lockstep_comm_broadcast_async(lockstep_comm_t* comm,
                                                              const lockstep_broadcast_desc_t* desc,
                                                              lockstep_async_t** out_handle) {
  return lockstep_comm_broadcast_async_sized(comm, desc, sizeof *desc, out_handle);
}
static inline lockstep_status_t lockstep_comm_all_gather(lockstep_comm_t* comm, const lockstep_all_gather_desc_t* desc,
                                                         lockstep_reduce_info_t* out_info) {
  return lockstep_comm_all_gather_sized(comm, desc, sizeof *desc, out_info, sizeof *out_info);
}
static inline lockstep_status_t lockstep_comm_all_gather_async(lockstep_comm_t* comm,
                                                               const lockstep_all_gather_desc_t* desc,
                                                               lockstep_async_t** out_handle) {
  return lockstep_comm_all_gather_async_sized(comm, desc, sizeof *desc, out_handle);
}
static inline lockstep_status_t lockstep_comm_reduce_scatter(lockstep_comm_t* comm,
                                                             const lockstep_reduce_scatter_desc_t* desc,
                                                             lockstep_reduce_info_t* out_info) {
  return lockstep_comm_reduce_scatter_sized(comm, desc, sizeof *desc, out_info, sizeof *out_info);
}
static inline lockstep_status_t lockstep_comm_reduce_scatter_async(lockstep_comm_t* comm,
                                                                   const lockstep_reduce_scatter_desc_t* desc,
                                                                   lockstep_async_t** out_handle) {
  return lockstep_comm_reduce_scatter_async_sized(comm, desc, sizeof *desc, out_handle);
}

/* ---------------------------------------------------------- shared state */

/** Where a tensor lives. Only CPU memory is supported now. */
typedef enum lockstep_device {
  LOCKSTEP_DEVICE_CPU = 0
} lockstep_device_t;

/** One named tensor of the shared state. The memory stays owned by the caller. */
typedef struct lockstep_tensor {
  const char* key;   /**< unique within the shared state, 1..255 bytes */
  void* data;
  uint64_t count;    /**< elements */
  lockstep_dtype_t dtype;
  lockstep_device_t device;
  /** Non-zero: a difference on this tensor between peers that are up to date does not
   * cause a transfer (e.g. per-peer statistics); an outdated peer still receives it. */
  int allow_content_inequality;
} lockstep_tensor_t;

typedef struct lockstep_shared_state {
  /** Advance it by exactly one before each sync (semantics rule 5); a peer that
   * receives the state gets the group's revision written here. */
  uint64_t revision;
  const lockstep_tensor_t* tensors;
  size_t count;
} lockstep_shared_state_t;

typedef enum lockstep_sync_strategy {
  /** The most popular content wins and is distributed to the others. */
  LOCKSTEP_SYNC_ENFORCE_POPULAR = 0,
  /** Never elected, never sends: adopts the elected content (e.g. a newcomer). */
  LOCKSTEP_SYNC_RECEIVE_ONLY = 1,
  /** Never receives: this peer's content must equal the elected one, else it is
   * removed from the run (SHARED_STATE_MISMATCH). */
  LOCKSTEP_SYNC_SEND_ONLY = 2
} lockstep_sync_strategy_t;

typedef struct lockstep_sync_info {
  uint64_t bytes_sent;      /**< tensor bytes this peer served to others */
  uint64_t bytes_received;  /**< tensor bytes this peer received */
  /** Since 0.7: the same on the wire (compressed blocks and their 8-byte headers; the
   * tags of sealed chunks not counted). Equal to the above where nothing was compressed. */
  uint64_t wire_bytes_sent;
  uint64_t wire_bytes_received;
  /** Since 0.7: the connections this peer received over (0 when it received nothing):
   * each source's part is striped over up to 4 connections of at least 16 MiB each
   * (p2p_streams of the config, when set, instead of 4). */
  uint32_t streams;
} lockstep_sync_info_t;

/** Synchronizes the shared state with every accepted peer of the group (a vote: all
 * must call it). Every tensor is hashed; the master elects the content and outdated
 * peers fetch exactly the differing 1 MiB segments of the differing tensors from
 * up-to-date ones (compressed where that pays), spread over all of them, and verify
 * each tensor's hash. On success every peer holds bit-identical tensors and
 * the same revision. On failure (PEER_CONNECTION_LOST, HASH_MISMATCH,
 * NO_SHARED_STATE_AVAILABLE; the same for every peer of the group) tensors that were
 * being received may hold partial content: call it again. out_info may be NULL.
 * Collectives must not be in flight (PENDING_ASYNC_OPERATIONS). */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_sync_shared_state_sized(lockstep_comm_t* comm,
                                                                         lockstep_shared_state_t* state,
                                                                         size_t state_size, size_t tensor_size,
                                                                         lockstep_sync_strategy_t strategy,
                                                                         lockstep_sync_info_t* out_info,
                                                                         size_t info_size);
static inline lockstep_status_t lockstep_comm_sync_shared_state(lockstep_comm_t* comm, lockstep_shared_state_t* state,
                                                                lockstep_sync_strategy_t strategy,
                                                                lockstep_sync_info_t* out_info) {
  return lockstep_comm_sync_shared_state_sized(comm, state, sizeof *state, sizeof(lockstep_tensor_t), strategy,
                                               out_info, sizeof *out_info);
}

/** The content digest the shared state uses for a buffer (32 lowercase hex digits and a
 * NUL in out_hex). The same for any number of threads; see docs/protocol.md. */
LOCKSTEP_EXPORT lockstep_status_t lockstep_hash(const void* data, size_t bytes, char out_hex[33]);

/** Leaves the run, joins every internal thread and frees the communicator. NULL is allowed.
 * Collectives still in flight end; their handles must still be awaited (lockstep_async_wait
 * then frees them and returns INTERRUPTED). */
LOCKSTEP_EXPORT lockstep_status_t lockstep_comm_destroy(lockstep_comm_t* comm);

#ifdef __cplusplus
}
#endif

#endif /* LOCKSTEP_LOCKSTEP_H */
