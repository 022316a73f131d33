/*
 * envbuild-agent: the exec agent that runs as PID 1 of a sandbox.
 *
 * It accepts on a unix socket the host created outside the sandbox and passed down as an fd
 * (--listen-fd), runs one command per connection (protocol 1 to 3, see README.md),
 * streams the command's stdout and stderr back as frames and ends with its exit status. As
 * PID 1 it also reaps every orphan. One process, one poll() loop, no threads: every fd is
 * non-blocking, so a slow or vanished client never stalls another session.
 *
 * Serial mode (--serial PORT, a microVM's virtio serial port): one byte stream carries many
 * sessions as CHANNEL frames (README.md, "Serial mode"). Each channel gets a socketpair whose
 * one end is an ordinary session connection, so the session state machine is the same in both
 * modes; the demultiplexer (struct chan) only moves whole inner frames between the line and
 * the socketpair, against a per-channel window in each direction.
 *
 * Build: gcc -static -O2 -Wall -Wextra -Werror -o envbuild-agent agent.c
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PROTO_VERSION 3u       /* the newest version spoken; a session asks for 1 to 3 */
#define PROTO_MIN 1u
#define MAX_PTY_DIM 4096u       /* largest rows or cols of a PTY */
#define AGENT_NAME "envbuild-agent"
#define MAX_PAYLOAD (1u << 20)   /* largest frame payload either side may send */
#define CHUNK (64u << 10)        /* largest stdout/stderr frame the agent sends */
#define STDIN_HIGH (1u << 20)    /* pending stdin above this: stop reading the connection */
#define MAX_SESSIONS 1000
#define MAX_ARGS 65536
#define EXIT_GRACE_MS 50         /* how long output pipes may stay open after the exit */
#define COALESCE_MS 2            /* how long a short output frame waits for more of its stream */
#define DETACH_BUF (64u << 10)   /* frames a detached command's output may fill; the rest is dropped */
#define MAX_DETACHED 64          /* detached commands at once (memory: MAX_DETACHED * DETACH_BUF) */

/* host -> agent */
enum { T_HELLO = 0x01, T_ARG, T_ENV, T_CWD, T_USER, T_TIMEOUT, T_START, T_STDIN, T_STDIN_EOF,
       T_KILL, T_PTY, T_RESIZE /* the last two: version 2 */ };
/* agent -> host */
enum { R_HELLO = 0x81, R_STDOUT, R_STDERR, R_EXIT, R_START_FAILED, R_ERROR };
/* version 3: a running command leaves its connection and a later one takes it up */
enum { T_DETACH = 0x0D, T_ATTACH = 0x0E, R_DETACHED = 0x87, R_ATTACHED = 0x88 };
/* serial mode: outer frames on the line (payload: channel u32, then the rest) */
enum { T_CHANNEL = 0x40, T_WINDOW = 0x41, T_CLOSE = 0x42 };
#define SERIAL_WINDOW (256u << 10) /* initial window, bytes of inner frames, each direction */
#define WINDOW_ACK (32u << 10)     /* announce consumed bytes in steps of at least this */
#define LINE_HIGH (1u << 20)       /* queued line output above this: stop reading channels */
/* R_EXIT flags */
enum { F_SIGNALED = 1, F_TIMED_OUT = 2, F_OUTPUT_OPEN = 4 };

extern char **environ;

struct buf {
    unsigned char *p;
    size_t off, len, cap; /* data is p[off .. off+len) */
};

enum phase { P_HELLO, P_REQUEST, P_STARTING, P_RUNNING, P_FINISHED };

struct session {
    enum phase phase;
    int conn, out, err, in, status; /* -1 once closed */
    int closing;                    /* close conn once tx is flushed */
    pid_t pid;
    int reaped, wstatus, flags, stdin_eof, start_failed;
    size_t owed[2];                 /* bytes in the out/err pipe when the command exited */
    int64_t deadline, grace;        /* monotonic ms; 0 = none */
    int64_t hold;                   /* tx is one output frame still filling until then; 0 = none */
    int hold_which;                 /* its stream: 0 stdout, 1 stderr */
    uint32_t timeout_ms;
    uint32_t version;               /* the protocol version of this session (its HELLO) */
    int pty;                        /* version 2: the command runs on a terminal */
    unsigned short rows, cols;
    int64_t last_frame;             /* when the last output frame was queued (PTY coalescing) */
    char **argv;
    size_t argc;
    char **env;
    size_t envc;
    char *cwd;
    int has_user;
    uid_t uid;
    gid_t gid;
    struct buf rx, tx, inq;
    int detached;                   /* version 3: runs on without a connection (DETACH) */
    uint32_t detach_id;             /* what ATTACH names it by */
    uint64_t dropped;               /* output bytes dropped while detached (over DETACH_BUF) */
    struct buf kept;                /* frames kept while detached, EXIT or START_FAILED last */
    size_t kept_last;               /* offset in kept of its last frame's header */
    struct session *moved;          /* set by ATTACH: the connection now belongs to it */
};

static struct session *sessions[MAX_SESSIONS];
static int nsessions;
static int ndetached;
static uint32_t last_detach_id;

static void logmsg(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, AGENT_NAME ": ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void closefd(int *fd) {
    if (*fd >= 0) {
        close(*fd);
        *fd = -1;
    }
}

