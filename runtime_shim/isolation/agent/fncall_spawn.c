/* envbuild-fncall-spawn: starts the agent of one FnCall call in namespaces of its own.
 * The design and the reasons are in runtime_shim/fncall_ns.py; this is its host-side helper,
 * run by the host (root) with posix_spawn for every call, a static C program because forking
 * the host's Python process twice per call cost ~6 ms.
 *
 *   envbuild-fncall-spawn [-c CGROUP_PROCS]... [-m MASKED]... [-r READONLY]... [-l RES:SOFT:HARD]...
 *       -C BND:EFF:PRM:INH -s POLICY:NICE -a CPU,CPU... -o OOM_SCORE_ADJ -u UMASK [-S]
 *       -- AGENT ARGV...
 * (-S: no seccomp filter, for a sandbox created with seccomp="unconfined"; else fd 8 must hold
 * the program.)
 *
 * fds: 3 the call's listening socket (the agent's fd 3), 4 the agent's stderr, 5 the report
 * pipe, 6 the container's mount namespace, 7 its UTS namespace, 8 the seccomp BPF program.
 * The environment is the agent's. On the report pipe (close-on-exec) the helper writes
 * "PID\n" (the host pid of the call's PID 1); any failure adds "\nSTEP: ERROR" and the exit
 * status is 1. The host reads to EOF: every copy is closed once the agent is executed. The
 * helper then waits for the call's PID 1 and exits when it is gone (the host kills it). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <net/if.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define REPORT_FD 5
#define MAX_LIST 64

static void fail(const char *step, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, step);
    int n = vsnprintf(msg, sizeof msg, step, ap);
    va_end(ap);
    if (n < 0 || n >= (int)sizeof msg)
        n = (int)sizeof msg - 1;
    char line[600];
    int len = snprintf(line, sizeof line, "\n%.*s: %s", n, msg, strerror(errno));
    if (write(REPORT_FD, line, (size_t)len) < 0)
        _exit(1);
    _exit(1);
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, text, strlen(text)) != (ssize_t)strlen(text))
        fail("write %s", path);
    close(fd);
}

static void do_mount(const char *src, const char *dst, const char *type, unsigned long flags,
                     const char *data) {
    if (mount(src, dst, type, flags, data) < 0)
        fail("mount %s", dst);
}

struct conf {
    const char *cgroups[MAX_LIST], *masked[MAX_LIST], *readonly[MAX_LIST], *rlimits[MAX_LIST];
    int ncgroups, nmasked, nreadonly, nrlimits;
    unsigned long long caps[4]; /* bounding, effective, permitted, inheritable */
    int policy, nice, oom, umask, no_seccomp;
    cpu_set_t cpus;
    char **argv;
};

static void add(const char **list, int *n, const char *value) {
    if (*n >= MAX_LIST) {
        errno = E2BIG;
        fail("too many arguments");
    }
    list[(*n)++] = value;
}

static void parse(int argc, char **argv, struct conf *c) {
    int opt;
    memset(c, 0, sizeof *c);
    CPU_ZERO(&c->cpus);
    while ((opt = getopt(argc, argv, "+c:m:r:l:C:s:a:o:u:S")) != -1) {
        errno = EINVAL;
        switch (opt) {
        case 'c': add(c->cgroups, &c->ncgroups, optarg); break;
        case 'm': add(c->masked, &c->nmasked, optarg); break;
        case 'r': add(c->readonly, &c->nreadonly, optarg); break;
        case 'l': add(c->rlimits, &c->nrlimits, optarg); break;
        case 'C':
            if (sscanf(optarg, "%llx:%llx:%llx:%llx", &c->caps[0], &c->caps[1], &c->caps[2],
                       &c->caps[3]) != 4)
                fail("-C %s", optarg);
            break;
        case 's':
            if (sscanf(optarg, "%d:%d", &c->policy, &c->nice) != 2)
                fail("-s %s", optarg);
            break;
        case 'a':
            for (char *p = optarg; *p;) {
                char *end;
                long cpu = strtol(p, &end, 10);
                if (end == p || cpu < 0 || cpu >= CPU_SETSIZE)
                    fail("-a %s", optarg);
                CPU_SET((int)cpu, &c->cpus);
                p = *end == ',' ? end + 1 : end;
            }
            break;
        case 'o': c->oom = atoi(optarg); break;
        case 'u': c->umask = (int)strtol(optarg, NULL, 8); break;
        case 'S': c->no_seccomp = 1; break;
        default: fail("usage");
        }
    }
    if (optind >= argc)
        fail("no agent command");
    c->argv = argv + optind;
}

/* The container's identity (cgroup, scheduling, namespaces) in the first child, new
 * namespaces made; PID 1 of the new PID namespace does the rest (call_init). */
static void enter(const struct conf *c) {
    char text[32];
    snprintf(text, sizeof text, "%d", getpid());
    for (int i = 0; i < c->ncgroups; i++)
        write_file(c->cgroups[i], text);
    struct sched_param param = {0};
    if (sched_setscheduler(0, c->policy, &param) < 0 || setpriority(PRIO_PROCESS, 0, c->nice) < 0
        || sched_setaffinity(0, sizeof c->cpus, &c->cpus) < 0)
        fail("set the scheduling attributes");
    snprintf(text, sizeof text, "%d", c->oom);
    write_file("/proc/self/oom_score_adj", text);
    umask((mode_t)c->umask);
    if (setns(6, CLONE_NEWNS) < 0 || setns(7, CLONE_NEWUTS) < 0)
        fail("join the sandbox's namespaces");
    if (unshare(CLONE_NEWNS | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWPID | CLONE_NEWNET) < 0)
        fail("make the call's namespaces");
    do_mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
}

