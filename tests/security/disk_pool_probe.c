/* Issue 39 item 2: what root in a sandbox can do to its disk cap on the node's btrfs pool.
 * Usage: disk_pool_probe DIR. Prints "name errno" per attempt (0: it worked):
 *   subvol      BTRFS_IOC_SUBVOL_CREATE DIR/esc (a subvolume: a quota group of its own?)
 *   nested_mib  MiB written into DIR/esc/big before a write failed (if subvol worked)
 *   limit       BTRFS_IOC_QGROUP_LIMIT on DIR's own group, clearing its limit
 *   quota_off   BTRFS_IOC_QUOTA_CTL disable
 *   projid      FS_IOC_FSSETXATTR: a new project id on DIR/p (chattr -p) */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>
#include <linux/fs.h>

struct vol_args { int64_t fd; char name[4088]; };
struct qgroup_limit_args { uint64_t qgroupid, flags, max_rfer, max_excl, rsv_rfer, rsv_excl; };
struct quota_ctl_args { uint64_t cmd, status; };
#define SUBVOL_CREATE _IOW(0x94, 14, struct vol_args)
#define QGROUP_LIMIT _IOR(0x94, 43, struct qgroup_limit_args)
#define QUOTA_CTL _IOWR(0x94, 40, struct quota_ctl_args)

static int attempt(int rc) { return rc < 0 ? errno : 0; }

int main(int argc, char **argv) {
    if (argc != 2) return 2;
    char path[4096];
    int dir = open(argv[1], O_RDONLY | O_DIRECTORY);
    if (dir < 0) { perror("open"); return 2; }
    struct vol_args va; memset(&va, 0, sizeof va); strcpy(va.name, "esc");
    int e = attempt(ioctl(dir, SUBVOL_CREATE, &va));
    printf("subvol %d\n", e);
    if (e == 0) {
        snprintf(path, sizeof path, "%s/esc/big", argv[1]);
        int f = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        static char buf[1 << 20];
        memset(buf, 'x', sizeof buf);
        int mib = 0;
        while (f >= 0 && mib < 512 && write(f, buf, sizeof buf) == (ssize_t)sizeof buf) mib++;
        if (f >= 0) close(f);
        printf("nested_mib %d\n", mib);
    }
    struct qgroup_limit_args la = {0, 3, ~0ULL, ~0ULL, 0, 0};
    printf("limit %d\n", attempt(ioctl(dir, QGROUP_LIMIT, &la)));
    struct quota_ctl_args qa = {2, 0};
    printf("quota_off %d\n", attempt(ioctl(dir, QUOTA_CTL, &qa)));
    snprintf(path, sizeof path, "%s/p", argv[1]);
    int p = open(path, O_RDONLY | O_CREAT, 0644);
    struct fsxattr fa; memset(&fa, 0, sizeof fa);
    e = attempt(ioctl(p, FS_IOC_FSGETXATTR, &fa));
    if (e == 0) { fa.fsx_projid = 4242; e = attempt(ioctl(p, FS_IOC_FSSETXATTR, &fa)); }
    printf("projid %d\n", e);
    return 0;
}