static int set_nonblock(int fd) {
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

/* ---- buffers ---------------------------------------------------------------------------- */

static int buf_reserve(struct buf *b, size_t extra) {
    if (b->off && b->off + b->len + extra > b->cap) { /* compact before growing */
        memmove(b->p, b->p + b->off, b->len);
        b->off = 0;
    }
    if (b->len + extra <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra)
        cap *= 2;
    unsigned char *p = realloc(b->p, cap);
    if (!p)
        return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

static unsigned char *buf_tail(struct buf *b) { return b->p + b->off + b->len; }

static void buf_consume(struct buf *b, size_t n) {
    b->off += n;
    b->len -= n;
    if (b->len == 0)
        b->off = 0;
}

static void buf_free(struct buf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

static void put_u32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24;
    p[1] = v >> 16;
    p[2] = v >> 8;
    p[3] = v;
}

static uint32_t get_u32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* ---- sessions --------------------------------------------------------------------------- */

static void session_drop(struct session *s);

static void queue_frame(struct session *s, int type, const void *payload, size_t len) {
    if (s->conn < 0)
        return;
    if (buf_reserve(&s->tx, 5 + len) < 0) {
        logmsg("out of memory; dropping a connection");
        session_drop(s);
        return;
    }
    s->hold = 0; /* a frame after the held one: that one is complete */
    unsigned char *p = buf_tail(&s->tx);
    p[0] = type;
    put_u32(p + 1, len);
    if (len)
        memcpy(p + 5, payload, len);
    s->tx.len += 5 + len;
}

static void kill_group(struct session *s, int sig) {
    if (s->pid <= 0 || s->reaped)
        return;
    /* The child calls setsid() first thing; a kill that races it reaches the child alone. */
    if (kill(-s->pid, sig) < 0 && errno == ESRCH)
        kill(s->pid, sig);
    /* a terminal's foreground job has a group of its own (the shell's job control) */
    pid_t fg;
    if (s->pty && s->out >= 0 && ioctl(s->out, TIOCGPGRP, &fg) == 0 && fg > 0 && fg != s->pid)
        kill(-fg, sig);
}

/* A protocol error: say why, stop the command, hang up once the message is out. */
static void session_fail(struct session *s, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    queue_frame(s, R_ERROR, msg, strlen(msg));
    kill_group(s, SIGKILL);
    s->closing = 1;
    s->phase = P_FINISHED;
}

/* The host went away (or must be dropped): the command dies with the connection, unless it
 * was detached: then only the connection goes (a host that hung up before DETACHED was out). */
static void session_drop(struct session *s) {
    if (s->detached) {
        s->hold = 0;
        closefd(&s->conn);
        buf_free(&s->tx);
        buf_free(&s->rx);
        return;
    }
    if (s->phase != P_FINISHED)
        kill_group(s, SIGKILL);
    s->phase = P_FINISHED;
    s->hold = 0;
    closefd(&s->conn);
    closefd(&s->in);
    buf_free(&s->tx);
    buf_free(&s->rx);
    buf_free(&s->inq);
}

static void session_free(int i) {
    struct session *s = sessions[i];
    closefd(&s->conn);
    closefd(&s->out);
    closefd(&s->err);
    closefd(&s->in);
    closefd(&s->status);
    for (size_t k = 0; k < s->argc; k++)
        free(s->argv[k]);
    free(s->argv);
    for (size_t k = 0; k < s->envc; k++)
        free(s->env[k]);
    free(s->env);
    free(s->cwd);
    buf_free(&s->rx);
    buf_free(&s->tx);
    buf_free(&s->inq);
    buf_free(&s->kept);
    free(s);
    sessions[i] = sessions[--nsessions];
    sessions[nsessions] = NULL;
}

static struct session *session_new(int conn) {
    struct session *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->conn = conn;
    s->out = s->err = s->in = s->status = -1;
    s->phase = P_HELLO;
    sessions[nsessions++] = s;
    return s;
}

/* ---- detached commands (version 3) ------------------------------------------------------ */

/* A frame of a detached command, kept for its ATTACH: output up to DETACH_BUF (a frame of
 * the same stream is extended, so a command printing a byte at a time does not fill it with
 * headers), past it counted in `dropped` and thrown away; a final frame always fits. */
static void keep(struct session *s, int type, const unsigned char *p, size_t n) {
    struct buf *k = &s->kept; /* only appended to: off stays 0 */
    int output = type == R_STDOUT || type == R_STDERR;
    unsigned char *last = k->len ? k->p + s->kept_last : NULL;
    int extend = output && last && last[0] == type && get_u32(last + 1) + n <= CHUNK;
    size_t need = n + (extend ? 0 : 5);
    if (output && k->len + need > DETACH_BUF) {
        s->dropped += n;
        return;
    }
    if (buf_reserve(k, need) < 0) {
        logmsg("out of memory for a detached command's output");
        s->dropped += n;
        return;
    }
    last = k->p + s->kept_last; /* (buf_reserve may have moved it) */
    if (extend) {
        put_u32(last + 1, get_u32(last + 1) + n);
    } else {
        s->kept_last = k->len;
        last = k->p + k->len;
        last[0] = type;
        put_u32(last + 1, n);
        k->len += 5;
    }
    if (n)
        memcpy(k->p + k->len, p, n);
    k->len += n;
}

/* A frame for the host now, or for the ATTACH that takes a detached command up. */
static void emit(struct session *s, int type, const void *payload, size_t len) {
    if (s->detached)
        keep(s, type, payload, len);
    else
        queue_frame(s, type, payload, len);
}

static struct session *detached_find(uint32_t id) {
    for (int i = 0; i < nsessions; i++)
        if (sessions[i]->detached && sessions[i]->detach_id == id)
            return sessions[i];
    return NULL;
}

/* DETACH: DETACHED (its id) goes after what tx holds, then the connection closes and the
 * command runs on; its output is kept (keep) until an ATTACH. */
static void detach(struct session *s) {
    if (s->phase == P_FINISHED)
        return; /* its final frame is queued already: nothing left to detach */
    if (ndetached >= MAX_DETACHED) {
        session_fail(s, "too many detached commands (at most %u)", MAX_DETACHED);
        return;
    }
    do
        last_detach_id++;
    while (!last_detach_id || detached_find(last_detach_id));
    unsigned char id[4];
    put_u32(id, last_detach_id);
    queue_frame(s, R_DETACHED, id, sizeof id);
    s->detach_id = last_detach_id;
    s->detached = 1;
    s->closing = 1;
    ndetached++;
}

/* ATTACH to t from the fresh session s: t takes s's connection and what s queued (its
 * HELLO), then ATTACHED (bytes dropped u64) and what t kept; s ends. */
static void attach(struct session *s, struct session *t) {
    t->conn = s->conn;
    s->conn = -1;
    buf_free(&t->tx);
    t->tx = s->tx;
    memset(&s->tx, 0, sizeof s->tx);
    t->version = s->version;
    t->detached = 0;
    ndetached--;
    t->closing = 0;
    unsigned char dropped[8];
    put_u32(dropped, (uint32_t)(t->dropped >> 32));
    put_u32(dropped + 4, (uint32_t)t->dropped);
    queue_frame(t, R_ATTACHED, dropped, sizeof dropped);
    if (t->conn >= 0 && t->kept.len && buf_reserve(&t->tx, t->kept.len) == 0) {
        memcpy(buf_tail(&t->tx), t->kept.p, t->kept.len);
        t->tx.len += t->kept.len;
    }
    buf_free(&t->kept);
    t->dropped = 0;
    t->kept_last = 0;
    if (t->phase == P_FINISHED)
        t->closing = 1; /* its final frame was kept: it is on its way */
    s->phase = P_FINISHED;
    s->moved = t;
}

/* ---- spawning --------------------------------------------------------------------------- */

static char *dupstr(const unsigned char *p, size_t n) {
    char *s = malloc(n + 1);
    if (s) {
        memcpy(s, p, n);
        s[n] = 0;
    }
    return s;
}

static int push(char ***vec, size_t *n, char *item) {
    if (!item)
        return -1;
    char **v = realloc(*vec, (*n + 2) * sizeof *v);
    if (!v) {
        free(item);
        return -1;
    }
    v[(*n)++] = item;
    v[*n] = NULL;
    *vec = v;
    return 0;
}

/* The agent's environment (the lock's env) with the request's overrides on top, plus room for
 * HOME. NULL-terminated; the strings are borrowed, not copied. */
static char **merged_env(struct session *s) {
    size_t n = 0;
    for (char **e = environ; *e; e++)
        n++;
    char **env = calloc(n + s->envc + 2, sizeof *env);
    if (!env)
        return NULL;
    size_t k = 0;
    for (char **e = environ; *e; e++) {
        size_t klen = strcspn(*e, "=");
        int overridden = 0;
        for (size_t j = 0; j < s->envc && !overridden; j++)
            overridden = strncmp(s->env[j], *e, klen) == 0 && s->env[j][klen] == '=';
        if (!overridden)
            env[k++] = *e;
    }
    for (size_t j = 0; j < s->envc; j++) {
        size_t klen = strcspn(s->env[j], "=");
        int later = 0; /* the last override of a key wins */
        for (size_t i = j + 1; i < s->envc && !later; i++)
            later = strncmp(s->env[i], s->env[j], klen) == 0 && s->env[i][klen] == '=';
        if (!later)
            env[k++] = s->env[j];
    }
    env[k] = NULL;
    return env;
}

/* HOME from /etc/passwd for uid, "/" without an entry: what runc does when HOME is unset. */
static void home_for(uid_t uid, char *out, size_t size) {
    snprintf(out, size, "HOME=/");
    FILE *f = fopen("/etc/passwd", "re");
    if (!f)
        return;
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        char *field[7];
        int n = 0;
        char *p = line;
        for (; n < 7; n++) {
            field[n] = p;
            p = strchr(p, ':');
            if (!p)
                break;
            *p++ = 0;
        }
        if (n < 6)
            continue;
        char *end;
        unsigned long u = strtoul(field[2], &end, 10);
        if (*end == 0 && u == uid) {
            snprintf(out, size, "HOME=%s", field[5]);
            break;
        }
    }
    fclose(f);
}

/* In the child: report why the command could not start and exit. */
static void __attribute__((noreturn)) child_fail(int fd, int code, const char *fmt, ...) {
    int e = errno;
    unsigned char msg[600];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf((char *)msg + 8, sizeof msg - 8, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if ((size_t)n > sizeof msg - 8)
        n = sizeof msg - 8;
    put_u32(msg, code);
    put_u32(msg + 4, e);
    ssize_t w = write(fd, msg, 8 + n);
    (void)w;
    _exit(code);
}

static void __attribute__((noreturn)) child(struct session *s, int pin, int pout, int perr,
                                            int report, char **env) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    for (int sig = 1; sig < NSIG; sig++)
        signal(sig, SIG_DFL); /* SIGPIPE was ignored in the agent; exec keeps ignores */
    setsid();                 /* own session and process group: kills reach the whole tree */
    /* a PTY (pin = pout = perr = the terminal): it becomes the controlling terminal of the new
     * session, as login does, so the shell gets job control and ^C reaches its foreground job */
    if (s->pty && ioctl(pin, TIOCSCTTY, 0) < 0)
        child_fail(report, 125, "TIOCSCTTY: %s", strerror(errno));
    if (dup2(pin, 0) < 0 || dup2(pout, 1) < 0 || dup2(perr, 2) < 0)
        child_fail(report, 125, "dup2: %s", strerror(errno));
    if (s->cwd && chdir(s->cwd) < 0)
        child_fail(report, 125, "chdir %s: %s", s->cwd, strerror(errno));
    if (s->has_user) { /* like runc exec --user uid:gid: no supplementary groups */
        if (setgroups(0, NULL) < 0)
            child_fail(report, 125, "setgroups: %s", strerror(errno));
        if (setgid(s->gid) < 0)
            child_fail(report, 125, "setgid %u: %s", (unsigned)s->gid, strerror(errno));
        if (setuid(s->uid) < 0)
            child_fail(report, 125, "setuid %u: %s", (unsigned)s->uid, strerror(errno));
    }
    char home[PATH_MAX + 8];
    size_t n = 0;
    int has_home = 0;
    for (; env[n]; n++)
        has_home |= strncmp(env[n], "HOME=", 5) == 0;
    if (!has_home) {
        home_for(getuid(), home, sizeof home);
        env[n] = home;
        env[n + 1] = NULL;
    }
    environ = env; /* execvp searches the command's PATH, not the agent's */
    execvp(s->argv[0], s->argv);
    int code = (errno == ENOENT || errno == ENOTDIR) ? 127 : 126; /* as a shell does */
    child_fail(report, code, "%s: %s", s->argv[0], strerror(errno));
}

static void start_failed(struct session *s, uint32_t code, uint32_t err, const char *msg) {
    size_t len = strlen(msg);
    unsigned char *p = malloc(8 + len);
    if (p) {
        put_u32(p, code);
        put_u32(p + 4, err);
        memcpy(p + 8, msg, len);
        emit(s, R_START_FAILED, p, 8 + len);
        free(p);
    }
    s->start_failed = 1;
    s->closing = 1;
    s->phase = P_FINISHED;
}

/* A new terminal of rows x cols: its master (pair[0]) and its peer (pair[1]), both
 * close-on-exec and neither our controlling terminal (the agent is a session leader). */
static int open_pty(struct session *s, int pair[2]) {
    pair[0] = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (pair[0] < 0) /* a devpts mounted with newinstance but no /dev/ptmx link */
        pair[0] = open("/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
    int unlock = 0;
    struct winsize ws = {.ws_row = s->rows, .ws_col = s->cols};
    if (pair[0] < 0 || ioctl(pair[0], TIOCSPTLCK, &unlock) < 0 ||
        ioctl(pair[0], TIOCSWINSZ, &ws) < 0)
        return -1;
    /* the peer of this master, not a path lookup that a process in the sandbox could race */
    pair[1] = ioctl(pair[0], TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (pair[1] < 0)
        return -1;
    /* the terminal is the user's, as login makes it (a command that opens `tty` by path) */
    if (s->has_user && fchown(pair[1], s->uid, -1) < 0)
        return -1;
    return 0;
}

/* The command's stdin, stdout and stderr: three pipes, or one terminal for all three. */
static int open_stdio(struct session *s, int pin[2], int pout[2], int perr[2]) {
    if (!s->pty)
        return pipe2(pin, O_CLOEXEC) < 0 || pipe2(pout, O_CLOEXEC) < 0 ||
                       pipe2(perr, O_CLOEXEC) < 0 ? -1 : 0;
    int pair[2] = {-1, -1};
    if (open_pty(s, pair) < 0) {
        int e = errno;
        closefd(&pair[0]);
        closefd(&pair[1]);
        errno = e;
        return -1;
    }
    /* the agent reads the master as stdout and writes stdin to a copy of it (closing stdin
     * closes the copy only: a terminal has no EOF but ^D) */
    pout[0] = pair[0];
    pin[0] = pair[1];
    if ((pin[1] = fcntl(pair[0], F_DUPFD_CLOEXEC, 3)) < 0 ||
        (pout[1] = fcntl(pair[1], F_DUPFD_CLOEXEC, 3)) < 0 ||
        (perr[1] = fcntl(pair[1], F_DUPFD_CLOEXEC, 3)) < 0)
        return -1;
    return 0;
}

static void spawn(struct session *s) {
    int pin[2] = {-1, -1}, pout[2] = {-1, -1}, perr[2] = {-1, -1}, rep[2] = {-1, -1};
    char **env = NULL;
    if (s->argc == 0) {
        session_fail(s, "START without ARG: the command is empty");
        return;
    }
    env = merged_env(s);
    if (!env || open_stdio(s, pin, pout, perr) < 0 || pipe2(rep, O_CLOEXEC) < 0) {
        char msg[128];
        snprintf(msg, sizeof msg, "%s: %s", s->pty ? "open a terminal" : "pipe", strerror(errno));
        start_failed(s, 125, errno, msg);
        goto out;
    }
    pid_t pid = fork();
    if (pid < 0) { /* e.g. EAGAIN at the sandbox's pids limit */
        char msg[128];
        snprintf(msg, sizeof msg, "fork: %s", strerror(errno));
        start_failed(s, 125, errno, msg);
        goto out;
    }
    if (pid == 0)
        child(s, pin[0], pout[1], perr[1], rep[1], env);
    /* (with a PTY the agent keeps no stderr: perr[0] is -1 and the terminal is stdout) */
    s->pid = pid;
    s->in = pin[1];
    s->out = pout[0];
    s->err = perr[0];
    s->status = rep[0];
    pin[1] = pout[0] = perr[0] = rep[0] = -1;
    set_nonblock(s->in);
    set_nonblock(s->out);
    set_nonblock(s->err);
    set_nonblock(s->status);
    s->phase = P_STARTING;
    if (s->timeout_ms)
        s->deadline = now_ms() + s->timeout_ms;
out:
    free(env);
    int *fds[] = {&pin[0], &pin[1], &pout[0], &pout[1], &perr[0], &perr[1], &rep[0], &rep[1]};
    for (size_t k = 0; k < sizeof fds / sizeof *fds; k++)
        closefd(fds[k]);
}

/* ---- frames from the host --------------------------------------------------------------- */

static int parse_user(struct session *s, const char *text) {
    char *end;
    unsigned long uid = strtoul(text, &end, 10), gid = uid;
    if (end == text || (*end && *end != ':'))
        return -1;
    if (*end == ':') {
        const char *g = end + 1;
        gid = strtoul(g, &end, 10);
        if (end == g || *end)
            return -1;
    }
    if (uid > 0xfffffffeul || gid > 0xfffffffeul)
        return -1;
    s->uid = uid;
    s->gid = gid;
    s->has_user = 1;
    return 0;
}

/* rows u16, cols u16 (PTY, RESIZE) into s, if both are in 1..MAX_PTY_DIM */
static int get_winsize(struct session *s, const unsigned char *p, size_t n) {
    if (n != 4)
        return 0;
    unsigned rows = (unsigned)p[0] << 8 | p[1], cols = (unsigned)p[2] << 8 | p[3];
    if (rows < 1 || rows > MAX_PTY_DIM || cols < 1 || cols > MAX_PTY_DIM)
        return 0;
    s->rows = rows;
    s->cols = cols;
    return 1;
}

static void on_frame(struct session *s, int type, const unsigned char *p, size_t n) {
    if (s->phase == P_HELLO) {
        if (type != T_HELLO || n < 4) {
            session_fail(s, "expected HELLO first");
            return;
        }
        uint32_t v = get_u32(p);
        if (v < PROTO_MIN || v > PROTO_VERSION) {
            session_fail(s, "unsupported protocol version %u; this agent speaks %u to %u", v,
                         PROTO_MIN, PROTO_VERSION);
            return;
        }
        s->version = v; /* the session speaks what the host asked for; HELLO says which */
        unsigned char hello[64];
        put_u32(hello, v);
        int len = snprintf((char *)hello + 4, sizeof hello - 4, AGENT_NAME " %u", PROTO_VERSION);
        queue_frame(s, R_HELLO, hello, 4 + len);
        s->phase = P_REQUEST;
        return;
    }
    if (s->phase == P_REQUEST) {
        if ((type == T_ARG || type == T_ENV || type == T_CWD || type == T_USER) &&
            memchr(p, 0, n)) {
            session_fail(s, "frame 0x%02x contains a NUL byte", type);
            return;
        }
        switch (type) {
        case T_ARG:
            if (s->argc >= MAX_ARGS || push(&s->argv, &s->argc, dupstr(p, n)) < 0)
                session_fail(s, "too many arguments");
            return;
        case T_ENV:
            if (!memchr(p, '=', n) || p[0] == '=') {
                session_fail(s, "ENV must be KEY=VALUE");
                return;
            }
            if (s->envc >= MAX_ARGS || push(&s->env, &s->envc, dupstr(p, n)) < 0)
                session_fail(s, "too many environment variables");
            return;
        case T_CWD:
            free(s->cwd);
            s->cwd = dupstr(p, n);
            return;
        case T_USER: {
            char text[64];
            if (n >= sizeof text) {
                session_fail(s, "USER is too long");
                return;
            }
            memcpy(text, p, n);
            text[n] = 0;
            if (parse_user(s, text) < 0)
                session_fail(s, "USER must be UID[:GID], got %s", text);
            return;
        }
        case T_TIMEOUT:
            if (n != 4) {
                session_fail(s, "TIMEOUT needs a u32 of milliseconds");
                return;
            }
            s->timeout_ms = get_u32(p);
            return;
        case T_PTY:
            if (s->version < 2 || !get_winsize(s, p, n))
                session_fail(s, "PTY needs protocol 2 and rows u16, cols u16 in 1..%u",
                             MAX_PTY_DIM);
            else
                s->pty = 1;
            return;
        case T_START:
            spawn(s);
            return;
        case T_ATTACH: {
            struct session *t = n == 4 ? detached_find(get_u32(p)) : NULL;
            if (s->version < 3 || n != 4 || s->argc || s->envc || s->cwd || s->has_user ||
                s->timeout_ms || s->pty)
                session_fail(s, "ATTACH needs protocol 3, an id u32, and comes alone");
            else if (!t || t->conn >= 0)
                session_fail(s, "no detached command %u", get_u32(p));
            else
                attach(s, t);
            return;
        }
        default:
            session_fail(s, "unexpected frame 0x%02x before START", type);
            return;
        }
    }
    /* started (or finished: late stdin and kills are harmless and ignored) */
    switch (type) {
    case T_STDIN:
        if (s->in >= 0 && !s->stdin_eof) {
            if (buf_reserve(&s->inq, n) < 0) {
                session_fail(s, "out of memory for stdin");
                return;
            }
            memcpy(buf_tail(&s->inq), p, n);
            s->inq.len += n;
        }
        return;
    case T_STDIN_EOF:
        s->stdin_eof = 1;
        if (s->inq.len == 0)
            closefd(&s->in);
        return;
    case T_KILL: {
        uint32_t sig = n == 4 ? get_u32(p) : 0;
        if (sig < 1 || sig >= (uint32_t)NSIG) {
            session_fail(s, "KILL needs a signal number");
            return;
        }
        if (s->phase != P_FINISHED)
            kill_group(s, sig);
        return;
    }
    case T_DETACH:
        if (s->version < 3 || n)
            session_fail(s, "DETACH needs protocol 3 and no payload");
        else
            detach(s);
        return;
    case T_RESIZE:
        if (!s->pty || !get_winsize(s, p, n)) {
            session_fail(s, "RESIZE needs a PTY session and rows u16, cols u16 in 1..%u",
                         MAX_PTY_DIM);
            return;
        }
        /* the kernel sends SIGWINCH to the terminal's foreground group itself */
        if (s->out >= 0) {
            struct winsize ws = {.ws_row = s->rows, .ws_col = s->cols};
            ioctl(s->out, TIOCSWINSZ, &ws);
        }
        return;
    default:
        if (s->phase != P_FINISHED)
            session_fail(s, "unexpected frame 0x%02x after START", type);
    }
}

static void on_conn_readable(struct session *s) {
    if (buf_reserve(&s->rx, CHUNK) < 0) {
        session_drop(s);
        return;
    }
    ssize_t r = read(s->conn, buf_tail(&s->rx), CHUNK);
    if (r < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (r <= 0) {
        session_drop(s);
        return;
    }
    s->rx.len += r;
    while (s->conn >= 0 && !s->closing && s->rx.len >= 5) {
        const unsigned char *h = s->rx.p + s->rx.off;
        uint32_t n = get_u32(h + 1);
        if (n > MAX_PAYLOAD) {
            session_fail(s, "frame of %u bytes is over the %u byte limit", n, MAX_PAYLOAD);
            return;
        }
        if (s->rx.len < 5 + (size_t)n)
            break;
        on_frame(s, h[0], h + 5, n);
        if (s->rx.p) /* session_drop frees rx */
            buf_consume(&s->rx, 5 + (size_t)n);
        if (s->moved) { /* ATTACH: what follows on the connection is the attached command's */
            struct session *t = s->moved;
            struct buf rest = s->rx;
            s->moved = NULL;
            s->rx = t->rx;
            t->rx = rest;
            s = t;
        }
    }
}

static void on_conn_writable(struct session *s) {
    ssize_t w = send(s->conn, s->tx.p + s->tx.off, s->tx.len, MSG_NOSIGNAL);
    if (w < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (w < 0) {
        session_drop(s);
        return;
    }
    buf_consume(&s->tx, w);
    if (s->tx.len == 0 && s->closing)
        closefd(&s->conn);
}

/* Output of the command's stdout (which = 0) or stderr (which = 1), one frame at a time: read
 * only while tx is empty, so the agent holds at most one chunk per session and backpressure
 * reaches the command. A frame shorter than CHUNK is held back up to COALESCE_MS and filled
 * with what the stream writes meanwhile (until it is full or the stream ends): a command
 * writing one byte at a time costs the host one frame per COALESCE_MS, not one per byte. */
static void on_pipe_readable(struct session *s, int which) {
    int *fd = which ? &s->err : &s->out;
    unsigned char scratch[4096];
    ssize_t r;
    if (s->detached && s->phase != P_FINISHED) { /* kept for an ATTACH, up to DETACH_BUF */
        r = read(*fd, scratch, sizeof scratch);
        if (r > 0)
            keep(s, which ? R_STDERR : R_STDOUT, scratch, r);
    } else if (s->conn < 0 || s->phase == P_FINISHED) { /* nobody to send to: discard */
        r = read(*fd, scratch, sizeof scratch);
    } else if (s->hold) { /* tx is the held frame of this stream (tx.off is 0) */
        unsigned char *p = s->tx.p;
        uint32_t have = get_u32(p + 1);
        r = read(*fd, p + 5 + have, CHUNK - have);
        if (r > 0) {
            put_u32(p + 1, have + r);
            s->tx.len += r;
            if (have + r == CHUNK)
                s->hold = 0;
        }
    } else {
        if (buf_reserve(&s->tx, 5 + CHUNK) < 0) {
            session_drop(s);
            return;
        }
        unsigned char *p = buf_tail(&s->tx);
        r = read(*fd, p + 5, CHUNK);
        if (r > 0) {
            p[0] = which ? R_STDERR : R_STDOUT;
            put_u32(p + 1, r);
            s->tx.len += 5 + r;
            int64_t now = now_ms();
            /* a terminal's echo goes at once; only a burst (a frame within COALESCE_MS of
             * the last) is held, so a keystroke's round trip does not pay the wait */
            int burst = !s->pty || now - s->last_frame < COALESCE_MS;
            s->last_frame = now;
            if ((size_t)r < CHUNK && burst) {
                s->hold = now + COALESCE_MS;
                s->hold_which = which;
            }
        }
    }
    if (r < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (r <= 0) {
        closefd(fd);
        s->hold = 0; /* the stream ended: nothing more will fill the frame */
        return;
    }
    s->owed[which] = s->owed[which] > (size_t)r ? s->owed[which] - r : 0;
}

static void on_stdin_writable(struct session *s) {
    ssize_t w = write(s->in, s->inq.p + s->inq.off, s->inq.len);
    if (w < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (w < 0) { /* EPIPE: the command closed its stdin; the rest is dropped */
        closefd(&s->in);
        buf_free(&s->inq);
        return;
    }
    buf_consume(&s->inq, w);
    if (s->inq.len == 0 && s->stdin_eof)
        closefd(&s->in);
}

static void on_status_readable(struct session *s) {
    unsigned char rep[600];
    ssize_t r = read(s->status, rep, sizeof rep - 1);
    if (r < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    closefd(&s->status);
    if (r >= 8) { /* the child reported a failure before exec */
        rep[r] = 0;
        start_failed(s, get_u32(rep), get_u32(rep + 4), (char *)rep + 8);
        closefd(&s->in);
        buf_free(&s->inq);
    } else if (s->phase == P_STARTING) {
        s->phase = P_RUNNING; /* EOF: exec succeeded (the pipe was close-on-exec) */
    }
}

static void on_reaped(struct session *s, int wstatus) {
    s->reaped = 1;
    s->wstatus = wstatus;
    s->grace = now_ms() + EXIT_GRACE_MS;
    /* What the command wrote before it exited is owed to the host whatever the grace. */
    int n;
    s->owed[0] = s->out >= 0 && ioctl(s->out, FIONREAD, &n) == 0 ? (size_t)n : 0;
    s->owed[1] = s->err >= 0 && ioctl(s->err, FIONREAD, &n) == 0 ? (size_t)n : 0;
}

/* Send EXIT once the command is reaped, its start confirmed, and its output delivered: both
 * pipes at EOF, or the owed bytes sent and the grace over (a background process holds a pipe). */
static void maybe_finish(struct session *s, int64_t now) {
    if (s->phase != P_RUNNING || !s->reaped || s->status >= 0 || s->tx.len)
        return;
    for (int which = 0; which < 2; which++) {
        int fd = which ? s->err : s->out;
        if (fd >= 0 && (s->owed[which] || now < s->grace))
            return;
    }
    int st = s->wstatus;
    unsigned char p[6];
    uint32_t code = 0;
    unsigned char flags = s->flags, sig = 0;
    if (WIFEXITED(st)) {
        code = WEXITSTATUS(st);
    } else if (WIFSIGNALED(st)) {
        sig = WTERMSIG(st);
        code = 128 + sig;
        flags |= F_SIGNALED;
    }
    if (s->out >= 0 || s->err >= 0)
        flags |= F_OUTPUT_OPEN;
    put_u32(p, code);
    p[4] = flags;
    p[5] = sig;
    emit(s, R_EXIT, p, sizeof p);
    s->phase = P_FINISHED;
    s->closing = 1;
    closefd(&s->in);
    buf_free(&s->inq);
}

static int session_done(struct session *s) {
    return s->phase == P_FINISHED && !s->detached && s->conn < 0 && s->out < 0 && s->err < 0 &&
           s->status < 0 && (s->pid <= 0 || s->reaped);
}

/* ---- main loop -------------------------------------------------------------------------- */

static int listen_on(const char *path) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    char tmp[sizeof addr.sun_path];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) {
        logmsg("socket path too long: %s", path);
        return -1;
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        logmsg("socket: %s", strerror(errno));
        return -1;
    }
    unlink(tmp);
    memcpy(addr.sun_path, tmp, strlen(tmp) + 1);
    /* bind under a temporary name and rename: the socket appears only once it accepts */
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) < 0 || chmod(tmp, 0600) < 0 ||
        listen(fd, 512) < 0 || rename(tmp, path) < 0) {
        logmsg("listen on %s: %s", path, strerror(errno));
        close(fd);
        return -1;
    }
    return fd;
}

static void accept_all(int lfd, int any_peer) {
    for (;;) {
        int c = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0)
            return; /* EAGAIN, or a transient error: poll again */
        struct ucred cred;
        socklen_t len = sizeof cred;
        /* Only the host may connect: a process outside our pid namespace has pid 0 here. A
         * process inside the sandbox could otherwise run commands as any user, root included. */
        if (!any_peer && (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0 || cred.pid)) {
            close(c);
            continue;
        }
        if (nsessions >= MAX_SESSIONS || !session_new(c)) {
            static const char text[] = "too many concurrent sessions";
            unsigned char msg[5 + sizeof text];
            msg[0] = R_ERROR;
            put_u32(msg + 1, sizeof text - 1);
            memcpy(msg + 5, text, sizeof text - 1);
            ssize_t w = send(c, msg, sizeof msg - 1, MSG_NOSIGNAL);
            (void)w;
            close(c);
        }
    }
}

static void reap(void) {
    int st;
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
        for (int i = 0; i < nsessions; i++) {
            if (sessions[i]->pid == pid && !sessions[i]->reaped) {
                on_reaped(sessions[i], st);
                break;
            }
        }
    }
}

/* ---- serial mode: channels over one byte stream ------------------------------------------ */

struct chan {
    uint32_t id;
    int fd;         /* our end of the session's socketpair; -1 once closed */
    int eof, dead;  /* fd at EOF; CLOSE sent or received (freed in the sweep) */
    int64_t credit; /* bytes of inner frames we may still send to the host */
    uint32_t acked; /* bytes delivered to the session, not yet announced with WINDOW */
    struct buf down, up; /* host -> session frames; session -> host bytes */
};

static struct chan *chans[MAX_SESSIONS];
static int nchans;
static int line = -1;
static int64_t line_hup_until;
static struct buf line_rx, line_tx;

static void line_queue(int type, uint32_t id, const void *a, size_t alen) {
    if (buf_reserve(&line_tx, 9 + alen) < 0) {
        logmsg("out of memory for the serial line");
        return;
    }
    unsigned char *p = buf_tail(&line_tx);
    p[0] = type;
    put_u32(p + 1, 4 + alen);
    put_u32(p + 5, id);
    if (alen)
        memcpy(p + 9, a, alen);
    line_tx.len += 9 + alen;
}

static void line_window(uint32_t id, uint32_t bytes) {
    unsigned char b[4];
    put_u32(b, bytes);
    line_queue(T_WINDOW, id, b, 4);
}

static struct chan *chan_find(uint32_t id) {
    for (int i = 0; i < nchans; i++)
        if (chans[i]->id == id && !chans[i]->dead)
            return chans[i];
    return NULL;
}

static void chan_kill(struct chan *c) { /* the session sees its connection drop */
    closefd(&c->fd);
    c->dead = 1;
}

static struct chan *chan_open(uint32_t id) {
    int sv[2];
    struct chan *c = NULL;
    if (nchans >= MAX_SESSIONS || nsessions >= MAX_SESSIONS ||
        socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, sv) < 0)
        goto refuse;
    c = calloc(1, sizeof *c);
    if (!c || !session_new(sv[0])) {
        free(c);
        close(sv[0]);
        close(sv[1]);
        goto refuse;
    }
    c->id = id;
    c->fd = sv[1];
    c->credit = SERIAL_WINDOW;
    chans[nchans++] = c;
    return c;
refuse: {
    static const char text[] = "too many concurrent sessions";
    unsigned char f[5 + sizeof text];
    f[0] = R_ERROR;
    put_u32(f + 1, sizeof text - 1);
    memcpy(f + 5, text, sizeof text - 1);
    line_queue(T_CHANNEL, id, f, sizeof f - 1);
    line_queue(T_CLOSE, id, NULL, 0);
    return NULL;
}
}

/* Frames the session wrote, passed on whole while the channel has credit (a frame may take
 * the credit below zero: a sender sends while its window is positive). EOF ends the channel. */
static void chan_pump(struct chan *c) {
    while (!c->dead && c->up.len >= 5 && c->credit > 0) {
        const unsigned char *h = c->up.p + c->up.off;
        size_t n = 5 + (size_t)get_u32(h + 1);
        if (c->up.len < n)
            break;
        line_queue(T_CHANNEL, c->id, h, n);
        c->credit -= n;
        buf_consume(&c->up, n);
    }
    if (!c->dead && c->eof && (c->up.len < 5 || c->up.len < 5 + (size_t)get_u32(
                                   c->up.p + c->up.off + 1))) {
        line_queue(T_CLOSE, c->id, NULL, 0);
        chan_kill(c);
    }
}

static void chan_readable(struct chan *c) {
    if (buf_reserve(&c->up, CHUNK + 5) < 0) {
        chan_kill(c);
        return;
    }
    ssize_t r = read(c->fd, buf_tail(&c->up), CHUNK + 5);
    if (r < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (r <= 0)
        c->eof = 1;
    else
        c->up.len += r;
    chan_pump(c);
}

static void chan_writable(struct chan *c) {
    ssize_t w = send(c->fd, c->down.p + c->down.off, c->down.len, MSG_NOSIGNAL);
    if (w < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (w < 0) { /* the session is gone; what the host still sends is dropped */
        buf_free(&c->down);
        return;
    }
    buf_consume(&c->down, w);
    c->acked += w;
    if (c->acked >= WINDOW_ACK || c->down.len == 0) {
        line_window(c->id, c->acked);
        c->acked = 0;
    }
}

static void line_close_all(void) {
    for (int i = 0; i < nchans; i++)
        if (!chans[i]->dead)
            chan_kill(chans[i]);
    buf_free(&line_rx);
    buf_free(&line_tx);
}

static void on_line_frame(int type, const unsigned char *p, size_t n) {
    if (n < 4) {
        logmsg("serial: frame 0x%02x without a channel", type);
        return;
    }
    uint32_t id = get_u32(p);
    struct chan *c = chan_find(id);
    switch (type) {
    case T_CHANNEL:
        if (n < 9 || get_u32(p + 5) != n - 9) {
            logmsg("serial: malformed CHANNEL frame on channel %u", id);
            return;
        }
        if (!c && p[4] != T_HELLO)
            return; /* a late frame for a channel that already ended */
        if (!c && !(c = chan_open(id)))
            return;
        if (c->fd < 0)
            return;
        if (buf_reserve(&c->down, n - 4) < 0) {
            chan_kill(c);
            return;
        }
        memcpy(buf_tail(&c->down), p + 4, n - 4);
        c->down.len += n - 4;
        return;
    case T_WINDOW:
        if (c && n == 8) {
            c->credit += get_u32(p + 4);
            chan_pump(c);
        }
        return;
    case T_CLOSE:
        if (c)
            chan_kill(c);
        return;
    default:
        logmsg("serial: unknown frame type 0x%02x", type);
    }
}

static void line_readable(void) {
    if (buf_reserve(&line_rx, CHUNK) < 0) {
        line_close_all();
        return;
    }
    ssize_t r = read(line, buf_tail(&line_rx), CHUNK);
    if (r < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (r <= 0) { /* the host side hung up: every channel ends */
        line_close_all();
        line_hup_until = now_ms() + 100;
        return;
    }
    line_rx.len += r;
    while (line_rx.len >= 5) {
        const unsigned char *h = line_rx.p + line_rx.off;
        uint32_t n = get_u32(h + 1);
        if (n > MAX_PAYLOAD + 9) { /* the stream cannot be resynchronised */
            logmsg("serial: frame of %u bytes is over the limit; dropping every channel", n);
            line_close_all();
            return;
        }
        if (line_rx.len < 5 + (size_t)n)
            break;
        on_line_frame(h[0], h + 5, n);
        buf_consume(&line_rx, 5 + (size_t)n);
    }
}

static void line_writable(void) {
    ssize_t w = write(line, line_tx.p + line_tx.off, line_tx.len);
    if (w < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (w < 0) {
        logmsg("serial: write: %s", strerror(errno));
        line_close_all();
        line_hup_until = now_ms() + 100;
        return;
    }
    buf_consume(&line_tx, w);
}

static void chans_sweep(void) {
    for (int i = nchans - 1; i >= 0; i--) {
        struct chan *c = chans[i];
        if (!c->dead)
            chan_pump(c);
        if (c->dead) {
            closefd(&c->fd);
            buf_free(&c->down);
            buf_free(&c->up);
            free(c);
            chans[i] = chans[--nchans];
            chans[nchans] = NULL;
        }
    }
}

static void usage(void) {
    fprintf(stderr, "usage: " AGENT_NAME " --listen-fd FD [--any-peer]\n"
                    "       " AGENT_NAME " --listen SOCKET_PATH [--any-peer]\n"
                    "       " AGENT_NAME " --serial PORT\n"
                    "       " AGENT_NAME " --version\n");
}

/* A listening unix stream socket the host created and runc passed down (--preserve-fds):
 * made close-on-exec so no command inherits it, and non-blocking for accept_all. */
static int inherited_listener(const char *text) {
    char *end;
    long fd = strtol(text, &end, 10);
    int type = 0, listening = 0;
    socklen_t len = sizeof type;
    if (*text == 0 || *end || fd < 3 || fd > INT_MAX ||
        getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) < 0 || type != SOCK_STREAM ||
        (len = sizeof listening, getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len)) < 0
        || !listening) {
        logmsg("--listen-fd %s: not a listening stream socket", text);
        return -1;
    }
    if (fcntl(fd, F_SETFD, FD_CLOEXEC) < 0 || set_nonblock(fd) < 0) {
        logmsg("--listen-fd %s: %s", text, strerror(errno));
        return -1;
    }
    return (int)fd;
}

int main(int argc, char **argv) {
    /* First thing: not dumpable, so no process in the sandbox (root included: it lacks
     * CAP_SYS_PTRACE) can ptrace the agent, open /proc/1/mem, /proc/1/environ or
     * /proc/1/fd/N, pidfd_getfd or process_vm_readv it. Children inherit this until their
     * execve, so a forked child is covered too until it becomes the command. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0)
        return 1;
    const char *listen_path = NULL, *serial_path = NULL, *listen_fd = NULL;
    int any_peer = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--listen") && i + 1 < argc) {
            listen_path = argv[++i];
        } else if (!strcmp(argv[i], "--listen-fd") && i + 1 < argc) {
            listen_fd = argv[++i];
        } else if (!strcmp(argv[i], "--any-peer")) {
            any_peer = 1;
        } else if (!strcmp(argv[i], "--version")) {
            printf(AGENT_NAME " protocol %u\n", PROTO_VERSION);
            return 0;
        } else if (!strcmp(argv[i], "--serial") && i + 1 < argc) {
            serial_path = argv[++i];
        } else {
            usage();
            return 2;
        }
    }
    if (!!listen_path + !!serial_path + !!listen_fd != 1) {
        usage();
        return 2;
    }
    for (int fd = 0; fd < 3; fd++) /* pipes must never land on 0-2 */
        if (fcntl(fd, F_GETFD) < 0 && open("/dev/null", O_RDWR) != fd)
            return 1;
    prctl(PR_SET_NAME, AGENT_NAME); /* ps shows this, not the mount point's name */
    signal(SIGPIPE, SIG_IGN);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
    int lfd = -1;
    if (serial_path) {
        line = open(serial_path, O_RDWR | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
        if (line < 0) {
            logmsg("open %s: %s", serial_path, strerror(errno));
            return 1;
        }
    } else if (listen_fd) {
        if ((lfd = inherited_listener(listen_fd)) < 0)
            return 1;
    } else if ((lfd = listen_on(listen_path)) < 0) {
        return 1;
    }
    if (sfd < 0)
        return 1;

    /* fds per session: conn, out, err, in, status; then one per serial channel */
    static struct pollfd pfd[3 + 6 * MAX_SESSIONS];
    static struct {
        int session, role;
    } who[3 + 6 * MAX_SESSIONS];
    enum { ROLE_CONN, ROLE_OUT, ROLE_ERR, ROLE_IN, ROLE_STATUS, ROLE_CHAN };

    for (;;) {
        int n = 0;
        int64_t now = now_ms(), wake = -1;
        pfd[n++] = (struct pollfd){.fd = sfd, .events = POLLIN};
        pfd[n++] = (struct pollfd){.fd = nsessions < MAX_SESSIONS ? lfd : -1, .events = POLLIN};
        int line_polled = line >= 0 && now >= line_hup_until;
        pfd[n++] = (struct pollfd){.fd = line_polled ? line : -1,
                                   .events = POLLIN | (line_tx.len ? POLLOUT : 0)};
        if (line >= 0 && !line_polled && (wake < 0 || line_hup_until < wake))
            wake = line_hup_until;
        for (int i = 0; i < nsessions; i++) {
            struct session *s = sessions[i];
            int fds[5] = {s->conn, s->out, s->err, s->in, s->status};
            short ev[5] = {0, 0, 0, 0, POLLIN};
            if (s->conn >= 0) {
                /* still read the connection while stdin is pending (kill frames), up to a
                 * bound; a hang-up (POLLHUP) is reported whatever the events */
                if (!s->closing && s->inq.len < STDIN_HIGH)
                    ev[0] |= POLLIN;
                if (s->tx.len && !s->hold)
                    ev[0] |= POLLOUT;
            }
            if (s->tx.len == 0)
                ev[1] = ev[2] = POLLIN;
            else if (s->hold)
                ev[1 + s->hold_which] = POLLIN;
            if (s->inq.len)
                ev[3] = POLLOUT;
            for (int k = 0; k < 5; k++) {
                if (fds[k] < 0 || (!ev[k] && k != 0))
                    continue;
                who[n].session = i;
                who[n].role = k;
                pfd[n++] = (struct pollfd){.fd = fds[k], .events = ev[k]};
            }
            int64_t t = 0;
            if (s->deadline && !s->reaped)
                t = s->deadline;
            if (s->reaped && s->phase == P_RUNNING && now < s->grace && (!t || s->grace < t))
                t = s->grace;
            if (s->hold && (!t || s->hold < t))
                t = s->hold;
            if (t && (wake < 0 || t < wake))
                wake = t;
        }
        for (int i = 0; i < nchans; i++) {
            struct chan *c = chans[i];
            short ev = (c->down.len ? POLLOUT : 0) |
                       (!c->eof && c->credit > 0 && line_tx.len < LINE_HIGH ? POLLIN : 0);
            if (c->fd < 0 || !ev)
                continue;
            who[n].session = i;
            who[n].role = ROLE_CHAN;
            pfd[n++] = (struct pollfd){.fd = c->fd, .events = ev};
        }
        int timeout = wake < 0 ? -1 : (wake <= now ? 0 : (int)(wake - now));
        if (poll(pfd, n, timeout) < 0 && errno != EINTR) {
            logmsg("poll: %s", strerror(errno));
            return 1;
        }
        if (pfd[0].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) == sizeof si) {
                if (si.ssi_signo == SIGTERM || si.ssi_signo == SIGINT)
                    return 0; /* PID 1 exits: the kernel kills everything in the sandbox */
            }
            reap();
        }
        /* sessions only move within the table when freed, which happens below */
        for (int k = 3; k < n; k++) {
            short re = pfd[k].revents;
            if (!re || who[k].role == ROLE_CHAN)
                continue;
            struct session *s = sessions[who[k].session];
            int fd = pfd[k].fd;
            switch (who[k].role) {
            case ROLE_CONN:
                if (s->conn != fd)
                    break;
                if (re & POLLOUT)
                    on_conn_writable(s);
                if (s->conn == fd && (re & (POLLIN | POLLHUP | POLLERR))) {
                    if (re & POLLIN)
                        on_conn_readable(s);
                    else
                        session_drop(s);
                }
                break;
            case ROLE_OUT:
            case ROLE_ERR: {
                int which = who[k].role == ROLE_ERR;
                if ((which ? s->err : s->out) == fd &&
                    (s->tx.len == 0 || (s->hold && s->hold_which == which)))
                    on_pipe_readable(s, which);
                break;
            }
            case ROLE_IN:
                if (s->in == fd) {
                    if (re & POLLOUT)
                        on_stdin_writable(s);
                    else if (re & (POLLERR | POLLHUP)) {
                        closefd(&s->in);
                        buf_free(&s->inq);
                    }
                }
                break;
            case ROLE_STATUS:
                if (s->status == fd)
                    on_status_readable(s);
                break;
            }
        }
        for (int k = 3; k < n; k++) { /* channels after sessions: the session loop reads
                                        sessions[who.session], which is a chan index here */
            struct chan *c;
            if (who[k].role != ROLE_CHAN || !pfd[k].revents)
                continue;
            c = chans[who[k].session];
            if (c->fd != pfd[k].fd)
                continue;
            if (pfd[k].revents & POLLOUT)
                chan_writable(c);
            if (c->fd >= 0 && (pfd[k].revents & (POLLIN | POLLHUP | POLLERR)))
                chan_readable(c);
        }
        if (pfd[2].revents & POLLOUT)
            line_writable();
        if (pfd[2].revents & POLLIN)
            line_readable();
        else if (pfd[2].revents & (POLLHUP | POLLERR)) { /* the host is not connected */
            line_close_all();
            line_hup_until = now_ms() + 100;
        }
        if (pfd[1].revents & POLLIN)
            accept_all(lfd, any_peer);
        now = now_ms();
        for (int i = nsessions - 1; i >= 0; i--) {
            struct session *s = sessions[i];
            if (s->hold && now >= s->hold)
                s->hold = 0; /* the held frame goes out */
            if (s->deadline && !s->reaped && now >= s->deadline) {
                kill_group(s, SIGKILL);
                s->flags |= F_TIMED_OUT;
                s->deadline = 0;
            }
            maybe_finish(s, now);
            if (s->closing && s->conn >= 0 && s->tx.len == 0)
                closefd(&s->conn);
            if (session_done(s))
                session_free(i);
        }
        chans_sweep();
    }
}
