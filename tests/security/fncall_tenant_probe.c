/* What one FnCall tenant tries to leave for the next (tests/security/test_fncall_tenants.py):
 * the channels busybox cannot reach. Each attempt prints "NAME RC ERRNO" (ERRNO 0 when
 * RC >= 0); a refused attempt is fine, the test only asserts the next call sees nothing.
 *
 *   probe plant   — SysV shm/sem/msg, a POSIX queue (mq_open), a key, an abstract unix
 *                   socket held by a background process, and PID 1's rlimits and scheduling
 *                   policy changed from outside (prlimit64/sched_setscheduler on pid 1). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

static void report(const char *name, long rc) {
    printf("%s %ld %d\n", name, rc, rc < 0 ? errno : 0);
    fflush(stdout);
}

static long abstract_socket(void) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    const char name[] = "\0envbuild-fncall-leak";
    memcpy(addr.sun_path, name, sizeof name - 1);
    if (bind(fd, (struct sockaddr *)&addr, sizeof(sa_family_t) + sizeof name - 1) < 0)
        return -1;
    if (listen(fd, 1) < 0)
        return -1;
    if (fork() == 0) { /* holds the socket after the call's command exits */
        setsid();
        sleep(300);
        _exit(0);
    }
    return 0;
}

int main(void) {
    report("shmget", syscall(SYS_shmget, 0x4c45414b, 4096, 01666));
    report("semget", syscall(SYS_semget, 0x4c45414b, 1, 01666));
    report("msgget", syscall(SYS_msgget, 0x4c45414b, 01666));
    report("mq_open", syscall(SYS_mq_open, "leak", O_CREAT | O_RDWR, 0666, NULL));
    report("add_key", syscall(SYS_add_key, "user", "leak", "x", 1, -3 /* session */));
    report("abstract_socket", abstract_socket());
    struct rlimit low = {.rlim_cur = 77, .rlim_max = 77};
    report("prlimit_pid1_nofile", syscall(SYS_prlimit64, 1, RLIMIT_NOFILE, &low, NULL));
    struct rlimit core = {.rlim_cur = 0, .rlim_max = 0};
    report("prlimit_pid1_core", syscall(SYS_prlimit64, 1, RLIMIT_CORE, &core, NULL));
    struct sched_param param = {.sched_priority = 0};
    report("sched_setscheduler_pid1", sched_setscheduler(1, SCHED_BATCH, &param));
    return 0;
}
