/* Byte planes and residuals of tpde.codec.frames and tpde.codec.transform, in C.
 *
 * A stream of byte planes holds byte k of every word in plane k, and a delta's words are a
 * residual against the reference's (docs/format.md, "Values"). numpy does each step as its
 * own pass: a strided byte copy per plane, and up to ten passes for a difference of floats'
 * order-preserving images. Here each is one loop over whole words, which compilers turn into
 * vector code, and the GIL is released for it, so the frame threads work side by side (not for
 * loops over fewer than RELEASE_BYTES: with other threads waiting, handing the GIL over and
 * taking it back cost more than a small record's whole loop):
 *
 *   take(rows, width, k, first, out)   byte k of words first.. of rows into out (a save's frame)
 *   join(parts, width, rows, mode)     words from their parts of all planes at once (a restore's
 *                                      slice, straight from the decompressed frames), stored, or
 *                                      applied as a residual to the words in rows
 *   diff(new, ref, width, out, mode, cap=0)  the residual of new against ref (mode 0: new
 *                                      itself); with cap, its byte planes all at once (a save's
 *                                      slice, or a batch's keyframe), plane k at out + k * cap
 *   apply(residual, width, rows, mode) a residual's words applied to rows
 *   changed(new, ref, width, out=None) how many words differ, and where (a sparse delta)
 *   apply_at(residual, width, rows, positions)  a sparse delta's XOR residual applied to the
 *                                      words at its positions
 *
 * A capsule, tpde.codec._planes.api (struct planes_api, in _planes.h), hands the join to
 * tpde.codec._rebuild, which rebuilds a mounted module's words on threads that never hold the GIL.
 *
 * rows, out and the words are contiguous bytes, bounds-checked; the word loops need words
 * aligned to their width on a little-endian host (tpde.codec.frames.native_words checks before it
 * calls them, and numpy's path takes the others). Modes: 0 store, 1 XOR, 2 the zigzagged
 * difference of the order-preserving integer images of floats, 3 that of integers; join and
 * apply also take 4 and 5, modes 2 and 3 undone (the words before a difference, from the words
 * after it: a re-base takes a step's words back from the step after it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_capsule.h"
#include "_planes.h"

#define RELEASE_BYTES (64 * 1024)
/* The GIL released around a loop over at least RELEASE_BYTES, and taken back after it. */
#define RELEASE_FOR(bytes) { PyThreadState *_held = (bytes) >= RELEASE_BYTES ? PyEval_SaveThread() : NULL;
#define RELEASED_END if (_held) PyEval_RestoreThread(_held); }

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define WORDS_ARE_LITTLE 1
#else
#define WORDS_ARE_LITTLE 0
#endif

/* The word loops are inlined into one entry per job (take_words, join_words, ...). Where GCC
 * can build a function for several instruction sets and pick one as the module loads
 * (target_clones; GCC 12 on, x86-64 with glibc), each entry is built for x86-64-v4 (AVX-512),
 * x86-64-v3 (AVX2) and the baseline (SSE2), so that a build for any x86-64 runs the widest
 * vectors the CPU has. benchmarks/planes_bench.py builds both (TPDE_ONE_TARGET leaves the
 * clones out) and times them: on a slice of words that stays in the cache, as a save's and a
 * restore's are, the widest vectors join, split and take planes markedly faster; from memory
 * the gain is smaller (figures: benchmarks/README.md). */
#if defined(__GNUC__)
#define LOOP static inline __attribute__((always_inline))
#else
#define LOOP static inline
#endif
#if defined(__GNUC__) && __GNUC__ >= 12 && !defined(__clang__) && defined(__x86_64__) && \
    defined(__GLIBC__) && defined(__has_attribute) && !defined(TPDE_ONE_TARGET)
#if __has_attribute(target_clones)
#define WIDE __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
#endif
#ifndef WIDE
#define WIDE
#endif

