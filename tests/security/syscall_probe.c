/* Calls the syscalls a sandbox must be refused (and a few it must keep) and prints one line
 * per call: "NAME RC ERRNO" (ERRNO 0 when RC >= 0). Built static by test_syscalls.py and run
 * inside a sandbox. Arguments are harmless or invalid on purpose: the point is whether the
 * kernel is reached (EINVAL/EBADF/ENOTTY...) or seccomp answers first (EPERM/ENOSYS). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <unistd.h>

static void report(const char *name, long rc) {
    printf("%s %ld %d\n", name, rc, rc < 0 ? errno : 0);
    fflush(stdout);
}

/* A raw clone(flags) in a child-returns-at-once style: the child exits immediately. */
static long raw_clone(unsigned long flags) {
    long rc = syscall(SYS_clone, flags | SIGCHLD, NULL, NULL, NULL, 0);
    if (rc == 0)
        _exit(0);
    if (rc > 0)
        waitpid((pid_t)rc, NULL, 0);
    return rc;
}

/* unshare in a child so a success does not change the probe itself. */
static long child_unshare(int flags) {
    int pipefd[2];
    if (pipe(pipefd) < 0)
        return -1;
    pid_t pid = fork();
    if (pid == 0) {
        int rc = unshare(flags);
        int err[2] = {rc, errno};
        if (write(pipefd[1], err, sizeof err) < 0)
            _exit(2);
        _exit(0);
    }
    int err[2] = {-1, EIO};
    close(pipefd[1]);
    if (read(pipefd[0], err, sizeof err) != sizeof err)
        err[1] = EIO;
    waitpid(pid, NULL, 0);
    close(pipefd[0]);
    errno = err[1];
    return err[0];
}

#if defined(__x86_64__)
static long int80(long nr, long a, long b, long c) {
    long ret;
    __asm__ volatile("int $0x80" : "=a"(ret) : "a"(nr), "b"(a), "c"(b), "d"(c) : "memory");
    return ret;
}
#endif

#define IOC(dir, type, nr, size) \
    (((unsigned long)(dir) << 30) | ((unsigned long)(size) << 16) | ((type) << 8) | (nr))

int main(void) {
    char buf[64] = {0};
    int fd = open("/", O_RDONLY | O_DIRECTORY);
    int tty = open("/dev/null", O_RDWR);

    report("keyctl", syscall(SYS_keyctl, 0 /* KEYCTL_GET_KEYRING_ID */, -3, 0));
    report("add_key", syscall(SYS_add_key, "user", "eb", "x", 1, -3 /* session */));
    report("request_key", syscall(SYS_request_key, "user", "eb", NULL, 0));
    report("bpf", syscall(SYS_bpf, 0 /* BPF_MAP_CREATE */, buf, 0));
    report("perf_event_open", syscall(SYS_perf_event_open, buf, 0, -1, -1, 0));
    report("userfaultfd", syscall(SYS_userfaultfd, O_CLOEXEC));
    report("io_uring_setup", syscall(SYS_io_uring_setup, 1, buf));
    report("unshare_newuser_newns", child_unshare(CLONE_NEWUSER | CLONE_NEWNS));
    report("unshare_newnet", child_unshare(CLONE_NEWNET));
    report("clone_newuser", raw_clone(CLONE_NEWUSER));
    report("clone_newpid", raw_clone(CLONE_NEWPID));
    report("clone3", syscall(SYS_clone3, buf, 64));
    report("mount", mount("none", "/tmp", "tmpfs", 0, NULL));
    report("umount2", umount2("/tmp", MNT_DETACH));
    report("pivot_root", syscall(SYS_pivot_root, "/", "/"));
    report("fsopen", syscall(SYS_fsopen, "tmpfs", 0));
    report("open_tree", syscall(SYS_open_tree, AT_FDCWD, "/", 1 /* OPEN_TREE_CLONE */));
    report("move_mount", syscall(SYS_move_mount, -1, "", -1, "", 0));
    report("setns", syscall(SYS_setns, fd, 0));
    report("kexec_load", syscall(SYS_kexec_load, 0, 0, NULL, 0));
    report("init_module", syscall(SYS_init_module, buf, 0, ""));
    report("finit_module", syscall(SYS_finit_module, -1, "", 0));
    /* The deny list matches type and number whatever the size: any plausible size will do. */
    report("ioctl_xfs_swapext", ioctl(fd, IOC(3, 'X', 109, 192), buf));
    report("ioctl_ext4_move_ext", ioctl(fd, IOC(3, 'f', 15, 40), buf));
    report("ioctl_ext4_swap_boot", ioctl(fd, IOC(0, 'f', 17, 0), buf));
    report("ioctl_tiocsti", ioctl(tty, TIOCSTI, "x"));
    /* The kernel truncates cmd to 32 bits: junk in the upper half must not get past. */
    report("ioctl_tiocsti_high", syscall(SYS_ioctl, tty, 0xAB00000000UL | TIOCSTI, "x"));
    report("ioctl_tioclinux", ioctl(tty, TIOCLINUX, buf));

#if defined(__x86_64__)
    /* The i386 ABI from this 64-bit process (int 0x80): the classic way around a filter that
     * only knows x86_64 numbers. Raw returns: -errno on failure. */
    long r32 = int80(288 /* i386 keyctl */, 0, -3, 0);
    errno = r32 < 0 ? (int)-r32 : 0;
    report("i386_keyctl", r32 < 0 ? -1 : r32);
    r32 = int80(310 /* i386 unshare */, CLONE_NEWUSER, 0, 0);
    errno = r32 < 0 ? (int)-r32 : 0;
    report("i386_unshare_newuser", r32 < 0 ? -1 : r32);
    r32 = int80(20 /* i386 getpid */, 0, 0, 0);
    errno = r32 < 0 ? (int)-r32 : 0;
    report("i386_getpid", r32 < 0 ? -1 : r32);
#endif

    /* Ordinary syscalls that must keep working. */
    report("ioctl_fionread", ioctl(tty, FIONREAD, buf) == 0 ? 0 : (errno == ENOTTY ? 0 : -1));
    int p[2];
    report("pipe", pipe(p));
    pid_t pid = fork();
    if (pid == 0) {
        execl("/bin/true", "true", (char *)NULL);
        _exit(127);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    report("fork_exec", pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : -1);
    report("clone_plain", raw_clone(0));
    report("unshare_files", unshare(CLONE_FILES));
    int s = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    long rc = s < 0 ? -1 : bind(s, (struct sockaddr *)&a, sizeof a);
    if (rc == 0)
        rc = listen(s, 1);
    if (rc == 0)
        rc = getsockname(s, (struct sockaddr *)&a, &alen);
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (rc == 0)
        rc = connect(c, (struct sockaddr *)&a, sizeof a);
    int acc = rc == 0 ? accept(s, NULL, NULL) : -1;
    if (rc == 0 && acc >= 0)
        rc = write(c, "ok", 2) == 2 && read(acc, buf, 2) == 2 && memcmp(buf, "ok", 2) == 0 ? 0 : -1;
    report("socket_loopback", rc);
    report("socket_vsock", socket(40 /* AF_VSOCK */, SOCK_STREAM, 0));
    return 0;
}
