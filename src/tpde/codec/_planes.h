/* What tpde.codec._planes hands other extensions through its capsule `tpde.codec._planes.api`. */
#ifndef TPDE_PLANES_H
#define TPDE_PLANES_H
#include <Python.h>

#define PLANES_API "tpde.codec._planes.api"

typedef struct {
    /* Words of `width` bytes (1, 2, 4 or 8, aligned to it) from their byte planes (byte k of
     * word j is p[k][j]) into `rows`: stored (mode 0) or applied as a residual (1-5, as
     * _planes.join's modes). */
    void (*join)(int width, const unsigned char *const *p, Py_ssize_t m, unsigned char *rows,
                 int mode);
    /* Whether `p` may hold words of `width` bytes for those loops. */
    int (*fits)(const void *p, int width);
} planes_api;
#endif