enum { STORE = 0, XOR = 1, SUB_FLOAT = 2, SUB_INT = 3, UNSUB_FLOAT = 4, UNSUB_INT = 5 };
enum { SPLIT_BLOCK = 1024 };  /* words of a residual worked out at once when split into planes */

#define WORDS(T, S, W)                                                                      \
    LOOP void take_##W(const unsigned char *rows, int k, Py_ssize_t m, unsigned char *out) { \
        const T *w = (const T *)rows;                                                       \
        const int s = 8 * k;                                                                \
        for (Py_ssize_t j = 0; j < m; j++) out[j] = (unsigned char)(w[j] >> s);             \
    }                                                                                       \
    LOOP T order_##W(T x) { return (T)(x ^ (T)((T)((S)x >> (8 * W - 1)) >> 1)); }           \
    LOOP T zig_##W(T d) { return (T)((T)(d << 1) ^ (T)((S)d >> (8 * W - 1))); }             \
    LOOP T unzig_##W(T r) { return (T)((r >> 1) ^ (T)(0 - (r & 1))); }                      \
    LOOP T applied_##W(T w, T r, int mode) {                                                \
        switch (mode) {                                                                     \
        case STORE: return r;                                                               \
        case XOR: return w ^ r;                                                             \
        case SUB_FLOAT: return order_##W((T)(order_##W(w) + unzig_##W(r)));                 \
        case UNSUB_FLOAT: return order_##W((T)(order_##W(w) - unzig_##W(r)));               \
        case UNSUB_INT: return (T)(w - unzig_##W(r));                                       \
        default: return (T)(w + unzig_##W(r));                                              \
        }                                                                                   \
    }                                                                                       \
    /* Each word is built in a register from its planes and stored whole: a slice of words \
     * is written in one pass (a plane at a time, every store would read and write back the \
     * words' cache lines once per plane), and a residual is applied in the same pass. One \
     * loop per mode (the mode is a constant in each), so that it is not tested per word. */ \
    LOOP T joined_##W(const unsigned char *const *planes, Py_ssize_t m,                     \
                      Py_ssize_t j) {                                                       \
        T v = 0;                                                                            \
        for (int k = W - 1; k >= 0; k--) v = (T)((v << 8) | planes[k][j]);                  \
        return v;                                                                           \
    }                                                                                       \
    LOOP void join_##W(const unsigned char *const *planes, Py_ssize_t m, unsigned char *rows, \
                       int mode) {                                                          \
        T *w = (T *)rows;                                                                   \
        Py_ssize_t j;                                                                       \
        switch (mode) {                                                                     \
        case STORE: for (j = 0; j < m; j++) w[j] = joined_##W(planes, m, j); break;         \
        case XOR: for (j = 0; j < m; j++) w[j] ^= joined_##W(planes, m, j); break;          \
        case SUB_FLOAT:                                                                     \
            for (j = 0; j < m; j++) w[j] = applied_##W(w[j], joined_##W(planes, m, j), SUB_FLOAT); \
            break;                                                                          \
        case UNSUB_FLOAT:                                                                   \
            for (j = 0; j < m; j++) w[j] = applied_##W(w[j], joined_##W(planes, m, j), UNSUB_FLOAT); \
            break;                                                                          \
        case UNSUB_INT:                                                                     \
            for (j = 0; j < m; j++) w[j] = applied_##W(w[j], joined_##W(planes, m, j), UNSUB_INT); \
            break;                                                                          \
        default:                                                                            \
            for (j = 0; j < m; j++) w[j] = applied_##W(w[j], joined_##W(planes, m, j), SUB_INT); \
        }                                                                                   \
    }                                                                                       \
    LOOP void apply_##W(const unsigned char *residual, Py_ssize_t m, unsigned char *rows,   \
                        int mode) {                                                         \
        T *w = (T *)rows;                                                                   \
        const T *r = (const T *)residual;                                                   \
        Py_ssize_t j;                                                                       \
        switch (mode) {                                                                     \
        case XOR: for (j = 0; j < m; j++) w[j] ^= r[j]; break;                              \
        case SUB_FLOAT: for (j = 0; j < m; j++) w[j] = applied_##W(w[j], r[j], SUB_FLOAT); break; \
        case UNSUB_FLOAT: for (j = 0; j < m; j++) w[j] = applied_##W(w[j], r[j], UNSUB_FLOAT); break; \
        case UNSUB_INT: for (j = 0; j < m; j++) w[j] = applied_##W(w[j], r[j], UNSUB_INT); break; \
        default: for (j = 0; j < m; j++) w[j] = applied_##W(w[j], r[j], SUB_INT);           \
        }                                                                                   \
    }                                                                                       \
    /* Counted in blocks, with a counter as wide as the words (the widest a vector unit adds \
     * without widening): a block is at most the counter's largest value. */               \
    LOOP Py_ssize_t count_##W(const unsigned char *new_, const unsigned char *ref_,         \
                              Py_ssize_t m) {                                               \
        const T *a = (const T *)new_, *b = (const T *)ref_;                                 \
        const Py_ssize_t most = sizeof(T) >= 4 ? (Py_ssize_t)1 << 30 : (Py_ssize_t)(T)~(T)0; \
        Py_ssize_t c = 0;                                                                   \
        for (Py_ssize_t lo = 0; lo < m; lo += most) {                                       \
            const Py_ssize_t hi = m - lo < most ? m : lo + most;                            \
            T block = 0;                                                                    \
            for (Py_ssize_t j = lo; j < hi; j++) block = (T)(block + (a[j] != b[j]));       \
            c += (Py_ssize_t)block;                                                         \
        }                                                                                   \
        return c;                                                                           \
    }                                                                                       \
    /* A residual's words, each one's bytes to their planes (plane k at out + k * cap), in \
     * one pass over new and ref: the residual is worked out a block at a time on the stack \
     * first (each loop vectorizes on its own, which runs faster than one fused            \
     * loop). */                                                                           \
    LOOP void spread_##W(const T *w, Py_ssize_t m, unsigned char *out, Py_ssize_t cap) {    \
        for (Py_ssize_t j = 0; j < m; j++)                                                  \
            for (int k = 0; k < W; k++) out[k * cap + j] = (unsigned char)(w[j] >> (8 * k)); \
    }                                                                                       \
    /* 64 words at a time: which of them changed, as the bits of a mask (flags the compiler \
     * vectorizes, packed 8 at a time by a multiply), then one position per set bit: no     \
     * branch per word, where a changed word is least predictable (faster than writing      \
     * every word's position and moving on only where it changed). With `planes`, the      \
     * changed words' XOR residual goes to its byte planes too (plane k at planes + k *     \
     * room), in the same pass: a sparse coding's values                                     \
     * without gathering the changed words of both first. At most `room` are found. */    \
    LOOP Py_ssize_t where_##W(const unsigned char *new_, const unsigned char *ref_,         \
                              Py_ssize_t m, int64_t *out, Py_ssize_t room,                  \
                              unsigned char *planes) {                                      \
        const T *a = (const T *)new_, *b = (const T *)ref_;                                 \
        Py_ssize_t c = 0;                                                                   \
        for (Py_ssize_t j = 0; j < m; j += 64) {                                            \
            uint64_t mask = 0;                                                              \
            if (m - j >= 64) {                                                              \
                unsigned char ne[64];                                                       \
                uint64_t eight;                                                             \
                for (int k = 0; k < 64; k++) ne[k] = a[j + k] != b[j + k];                  \
                for (int k = 0; k < 8; k++) {                                               \
                    memcpy(&eight, ne + 8 * k, 8);                                          \
                    mask |= ((eight * 0x0102040810204080ULL) >> 56) << (8 * k);             \
                }                                                                           \
            } else {                                                                        \
                for (Py_ssize_t k = 0; k < m - j; k++)                                      \
                    mask |= (uint64_t)(a[j + k] != b[j + k]) << k;                          \
            }                                                                               \
            if (__builtin_popcountll(mask) > room - c) return -1;                           \
            for (; mask; mask &= mask - 1, c++) {                                           \
                Py_ssize_t at = j + __builtin_ctzll(mask);                                  \
                out[c] = (int64_t)at;                                                       \
                if (planes) {                                                               \
                    T x = (T)(a[at] ^ b[at]);                                               \
                    spread_##W(&x, 1, planes + c, room);                                    \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
        return c;                                                                           \
    }                                                                                       \
    LOOP void diff_##W(const unsigned char *new_, const unsigned char *ref_, Py_ssize_t m,  \
                       unsigned char *out, int mode);                                       \
    LOOP void split_##W(const unsigned char *new_, const unsigned char *ref_, Py_ssize_t m, \
                        unsigned char *out, Py_ssize_t cap, int mode) {                     \
        T block[SPLIT_BLOCK];                                                               \
        if (mode == STORE) { /* the words' own planes: nothing to work out first */         \
            spread_##W((const T *)new_, m, out, cap);                                       \
            return;                                                                         \
        }                                                                                   \
        for (Py_ssize_t lo = 0; lo < m; lo += SPLIT_BLOCK) {                                \
            const Py_ssize_t n = m - lo < SPLIT_BLOCK ? m - lo : SPLIT_BLOCK;               \
            diff_##W(new_ + lo * W, ref_ + lo * W, n, (unsigned char *)block, mode);        \
            spread_##W(block, n, out + lo, cap);                                            \
        }                                                                                   \
    }                                                                                       \
    LOOP void diff_##W(const unsigned char *new_, const unsigned char *ref_, Py_ssize_t m,  \
                       unsigned char *out, int mode) {                                      \
        const T *a = (const T *)new_, *b = (const T *)ref_;                                 \
        T *o = (T *)out;                                                                    \
        Py_ssize_t j;                                                                       \
        if (mode == STORE)                                                                  \
            memcpy(o, a, (size_t)m * W);                                                    \
        else if (mode == XOR)                                                               \
            for (j = 0; j < m; j++) o[j] = a[j] ^ b[j];                                     \
        else if (mode == SUB_FLOAT)                                                         \
            for (j = 0; j < m; j++) o[j] = zig_##W((T)(order_##W(a[j]) - order_##W(b[j]))); \
        else                                                                                \
            for (j = 0; j < m; j++) o[j] = zig_##W((T)(a[j] - b[j]));                       \
    }
