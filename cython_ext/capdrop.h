/* Capabilities dropped in every thread of the process (ckptd.live.privilege). */
#ifndef CKPTD_CAPDROP_H
#define CKPTD_CAPDROP_H
#include <stdint.h>
/* keep: the capability bits kept in the permitted and effective sets, keep_bounding
   those kept in the bounding set;
   set_caps 0: only the bounding set and no_new_privs (a setuid follows and clears the
   rest); returns 0, or -errno of the first failure with *what naming the step and
   *tid the thread; *threads is the number of threads that applied it. */
int ckptd_drop_all_threads(uint64_t keep, uint64_t keep_bounding, int set_caps, int last_cap, int *threads,
                           int *tid, const char **what);
#endif
