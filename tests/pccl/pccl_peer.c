/* A PCCL program for the tests of the PCCL-compatible library (tests/pccl/test_pccl.py).
 *
 * Compiled against pccl.h alone (its build sees no lockstep header) and linked against
 * libpccl.so.1, it uses PCCL v1.0's API the way PCCL's documentation shows: init, create,
 * connect, the membership loop (are peers pending -> update topology, retried while it
 * fails), collectives retried while a peer was lost, the shared state synchronized with
 * the revision advanced by one.
 *
 *   pccl_peer SCENARIO --port P --index I --peers N [--victim V] [--iterations K]
 *
 * Peer I of N contributes values derived from I, so every peer can compute the expected
 * result of every collective. Each check prints "ok NAME" or "FAIL NAME: why"; results
 * that must be bit-identical on every peer print "digest NAME HEX" (the driver compares
 * them across peers). Exit status: 0 if every check passed, 1 otherwise, 2 bad usage,
 * 75 the master's port was taken (scenario master: the driver picks another).
 *
 * Scenarios:
 *   collectives  every dtype x op, in place and out of place, both quantizations, reduce info
 *   async        several async all-reduces in flight, awaited in another order; a tag reused
 *   multiple     pcclAllReduceMultipleWithRetry over 8 descriptors, 3 in flight
 *   sync         shared state: the popular content wins, allow_content_inequality, a no-op sync
 *   optimize     optimize topology (retried while it fails), then an all-reduce
 *   churn        all-reduces of 4 Mi floats retried while a peer is lost (the driver
 *                kills peer V mid-way) until K have succeeded without it: each failed
 *                attempt leaves recvbuf as it was, the survivors' last results are their
 *                own sums; then multiple-with-retry alone ends with pcclTooFewPeers once
 *                only one peer is left
 *   errors       every invalid call a program can make, each with its code, and the next
 *                valid call succeeding (needs a master; one process)
 *   master       an embedded master (pcclCreateMaster) on the port until stdin closes
 *   fill         one f32 sum all-reduce of --count elements equal to --fill, tag --tag,
 *                whose every element must be --expect (a run mixed with native peers)
 */
#include <pccl.h>

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int g_failures = 0;
static int g_index = 0;
static int g_peers = 1;
static int g_port = CCOIP_PROTOCOL_PORT_MASTER;
static int g_ipv6 = 0; /* --ipv6 1: the master is at ::1 */

static void check(int ok, const char* name, const char* fmt, ...) {
  if (ok) {
    printf("ok %s\n", name);
  } else {
    va_list args;
    va_start(args, fmt);
    printf("FAIL %s: ", name);
    vprintf(fmt, args);
    printf("\n");
    va_end(args);
    ++g_failures;
  }
  fflush(stdout);
}

static void die(const char* what, pcclResult_t result) {
  printf("FAIL %s: result %d\n", what, (int)result);
  fflush(stdout);
  exit(1);
}