WORDS(uint8_t, int8_t, 1)
WORDS(uint16_t, int16_t, 2)
WORDS(uint32_t, int32_t, 4)
WORDS(uint64_t, int64_t, 8)

#define BY_WIDTH(width, call)                                                               \
    switch (width) {                                                                        \
    case 1: call(1); break;                                                                 \
    case 2: call(2); break;                                                                 \
    case 4: call(4); break;                                                                 \
    default: call(8);                                                                       \
    }

WIDE static void take_words(int width, const unsigned char *r, int k, Py_ssize_t m,
                            unsigned char *o) {
#define TAKE(W) take_##W(r, k, m, o)
    BY_WIDTH(width, TAKE)
}

WIDE static void join_words(int width, const unsigned char *const *p, Py_ssize_t m,
                            unsigned char *r, int mode) {
#define JOIN(W) join_##W(p, m, r, mode)
    BY_WIDTH(width, JOIN)
}

WIDE static void apply_words(int width, const unsigned char *p, Py_ssize_t m, unsigned char *r,
                             int mode) {
#define APPLY(W) apply_##W(p, m, r, mode)
    BY_WIDTH(width, APPLY)
}

WIDE static void split_words(int width, const unsigned char *pa, const unsigned char *pb,
                             Py_ssize_t m, unsigned char *o, Py_ssize_t cap, int mode) {
#define SPLIT(W) split_##W(pa, pb, m, o, cap, mode)
    BY_WIDTH(width, SPLIT)
}

