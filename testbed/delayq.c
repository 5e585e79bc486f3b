/*
 * lockstep-testbed-delayq: one-way delay, random loss and jitter for one directed pair
 * of test bed hosts.
 *
 * The test bed sends the packets of a pair to an NFQUEUE queue (an iptables rule in
 * the hub's namespace, without --queue-bypass). This program binds that queue, stamps
 * each packet with the time it was read, keeps it in a FIFO (the delay is the same for
 * every packet, so arrival order is release order) and gives the kernel an ACCEPT
 * verdict when the packet is due. A single batch verdict releases every packet up to
 * the newest due one, so a burst of due packets costs one message.
 *
 * Loss (--loss P): each packet is dropped with probability P when it is read. Jitter
 * (--jitter-ms J): each packet gets an extra delay drawn uniformly from [0, J]. Without
 * --reorder a packet is never released before the one read before it (its due time is
 * max(previous due time, now + delay + extra)), so the FIFO and the batch verdicts
 * stay; with --reorder each packet keeps its own due time, the packets wait in a heap
 * ordered by due time, and each is released by its own verdict. With loss or jitter
 * the kernel hands us every wire packet on its own: the queue is bound without
 * NFQA_CFG_F_GSO, so a segmentation-offload packet (up to 64 KB, dozens of wire
 * packets) is segmented into MTU-sized packets before it is queued, and a loss drops
 * one wire packet, never a whole bundle.
 *
 * Fail closed: if this program dies, the kernel drops the packets it held, and new
 * packets for the queue are dropped as no one listens on it (no --queue-bypass and no
 * NFQA_CFG_F_FAIL_OPEN). Memory is bounded: at most --max-packets packets and
 * --max-bytes bytes are held; beyond that a packet is dropped at once and counted.
 *
 * Statistics are written as one JSON line to stderr on SIGUSR1 and at exit, with the
 * kernel's own drop counters of the queue.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <linux/netfilter.h>
#include <libnetfilter_queue/libnetfilter_queue.h>

/* Bytes copied to user space per packet: the IPv4 header is enough to learn the
 * packet's length (for the byte bound); the payload is never needed. */
#define COPY_RANGE 20u
/* Messages read from the socket before the due packets are looked at again. */
#define READ_BATCH 512

struct held {
  uint64_t due_ns;
  uint64_t seq; /* arrival order */
  uint32_t id;
  uint32_t len;
};

struct state {
  struct nfq_handle *h;
  struct nfq_q_handle *qh;
  uint64_t delay_ns;
  uint64_t now_ns; /* time the current message was read */
  struct held *ring; /* FIFO ring, or the heap with --reorder */
  size_t cap;        /* max held packets */
  size_t head, count;
  uint64_t bytes, max_bytes;
  /* impairments */
  double loss;         /* drop probability per packet */
  uint64_t loss_threshold; /* drop when the next 64-bit random number is below it */
  uint64_t jitter_ns;  /* extra delay drawn from [0, jitter_ns] */
  int reorder;         /* each packet its own due time (heap) */
  int segment;         /* GSO packets are segmented by the kernel before queueing */
  uint64_t last_due_ns;
  uint64_t next_seq, max_seq_released;
  uint64_t rng[4];     /* xoshiro256** */
  /* statistics */
  uint64_t received, released, dropped_full, dropped_loss, verdict_errors, enobufs;
  uint64_t jittered, reordered;
  uint64_t max_extra_ns; /* largest extra delay given (jitter, and waiting behind it) */
  size_t max_held;
  uint64_t max_late_ns; /* worst lateness of a release behind its due time */
  unsigned queue;
  double delay_ms, jitter_ms;
  uint64_t seed;
};

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

/* xoshiro256**: fast, and good enough for drop and jitter decisions. */
static uint64_t next_random(struct state *s) {
  uint64_t *r = s->rng;
  uint64_t result = rotl(r[1] * 5, 7) * 9;
  uint64_t t = r[1] << 17;
  r[2] ^= r[0];
  r[3] ^= r[1];
  r[1] ^= r[2];
  r[0] ^= r[3];
  r[2] ^= t;
  r[3] = rotl(r[3], 45);
  return result;
}

