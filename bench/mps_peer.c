/* A peer of an MPS control socket that a task runs as root in its container (bench/gpu_mps_escapes.py): the
 * wire recorded on driver 580 (bench/results/gpu-mps-wire/), on SOCK_SEQPACKET with credentials and
 * descriptors, to try what a slot task might, and, on stand-in GPUs only, to be a CUDA client.
 *
 *   mps-peer control PATH COMMAND     nvidia-cuda-mps-control's messages (the word 4, then COMMAND)
 *   mps-peer fdpass PATH              OUTBCRED with a descriptor of the peer's (no client passes one)
 *   mps-peer drop PATH                a CUDA client's whole handshake, its server descriptor closed unused
 *   mps-peer mute PATH SECONDS        the same, the descriptor held SECONDS without a word on it
 *   mps-peer hold PATH COUNT SECONDS  COUNT connections that never speak, kept open SECONDS (reopened)
 *   mps-peer standin-client PATH      a CUDA client of the stand-in daemon (localswarm/standins): its ceiling.
 *                                     Never against a real MPS server: what it sends there is the stand-in's.
 *
 * One line on stdout says what happened. Exit 0: done as asked; 2: no socket at PATH; 3: the peer cut the
 * connection off; 46: no server answered (as CUDA's error 46). Static, so any image runs it:
 * cc -O2 -static -o mps-peer mps_peer.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static const char HELLO[] = "OUTBHELL", CRED[] = "OUTBCRED", CUFD[] = "OUTBCUFD";  /* each sent with its NUL */

static int open_socket(const char *path, int timeout_s) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path) { fprintf(stderr, "mps-peer: path too long\n"); exit(2); }
    strcpy(addr.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_SEQPACKET, 0), on = 1;
    struct timeval tv = {.tv_sec = timeout_s};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        close(fd);
        return -errno;
    }
    setsockopt(fd, SOL_SOCKET, SO_PASSCRED, &on, sizeof on);
    return fd;
}

static int must_connect(const char *path) {
    int fd = open_socket(path, 10);
    if (fd < 0) {
        printf("mps-peer: no socket at %s (%s)\n", path, strerror(-fd));
        exit(2);
    }
    return fd;
}

/* One message with our credentials and, when passed >= 0, a descriptor. */
static int send_message(int fd, const void *data, size_t size, int passed) {
    char space[CMSG_SPACE(sizeof(struct ucred)) + CMSG_SPACE(sizeof(int))] = {0};
    struct iovec iov = {.iov_base = (void *)data, .iov_len = size};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = space,
                         .msg_controllen = CMSG_SPACE(sizeof(struct ucred))};
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    struct ucred me = {.pid = getpid(), .uid = getuid(), .gid = getgid()};
    c->cmsg_level = SOL_SOCKET, c->cmsg_type = SCM_CREDENTIALS, c->cmsg_len = CMSG_LEN(sizeof me);
    memcpy(CMSG_DATA(c), &me, sizeof me);
    if (passed >= 0) {
        msg.msg_controllen += CMSG_SPACE(sizeof(int));
        c = CMSG_NXTHDR(&msg, c);
        c->cmsg_level = SOL_SOCKET, c->cmsg_type = SCM_RIGHTS, c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &passed, sizeof(int));
    }
    return sendmsg(fd, &msg, MSG_NOSIGNAL) < 0 ? -errno : 0;
}

/* One message; its length (0: the peer closed; < 0: -errno), and the descriptor it carried in *passed. */
static ssize_t receive(int fd, char *buf, size_t size, int *passed) {
    char space[CMSG_SPACE(sizeof(struct ucred)) + CMSG_SPACE(4 * sizeof(int))];
    struct iovec iov = {.iov_base = buf, .iov_len = size};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = space, .msg_controllen = sizeof space};
    ssize_t got = recvmsg(fd, &msg, 0);
    if (passed) *passed = -1;
    if (got < 0) return -errno;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && passed)
            memcpy(passed, CMSG_DATA(c), sizeof(int));
    return got;
}

static void greeted(int fd, const char *path) {
    char buf[64];
    ssize_t got = receive(fd, buf, sizeof buf, NULL);
    if (got != sizeof HELLO || memcmp(buf, HELLO, sizeof HELLO) != 0) {
        printf("mps-peer: %s did not greet (%zd bytes)\n", path, got);
        exit(3);
    }
}

/* What the peer did after we sent: cut off (exit 3), or answered. */
static int outcome(int fd, const char *what) {
    char buf[512];
    ssize_t got = receive(fd, buf, sizeof buf - 1, NULL);
    if (got <= 0) {
        printf("mps-peer: %s: cut off (%s)\n", what, got == 0 ? "closed" : strerror((int)-got));
        return 3;
    }
    buf[got] = 0;
    printf("mps-peer: %s: answered %zd bytes: %s\n", what, got, got > 4 ? buf + 4 : "");
    return 0;
}