WIDE static void diff_words(int width, const unsigned char *pa, const unsigned char *pb,
                            Py_ssize_t m, unsigned char *o, int mode) {
#define DIFF(W) diff_##W(pa, pb, m, o, mode)
    BY_WIDTH(width, DIFF)
}

WIDE static Py_ssize_t count_words(int width, const unsigned char *pa, const unsigned char *pb,
                                   Py_ssize_t m) {
    Py_ssize_t c;
#define COUNT(W) c = count_##W(pa, pb, m)
    BY_WIDTH(width, COUNT)
    return c;
}

WIDE static Py_ssize_t where_words(int width, const unsigned char *pa, const unsigned char *pb,
                                   Py_ssize_t m, int64_t *o, Py_ssize_t room, unsigned char *p) {
    Py_ssize_t c;
#define WHERE(W) c = where_##W(pa, pb, m, o, room, p)
    BY_WIDTH(width, WHERE)
    return c;
}

static int words_fit(const void *p, int width) {
    return width == 1 || (WORDS_ARE_LITTLE && (width == 2 || width == 4 || width == 8) &&
                          (uintptr_t)p % (uintptr_t)width == 0);
}

static int fail(const char *why) {
    PyErr_SetString(PyExc_ValueError, why);
    return -1;
}

/* Words of `width` bytes in `b`, as many bytes in `a`, a mode in range. */
static int check_words(Py_buffer *a, Py_buffer *b, int width, int mode, int lowest,
                       int highest) {
    if (mode < lowest || mode > highest) return fail("no such residual");
    if (a->len != b->len || b->len % (width > 0 ? width : 1)) return fail("words differ in size");
    if (!words_fit(b->buf, width) || !words_fit(a->buf, width))
        return fail("words not aligned to a width of 1, 2, 4 or 8 bytes on a little-endian host");
    return 0;
}

