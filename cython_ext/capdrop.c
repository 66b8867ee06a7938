/* Capabilities are per thread in Linux (capset(2), PR_CAPBSET_DROP and no_new_privs act
 * on the calling thread only), so a drop in one thread leaves the others' untouched.
 * ckptd_drop_all_threads applies the same drop in every thread: a real-time signal is
 * sent to each other thread (tgkill), whose handler makes the raw system calls (all
 * async-signal-safe) and reports back through atomics; then the calling thread. The
 * task list is read again until a pass finds no thread left to do, so a thread started
 * meanwhile by a thread not yet dropped is caught too (a thread started by a dropped
 * one inherits the dropped sets). */
#define _GNU_SOURCE
#include "capdrop.h"
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <linux/capability.h>

#define MAX_THREADS 4096

static uint64_t g_keep, g_keep_bnd;
static int g_set_caps, g_last_cap;
static volatile int g_done, g_err, g_err_tid;
static const char *volatile g_what;

static int apply_here(const char **what) {
    for (int cap = 0; cap <= g_last_cap; cap++) {
        if (g_keep_bnd & (1ULL << cap))
            continue;
        if (prctl(PR_CAPBSET_READ, cap, 0, 0, 0) != 1)
            continue;  /* not there (or unknown to this kernel) */
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0) {
            *what = "drop a capability from the bounding set";
            return -errno;
        }
    }
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);  /* EINVAL on old kernels */
    if (g_set_caps) {
        struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
        struct __user_cap_data_struct d[2];
        memset(d, 0, sizeof d);
        d[0].effective = d[0].permitted = (uint32_t)g_keep;
        d[1].effective = d[1].permitted = (uint32_t)(g_keep >> 32);
        if (syscall(SYS_capset, &h, d) != 0) {
            *what = "capset";
            return -errno;
        }
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
        *what = "set no_new_privs";
        return -errno;
    }
    return 0;
}

static void handler(int sig, siginfo_t *si, void *uc) {
    (void)sig; (void)si; (void)uc;
    int saved = errno;
    const char *what = 0;
    int r = apply_here(&what);
    if (r && !__atomic_load_n(&g_err, __ATOMIC_SEQ_CST)) {
        g_what = what;
        g_err_tid = (int)syscall(SYS_gettid);
        __atomic_store_n(&g_err, r, __ATOMIC_SEQ_CST);
    }
    __atomic_add_fetch(&g_done, 1, __ATOMIC_SEQ_CST);
    errno = saved;
}

static int contains(const int *xs, int n, int x) {
    for (int i = 0; i < n; i++)
        if (xs[i] == x)
            return 1;
    return 0;
}

int ckptd_drop_all_threads(uint64_t keep, uint64_t keep_bounding, int set_caps, int last_cap, int *threads,
                           int *tid, const char **what) {
    static int done_tids[MAX_THREADS];
    int ndone = 0, self = (int)syscall(SYS_gettid), pid = getpid(), sig = SIGRTMIN + 3;
    struct sigaction sa, old;
    g_keep = keep; g_keep_bnd = keep_bounding; g_set_caps = set_caps; g_last_cap = last_cap > 63 ? 63 : last_cap;
    g_done = 0; g_err = 0; g_err_tid = 0; g_what = 0;
    *threads = 0; *tid = self; *what = "";
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = handler;
    sa.sa_flags = SA_SIGINFO | SA_RESTART;
    sigfillset(&sa.sa_mask);
    if (sigaction(sig, &sa, &old) != 0) {
        *what = "install the signal handler";
        return -errno;
    }
    int r = 0;
    for (int pass = 0; pass < 64 && !r; pass++) {
        DIR *d = opendir("/proc/self/task");
        if (!d) { r = -errno; *what = "list /proc/self/task"; break; }
        int sent = 0;
        struct dirent *e;
        while ((e = readdir(d)) != 0 && !r) {
            int t = atoi(e->d_name);
            if (t <= 0 || t == self || contains(done_tids, ndone, t))
                continue;
            if (ndone >= MAX_THREADS) { r = -E2BIG; *what = "count threads"; break; }
            int before = __atomic_load_n(&g_done, __ATOMIC_SEQ_CST);
            if (syscall(SYS_tgkill, pid, t, sig) != 0) {
                if (errno == ESRCH) continue;  /* it has just ended */
                r = -errno; *what = "signal a thread"; *tid = t; break;
            }
            done_tids[ndone++] = t;
            sent++;
            /* wait for its handler: 5 s (a thread blocking the signal never answers) */
            struct timespec ts = {0, 200000};
            int waited = 0;
            while (__atomic_load_n(&g_done, __ATOMIC_SEQ_CST) == before && waited < 25000) {
                char path[64];
                nanosleep(&ts, 0);
                waited++;
                if (waited % 500 == 0) {  /* ended without answering? */
                    snprintf(path, sizeof path, "/proc/self/task/%d", t);
                    if (access(path, F_OK) != 0) break;
                }
            }
            if (__atomic_load_n(&g_done, __ATOMIC_SEQ_CST) == before) {
                char path[64];
                snprintf(path, sizeof path, "/proc/self/task/%d", t);
                if (access(path, F_OK) == 0) {
                    r = -ETIMEDOUT; *what = "reach a thread (it blocks the signal)"; *tid = t;
                }
            }
            if (__atomic_load_n(&g_err, __ATOMIC_SEQ_CST)) {
                r = g_err; *what = g_what; *tid = g_err_tid;
            }
        }
        closedir(d);
        if (!sent)
            break;
    }
    if (!r) {
        r = apply_here(what);
        *tid = self;
    }
    *threads = __atomic_load_n(&g_done, __ATOMIC_SEQ_CST) + (r ? 0 : 1);
    sigaction(sig, &old, 0);
    return r;
}
