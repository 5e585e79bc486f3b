/*
 * lockstep-testbed-delayq: one-way delay for one directed pair of test bed hosts.
 *
 * The test bed sends the packets of a pair to an NFQUEUE queue (an iptables rule in
 * the receiving host's namespace, without --queue-bypass). This program binds that
 * queue, stamps each packet with the time it was read, keeps it in a FIFO (the delay
 * is the same for every packet, so arrival order is release order) and gives the
 * kernel an ACCEPT verdict when the packet is due. A single batch verdict releases
 * every packet up to the newest due one, so a burst of due packets costs one message.
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
  uint32_t id;
  uint32_t len;
};

struct state {
  struct nfq_handle *h;
  struct nfq_q_handle *qh;
  uint64_t delay_ns;
  uint64_t now_ns; /* time the current message was read */
  struct held *ring;
  size_t cap; /* max held packets */
  size_t head, count;
  uint64_t bytes, max_bytes;
  /* statistics */
  uint64_t received, released, dropped_full, verdict_errors, enobufs;
  size_t max_held;
  uint64_t max_late_ns; /* worst lateness of a release behind its due time */
  unsigned queue;
  double delay_ms;
};

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
          "{\"event\":\"%s\",\"queue\":%u,\"delay_ms\":%.3f,\"received\":%" PRIu64
          ",\"released\":%" PRIu64 ",\"dropped_full\":%" PRIu64 ",\"enobufs\":%" PRIu64
          ",\"verdict_errors\":%" PRIu64 ",\"held\":%zu,\"max_held\":%zu,\"max_packets\":%zu"
          ",\"held_bytes\":%" PRIu64 ",\"max_late_us\":%.1f"
          ",\"kernel_queue_dropped\":%lld,\"kernel_user_dropped\":%lld}\n",
          event, s->queue, s->delay_ms, s->received, s->released, s->dropped_full, s->enobufs,
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
  if (plen >= 4 && payload != NULL) {
    uint16_t tot;
    memcpy(&tot, payload + 2, sizeof tot);
    tot = ntohs(tot);
    len = tot != 0 ? tot : 65536u; /* 0: a BIG TCP packet; count it as large */
  }

  if (s->count >= s->cap || s->bytes + len > s->max_bytes) {
    s->dropped_full++;
    if (nfq_set_verdict(qh, id, NF_DROP, 0, NULL) < 0) s->verdict_errors++;
    return 0;
  }
  size_t tail = (s->head + s->count) % s->cap;
  s->ring[tail].id = id;
  s->ring[tail].len = len;
  s->ring[tail].due_ns = s->now_ns + s->delay_ns;
  s->count++;
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
          "  --rt                run with SCHED_FIFO priority 10 (less jitter under load)\n"
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
  double delay_ms = -1;
  const char *pidfile = NULL;
  int rt = 0;

  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      usage(stdout);
      return 0;
    } else if (strcmp(a, "--rt") == 0) {
      rt = 1;
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
  if (nfq_set_queue_flags(s.qh, NFQA_CFG_F_GSO | NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO) < 0)
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
