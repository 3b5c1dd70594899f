/* The busy responder: a thread without the Python GIL that answers connections the event loop leaves waiting.

   While a model loads, the engine thread runs native code that holds the GIL for up to seconds at a time (the
   tokenizers library building a BPE vocabulary, llguidance building its token table), and the event loop,
   which needs the GIL, cannot accept. This thread watches the server's listening sockets; a connection still
   waiting in the backlog after `grace_ms` (the event loop would have taken it by then) is accepted here and
   answered with one fixed response (the server's "503 Loading model"), then closed.

   Bounds: one connection at a time; each gets at most ~1 s (the request head, up to 16 KiB, a declared body up
   to 1 MiB discarded, the response), so a client that stalls cannot keep the thread for longer. The caller
   keeps the listening sockets open until kq_busy_stop() has returned.

   The watchdog (kq_busy_watchdog): while set, this thread also sends systemd's "WATCHDOG=1" datagram to the
   notify socket every interval_ms (the server runs the load's GIL-bound steps before its event loop exists,
   and the event loop's own pings take over once it runs), so the pings prove that what answers the service's
   connections is alive. Sending never blocks; a datagram that cannot go is dropped, as systemd.py does. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <stddef.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "kq.h"

#define BUSY_MAX_FDS 16
#define BUSY_HEAD_MAX 16384
#define BUSY_BODY_MAX (1 << 20)
#define BUSY_CONN_MS 1000
#define BUSY_POLL_MS 20

static struct {
    pthread_t thread;
    int running;
    atomic_int stop;
    atomic_long answered;
    int fds[BUSY_MAX_FDS];
    int nfds;
    int grace_ms;
    char *response;
    size_t response_len;
} busy;

static long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static struct {
    pthread_mutex_t lock;
    int fd;                /* the datagram socket, -1 until set */
    struct sockaddr_un addr;
    socklen_t len;
    int interval_ms;       /* 0: off */
    long next;             /* when the next ping is due (now_ms) */
    int64_t sent;
} wd = {.lock = PTHREAD_MUTEX_INITIALIZER, .fd = -1};

static void watchdog_tick(long now) {
    static const char ping[] = "WATCHDOG=1";
    pthread_mutex_lock(&wd.lock);
    if (wd.interval_ms > 0 && now >= wd.next) {
        if (sendto(wd.fd, ping, sizeof ping - 1, MSG_DONTWAIT | MSG_NOSIGNAL, (struct sockaddr *)&wd.addr,
                   wd.len) >= 0)
            wd.sent++;
        wd.next = now + wd.interval_ms;
    }
    pthread_mutex_unlock(&wd.lock);
}

int64_t kq_busy_watchdog(const char *addr, int addr_len, int interval_ms) {
    pthread_mutex_lock(&wd.lock);
    int64_t out = 0;
    if (addr == NULL || interval_ms <= 0) {  /* off: the pings sent since it was set */
        out = wd.sent;
        wd.interval_ms = 0;
        wd.sent = 0;
        if (wd.fd >= 0) close(wd.fd);
        wd.fd = -1;
    } else if (addr_len <= 0 || (size_t)addr_len > sizeof wd.addr.sun_path) {
        out = -EINVAL;
    } else {
        if (wd.fd < 0) wd.fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if (wd.fd < 0) {
            out = -errno;
        } else {
            memset(&wd.addr, 0, sizeof wd.addr);
            wd.addr.sun_family = AF_UNIX;
            memcpy(wd.addr.sun_path, addr, (size_t)addr_len);  /* a leading NUL: an abstract address */
            wd.len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + (size_t)addr_len);
            wd.interval_ms = interval_ms;
            wd.next = 0;  /* the first ping at the thread's next look */
        }
    }
    pthread_mutex_unlock(&wd.lock);
    return out;
}

/* Wait until c is readable or the deadline passes; 1 when readable. */
static int readable_by(int c, long deadline) {
    long left = deadline - now_ms();
    if (left <= 0) return 0;
    struct pollfd p = {.fd = c, .events = POLLIN};
    return poll(&p, 1, (int)left) > 0;
}

/* The declared Content-Length of a request head (0 when absent or unreadable). */
static long content_length(const char *head, size_t n) {
    static const char key[] = "\r\ncontent-length:";
    for (size_t i = 0; i + sizeof key - 1 < n; i++) {
        if (strncasecmp(head + i, key, sizeof key - 1) == 0) {
            long v = strtol(head + i + sizeof key - 1, NULL, 10);
            return v > 0 ? v : 0;
        }
    }
    return 0;
}