static PyObject *take(PyObject *self, PyObject *args) {
    Py_buffer rows, out;
    int width, k;
    Py_ssize_t first;
    if (!PyArg_ParseTuple(args, "y*iinw*", &rows, &width, &k, &first, &out)) return NULL;
    int bad = 0;
    if (width < 1 || k < 0 || k >= width) bad = fail("plane out of range of the word width");
    else if (rows.len % width || first < 0 || first > rows.len / width ||
             out.len > rows.len / width - first)
        bad = fail("plane bytes out of range of the words");
    if (!bad) {
        const unsigned char *r = (const unsigned char *)rows.buf + first * width;
        unsigned char *o = (unsigned char *)out.buf;
        Py_ssize_t m = out.len;
        RELEASE_FOR(m * width)
        if (words_fit(r, width)) {
            take_words(width, r, k, m, o);
        } else {  /* a byte loop: unaligned words, or another width */
            for (Py_ssize_t j = 0; j < m; j++) o[j] = r[j * width + k];
        }
        RELEASED_END
    }
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

static PyObject *join(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_buffer rows, parts[8];
    const unsigned char *p[8];
    int width, mode, got = 0, bad = 0;
    if (!PyArg_ParseTuple(args, "Oiw*i", &seq, &width, &rows, &mode)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "parts must be a sequence of byte buffers");
    if (fast == NULL) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    Py_ssize_t m = 0;
    if (mode < STORE || mode > UNSUB_INT) bad = fail("no such residual");
    else if (!words_fit(rows.buf, width))
        bad = fail("words not aligned to a width of 1, 2, 4 or 8 bytes on a little-endian host");
    else if (PySequence_Fast_GET_SIZE(fast) != width || rows.len % width)
        bad = fail("one part of each plane is needed");
    else
        m = rows.len / width;
    for (; !bad && got < width; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &parts[got],
                               PyBUF_SIMPLE) < 0) {
            bad = -1;
            break;
        }
        p[got] = (const unsigned char *)parts[got].buf;
        if (parts[got].len != m) bad = fail("a plane's part differs in size from the words");
    }
    if (!bad) {
        unsigned char *r = (unsigned char *)rows.buf;
        RELEASE_FOR(rows.len)
        join_words(width, p, m, r, mode);
        RELEASED_END
    }
    for (int k = 0; k < got; k++) PyBuffer_Release(&parts[k]);
    Py_DECREF(fast);
    PyBuffer_Release(&rows);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