/* A CUDA client's handshake up to its server descriptor, which it returns; the last word sent. */
static int handshake(const char *path) {
    int fd = must_connect(path), server;
    int32_t kind = 2, last = 0;
    char buf[64];
    greeted(fd, path);
    if (send_message(fd, CRED, sizeof CRED, -1) || send_message(fd, &kind, sizeof kind, -1)) {
        printf("mps-peer: handshake: cut off before the descriptor\n");
        exit(3);
    }
    ssize_t got = receive(fd, buf, sizeof buf, &server);
    if (got != sizeof CUFD || memcmp(buf, CUFD, sizeof CUFD) != 0 || server < 0) {
        printf("mps-peer: handshake: no server descriptor (%zd bytes): CUDA error 46\n", got);
        exit(46);
    }
    send_message(fd, &last, sizeof last, -1);
    close(fd);
    return server;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: mps-peer control|fdpass|drop|mute|hold|standin-client PATH [...]\n");
        return 2;
    }
    const char *mode = argv[1], *path = argv[2];
    if (!strcmp(mode, "control") && argc == 4) {
        int fd = must_connect(path);
        int32_t kind = 4;
        char text[512];
        int n = snprintf(text, sizeof text, "%s\n", argv[3]) + 1;
        uint64_t length = (uint64_t)n, zero = 0;
        greeted(fd, path);
        if (send_message(fd, CRED, sizeof CRED, -1) || send_message(fd, &kind, sizeof kind, -1) ||
            send_message(fd, &length, sizeof length, -1) || send_message(fd, text, (size_t)n, -1) ||
            send_message(fd, &zero, sizeof zero, -1)) {
            printf("mps-peer: control %s: cut off while sending\n", argv[3]);
            return 3;
        }
        char what[600];
        snprintf(what, sizeof what, "control %s", argv[3]);
        return outcome(fd, what);
    }
    if (!strcmp(mode, "fdpass")) {
        int fd = must_connect(path), passed = open("/dev/null", O_RDONLY);
        greeted(fd, path);
        if (send_message(fd, CRED, sizeof CRED, passed)) {
            printf("mps-peer: fdpass: cut off while sending\n");
            return 3;
        }
        int32_t kind = 2;
        if (send_message(fd, &kind, sizeof kind, -1)) {
            printf("mps-peer: fdpass: cut off while sending\n");
            return 3;
        }
        return outcome(fd, "fdpass");
    }
    if (!strcmp(mode, "drop")) {
        close(handshake(path));
        printf("mps-peer: drop: took the server descriptor and closed it unused\n");
        return 0;
    }
    if (!strcmp(mode, "mute") && argc == 4) {
        int server = handshake(path);
        printf("mps-peer: mute: holding the server descriptor for %s s without a word\n", argv[3]);
        fflush(stdout);
        sleep((unsigned)atoi(argv[3]));
        close(server);
        return 0;
    }
    if (!strcmp(mode, "hold") && argc == 5) {
        /* COUNT connections that never speak, kept open for SECONDS: one the peer closes is opened again. */
        int count = atoi(argv[3]), open_now = 0, refused = 0, reopened = 0;
        double until = now_s() + atof(argv[4]);
        int *fds = calloc((size_t)count, sizeof(int));
        struct pollfd *polls = calloc((size_t)count, sizeof(struct pollfd));
        for (int i = 0; i < count; i++) {
            fds[i] = open_socket(path, 1);
            if (fds[i] == -ENOENT || fds[i] == -ENOTDIR) {
                printf("mps-peer: no socket at %s\n", path);
                return 2;
            }
            if (fds[i] >= 0) open_now++; else refused++;
        }
        printf("mps-peer: hold: %d of %d connections open (%d refused), kept for %s s\n", open_now, count, refused,
               argv[4]);
        fflush(stdout);
        double next_pass = 0;  /* closed ones are opened again once a second: a flood, not a busy loop */
        while (now_s() < until) {
            for (int i = 0; i < count; i++) polls[i] = (struct pollfd){.fd = fds[i], .events = POLLIN};
            poll(polls, (nfds_t)count, 100);
            if (now_s() < next_pass) continue;
            next_pass = now_s() + 1;
            for (int i = 0; i < count; i++) {
                char buf[64];
                ssize_t got = 1;
                while (fds[i] >= 0 && (got = recv(fds[i], buf, sizeof buf, MSG_DONTWAIT)) > 0) {}  /* the greeting */
                if (fds[i] < 0 || got == 0 || (got < 0 && errno != EAGAIN)) {
                    if (fds[i] >= 0) close(fds[i]);
                    fds[i] = open_socket(path, 1);
                    reopened++;
                }
            }
        }
        printf("mps-peer: hold: done; %d connections were closed by the peer and opened again\n", reopened);
        return 0;
    }
    if (!strcmp(mode, "standin-client")) {
        double t0 = now_s();
        int server = handshake(path);
        char buf[64];
        struct timeval tv = {.tv_sec = 10};
        setsockopt(server, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        if (send_message(server, CRED, sizeof CRED, -1) == 0) {
            ssize_t got = receive(server, buf, sizeof buf - 1, NULL);
            if (got > 6 && !memcmp(buf, "LIMIT ", 6)) {
                buf[got] = 0;
                printf("limit %s in %.0f ms\n", buf + 6, (now_s() - t0) * 1000);
                return 0;
            }
        }
        printf("mps-peer: the MPS server did not answer: CUDA error 46\n");
        return 46;
    }
    fprintf(stderr, "mps-peer: unknown mode %s, or its arguments\n", mode);
    return 2;
}