static void seed_random(struct state *s, uint64_t seed) {
  /* splitmix64 spreads the seed over the state */
  for (int i = 0; i < 4; i++) {
    uint64_t z = (seed += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    s->rng[i] = z ^ (z >> 31);
  }
}

/* Heap of held packets ordered by (due time, arrival), for --reorder. */
static int heap_less(const struct held *a, const struct held *b) {
  return a->due_ns < b->due_ns || (a->due_ns == b->due_ns && a->seq < b->seq);
}

static void heap_push(struct state *s, struct held p) {
  size_t i = s->count++;
  while (i > 0) {
    size_t parent = (i - 1) / 2;
    if (!heap_less(&p, &s->ring[parent])) break;
    s->ring[i] = s->ring[parent];
    i = parent;
  }
  s->ring[i] = p;
}

static struct held heap_pop(struct state *s) {
  struct held top = s->ring[0];
  struct held last = s->ring[--s->count];
  size_t i = 0, n = s->count;
  for (;;) {
    size_t c = 2 * i + 1;
    if (c >= n) break;
    if (c + 1 < n && heap_less(&s->ring[c + 1], &s->ring[c])) c++;
    if (!heap_less(&s->ring[c], &last)) break;
    s->ring[i] = s->ring[c];
    i = c;
  }
  if (n > 0) s->ring[i] = last;
  return top;
}

static uint64_t now_mono(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* The kernel's counters of this queue (this network namespace's
 * /proc/net/netfilter/nfnetlink_queue): packets it dropped because the queue was full,
 * and because they could not be sent to us. */
static void kernel_drops(unsigned queue, long long *queue_dropped, long long *user_dropped) {
  *queue_dropped = *user_dropped = -1;
  FILE *f = fopen("/proc/net/netfilter/nfnetlink_queue", "r");
  if (f == NULL) return;
  unsigned q, portid, total, mode, range;
  unsigned long long qd, ud;
  while (fscanf(f, "%u %u %u %u %u %llu %llu %*u %*u", &q, &portid, &total, &mode, &range, &qd,
                &ud) == 7) {
    if (q == queue) {
      *queue_dropped = (long long)qd;
      *user_dropped = (long long)ud;
      break;
    }
  }
  fclose(f);
}

static void print_stats(const struct state *s, const char *event) {
  long long kq, ku;
  kernel_drops(s->queue, &kq, &ku);
  fprintf(stderr,
          "{\"event\":\"%s\",\"queue\":%u,\"delay_ms\":%.3f,\"loss\":%.6g,\"jitter_ms\":%.3f"
          ",\"reorder\":%s,\"segmented\":%s,\"seed\":%" PRIu64 ",\"received\":%" PRIu64
          ",\"released\":%" PRIu64 ",\"dropped_loss\":%" PRIu64 ",\"dropped_full\":%" PRIu64
          ",\"jittered\":%" PRIu64 ",\"reordered\":%" PRIu64 ",\"max_extra_us\":%.1f"
          ",\"enobufs\":%" PRIu64
          ",\"verdict_errors\":%" PRIu64 ",\"held\":%zu,\"max_held\":%zu,\"max_packets\":%zu"
          ",\"held_bytes\":%" PRIu64 ",\"max_late_us\":%.1f"
          ",\"kernel_queue_dropped\":%lld,\"kernel_user_dropped\":%lld}\n",
          event, s->queue, s->delay_ms, s->loss, s->jitter_ms, s->reorder ? "true" : "false",
          s->segment ? "true" : "false", s->seed, s->received, s->released, s->dropped_loss,
          s->dropped_full, s->jittered, s->reordered, (double)s->max_extra_ns / 1000.0, s->enobufs,
          s->verdict_errors, s->count, s->max_held, s->cap, s->bytes,
          (double)s->max_late_ns / 1000.0, kq, ku);
  fflush(stderr);
}

static int on_packet(struct nfq_q_handle *qh, struct nfgenmsg *msg, struct nfq_data *nfa,
                     void *data) {
  (void)msg;
  struct state *s = data;
  struct nfqnl_msg_packet_hdr *ph = nfq_get_msg_packet_hdr(nfa);
  if (ph == NULL) return 0;
  uint32_t id = ntohl(ph->packet_id);
  s->received++;

  uint32_t len = 1500;
  unsigned char *payload = NULL;
  int plen = nfq_get_payload(nfa, &payload);
  if (plen >= 6 && payload != NULL && (payload[0] >> 4) == 6) {
    uint16_t payload_len; /* IPv6: the payload's length, after the 40-byte header */
    memcpy(&payload_len, payload + 4, sizeof payload_len);
    payload_len = ntohs(payload_len);
    len = payload_len != 0 ? 40u + payload_len : 65536u; /* 0: a jumbogram */
  } else if (plen >= 4 && payload != NULL) {
    uint16_t tot;
    memcpy(&tot, payload + 2, sizeof tot);
    tot = ntohs(tot);
    len = tot != 0 ? tot : 65536u; /* 0: a BIG TCP packet; count it as large */
  }

  if (s->loss_threshold != 0 && next_random(s) < s->loss_threshold) {
    s->dropped_loss++;
    if (nfq_set_verdict(qh, id, NF_DROP, 0, NULL) < 0) s->verdict_errors++;
    return 0;
  }
  if (s->count >= s->cap || s->bytes + len > s->max_bytes) {
    s->dropped_full++;
    if (nfq_set_verdict(qh, id, NF_DROP, 0, NULL) < 0) s->verdict_errors++;
    return 0;
  }
  uint64_t base = s->now_ns + s->delay_ns, due = base;
  if (s->jitter_ns != 0) {
    /* uniform in [0, jitter_ns] */
    uint64_t extra = (uint64_t)((double)(next_random(s) >> 11) * 0x1.0p-53 * (double)(s->jitter_ns + 1));
    if (extra > s->jitter_ns) extra = s->jitter_ns;
    due += extra;
    if (!s->reorder && due < s->last_due_ns) due = s->last_due_ns; /* never overtake */
    if (due > base) s->jittered++;
    if (due - base > s->max_extra_ns) s->max_extra_ns = due - base;
  }
  s->last_due_ns = due;
  struct held p = {.due_ns = due, .seq = s->next_seq++, .id = id, .len = len};
  if (s->reorder) {
    heap_push(s, p);
  } else {
    s->ring[(s->head + s->count) % s->cap] = p;
    s->count++;
  }
  s->bytes += len;
  if (s->count > s->max_held) s->max_held = s->count;
  return 0;
}

/* Reads up to `limit` queued packet messages without blocking; -1 on a fatal error. */
static int read_pending(struct state *s, int fd, size_t limit) {
  static char buf[1 << 17];
  for (size_t k = 0; k < limit; k++) {
    ssize_t r = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (r < 0) {
      if (errno == ENOBUFS) { /* messages were lost: the kernel dropped those packets */
        s->enobufs++;
        continue;
      }
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
      fprintf(stderr, "delayq: recv: %s\n", strerror(errno));
      return -1;
    }
    s->now_ns = now_mono();
    nfq_handle_packet(s->h, buf, (int)r);
  }
  return 0;
}

/* Releases every held packet that is due at `now`; returns the due time of the next
 * held packet, or 0 when none is held. */
static uint64_t release_due(struct state *s, uint64_t now) {
  if (s->reorder) {
    /* Each packet by its own verdict: a batch verdict would also release the held
     * packets with smaller ids that are not due yet. */
    while (s->count > 0 && s->ring[0].due_ns <= now) {
      struct held p = heap_pop(s);
      uint64_t late = now - p.due_ns;
      if (late > s->max_late_ns) s->max_late_ns = late;
      if (p.seq < s->max_seq_released) {
        s->reordered++;
      } else {
        s->max_seq_released = p.seq;
      }
      s->bytes -= p.len;
      if (nfq_set_verdict(s->qh, p.id, NF_ACCEPT, 0, NULL) < 0) s->verdict_errors++;
      s->released++;
    }
    return s->count > 0 ? s->ring[0].due_ns : 0;
  }
  size_t n = 0;
  uint32_t last_id = 0;
  while (s->count > 0 && s->ring[s->head].due_ns <= now) {
    const struct held *p = &s->ring[s->head];
    uint64_t late = now - p->due_ns;
    if (late > s->max_late_ns) s->max_late_ns = late;
    last_id = p->id;
    s->bytes -= p->len;
    s->head = (s->head + 1) % s->cap;
    s->count--;
    n++;
  }
  if (n > 0) {
    /* ACCEPT every queued packet with an id up to last_id: all of them were read,
     * and the ones already dropped are no longer in the kernel's queue. */
    if (nfq_set_verdict_batch(s->qh, last_id, NF_ACCEPT) < 0) s->verdict_errors++;
    s->released += n;
  }
  return s->count > 0 ? s->ring[s->head].due_ns : 0;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: lockstep-testbed-delayq --queue N --delay-ms MS [options]\n"
          "Holds each packet of NFQUEUE queue N for MS milliseconds, then accepts it.\n"
          "Run it inside the network namespace whose iptables rule queues the packets.\n"
          "  --queue N           NFQUEUE number (0..65535)\n"
          "  --delay-ms MS       one-way delay in milliseconds (may be fractional)\n"
          "  --max-packets N     most packets held at once (default 65536)\n"
          "  --max-bytes B       most bytes held at once (default 268435456)\n"
          "  --rcvbuf B          netlink receive buffer in bytes (default 33554432)\n"
          "  --pidfile F         write the pid to F once the queue is bound\n"
          "  --loss P            drop each packet with probability P (0..1)\n"
          "  --jitter-ms J       extra delay per packet, uniform in [0, J] ms (0..60000)\n"
          "  --reorder           with --jitter-ms: each packet its own due time, so later\n"
          "                      packets may overtake earlier ones (default: never)\n"
          "  --seed S            seed of the random numbers (default: from the clock)\n"
          "  --rt                run with SCHED_FIFO priority 10 (less jitter under load)\n"
          "With --loss or --jitter-ms the kernel segments offload (GSO) packets before\n"
          "queueing them, so every decision is about one wire packet.\n"
          "Statistics: one JSON line on stderr on SIGUSR1 and at exit.\n"
          "SIGTERM/SIGINT: stop reading, release what is held when due, then exit;\n"
          "a second signal exits at once (held packets are then dropped).\n");
}