static PyObject *apply(PyObject *self, PyObject *args) {
    Py_buffer residual, rows;
    int width, mode;
    if (!PyArg_ParseTuple(args, "y*iw*i", &residual, &width, &rows, &mode)) return NULL;
    int bad = check_words(&residual, &rows, width, mode, XOR, UNSUB_INT);
    if (!bad) {
        const unsigned char *p = (const unsigned char *)residual.buf;
        unsigned char *r = (unsigned char *)rows.buf;
        Py_ssize_t m = rows.len / width;
        RELEASE_FOR(rows.len)
        apply_words(width, p, m, r, mode);
        RELEASED_END
    }
    PyBuffer_Release(&residual);
    PyBuffer_Release(&rows);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

/* diff(new, ref, width, out, mode, cap=0): the residual's words (mode 0: new's own) into out;
 * with cap, their byte planes, plane k at out + k * cap (a save's slice, split as it is worked
 * out, or a keyframe's planes). */
static PyObject *diff(PyObject *self, PyObject *args) {
    Py_buffer a, b, out;
    int width, mode;
    Py_ssize_t cap = 0;
    if (!PyArg_ParseTuple(args, "y*y*iw*i|n", &a, &b, &width, &out, &mode, &cap)) return NULL;
    int bad = check_words(&a, &b, width, mode, STORE, SUB_INT);
    Py_ssize_t m = bad ? 0 : a.len / width;
    if (!bad && !cap)
        bad = check_words(&a, &out, width, mode, STORE, SUB_INT);
    else if (!bad && (cap < m || cap > out.len / width || out.len < cap * width))
        bad = fail("planes out of range of the words");
    if (!bad) {
        const unsigned char *pa = (const unsigned char *)a.buf;
        const unsigned char *pb = (const unsigned char *)b.buf;
        unsigned char *o = (unsigned char *)out.buf;
        RELEASE_FOR(a.len)
        if (cap) {
            split_words(width, pa, pb, m, o, cap, mode);
        } else {
            diff_words(width, pa, pb, m, o, mode);
        }
        RELEASED_END
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&out);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

/* changed(new, ref, width, out=None, planes=None) -> int: how many words differ; with out
 * (int64, room for them), their positions too; with planes as well (width bytes per position
 * out has room for), the XOR residual of those words as byte planes, plane k at
 * planes[k * room:]. A sparse delta's positions and values without a mask of the tensor's size
 * made, counted and searched in three passes, nor its changed words gathered. */
static PyObject *changed(PyObject *self, PyObject *args) {
    Py_buffer a, b, out = {0}, pl = {0};
    int width;
    PyObject *where = Py_None, *planes = Py_None;
    if (!PyArg_ParseTuple(args, "y*y*i|OO", &a, &b, &width, &where, &planes)) return NULL;
    int bad = check_words(&a, &b, width, XOR, XOR, XOR);
    Py_ssize_t c = 0, m = width > 0 ? b.len / width : 0;
    if (!bad && where != Py_None) {
        if (PyObject_GetBuffer(where, &out, PyBUF_WRITABLE) < 0) bad = -1;
        else if (out.len % 8 || ((uintptr_t)out.buf) % 8) bad = fail("positions must be int64");
    }
    if (!bad && planes != Py_None) {
        if (where == Py_None) bad = fail("planes need positions beside them");
        else if (PyObject_GetBuffer(planes, &pl, PyBUF_WRITABLE) < 0) bad = -1;
        else if (pl.len != (out.len / 8) * width)
            bad = fail("planes must hold width bytes per position there is room for");
    }
    if (!bad) {
        const unsigned char *pa = (const unsigned char *)a.buf;
        const unsigned char *pb = (const unsigned char *)b.buf;
        int64_t *o = (int64_t *)out.buf;
        unsigned char *p = (unsigned char *)pl.buf;
        Py_ssize_t room = out.len / 8;
        RELEASE_FOR(b.len)
        if (where == Py_None) {
            c = count_words(width, pa, pb, m);
        } else {
            c = where_words(width, pa, pb, m, o, room, p);
        }
        RELEASED_END
        if (c < 0) bad = fail("more words changed than there is room for");
    }
    if (pl.obj) PyBuffer_Release(&pl);
    if (out.obj) PyBuffer_Release(&out);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    if (bad) return NULL;
    return PyLong_FromSsize_t(c);
}

/* A residual's words XORed into rows at their positions, which are checked first: no word
 * changes unless all of them lie in rows. numpy's `rows[at] ^= residual` gathers, XORs and
 * scatters in passes of their own; this is one pass. */
#define XOR_AT(T)                                                                    \
    {                                                                                \
        T *w = (T *)r;                                                               \
        const T *v = (const T *)x;                                                   \
        for (Py_ssize_t j = 0; j < count; j++) w[at[j]] ^= v[j];                     \
    }

static PyObject *apply_at(PyObject *self, PyObject *args) {
    Py_buffer residual, rows, where;
    int width;
    if (!PyArg_ParseTuple(args, "y*iw*y*", &residual, &width, &rows, &where)) return NULL;
    int bad = 0;
    Py_ssize_t count = where.len / 8;
    if (!words_fit(rows.buf, width) || !words_fit(residual.buf, width))
        bad = fail("words not aligned to a width of 1, 2, 4 or 8 bytes on a little-endian host");
    else if (where.len % 8 || ((uintptr_t)where.buf) % 8) bad = fail("positions must be int64");
    else if (residual.len != count * width || rows.len % width)
        bad = fail("a residual word is needed for each position");
    if (!bad) {
        const int64_t *at = (const int64_t *)where.buf;
        const unsigned char *x = (const unsigned char *)residual.buf;
        unsigned char *r = (unsigned char *)rows.buf;
        uint64_t m = (uint64_t)(rows.len / width), outside = 0;
        RELEASE_FOR(count * 8)
        for (Py_ssize_t j = 0; j < count; j++) outside |= (uint64_t)at[j] >= m;
        if (!outside) {
            switch (width) {
            case 1: XOR_AT(uint8_t) break;
            case 2: XOR_AT(uint16_t) break;
            case 4: XOR_AT(uint32_t) break;
            default: XOR_AT(uint64_t) break;
            }
        }
        RELEASED_END
        if (outside) bad = fail("a position lies outside the words");
    }
    PyBuffer_Release(&residual);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&where);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"changed", changed, METH_VARARGS,
     "changed(new, ref, width, out=None, planes=None): how many words differ (and where, into "
     "out; and their XOR residual's byte planes, into planes)."},
    {"take", take, METH_VARARGS,
     "take(rows, width, k, first, out): byte k of words first.. of rows into out."},
    {"join", join, METH_VARARGS,
     "join(parts, width, rows, mode): words from a part of each of their byte planes (byte k "
     "of word j is parts[k][j]), stored (mode 0) or applied to rows as a residual (modes 1-3; "
     "4-5 undo 2-3)."},
    {"diff", diff, METH_VARARGS,
     "diff(new, ref, width, out, mode, cap=0): the residual (modes 1-3) of new against ref "
     "(mode 0: new itself); with cap, as byte planes, plane k at out[k * cap:]."},
    {"apply", apply, METH_VARARGS,
     "apply(residual, width, rows, mode): a residual's words (modes 1-3) applied to rows "
     "(4-5: modes 2-3 undone)."},
    {"apply_at", apply_at, METH_VARARGS,
     "apply_at(residual, width, rows, positions): residual word j XORed into word "
     "positions[j] of rows."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_planes",
                                    "Byte planes and residuals in C (see tpde.codec.frames).", -1,
                                    methods};

static const planes_api api = {join_words, words_fit};

PyMODINIT_FUNC PyInit__planes(void) {
    return module_with_api(&module, &api, PLANES_API);
}
