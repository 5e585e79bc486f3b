/* An LD_PRELOAD shim for the end-to-end tests of data-plane encryption: it plays an
 * attacker on the path who alters one byte of a stream after the handshake. With
 * LOCKSTEP_TAMPER_MIN_BYTES=N in the environment, the first call of at least N bytes (a
 * ring sub-chunk or a shared-state chunk: the library's control frames are far smaller)
 * goes out with its byte LOCKSTEP_TAMPER_OFFSET (default 19: inside the payload, after
 * the 16-byte ring header) XORed with 0x40; later calls pass unchanged. The call is
 * sendmsg() (the ring), or send() with LOCKSTEP_TAMPER_CALL=send (shared-state transfers).
 * The caller's buffers are not touched: the altered byte goes out from a copy. Without
 * the variable the shim only forwards. Test support only: never linked into the library. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

typedef ssize_t (*sendmsg_fn)(int, const struct msghdr*, int);
typedef ssize_t (*send_fn)(int, const void*, size_t, int);

static atomic_int tampered = 0;

/* Whether this call is the one to alter (armed, not done yet, the chosen function). */
static int armed(const char* call, size_t* min_bytes, size_t* offset) {
  const char* min_text = getenv("LOCKSTEP_TAMPER_MIN_BYTES");
  if (min_text == NULL || atomic_load(&tampered) != 0) return 0;
  const char* which = getenv("LOCKSTEP_TAMPER_CALL");
  if (strcmp(which != NULL ? which : "sendmsg", call) != 0) return 0;
  const char* offset_text = getenv("LOCKSTEP_TAMPER_OFFSET");
  *min_bytes = (size_t)strtoull(min_text, NULL, 10);
  *offset = offset_text != NULL ? (size_t)strtoull(offset_text, NULL, 10) : 19;
  return 1;
}

ssize_t send(int fd, const void* buf, size_t len, int flags) {
  static send_fn next = NULL;
  if (next == NULL) next = (send_fn)dlsym(RTLD_NEXT, "send");
  size_t min_bytes = 0;
  size_t offset = 0;
  if (!armed("send", &min_bytes, &offset) || len < min_bytes || offset >= len) return next(fd, buf, len, flags);
  unsigned char* altered = malloc(len);
  if (altered == NULL) return next(fd, buf, len, flags);
  memcpy(altered, buf, len);
  altered[offset] ^= 0x40;
  const ssize_t sent = next(fd, altered, len, flags);
  free(altered);
  if (sent > 0 && (size_t)sent > offset) atomic_store(&tampered, 1);
  return sent;
}

ssize_t sendmsg(int fd, const struct msghdr* msg, int flags) {
  static sendmsg_fn next = NULL;
  if (next == NULL) next = (sendmsg_fn)dlsym(RTLD_NEXT, "sendmsg");
  size_t min_bytes = 0;
  size_t offset = 0;
  if (msg == NULL || !armed("sendmsg", &min_bytes, &offset)) return next(fd, msg, flags);
  size_t total = 0;
  for (size_t i = 0; i < msg->msg_iovlen; ++i) total += msg->msg_iov[i].iov_len;
  if (total < min_bytes || offset >= total || msg->msg_iovlen > 16) return next(fd, msg, flags);
  /* The iovec that holds the byte is replaced by an altered copy. */
  struct iovec iov[16];
  struct msghdr copy = *msg;
  memcpy(iov, msg->msg_iov, msg->msg_iovlen * sizeof iov[0]);
  copy.msg_iov = iov;
  size_t at = offset;
  size_t which = 0;
  while (at >= iov[which].iov_len) at -= iov[which++].iov_len;
  unsigned char* altered = malloc(iov[which].iov_len);
  if (altered == NULL) return next(fd, msg, flags);
  memcpy(altered, iov[which].iov_base, iov[which].iov_len);
  altered[at] ^= 0x40;
  iov[which].iov_base = altered;
  const ssize_t sent = next(fd, &copy, flags);
  free(altered);
  /* Done only once the altered byte has left; a short send tries again next time. */
  if (sent > 0 && (size_t)sent > offset) atomic_store(&tampered, 1);
  return sent;
}