static int parse_u64(const char *v, uint64_t *out) {
  char *end = NULL;
  errno = 0;
  unsigned long long x = strtoull(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0') return -1;
  *out = x;
  return 0;
}

int main(int argc, char **argv) {
  struct state s;
  memset(&s, 0, sizeof s);
  uint64_t queue = UINT64_MAX, max_packets = 65536, rcvbuf = 32u << 20;
  s.max_bytes = 256u << 20;
  double delay_ms = -1, loss = 0, jitter_ms = 0;
  const char *pidfile = NULL;
  int rt = 0, reorder = 0, have_seed = 0;
  uint64_t seed = 0;

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      usage(stdout);
      return 0;
    } else if (strcmp(a, "--rt") == 0) {
      rt = 1;
      continue;
    } else if (strcmp(a, "--reorder") == 0) {
      reorder = 1;
      continue;
    }
    if (v == NULL) {
      fprintf(stderr, "delayq: %s needs a value\n", a);
      usage(stderr);
      return 2;
    }
    i++;
    int bad = 0;
    if (strcmp(a, "--queue") == 0) {
      bad = parse_u64(v, &queue) != 0 || queue > 65535;
    } else if (strcmp(a, "--delay-ms") == 0) {
      char *end = NULL;
      delay_ms = strtod(v, &end);
      bad = end == v || *end != '\0' || !(delay_ms >= 0 && delay_ms <= 600000);
    } else if (strcmp(a, "--loss") == 0) {
      char *end = NULL;
      loss = strtod(v, &end);
      if (end == v || *end != '\0' || !(loss >= 0 && loss <= 1)) {
        fprintf(stderr, "delayq: loss %s out of range: a probability from 0 to 1\n", v);
        return 2;
      }
    } else if (strcmp(a, "--jitter-ms") == 0) {
      char *end = NULL;
      jitter_ms = strtod(v, &end);
      if (end == v || *end != '\0' || !(jitter_ms >= 0 && jitter_ms <= 60000)) {
        fprintf(stderr, "delayq: jitter %s ms out of range: 0 to 60000 ms\n", v);
        return 2;
      }
    } else if (strcmp(a, "--seed") == 0) {
      bad = parse_u64(v, &seed) != 0;
      have_seed = 1;
    } else if (strcmp(a, "--max-packets") == 0) {
      bad = parse_u64(v, &max_packets) != 0 || max_packets == 0 || max_packets > (1u << 24);
    } else if (strcmp(a, "--max-bytes") == 0) {
      bad = parse_u64(v, &s.max_bytes) != 0 || s.max_bytes == 0;
    } else if (strcmp(a, "--rcvbuf") == 0) {
      bad = parse_u64(v, &rcvbuf) != 0 || rcvbuf == 0 || rcvbuf > (1u << 30);
    } else if (strcmp(a, "--pidfile") == 0) {
      pidfile = v;
    } else {
      fprintf(stderr, "delayq: unknown option %s\n", a);
      usage(stderr);
      return 2;
    }
    if (bad) {
      fprintf(stderr, "delayq: bad value for %s: %s\n", a, v);
      return 2;
    }
  }
  if (queue == UINT64_MAX || delay_ms < 0) {
    usage(stderr);
    return 2;
  }
  s.queue = (unsigned)queue;
  s.delay_ms = delay_ms;
  s.delay_ns = (uint64_t)(delay_ms * 1e6 + 0.5);
  s.loss = loss;
  /* P(next_random() < threshold) = threshold / 2^64 = loss; loss 1 drops everything. */
  s.loss_threshold = loss >= 1 ? UINT64_MAX : (uint64_t)(loss * 0x1.0p64);
  s.jitter_ms = jitter_ms;
  s.jitter_ns = (uint64_t)(jitter_ms * 1e6 + 0.5);
  s.reorder = reorder && s.jitter_ns != 0;
  s.segment = s.loss_threshold != 0 || s.jitter_ns != 0;
  if (!have_seed) seed = now_mono() ^ ((uint64_t)getpid() << 32);
  s.seed = seed;
  seed_random(&s, seed);
  s.cap = (size_t)max_packets;
  s.ring = calloc(s.cap, sizeof *s.ring);
  if (s.ring == NULL) {
    fprintf(stderr, "delayq: out of memory\n");
    return 1;
  }

  /* Timers fire on time: no slack, and optionally a real-time priority. */
  prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
  if (rt) {
    struct sched_param sp;
    memset(&sp, 0, sizeof sp);
    sp.sched_priority = 10;
    if (sched_setscheduler(0, SCHED_FIFO, &sp) != 0)
      fprintf(stderr, "delayq: SCHED_FIFO refused (%s); running without it\n", strerror(errno));
  }

  sigset_t mask;
  sigemptyset(&mask);
  sigaddset(&mask, SIGTERM);
  sigaddset(&mask, SIGINT);
  sigaddset(&mask, SIGUSR1);
  sigaddset(&mask, SIGHUP);
  sigprocmask(SIG_BLOCK, &mask, NULL);
  int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
  int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC | TFD_NONBLOCK);
  if (sfd < 0 || tfd < 0) {
    fprintf(stderr, "delayq: signalfd/timerfd: %s\n", strerror(errno));
    return 1;
  }

  s.h = nfq_open();
  if (s.h == NULL) {
    fprintf(stderr, "delayq: nfq_open: %s (root and the nfnetlink_queue module needed)\n",
            strerror(errno));
    return 1;
  }
  s.qh = nfq_create_queue(s.h, (uint16_t)queue, on_packet, &s);
  if (s.qh == NULL) {
    fprintf(stderr, "delayq: cannot bind queue %u: %s (is another program bound to it?)\n",
            s.queue, strerror(errno));
    return 1;
  }
  if (nfq_set_mode(s.qh, NFQNL_COPY_PACKET, COPY_RANGE) < 0) {
    fprintf(stderr, "delayq: nfq_set_mode: %s\n", strerror(errno));
    return 1;
  }
  /* The kernel's own bound on queued packets is ours plus room for the packets not yet
   * read, so the packets beyond our bound reach us to be dropped and counted; past its
   * bound the kernel drops (never accepts: no FAIL_OPEN). GSO packets are queued whole,
   * not segmented. */
  if (nfq_set_queue_maxlen(s.qh, (uint32_t)(max_packets + 4096)) < 0)
    fprintf(stderr, "delayq: nfq_set_queue_maxlen: %s\n", strerror(errno));
  /* Without loss and jitter GSO packets are queued whole (less CPU); with them, the
   * flag is off, so the kernel segments each GSO packet into wire packets first. */
  if (nfq_set_queue_flags(s.qh, NFQA_CFG_F_GSO | NFQA_CFG_F_FAIL_OPEN,
                          s.segment ? 0 : NFQA_CFG_F_GSO) < 0)
    fprintf(stderr, "delayq: NFQA_CFG_F_GSO not supported: %s\n", strerror(errno));
  int fd = nfq_fd(s.h);
  nfnl_rcvbufsiz(nfq_nfnlh(s.h), (unsigned)rcvbuf);
  /* Overruns of the socket buffer show as ENOBUFS and are counted; the kernel drops
   * those packets (fail closed). */
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);

  if (pidfile != NULL) {
    char tmp[PATH_MAX];
    snprintf(tmp, sizeof tmp, "%s.tmp", pidfile);
    FILE *pf = fopen(tmp, "w");
    if (pf == NULL || fprintf(pf, "%ld\n", (long)getpid()) < 0 || fclose(pf) != 0 ||
        rename(tmp, pidfile) != 0) {
      fprintf(stderr, "delayq: cannot write pidfile %s: %s\n", pidfile, strerror(errno));
      return 1;
    }
  }
  print_stats(&s, "ready");

  uint64_t armed_for = 0;
  int draining = 0;
  for (;;) {
    struct pollfd pfd[3] = {
        {.fd = fd, .events = draining ? 0 : POLLIN},
        {.fd = tfd, .events = POLLIN},
        {.fd = sfd, .events = POLLIN},
    };
    if (poll(pfd, 3, -1) < 0) {
      if (errno == EINTR) continue;
      fprintf(stderr, "delayq: poll: %s\n", strerror(errno));
      break;
    }
    int start_draining = 0;
    if (pfd[2].revents & POLLIN) {
      struct signalfd_siginfo si;
      while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {
        if (si.ssi_signo == SIGUSR1) {
          print_stats(&s, "stats");
        } else if (draining || start_draining) {
          print_stats(&s, "exit");
          return 0;
        } else {
          start_draining = 1;
        }
      }
    }
    /* When told to stop (after the rule is gone), read what is still in the socket
     * once more, so those packets are held and released like the others. */
    if ((pfd[0].revents & (POLLIN | POLLERR)) || start_draining) {
      if (read_pending(&s, fd, start_draining ? SIZE_MAX : READ_BATCH) < 0) {
        print_stats(&s, "exit");
        return 1;
      }
    }
    if (start_draining) draining = 1;
    if (pfd[1].revents & POLLIN) {
      uint64_t expirations;
      if (read(tfd, &expirations, sizeof expirations) < 0 && errno != EAGAIN) break;
      armed_for = 0;
    }
    uint64_t next = release_due(&s, now_mono());
    if (draining && s.count == 0) break;
    if (next != 0 && next != armed_for) {
      struct itimerspec its;
      memset(&its, 0, sizeof its);
      its.it_value.tv_sec = (time_t)(next / 1000000000ull);
      its.it_value.tv_nsec = (long)(next % 1000000000ull);
      if (timerfd_settime(tfd, TFD_TIMER_ABSTIME, &its, NULL) < 0) {
        fprintf(stderr, "delayq: timerfd_settime: %s\n", strerror(errno));
        break;
      }
      armed_for = next;
    }
  }
  print_stats(&s, "exit");
  nfq_destroy_queue(s.qh);
  nfq_close(s.h);
  free(s.ring);
  return 0;
}
