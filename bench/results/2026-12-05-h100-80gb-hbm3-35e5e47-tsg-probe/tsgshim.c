// LD_PRELOAD probe: after each successful RM_ALLOC of a channel group (class 0xa06c, KEPLER_CHANNEL_GROUP_A),
// set its timeslice to $TSGSLICE_US with RM_CONTROL NVA06C_CTRL_CMD_SET_TIMESLICE (0xa06c0103) on the same fd,
// and log each allocation and the control's status to $TSGLOG.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/ioctl.h>

typedef int (*ioctl_fn)(int, unsigned long, ...);
static ioctl_fn real_ioctl;

struct nvos54 { uint32_t hClient, hObject, cmd, flags; uint64_t params; uint32_t paramsSize, status; };

static void logline(const char *fmt, ...) {
  const char *path = getenv("TSGLOG");
  if (!path) return;
  FILE *f = fopen(path, "a");
  if (!f) return;
  va_list ap; va_start(ap, fmt); vfprintf(f, fmt, ap); va_end(ap);
  fclose(f);
}

int ioctl(int fd, unsigned long req, ...) {
  va_list ap; va_start(ap, req); void *arg = va_arg(ap, void *); va_end(ap);
  if (!real_ioctl) real_ioctl = (ioctl_fn)dlsym(RTLD_NEXT, "ioctl");
  int ret = real_ioctl(fd, req, arg);
  unsigned nr = req & 0xff, size = (req >> 16) & 0x3fff, type = (req >> 8) & 0xff;
  if (ret == 0 && type == 'F' && nr == 0x2B && (size == 32 || size == 48) && arg) {
    uint32_t *h = (uint32_t *)arg;
    uint32_t status = *(uint32_t *)((char *)arg + (size == 32 ? 28 : 40));
    if (h[3] == 0xa06c && status == 0) {
      const char *us = getenv("TSGSLICE_US");
      if (us && *us) {
        uint64_t slice = strtoull(us, 0, 10);
        struct nvos54 c = {h[0], h[2], 0xa06c0103u, 0, (uint64_t)(uintptr_t)&slice, 8, 0};
        int r = real_ioctl(fd, 0xC020462Aul, &c);
        uint64_t back = 0;
        struct nvos54 g = {h[0], h[2], 0xa06c0104u, 0, (uint64_t)(uintptr_t)&back, 8, 0};
        int rg = real_ioctl(fd, 0xC020462Aul, &g);
        logline("pid %d tsg client %#x handle %#x parent %#x set %llu us: ioctl %d status %#x; get ioctl %d status %#x "
                "%llu us\n", getpid(), h[0], h[2], h[1], (unsigned long long)slice, r, c.status, rg, g.status,
                (unsigned long long)back);
      } else {
        logline("pid %d tsg client %#x handle %#x parent %#x default\n", getpid(), h[0], h[2], h[1]);
      }
    }
  }
  return ret;
}