static void answer(int c) {
    long deadline = now_ms() + BUSY_CONN_MS;
    char head[BUSY_HEAD_MAX + 1];
    size_t n = 0;
    char *end = NULL;
    while (n < BUSY_HEAD_MAX && readable_by(c, deadline)) {
        ssize_t r = recv(c, head + n, BUSY_HEAD_MAX - n, MSG_DONTWAIT);
        if (r <= 0) {
            if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
            break;
        }
        n += (size_t)r;
        head[n] = 0;
        if ((end = strstr(head, "\r\n\r\n")) != NULL) break;
    }
    if (end != NULL) {  /* discard the body it declares (bounded), so that closing does not reset the answer */
        long body = content_length(head, (size_t)(end + 2 - head)) - (long)(n - (size_t)(end + 4 - head));
        char sink[4096];
        while (body > 0 && body <= BUSY_BODY_MAX && readable_by(c, deadline)) {
            ssize_t r = recv(c, sink, sizeof sink, MSG_DONTWAIT);
            if (r <= 0) {
                if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
                break;
            }
            body -= r;
        }
    }
    size_t sent = 0;
    while (sent < busy.response_len && now_ms() < deadline) {
        ssize_t w = send(c, busy.response + sent, busy.response_len - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno != EAGAIN && errno != EINTR) break;
            struct pollfd p = {.fd = c, .events = POLLOUT};
            long left = deadline - now_ms();
            if (left <= 0 || poll(&p, 1, (int)left) <= 0) break;
            continue;
        }
        sent += (size_t)w;
    }
    shutdown(c, SHUT_WR);
    long linger = now_ms() + 100;  /* let the client read and close first */
    char sink[4096];
    while (readable_by(c, linger < deadline ? linger : deadline) && recv(c, sink, sizeof sink, MSG_DONTWAIT) > 0) {}
    close(c);
    atomic_fetch_add(&busy.answered, 1);
}

/* A listening socket readable at every look for grace_ms has a connection the event loop is not taking: accept
   and answer one, and go on doing so while it stays readable (a backlog is drained one after another, with no
   new grace each). */
static void *busy_main(void *arg) {
    (void)arg;
    long waiting_since[BUSY_MAX_FDS] = {0};
    struct pollfd p[BUSY_MAX_FDS];
    while (!atomic_load(&busy.stop)) {
        watchdog_tick(now_ms());
        int pending = 0;
        for (int i = 0; i < busy.nfds; i++) {
            p[i] = (struct pollfd){.fd = busy.fds[i], .events = POLLIN};
            pending |= waiting_since[i] != 0;
        }
        if (pending) {  /* poll returns at once on a readable socket: wait by sleeping instead */
            struct timespec tick = {.tv_sec = 0, .tv_nsec = 2 * 1000000L};
            nanosleep(&tick, NULL);
        }
        int r = poll(p, (nfds_t)busy.nfds, pending ? 0 : BUSY_POLL_MS);
        long now = now_ms();
        for (int i = 0; i < busy.nfds && !atomic_load(&busy.stop); i++) {
            if (r <= 0 || !(p[i].revents & POLLIN)) {
                waiting_since[i] = 0;
                continue;
            }
            if (waiting_since[i] == 0) waiting_since[i] = now;
            if (now - waiting_since[i] < busy.grace_ms) continue;
            int c = accept4(busy.fds[i], NULL, NULL, SOCK_CLOEXEC);
            if (c >= 0) answer(c);
            else waiting_since[i] = 0;  /* the event loop took it meanwhile */
        }
    }
    return NULL;
}

int kq_busy_start(const int *fds, int nfds, int grace_ms, const char *response, int64_t response_len) {
    if (busy.running) return -EBUSY;
    if (nfds <= 0 || nfds > BUSY_MAX_FDS || grace_ms < 0 || response_len <= 0) return -EINVAL;
    busy.response = malloc((size_t)response_len);
    if (busy.response == NULL) return -ENOMEM;
    memcpy(busy.response, response, (size_t)response_len);
    busy.response_len = (size_t)response_len;
    memcpy(busy.fds, fds, sizeof(int) * (size_t)nfds);
    busy.nfds = nfds;
    busy.grace_ms = grace_ms;
    atomic_store(&busy.stop, 0);
    atomic_store(&busy.answered, 0);
    int err = pthread_create(&busy.thread, NULL, busy_main, NULL);
    if (err != 0) {
        free(busy.response);
        busy.response = NULL;
        return -err;
    }
    busy.running = 1;
    return 0;
}

int64_t kq_busy_stop(void) {
    if (!busy.running) return 0;
    atomic_store(&busy.stop, 1);
    pthread_join(busy.thread, NULL);
    busy.running = 0;
    free(busy.response);
    busy.response = NULL;
    return (int64_t)atomic_load(&busy.answered);
}
