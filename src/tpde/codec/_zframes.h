/* What tpde.codec._zframes hands other extensions through its capsule `tpde.codec._zframes.api`. */
#ifndef TPDE_ZFRAMES_H
#define TPDE_ZFRAMES_H
#include <stddef.h>

#define ZFRAMES_API "tpde.codec._zframes.api"
enum { MAX_WHY = 160 };

typedef struct {
    /* Whether the system's zstd was found; nothing below may be called otherwise. */
    int (*found)(void);
    /* The calling thread's decompression context (made on first use, freed as the thread
     * ends); NULL where zstd could not make one. */
    void *(*context)(void);
    /* Frame `f` of `n` bytes into `dst`, exactly `want` bytes, its declared size checked
     * first: 0, or -1 with `why` (MAX_WHY bytes) filled. */
    int (*frame)(void *context, const char *f, size_t n, char *dst, size_t want, char *why);
} zframes_api;
#endif