#define MUST(call)                      \
  do {                                  \
    pcclResult_t r_ = (call);           \
    if (r_ != pcclSuccess) die(#call, r_); \
  } while (0)

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t fnv1a(const void* data, size_t bytes) {
  const unsigned char* p = (const unsigned char*)data;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

static void digest(const char* name, const void* data, size_t bytes) {
  printf("digest %s %016llx\n", name, (unsigned long long)fnv1a(data, bytes));
  fflush(stdout);
}

static ccoip_socket_address_t loopback(int port) {
  ccoip_socket_address_t a;
  memset(&a, 0, sizeof a);
  if (g_ipv6) {
    a.inet.protocol = inetIPv6;
    a.inet.ipv6.data[15] = 1; /* ::1 */
  } else {
    a.inet.protocol = inetIPv4;
    a.inet.ipv4.data[0] = 127;
    a.inet.ipv4.data[3] = 1;
  }
  a.port = (uint16_t)port;
  return a;
}

static pcclComm_t* create(uint32_t pool) {
  pcclCommCreateParams_t params;
  memset(&params, 0, sizeof params);
  params.master_address = loopback(g_port);
  params.peer_group = 0;
  params.p2p_connection_pool_size = pool;
  pcclComm_t* comm = NULL;
  MUST(pcclCreateCommunicator(&params, &comm));
  return comm;
}

static int world_of(const pcclComm_t* comm) {
  int world = 0;
  MUST(pcclGetAttribute(comm, PCCL_ATTRIBUTE_PEER_GROUP_WORLD_SIZE, &world));
  return world;
}

static void update_topology(pcclComm_t* comm) {
  pcclResult_t r;
  while ((r = pcclUpdateTopology(comm)) == pcclUpdateTopologyFailed) {
  }
  if (r != pcclSuccess) die("pcclUpdateTopology", r);
}

/* Connects and takes part in the membership votes until the group has n peers. */
static void join(pcclComm_t* comm, int n) {
  MUST(pcclConnect(comm));
  double deadline = now_s() + 60;
  while (world_of(comm) < n) {
    if (now_s() > deadline) die("join: the group did not reach its size", pcclInternalError);
    bool pending = false;
    MUST(pcclArePeersPending(comm, &pending));
    if (pending) {
      update_topology(comm);
    } else {
      sleep_ms(20);
    }
  }
  check(world_of(comm) == n, "join", "world %d, expected %d", world_of(comm), n);
}

/* ---- element types: PCCL's numbering, a size and a conversion from double */

static const char* const kTypeNames[] = {"u8", "i8", "i16", "u16", "u32", "i32",
                                         "u64", "i64", "f16", "bf16", "f32", "f64"};
static const size_t kTypeSizes[] = {1, 1, 2, 2, 4, 4, 8, 8, 2, 2, 4, 8};
static const char* const kOpNames[] = {"sum", "avg", "prod", "max", "min"};

static int is_float(pcclDataType_t t) { return t >= pcclFloat16; }

static uint16_t to_f16(float f) {
  /* Exact for the small integers and halves the tests use. */
  uint32_t x;
  memcpy(&x, &f, 4);
  uint32_t sign = (x >> 16) & 0x8000u;
  int exp = (int)((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffffu;
  if ((x & 0x7fffffffu) == 0) return (uint16_t)sign;
  return (uint16_t)(sign | ((uint32_t)exp << 10) | (mant >> 13));
}

static float from_f16(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ffu;
  uint32_t x = sign;
  if (exp == 0x1f) {
    x |= 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    x |= ((exp - 15 + 127) << 23) | (mant << 13);
  } else if (mant != 0) {
    float f = ldexpf((float)mant, -24);
    return sign ? -f : f;
  }
  float f;
  memcpy(&f, &x, 4);
  return f;
}

static void store(pcclDataType_t t, void* buf, size_t i, double v) {
  switch (t) {
    case pcclUint8: ((uint8_t*)buf)[i] = (uint8_t)(int64_t)v; break;
    case pcclInt8: ((int8_t*)buf)[i] = (int8_t)v; break;
    case pcclInt16: ((int16_t*)buf)[i] = (int16_t)v; break;
    case pcclUint16: ((uint16_t*)buf)[i] = (uint16_t)(int64_t)v; break;
    case pcclUint32: ((uint32_t*)buf)[i] = (uint32_t)(int64_t)v; break;
    case pcclInt32: ((int32_t*)buf)[i] = (int32_t)v; break;
    case pcclUint64: ((uint64_t*)buf)[i] = (uint64_t)(int64_t)v; break;
    case pcclInt64: ((int64_t*)buf)[i] = (int64_t)v; break;
    case pcclFloat16: ((uint16_t*)buf)[i] = to_f16((float)v); break;
    case pcclBFloat16: {
      float f = (float)v;
      uint32_t x;
      memcpy(&x, &f, 4);
      ((uint16_t*)buf)[i] = (uint16_t)(x >> 16);
      break;
    }
    case pcclFloat: ((float*)buf)[i] = (float)v; break;
    case pcclDouble: ((double*)buf)[i] = v; break;
  }
}

static double load(pcclDataType_t t, const void* buf, size_t i) {
  switch (t) {
    case pcclUint8: return ((const uint8_t*)buf)[i];
    case pcclInt8: return ((const int8_t*)buf)[i];
    case pcclInt16: return ((const int16_t*)buf)[i];
    case pcclUint16: return ((const uint16_t*)buf)[i];
    case pcclUint32: return ((const uint32_t*)buf)[i];
    case pcclInt32: return ((const int32_t*)buf)[i];
    case pcclUint64: return (double)((const uint64_t*)buf)[i];
    case pcclInt64: return (double)((const int64_t*)buf)[i];
    case pcclFloat16: return from_f16(((const uint16_t*)buf)[i]);
    case pcclBFloat16: {
      uint32_t x = (uint32_t)((const uint16_t*)buf)[i] << 16;
      float f;
      memcpy(&f, &x, 4);
      return f;
    }
    case pcclFloat: return ((const float*)buf)[i];
    case pcclDouble: return ((const double*)buf)[i];
  }
  return 0;
}

static int is_signed(pcclDataType_t t) {
  return t == pcclInt8 || t == pcclInt16 || t == pcclInt32 || t == pcclInt64 || is_float(t);
}

/* Peer p's element i: small values whose sums, products, maxima and minima every type
 * holds exactly (products of 1s and 2s), so that the expected result does not depend on
 * the order of the reduction; negative in every third element of a signed type (a
 * different third on each peer), so that a signed type taken for its unsigned twin (PCCL
 * numbers i16 before u16) gives other maxima, minima and averages. */
static double contribution(int p, size_t i, pcclRedOp_t op, pcclDataType_t t) {
  if (op == pcclProd) return (double)(1 + (int)((i + (size_t)p) % 2));
  double v = (double)((p + 1) * (int)(1 + i % 5));
  return is_signed(t) && (i + (size_t)p) % 3 == 0 ? -v : v;
}

static double expected(int peers, int skip, size_t i, pcclRedOp_t op, pcclDataType_t t) {
  double acc = 0;
  int n = 0;
  for (int p = 0; p < peers; ++p) {
    if (p == skip) continue;
    double v = contribution(p, i, op, t);
    if (n == 0) acc = v;
    else if (op == pcclSum || op == pcclAvg) acc += v;
    else if (op == pcclProd) acc *= v;
    else if (op == pcclMax) acc = v > acc ? v : acc;
    else acc = v < acc ? v : acc;
    ++n;
  }
  if (op == pcclAvg) acc = is_float(t) ? acc / n : (double)((int64_t)acc / n);
  return acc;
}

static void fill(pcclDataType_t t, void* buf, size_t count, int p, pcclRedOp_t op) {
  for (size_t i = 0; i < count; ++i) store(t, buf, i, contribution(p, i, op, t));
}

static pcclReduceDescriptor_t descriptor(size_t count, pcclRedOp_t op, uint64_t tag, pcclDataType_t t) {
  pcclReduceDescriptor_t d;
  memset(&d, 0, sizeof d);
  d.count = count;
  d.op = op;
  d.tag = tag;
  d.src_descriptor.datatype = t;
  d.src_descriptor.distribution_hint = pcclDistributionNone;
  d.quantization_options.quantized_datatype = t;
  d.quantization_options.algorithm = pcclQuantNone;
  return d;
}

/* The largest difference between buf and the expected result (peer `skip` left out). */
static double worst(pcclDataType_t t, const void* buf, size_t count, pcclRedOp_t op, int skip) {
  double w = 0;
  for (size_t i = 0; i < count; ++i) {
    double d = fabs(load(t, buf, i) - expected(g_peers, skip, i, op, t));
    if (d > w || d != d) w = d != d ? INFINITY : d;
  }
  return w;
}

/* All-reduce retried while a peer is lost. */
static pcclResult_t all_reduce_retry(const void* send, void* recv, const pcclReduceDescriptor_t* d,
                                     const pcclComm_t* comm, pcclReduceInfo_t* info) {
  pcclResult_t r;
  while ((r = pcclAllReduce(send, recv, d, comm, info)) == pcclRankConnectionLost) {
  }
  return r;
}

/* ---- scenarios */

static void scenario_collectives(pcclComm_t* comm) {
  const size_t count = 3000; /* above the vote-carried size for 8-byte types: the ring runs */
  char name[96];
  uint64_t tag = 1;
  for (int t = pcclUint8; t <= pcclDouble; ++t) {
    for (int op = pcclSum; op <= pcclMin; ++op) {
      size_t bytes = count * kTypeSizes[t];
      void* send = malloc(bytes);
      void* recv = malloc(bytes);
      fill((pcclDataType_t)t, send, count, g_index, (pcclRedOp_t)op);
      pcclReduceDescriptor_t d = descriptor(count, (pcclRedOp_t)op, tag++, (pcclDataType_t)t);
      pcclReduceInfo_t info;
      memset(&info, 0, sizeof info);
      snprintf(name, sizeof name, "allreduce_%s_%s", kTypeNames[t], kOpNames[op]);
      pcclResult_t r = all_reduce_retry(send, recv, &d, comm, &info);
      double w = worst((pcclDataType_t)t, recv, count, (pcclRedOp_t)op, -1);
      /* An average of floats is rounded once more: within a unit of the type's last place. */
      double bound = op != pcclAvg ? 0 : t == pcclBFloat16 ? 0.5 : t == pcclFloat16 ? 0.05 : is_float((pcclDataType_t)t) ? 1e-4 : 0;
      check(r == pcclSuccess && w <= bound && info.local_world_size == (uint32_t)g_peers, name,
            "result %d, worst difference %g, world %u", (int)r, w, info.local_world_size);
      digest(name, recv, bytes);
      /* In place: the source is the destination. */
      snprintf(name, sizeof name, "inplace_%s_%s", kTypeNames[t], kOpNames[op]);
      d.tag = tag++;
      r = all_reduce_retry(send, send, &d, comm, NULL);
      check(r == pcclSuccess && memcmp(send, recv, bytes) == 0, name, "result %d", (int)r);
      free(send);
      free(recv);
    }
  }
  /* Quantized: 8-bit codes under both algorithms, within a code step of the sum. */
  const size_t big = 1u << 16;
  float* send = malloc(big * sizeof(float));
  float* recv = malloc(big * sizeof(float));
  for (int alg = pcclQuantMinMax; alg <= pcclQuantZeroPointScale; ++alg) {
    for (size_t i = 0; i < big; ++i) send[i] = (float)(g_index + 1) * (float)(i % 101) / 100.0f;
    pcclReduceDescriptor_t d = descriptor(big, pcclSum, tag++, pcclFloat);
    d.quantization_options.quantized_datatype = pcclUint8;
    d.quantization_options.algorithm = (pcclQuantizationAlgorithm_t)alg;
    pcclReduceInfo_t info;
    pcclResult_t r = all_reduce_retry(send, recv, &d, comm, &info);
    double w = 0, total = 0;
    for (int p = 0; p < g_peers; ++p) total += p + 1;
    for (size_t i = 0; i < big; ++i) {
      double e = total * (double)(i % 101) / 100.0;
      if (fabs(recv[i] - e) > w) w = fabs(recv[i] - e);
    }
    snprintf(name, sizeof name, "quantized_%s", alg == pcclQuantMinMax ? "minmax" : "zeropoint");
    /* Each of the N-1 reduce steps and the gather re-encodes with a step of range/255. */
    check(r == pcclSuccess && w <= total * (double)g_peers / 255.0, name, "result %d, worst difference %g", (int)r, w);
    digest(name, recv, big * sizeof(float));
    /* The bytes on the wire: 8-bit codes, about a quarter of the floats' bytes. */
    double ratio = (double)info.tx_bytes / (double)(big * sizeof(float));
    snprintf(name, sizeof name, "quantized_bytes_%s", alg == pcclQuantMinMax ? "minmax" : "zeropoint");
    check(r == pcclSuccess && ratio > 0.05 && ratio < 0.6 * (double)(g_peers - 1) / g_peers * 2, name,
          "sent %llu bytes for %zu floats", (unsigned long long)info.tx_bytes, big);
  }
  free(send);
  free(recv);
}

static void scenario_async(pcclComm_t* comm) {
  enum { kOps = 6 };
  const size_t count = 1u << 18;
  float* send[kOps];
  float* recv[kOps];
  pcclAsyncReduceOp_t handles[kOps];
  for (int k = 0; k < kOps; ++k) {
    send[k] = malloc(count * sizeof(float));
    recv[k] = malloc(count * sizeof(float));
    fill(pcclFloat, send[k], count, g_index + k, pcclSum);
  }
  for (int attempt = 0;; ++attempt) {
    for (int k = 0; k < kOps; ++k) {
      pcclReduceDescriptor_t d = descriptor(count, pcclSum, 100 + (uint64_t)k, pcclFloat);
      MUST(pcclAllReduceAsync(send[k], recv[k], &d, comm, &handles[k]));
    }
    if (attempt == 0) {
      /* A tag still in flight cannot be launched again. */
      pcclReduceDescriptor_t d = descriptor(count, pcclSum, 100, pcclFloat);
      pcclAsyncReduceOp_t again;
      pcclResult_t r = pcclAllReduceAsync(send[0], recv[0], &d, comm, &again);
      check(r == pcclInvalidUsage, "async_tag_in_flight", "result %d", (int)r);
    }
    int lost = 0;
    for (int k = kOps - 1; k >= 0; --k) { /* awaited in the other order */
      pcclReduceInfo_t info;
      pcclResult_t r = pcclAwaitAsyncReduce(&handles[k], &info);
      if (r == pcclRankConnectionLost) lost = 1;
      else if (r != pcclSuccess) die("pcclAwaitAsyncReduce", r);
    }
    if (!lost) break;
  }
  for (int k = 0; k < kOps; ++k) {
    double w = 0;
    for (size_t i = 0; i < count; ++i) {
      double e = 0;
      for (int p = 0; p < g_peers; ++p) e += contribution(p + k, i, pcclSum, pcclFloat);
      if (fabs(recv[k][i] - e) > w) w = fabs(recv[k][i] - e);
    }
    char name[64];
    snprintf(name, sizeof name, "async_%d", k);
    check(w == 0, name, "worst difference %g", w);
    digest(name, recv[k], count * sizeof(float));
    free(send[k]);
    free(recv[k]);
  }
  /* A handle awaited twice, and one of no operation: invalid arguments. */
  pcclResult_t r = pcclAwaitAsyncReduce(&handles[0], NULL);
  check(r == pcclInvalidArgument, "async_awaited_twice", "result %d", (int)r);
}

static void scenario_multiple(pcclComm_t* comm) {
  enum { kOps = 8 };
  const size_t count = 100000;
  pcclReduceOpDescriptor_t descs[kOps];
  double* bufs[kOps];
  for (int k = 0; k < kOps; ++k) {
    bufs[k] = malloc(count * sizeof(double));
    fill(pcclDouble, bufs[k], count, g_index, pcclMax);
    descs[k].sendbuf = bufs[k];
    descs[k].recvbuf = bufs[k];
    descs[k].descriptor = descriptor(count, pcclMax, 200 + (uint64_t)k, pcclDouble);
  }
  pcclReduceInfo_t info;
  memset(&info, 0, sizeof info);
  pcclResult_t r = pcclAllReduceMultipleWithRetry(descs, kOps, comm, &info, 3);
  double w = 0;
  for (int k = 0; k < kOps; ++k) {
    double wk = worst(pcclDouble, bufs[k], count, pcclMax, -1);
    if (wk > w) w = wk;
  }
  check(r == pcclSuccess && w == 0 && info.local_world_size == (uint32_t)g_peers && info.tx_bytes > 0, "multiple",
        "result %d, worst %g, world %u, tx %llu", (int)r, w, info.local_world_size, (unsigned long long)info.tx_bytes);
  digest("multiple", bufs[kOps - 1], count * sizeof(double));
  for (int k = 0; k < kOps; ++k) free(bufs[k]);
}

/* Peers 0 .. N-2 hold the same weights, the last peer other ones: the popular content
 * wins everywhere. "stats" differs on every peer and allows it: nobody receives it. */
static void scenario_sync(pcclComm_t* comm) {
  const size_t n = 1u << 16;
  float* weights = malloc(n * sizeof(float));
  int64_t steps[4] = {7, 8, 9, 10};
  double stats[3] = {(double)g_index, 1, 2};
  int odd = g_index == g_peers - 1;
  for (size_t i = 0; i < n; ++i) weights[i] = odd ? -1.0f : (float)i * 0.5f;
  pcclTensorInfo_t infos[3];
  memset(infos, 0, sizeof infos);
  infos[0].name = "weights";
  infos[0].data = weights;
  infos[0].count = n;
  infos[0].datatype = pcclFloat;
  infos[0].device_type = pcclDeviceCpu;
  infos[1].name = "steps";
  infos[1].data = steps;
  infos[1].count = 4;
  infos[1].datatype = pcclInt64;
  infos[1].device_type = pcclDeviceCpu;
  infos[2].name = "stats";
  infos[2].data = stats;
  infos[2].count = 3;
  infos[2].datatype = pcclDouble;
  infos[2].device_type = pcclDeviceCpu;
  infos[2].allow_content_inequality = true;
  pcclSharedState_t state = {1, 3, infos};
  pcclSharedStateSyncInfo_t info;
  memset(&info, 0, sizeof info);
  pcclResult_t r;
  while ((r = pcclSynchronizeSharedState(comm, &state, &info)) == pcclRankConnectionLost) {
  }
  int same = 1;
  for (size_t i = 0; i < n; ++i) same &= weights[i] == (float)i * 0.5f;
  check(r == pcclSuccess && same && state.revision == 1, "sync_popular", "result %d, revision %llu, content %s",
        (int)r, (unsigned long long)state.revision, same ? "popular" : "not the popular one");
  check(stats[0] == (double)g_index, "sync_allowed_inequality", "stats[0] %g", stats[0]);
  check(odd ? info.rx_bytes >= n * sizeof(float) : info.rx_bytes == 0, "sync_bytes", "rx %llu, tx %llu",
        (unsigned long long)info.rx_bytes, (unsigned long long)info.tx_bytes);
  digest("sync_weights", weights, n * sizeof(float));
  /* The next revision with nothing changed: nothing moves. */
  state.revision = 2;
  r = pcclSynchronizeSharedState(comm, &state, &info);
  check(r == pcclSuccess && info.rx_bytes == 0 && info.tx_bytes == 0 && state.revision == 2, "sync_unchanged",
        "result %d, rx %llu, tx %llu", (int)r, (unsigned long long)info.rx_bytes, (unsigned long long)info.tx_bytes);
  free(weights);
}

static void scenario_optimize(pcclComm_t* comm) {
  pcclResult_t r;
  while ((r = pcclOptimizeTopology(comm)) == pcclTopologyOptimizationFailed) {
  }
  check(r == pcclSuccess, "optimize", "result %d", (int)r);
  const size_t count = 1u << 16;
  int32_t* buf = malloc(count * sizeof(int32_t));
  fill(pcclInt32, buf, count, g_index, pcclSum);
  pcclReduceDescriptor_t d = descriptor(count, pcclSum, 300, pcclInt32);
  r = all_reduce_retry(buf, buf, &d, comm, NULL);
  check(r == pcclSuccess && worst(pcclInt32, buf, count, pcclSum, -1) == 0, "optimize_allreduce", "result %d", (int)r);
  free(buf);
}

static void scenario_churn(pcclComm_t* comm, int victim, int iterations) {
  const size_t count = 4u << 20;
  float* send = malloc(count * sizeof(float));
  float* recv = malloc(count * sizeof(float));
  fill(pcclFloat, send, count, g_index, pcclSum);
  int lost = 0, restored = 1, last_world = 0, after = 0;
  pcclResult_t r = pcclSuccess;
  double deadline = now_s() + 120;
  /* Until `iterations` all-reduces have succeeded without the victim (it runs until killed). */
  for (int it = 0; after < iterations; ++it) {
    if (now_s() > deadline) die("churn: the world never shrank", pcclInternalError);
    pcclReduceDescriptor_t d = descriptor(count, pcclSum, 400 + (uint64_t)it, pcclFloat);
    pcclReduceInfo_t info;
    for (;;) {
      for (size_t i = 0; i < count; i += 4099) recv[i] = -7.0f; /* a sentinel the result never holds */
      r = pcclAllReduce(send, recv, &d, comm, &info);
      if (r != pcclRankConnectionLost) break;
      ++lost;
      for (size_t i = 0; i < count; i += 4099) restored &= recv[i] == -7.0f;
    }
    if (r != pcclSuccess) die("pcclAllReduce", r);
    last_world = (int)info.local_world_size;
    if (last_world < g_peers) ++after;
    printf("iteration %d world %d\n", it, last_world);
    fflush(stdout);
  }
  check(restored, "churn_restored", "a failed attempt changed recvbuf");
  printf("lost %d\n", lost);
  double w = worst(pcclFloat, recv, count, pcclSum, victim);
  check(w == 0 && last_world == g_peers - 1, "churn_survivors", "world %d, worst difference %g", last_world, w);
  /* The survivors leave one by one; the last one alone: too few peers. */
  pcclReduceOpDescriptor_t descs[2];
  for (int k = 0; k < 2; ++k) {
    descs[k].sendbuf = send;
    descs[k].recvbuf = recv;
    descs[k].descriptor = descriptor(1024, pcclSum, 500 + (uint64_t)k, pcclFloat);
  }
  if (g_index == 0) {
    /* Peer 0 stays; every other survivor leaves after its last iteration. */
    double deadline = now_s() + 60;
    while ((r = pcclAllReduceMultipleWithRetry(descs, 2, comm, NULL, 2)) == pcclSuccess && now_s() < deadline) {
      bool pending = false;
      pcclArePeersPending(comm, &pending);
      if (pending) update_topology(comm);
      sleep_ms(50);
    }
    check(r == pcclTooFewPeers, "churn_alone", "result %d", (int)r);
    /* Once the view says so (after update topology), an async all-reduce fails at once. */
    update_topology(comm);
    pcclAsyncReduceOp_t h;
    r = pcclAllReduceAsync(send, recv, &descs[0].descriptor, comm, &h);
    check(r == pcclTooFewPeers, "churn_alone_async", "result %d", (int)r);
  }
  free(send);
  free(recv);
}

static void scenario_fill(pcclComm_t* comm, size_t count, uint64_t tag, float value, float expect) {
  float* buf = malloc(count * sizeof(float));
  for (size_t i = 0; i < count; ++i) buf[i] = value;
  pcclReduceDescriptor_t d = descriptor(count, pcclSum, tag, pcclFloat);
  pcclReduceInfo_t info;
  pcclResult_t r = all_reduce_retry(buf, buf, &d, comm, &info);
  int uniform = 1;
  for (size_t i = 0; i < count; ++i) uniform &= buf[i] == expect;
  check(r == pcclSuccess && uniform && info.local_world_size == (uint32_t)g_peers, "fill",
        "result %d, first element %g, world %u", (int)r, (double)buf[0], info.local_world_size);
  free(buf);
}

/* Update topology belongs to the communicator's thread (only all-reduces may run on one
 * other thread). */
static void* wrong_thread(void* arg) { return (void*)(intptr_t)pcclUpdateTopology((pcclComm_t*)arg); }

static void scenario_errors(void) {
  pcclResult_t r;
  pcclCommCreateParams_t params;
  memset(&params, 0, sizeof params);
  params.master_address = loopback(g_port);
  pcclComm_t* comm = NULL;
  r = pcclCreateCommunicator(&params, &comm);
  check(r == pcclNotInitialized, "before_init", "result %d", (int)r);
  pcclBuildInfo_t build;
  memset(&build, 0xff, sizeof build);
  r = pcclGetBuildInfo(&build); /* the one call PCCL serves before pcclInit */
  check(r == pcclSuccess && !build.has_cuda_support, "build_info", "result %d", (int)r);
  MUST(pcclInit());
  MUST(pcclInit()); /* again: harmless */
  check(pcclGetBuildInfo(NULL) == pcclInvalidArgument, "build_info_null", "");
  check(pcclCreateCommunicator(NULL, &comm) == pcclInvalidArgument, "create_null_params", "");
  check(pcclCreateCommunicator(&params, NULL) == pcclInvalidArgument, "create_null_out", "");
  params.master_address.inet.protocol = inetIPv6; /* ::ffff:127.0.0.1 */
  params.master_address.inet.ipv6.data[10] = params.master_address.inet.ipv6.data[11] = 0xff;
  params.master_address.inet.ipv6.data[12] = 127;
  params.master_address.inet.ipv6.data[15] = 1;
  check(pcclCreateCommunicator(&params, &comm) == pcclInvalidArgument, "create_ipv4_mapped", "");
  params.master_address.inet.protocol = (ccoip_inet_protocol_t)7;
  check(pcclCreateCommunicator(&params, &comm) == pcclInvalidArgument, "create_unknown_protocol", "");
  params.master_address = loopback(g_port);
  setenv("LOCKSTEP_P2P_STREAMS", "17", 1);
  check(pcclCreateCommunicator(&params, &comm) == pcclInvalidArgument, "create_bad_environment", "");
  setenv("LOCKSTEP_P2P_STREAMS", "x", 1);
  check(pcclCreateCommunicator(&params, &comm) == pcclInvalidArgument, "create_malformed_environment", "");
  unsetenv("LOCKSTEP_P2P_STREAMS");
  /* A well-formed variable reaches lockstep: encryption without a run secret is refused. */
  setenv("LOCKSTEP_ENCRYPT_DATA", "1", 1);
  check(pcclCreateCommunicator(&params, &comm) == pcclInvalidArgument, "create_encrypt_without_secret", "");
  unsetenv("LOCKSTEP_ENCRYPT_DATA");
  MUST(pcclCreateCommunicator(&params, &comm));

  /* Unknown handles: a made-up pointer is refused, never dereferenced. */
  char junk[256];
  memset(junk, 0xab, sizeof junk);
  pcclComm_t* fake = (pcclComm_t*)(void*)junk;
  int value = 0;
  bool pending = false;
  check(pcclConnect(fake) == pcclInvalidArgument, "connect_unknown_handle", "");
  check(pcclGetAttribute(fake, PCCL_ATTRIBUTE_GLOBAL_WORLD_SIZE, &value) == pcclInvalidArgument,
        "attribute_unknown_handle", "");
  check(pcclDestroyCommunicator(fake) == pcclInvalidArgument, "destroy_unknown_handle", "");
  check(pcclConnect(NULL) == pcclInvalidArgument, "connect_null", "");
  pcclAsyncReduceOp_t fake_op = {fake, 1};
  check(pcclAwaitAsyncReduce(&fake_op, NULL) == pcclInvalidArgument, "await_unknown_handle", "");
  check(pcclAwaitAsyncReduce(NULL, NULL) == pcclInvalidArgument, "await_null", "");
  check(pcclRunMaster((pcclMasterInstance_t*)(void*)junk) == pcclInvalidArgument, "master_unknown_handle", "");
  check(pcclCreateMaster(loopback(0), NULL) == pcclInvalidArgument, "master_null_out", "");

  /* Operations before connect. */
  float x[4] = {1, 2, 3, 4};
  pcclReduceDescriptor_t d = descriptor(4, pcclSum, 1, pcclFloat);
  check(pcclUpdateTopology(comm) == pcclInvalidUsage, "update_before_connect", "result %d",
        (int)pcclUpdateTopology(comm));
  check(pcclAllReduce(x, x, &d, comm, NULL) == pcclInvalidUsage, "allreduce_before_connect", "");
  check(pcclArePeersPending(comm, &pending) == pcclInvalidUsage, "pending_before_connect", "");
  check(pcclGetAttribute(comm, (pcclAttribute_t)0, &value) == pcclInvalidArgument, "attribute_zero", "");
  check(pcclGetAttribute(comm, (pcclAttribute_t)5, &value) == pcclInvalidArgument, "attribute_five", "");
  check(pcclGetAttribute(comm, PCCL_ATTRIBUTE_GLOBAL_WORLD_SIZE, NULL) == pcclInvalidArgument, "attribute_null", "");

  MUST(pcclConnect(comm));
  check(world_of(comm) == 1, "alone", "world %d", world_of(comm));

  /* Malformed descriptors: each an invalid argument, and then a valid call works. */
  pcclReduceDescriptor_t bad = d;
  bad.src_descriptor.datatype = (pcclDataType_t)12;
  check(pcclAllReduce(x, x, &bad, comm, NULL) == pcclInvalidArgument, "dtype_unknown", "");
  bad = d;
  bad.op = (pcclRedOp_t)5;
  check(pcclAllReduce(x, x, &bad, comm, NULL) == pcclInvalidArgument, "op_unknown", "");
  bad = d;
  bad.src_descriptor.distribution_hint = (pcclDistributionHint_t)3;
  check(pcclAllReduce(x, x, &bad, comm, NULL) == pcclInvalidArgument, "hint_unknown", "");
  bad = d;
  bad.quantization_options.algorithm = (pcclQuantizationAlgorithm_t)3;
  check(pcclAllReduce(x, x, &bad, comm, NULL) == pcclInvalidArgument, "quantization_unknown", "");
  bad = d;
  bad.quantization_options.algorithm = pcclQuantMinMax;
  bad.quantization_options.quantized_datatype = pcclUint16;
  check(pcclAllReduce(x, x, &bad, comm, NULL) == pcclInvalidArgument, "quantized_type_unsupported", "");
  bad = d;
  bad.quantization_options.quantized_datatype = (pcclDataType_t)-1;
  check(pcclAllReduce(x, x, &bad, comm, NULL) == pcclInvalidArgument, "quantized_type_unknown", "");
  check(pcclAllReduce(NULL, x, &d, comm, NULL) == pcclInvalidArgument, "allreduce_null_send", "");
  check(pcclAllReduce(x, x, NULL, comm, NULL) == pcclInvalidArgument, "allreduce_null_descriptor", "");
  pcclAsyncReduceOp_t h;
  check(pcclAllReduceAsync(x, x, &d, comm, NULL) == pcclInvalidArgument, "async_null_handle", "");
  pcclReduceOpDescriptor_t one = {x, x, d};
  check(pcclAllReduceMultipleWithRetry(NULL, 1, comm, NULL, 1) == pcclInvalidArgument, "multiple_null", "");
  check(pcclAllReduceMultipleWithRetry(&one, 1, comm, NULL, 0) == pcclInvalidArgument, "multiple_zero_in_flight", "");
  check(pcclAllReduceMultipleWithRetry(&one, (size_t)-1, comm, NULL, 1) == pcclInvalidArgument, "multiple_huge", "");
  pcclTensorInfo_t t;
  memset(&t, 0, sizeof t);
  t.name = "x";
  t.data = x;
  t.count = 4;
  t.datatype = pcclFloat;
  t.device_type = pcclDeviceCuda;
  pcclSharedState_t state = {1, 1, &t};
  check(pcclSynchronizeSharedState(comm, &state, NULL) == pcclInvalidArgument, "sync_cuda", "");
  t.device_type = pcclDeviceCpu;
  t.name = NULL;
  check(pcclSynchronizeSharedState(comm, &state, NULL) == pcclInvalidArgument, "sync_null_name", "");
  t.name = "x";
  t.datatype = (pcclDataType_t)99;
  check(pcclSynchronizeSharedState(comm, &state, NULL) == pcclInvalidArgument, "sync_dtype_unknown", "");
  t.datatype = pcclFloat;
  state.infos = NULL;
  check(pcclSynchronizeSharedState(comm, &state, NULL) == pcclInvalidArgument, "sync_null_infos", "");
  state.infos = &t;
  state.count = (size_t)-1;
  check(pcclSynchronizeSharedState(comm, &state, NULL) == pcclInvalidArgument, "sync_huge", "");
  state.count = 1;
  check(pcclSynchronizeSharedState(comm, NULL, NULL) == pcclInvalidArgument, "sync_null_state", "");

  /* The communicator belongs to its thread. */
  pthread_t thread;
  void* result = NULL;
  pthread_create(&thread, NULL, wrong_thread, comm);
  pthread_join(thread, &result);
  check((pcclResult_t)(intptr_t)result == pcclInvalidUsage, "wrong_thread", "result %d", (int)(intptr_t)result);

  /* Alone: every collective says so, at once for the async one. */
  r = pcclAllReduce(x, x, &d, comm, NULL);
  check(r == pcclTooFewPeers, "allreduce_alone", "result %d", (int)r);
  r = pcclAllReduceAsync(x, x, &d, comm, &h);
  check(r == pcclTooFewPeers, "async_alone", "result %d", (int)r);
  r = pcclAllReduceMultipleWithRetry(&one, 1, comm, NULL, 1);
  check(r == pcclTooFewPeers, "multiple_alone", "result %d", (int)r);
  /* The shared state of a peer alone: its own content, its revision. */
  state.revision = 1;
  r = pcclSynchronizeSharedState(comm, &state, NULL);
  check(r == pcclSuccess && state.revision == 1, "sync_alone", "result %d", (int)r);
  /* A revision that skips one: the master removes this peer. */
  state.revision = 5;
  r = pcclSynchronizeSharedState(comm, &state, NULL);
  check(r == pcclMasterConnectionFailed, "sync_revision_skipped", "result %d", (int)r);
  MUST(pcclDestroyCommunicator(comm));
  check(pcclDestroyCommunicator(comm) == pcclInvalidArgument, "destroy_twice", "");
}

static void scenario_master(void) {
  pcclMasterInstance_t* master = NULL;
  MUST(pcclCreateMaster(loopback(g_port), &master));
  pcclResult_t r = pcclRunMaster(master);
  if (r == pcclMasterConnectionFailed) {
    pcclDestroyMaster(master);
    exit(75);
  }
  if (r != pcclSuccess) die("pcclRunMaster", r);
  check(pcclRunMaster(master) == pcclInvalidUsage, "master_run_twice", "");
  /* Not interrupted yet: awaiting it could never end, so it is refused. */
  check(pcclMasterAwaitTermination(master) == pcclInvalidUsage, "master_await_uninterrupted", "");
  printf("master running\n");
  fflush(stdout);
  char line[64];
  while (fgets(line, sizeof line, stdin) != NULL) {
  }
  MUST(pcclInterruptMaster(master));
  MUST(pcclMasterAwaitTermination(master));
  MUST(pcclDestroyMaster(master));
  check(pcclDestroyMaster(master) == pcclInvalidArgument, "master_destroy_twice", "");
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: pccl_peer SCENARIO --port P --index I --peers N [--victim V] [--iterations K]\n");
    return 2;
  }
  const char* scenario = argv[1];
  int victim = -1, iterations = 10, pool = 1, count = 1000, tag = 1, value = 1, expect = 0;
  for (int i = 2; i + 1 < argc; i += 2) {
    int v = atoi(argv[i + 1]);
    if (strcmp(argv[i], "--port") == 0) g_port = v;
    else if (strcmp(argv[i], "--index") == 0) g_index = v;
    else if (strcmp(argv[i], "--ipv6") == 0) g_ipv6 = v;
    else if (strcmp(argv[i], "--peers") == 0) g_peers = v;
    else if (strcmp(argv[i], "--victim") == 0) victim = v;
    else if (strcmp(argv[i], "--iterations") == 0) iterations = v;
    else if (strcmp(argv[i], "--pool") == 0) pool = v;
    else if (strcmp(argv[i], "--count") == 0) count = v;
    else if (strcmp(argv[i], "--tag") == 0) tag = v;
    else if (strcmp(argv[i], "--fill") == 0) value = v;
    else if (strcmp(argv[i], "--expect") == 0) expect = v;
    else {
      fprintf(stderr, "pccl_peer: unknown option %s\n", argv[i]);
      return 2;
    }
  }
  if (strcmp(scenario, "errors") == 0) {
    scenario_errors();
    printf("done\n");
    return g_failures == 0 ? 0 : 1;
  }
  MUST(pcclInit());
  if (strcmp(scenario, "master") == 0) {
    scenario_master();
    printf("done\n");
    return g_failures == 0 ? 0 : 1;
  }
  pcclComm_t* comm = create((uint32_t)pool);
  join(comm, g_peers);
  if (strcmp(scenario, "collectives") == 0) scenario_collectives(comm);
  else if (strcmp(scenario, "async") == 0) scenario_async(comm);
  else if (strcmp(scenario, "multiple") == 0) scenario_multiple(comm);
  else if (strcmp(scenario, "sync") == 0) scenario_sync(comm);
  else if (strcmp(scenario, "optimize") == 0) scenario_optimize(comm);
  else if (strcmp(scenario, "churn") == 0) scenario_churn(comm, victim, iterations);
  else if (strcmp(scenario, "fill") == 0) scenario_fill(comm, (size_t)count, (uint64_t)tag, (float)value, (float)expect);
  else {
    fprintf(stderr, "pccl_peer: unknown scenario %s\n", scenario);
    return 2;
  }
  MUST(pcclDestroyCommunicator(comm));
  printf("done\n");
  return g_failures == 0 ? 0 : 1;
}