static void fresh_mounts(const struct conf *c) {
    const unsigned long hardened = MS_NOSUID | MS_NODEV | MS_NOEXEC;
    const char *replaced[] = {"/proc", "/sys", "/dev/pts", "/dev/mqueue"};
    for (size_t i = 0; i < sizeof replaced / sizeof *replaced; i++)
        if (umount2(replaced[i], MNT_DETACH) < 0)
            fail("unmount the container's %s", replaced[i]);
    do_mount("proc", "/proc", "proc", hardened, NULL);
    do_mount("sysfs", "/sys", "sysfs", hardened | MS_RDONLY, NULL);
    do_mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
             "newinstance,ptmxmode=0666,mode=0620,gid=5");
    do_mount("mqueue", "/dev/mqueue", "mqueue", hardened, NULL);
    for (int i = 0; i < c->nmasked; i++) { /* as runc masks them */
        struct stat st;
        if (stat(c->masked[i], &st) < 0)
            continue;
        if (S_ISDIR(st.st_mode))
            do_mount("tmpfs", c->masked[i], "tmpfs", MS_RDONLY, NULL);
        else
            do_mount("/dev/null", c->masked[i], NULL, MS_BIND, NULL);
    }
    for (int i = 0; i < c->nreadonly; i++) {
        if (access(c->readonly[i], F_OK) < 0)
            continue;
        do_mount(c->readonly[i], c->readonly[i], NULL, MS_BIND | MS_REC, NULL);
        do_mount(c->readonly[i], c->readonly[i], NULL,
                 MS_BIND | MS_REC | MS_REMOUNT | MS_RDONLY | hardened, NULL);
    }
}

static void loopback_up(void) { /* runc brings up the container's lo; this is the call's */
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strcpy(ifr.ifr_name, "lo");
    if (s < 0 || ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
        fail("read the flags of lo");
    ifr.ifr_flags |= IFF_UP;
    if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
        fail("bring up lo");
    close(s);
}

static void confine(const struct conf *c) {
    for (int i = 0; i < c->nrlimits; i++) {
        int res;
        long long soft, hard;
        if (sscanf(c->rlimits[i], "%d:%lld:%lld", &res, &soft, &hard) != 3)
            fail("-l %s", c->rlimits[i]);
        struct rlimit rl = {soft < 0 ? RLIM_INFINITY : (rlim_t)soft,
                            hard < 0 ? RLIM_INFINITY : (rlim_t)hard};
        if (setrlimit(res, &rl) < 0)
            fail("set rlimit %d", res);
    }
    int last = CAP_LAST_CAP;
    FILE *f = fopen("/proc/sys/kernel/cap_last_cap", "re");
    if (f == NULL || fscanf(f, "%d", &last) != 1)
        fail("read cap_last_cap");
    fclose(f);
    for (int cap = 0; cap <= last; cap++)
        if (!(c->caps[0] >> cap & 1) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0)
            fail("drop capability %d", cap);
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0)
        fail("clear the ambient capabilities");
    struct __user_cap_header_struct hdr = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    for (int i = 0; i < 2; i++) {
        data[i].effective = (__u32)(c->caps[1] >> (32 * i));
        data[i].permitted = (__u32)(c->caps[2] >> (32 * i));
        data[i].inheritable = (__u32)(c->caps[3] >> (32 * i));
    }
    if (syscall(SYS_capset, &hdr, data) < 0)
        fail("set the capabilities");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        fail("set no_new_privs");
    if (c->no_seccomp)
        return;
    static struct sock_filter program[BPF_MAXINSNS];
    ssize_t size = pread(8, program, sizeof program, 0);
    if (size <= 0 || size % (ssize_t)sizeof *program != 0) {
        errno = size < 0 ? errno : EINVAL;
        fail("read the seccomp program");
    }
    struct sock_fprog prog = {(unsigned short)(size / (ssize_t)sizeof *program), program};
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog) < 0)
        fail("install the seccomp filter");
}

/* PID 1 of the call: its own /proc, /sys, /dev/pts, /dev/mqueue and lo; then the anchor's
 * confinement and the agent. */
static void call_init(const struct conf *c) {
    /* a new, empty session keyring, as runc gives every container (never the host's) */
    if (syscall(SYS_keyctl, 1 /* KEYCTL_JOIN_SESSION_KEYRING */, NULL) < 0)
        fail("join a new session keyring");
    fresh_mounts(c);
    loopback_up();
    int null = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (null < 0 || dup2(null, 0) < 0 || dup2(null, 1) < 0 || dup2(4, 2) < 0)
        fail("set up the agent's stdio");
    if (syscall(SYS_close_range, 4, ~0U, 4 /* CLOSE_RANGE_CLOEXEC */) < 0)
        fail("mark fds close-on-exec");
    confine(c);
    execv(c->argv[0], c->argv);
    fail("execute %s", c->argv[0]);
}

int main(int argc, char **argv) {
    struct conf c;
    parse(argc, argv, &c);
    enter(&c);
    pid_t pid = fork();
    if (pid < 0)
        fail("fork the call's PID 1");
    if (pid == 0)
        call_init(&c);
    char text[32];
    int len = snprintf(text, sizeof text, "%d\n", pid);
    if (write(REPORT_FD, text, (size_t)len) != len)
        return 1;
    close(REPORT_FD);
    /* Stay its parent, so it is reaped the moment it dies: a zombie would count against the
     * sandbox's pids limit until the host's init got to it. */
    int status;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR)
        ;
    return 0;
}
