/* Records rebuilt in one call, outside the GIL: a mounted module's, or a restore's batch.
 *
 * A mount at budget 0 decodes every module on every forward. Through Python each record's
 * decode is a dozen calls around the C loops (frames, planes, residual, hash), and with torch's
 * default threads the second core is held by torch's own OpenMP thread, which waits (spinning)
 * for the next parallel region and leaves no core to a decode thread of tpde's. Here a
 * module's records are rebuilt in one call: each tensor's keyframe and deltas, frame by frame
 * into their byte planes, joined into its words and applied there, and its XXH3-128 checked
 * against the record's, with the GIL released throughout. Given more than one thread, the tensors
 * are shared out over an OpenMP team of the calling thread: torch's own threads, where torch's
 * OpenMP runtime is the one opened, which pick the work up at once.
 *
 *   open(xxhash, openmp)  the libraries to find XXH3-128 and GOMP_parallel in: paths of
 *                         shared objects the process has loaded already (openmp may be None);
 *                         whether XXH3-128 was found
 *   rebuild(tasks, threads, fresh)  rebuild every task on a team of that many threads (fresh:
 *                         its words are new memory, asked for in huge pages); the indices of
 *                         those that failed, each with why
 *
 * A task is (out, width, check, hash_high, hash_low, records): `out` the writable words (of
 * `width` bytes) to rebuild, and records, keyframe first, each (data, frames, chunk, raw,
 * mode[, positions]): `data` holds the record's values frames back to back (or is a pair
 * (descriptor, offset) of a file they start at, read a frame at a time), `frames` their
 * compressed sizes, `chunk` and `raw` the stream's (docs/format.md, "Values"); `mode` 0 for
 * the keyframe, 1-3 for a dense residual (_planes.join's modes), 9 for a sparse delta, whose
 * int64 `positions` the caller has decoded (one per word of its stream). With `check`, the
 * words must hash to the 128-bit value given. Every size and position is checked before any
 * work; a frame that does not decode to exactly its chunk, or words that do not hash as they
 * should, fail their task, and the caller rebuilds it through tpde's Python path, which says
 * where the chain is damaged.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_planes.h"
#include "_zframes.h"

#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>
#define REBUILD_DLOPEN 1
#endif

/* Tasks whose records' streams together fit in this many raw bytes (the first ones that do,
 * in a call) have them all decompressed into planes first, frame by frame over the team,
 * then joined and applied a slice of words at a time; the others a range of words at a time,
 * each record's part of each plane through a buffer of a frame: a mount at budget 0 holds
 * its module's words and little more. */
#define PLANES_BYTES ((Py_ssize_t)2 << 20)
/* The most bytes a large task's buffers may take on one thread (a frame per plane and a
 * slice of each plane); a record that would need more is left to the Python path. */
#define MAX_BUFFERS ((Py_ssize_t)64 << 20)
/* The words a small task hands one thread at a time. */
#define JOIN_WORDS ((Py_ssize_t)1 << 16)
/* About the words a large task hands one thread at a time (whole frames of each plane). */
#define RANGE_WORDS ((Py_ssize_t)1 << 16)

typedef struct {
    uint64_t low64, high64;
} xxh128_t;

static const zframes_api *Z;
static const planes_api *P;
static xxh128_t (*xxh3_128)(const void *, size_t);
static void (*gomp_parallel)(void (*)(void *), void *, unsigned, unsigned);
static void (*gomp_barrier)(void);

/* Records' modes: 0 a keyframe's words, 1-3 a dense residual (_planes.join's), and a sparse
 * delta's XOR residual at its positions. */
enum { KEY = 0, SPARSE = 9 };

typedef struct {
    Py_buffer data;  /* the frames in memory, or */
    int fd;          /* a descriptor to read them from, from `base` on (-1: data) */
    Py_ssize_t base;
    Py_ssize_t *at; /* where each frame starts in data; count + 1 entries */
    Py_ssize_t count, chunk, raw;
    int mode;
    Py_buffer where; /* SPARSE: the int64 positions of its raw / width words */
    unsigned char *values; /* SPARSE in a large task: its stream, decompressed whole */
} record_t;

typedef struct {
    Py_buffer out;
    int width, check;
    uint64_t high, low;
    record_t *records;
    Py_ssize_t n_records, got; /* records whose buffers are held */
    int small;                 /* decompressed into planes (else a range at a time) */
    unsigned char *planes;     /* a small task's: every record's stream, one after another */
    int failed;
    char why[MAX_WHY];
} task_t;

/* Work of one phase: frame `i` of record `r` decompressed to `to` (a small task's planes, or
 * a sparse delta's values in a large one), or words [lo, hi) of a task, rebuilt through every
 * record in turn. */
typedef struct {
    task_t *t;
    const record_t *r;
    Py_ssize_t i, lo, hi;
    unsigned char *to;
} unit_t;

typedef struct {
    unit_t *units;
    Py_ssize_t n, next;
} phase_t;

/* The small tasks' frames, then every task's words, then every task's hash: every thread of
 * the team finishes a phase before any starts the next. */
enum { FRAMES, WORDS, PHASES };
typedef struct {
    task_t *tasks;
    Py_ssize_t n_tasks, hashed;
    phase_t phases[PHASES];
    void (*barrier)(void); /* the team's, as found when the call began; NULL: no team */
} job_t;

static int fail(task_t *t, const char *why) {
    if (!t->failed) snprintf(t->why, MAX_WHY, "%s", why);
    t->failed = 1;
    return -1;
}

static Py_ssize_t raw_of(const task_t *t) {
    Py_ssize_t sum = 0;
    for (Py_ssize_t j = 0; j < t->n_records; j++) sum += t->records[j].raw;
    return sum;
}

/* Frame i of r into dst: from memory, or read first (from the page cache, most often: a
 * mount holds no more than a frame of the compressed bytes it reads). */
static int frame(task_t *t, void *ctx, const record_t *r, Py_ssize_t i, char *dst) {
    Py_ssize_t first = i * r->chunk, want = r->raw - first < r->chunk ? r->raw - first : r->chunk;
    size_t len = (size_t)(r->at[i + 1] - r->at[i]);
    char why[MAX_WHY], *read = NULL;
    const char *src = (const char *)r->data.buf + r->at[i];
    if (ctx == NULL) return fail(t, "zstd could not make a decompression context");
    if (r->fd >= 0) {
        if ((read = malloc(len)) == NULL) return fail(t, "out of memory");
        size_t got = 0;
        while (got < len) {
            ssize_t n = pread(r->fd, read + got, len - got, (off_t)(r->base + r->at[i] + got));
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            got += (size_t)n;
        }
        if (got < len) {
            free(read);
            return fail(t, "a frame could not be read whole");
        }
        src = read;
    }
    int bad = Z->frame(ctx, src, len, dst, (size_t)want, why);
    free(read);
    return bad < 0 ? fail(t, why) : 0;
}

/* The first of the `count` sorted positions at or after `word`. */
static Py_ssize_t first_at(const int64_t *at, Py_ssize_t count, Py_ssize_t word) {
    Py_ssize_t lo = 0, hi = count;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (at[mid] < word) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* Residual words j of a sparse delta, from planes `stride` bytes apart, XORed into the words
 * at their positions (checked to lie in the words before any work). */
#define XOR_AT(T)                                                                           \
    for (Py_ssize_t j = 0; j < n; j++) {                                                    \
        T x = 0;                                                                            \
        for (int k = 0; k < w; k++) x |= (T)((T)planes[k * stride + j] << (8 * k));         \
        ((T *)out)[at[j]] ^= x;                                                             \
    }
static void xor_at(int w, const unsigned char *planes, Py_ssize_t stride, const int64_t *at,
                   Py_ssize_t n, unsigned char *out) {
    switch (w) {
    case 1: XOR_AT(uint8_t) break;
    case 2: XOR_AT(uint16_t) break;
    case 4: XOR_AT(uint32_t) break;
    default: XOR_AT(uint64_t) break;
    }
}

/* Words (or a sparse delta's values) [lo, hi) of record r's stream, a plane's part each,
 * into parts (plane k at parts + k * slice), through the frames `held` names in `frames`
 * (one per plane) or straight into the part where a whole frame lies in it. A frame that
 * straddles two planes, or two units, is decompressed once for each. */
static int fill(task_t *t, void *ctx, const record_t *r, Py_ssize_t lo, Py_ssize_t hi,
                unsigned char *frames, Py_ssize_t *held, unsigned char *parts, Py_ssize_t slice) {
    const Py_ssize_t m = r->raw / t->width;
    for (int k = 0; k < t->width; k++) {
        Py_ssize_t a = k * m + lo, b = k * m + hi;
        unsigned char *dst = parts + k * slice, *mine = frames + k * r->chunk;
        while (a < b) {
            Py_ssize_t i = a / r->chunk, f0 = i * r->chunk;
            Py_ssize_t f1 = f0 + r->chunk < r->raw ? f0 + r->chunk : r->raw;
            Py_ssize_t upto = f1 < b ? f1 : b;
            if (held[k] != i && a == f0 && f1 <= b) {
                if (frame(t, ctx, r, i, (char *)dst) < 0) return -1;
            } else {
                if (held[k] != i) {
                    if (frame(t, ctx, r, i, (char *)mine) < 0) return -1;
                    held[k] = i;
                }
                memcpy(dst, mine + (a - f0), (size_t)(upto - a));
            }
            dst += upto - a;
            a = upto;
        }
    }
    return 0;
}

/* Words [lo, hi) of a large task, through each record in turn, a slice at a time. */
static int ranged(task_t *t, void *ctx, Py_ssize_t lo, Py_ssize_t hi) {
    const int w = t->width;
    for (Py_ssize_t j = 0; j < t->n_records; j++) {
        const record_t *r = &t->records[j];
        const Py_ssize_t slice = r->chunk > JOIN_WORDS ? r->chunk : JOIN_WORDS;
        Py_ssize_t a = lo, b = hi, held[8];
        const int64_t *at = NULL;
        if (r->mode == SPARSE) { /* the values of the positions in the range, decompressed */
            const Py_ssize_t count = r->where.len / 8;
            at = (const int64_t *)r->where.buf;
            a = first_at(at, count, lo);
            b = first_at(at, count, hi);
            xor_at(w, r->values + a, count, at + a, b - a, (unsigned char *)t->out.buf);
            continue;
        }
        unsigned char *buf = malloc((size_t)w * (size_t)(r->chunk + slice));
        if (buf == NULL) return fail(t, "out of memory");
        unsigned char *frames = buf, *parts = buf + (Py_ssize_t)w * r->chunk;
        const unsigned char *p[8];
        for (int k = 0; k < w; k++) {
            held[k] = -1;
            p[k] = parts + k * slice;
        }
        int bad = 0;
        for (Py_ssize_t s0 = a; !bad && s0 < b; s0 += slice) {
            const Py_ssize_t n = b - s0 < slice ? b - s0 : slice;
            bad = fill(t, ctx, r, s0, s0 + n, frames, held, parts, slice);
            if (bad) break;
            if (r->mode == SPARSE)
                xor_at(w, parts, slice, at + s0, n, (unsigned char *)t->out.buf);
            else
                P->join(w, p, n, (unsigned char *)t->out.buf + s0 * w, r->mode);
        }
        free(buf);
        if (bad) return -1;
    }
    return 0;
}

/* Words [lo, hi) of a small task, from its planes, through each record in turn. */
static void joined(task_t *t, Py_ssize_t lo, Py_ssize_t hi) {
    const int w = t->width;
    const unsigned char *planes = t->planes;
    unsigned char *out = (unsigned char *)t->out.buf;
    for (Py_ssize_t j = 0; j < t->n_records; planes += t->records[j].raw, j++) {
        const record_t *r = &t->records[j];
        const Py_ssize_t m = r->raw / w;
        if (r->mode == SPARSE) {
            const int64_t *at = (const int64_t *)r->where.buf;
            Py_ssize_t a = first_at(at, m, lo), b = first_at(at, m, hi);
            xor_at(w, planes + a, m, at + a, b - a, out);
            continue;
        }
        const unsigned char *p[8];
        for (int k = 0; k < w; k++) p[k] = planes + k * m + lo;
        P->join(w, p, hi - lo, out + lo * w, r->mode);
    }
}

static void work(const unit_t *u, int phase) {
    task_t *t = u->t;
    if (t->failed) return;
    if (phase == FRAMES)
        frame(t, Z->context(), u->r, u->i, (char *)u->to + u->i * u->r->chunk);
    else if (t->planes != NULL)
        joined(t, u->lo, u->hi);
    else
        ranged(t, Z->context(), u->lo, u->hi);
}

static void hash(task_t *t) {
    if (t->failed || !t->check) return;
    xxh128_t h = xxh3_128(t->out.buf, (size_t)t->out.len);
    if (h.high64 != t->high || h.low64 != t->low)
        fail(t, "restored bytes do not match the stored hash");
}

static void team_body(void *arg) {
    job_t *j = (job_t *)arg;
    for (int ph = 0; ph < PHASES; ph++) {
        phase_t *f = &j->phases[ph];
        for (;;) {
            Py_ssize_t i = __atomic_fetch_add(&f->next, 1, __ATOMIC_RELAXED);
            if (i >= f->n) break;
            work(&f->units[i], ph);
        }
        if (j->barrier != NULL) j->barrier();
    }
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&j->hashed, 1, __ATOMIC_RELAXED);
        if (i >= j->n_tasks) break;
        hash(&j->tasks[i]);
    }
}

/* The units of a phase for task t, written from units[n] on where units is not NULL; how
 * many. A small task's frames carry, in lo, where their record's stream starts in its
 * planes. */
static Py_ssize_t units_of(task_t *t, int phase, unit_t *units, Py_ssize_t n) {
    const Py_ssize_t m = t->out.len / t->width;
    Py_ssize_t c = 0;
    if (phase == FRAMES) { /* a small task's every record, a large one's sparse deltas */
        unsigned char *to = t->planes;
        for (Py_ssize_t j = 0; j < t->n_records; j++) {
            record_t *r = &t->records[j];
            if (!t->small && r->values == NULL) continue;
            for (Py_ssize_t i = 0; i < r->count; i++, c++)
                if (units) units[n + c] = (unit_t){t, r, i, 0, 0, t->small ? to : r->values};
            to += r->raw;
        }
        return c;
    }
    /* A large task's ranges are whole frames of its keyframe's planes. */
    const Py_ssize_t chunk = t->records[0].chunk;
    const Py_ssize_t step = t->small ? JOIN_WORDS : (RANGE_WORDS + chunk - 1) / chunk * chunk;
    for (Py_ssize_t lo = 0; lo < m; lo += step, c++)
        if (units) units[n + c] = (unit_t){t, NULL, 0, lo, m - lo > step ? lo + step : m, NULL};
    return c;
}

/* The phases' units, with the GIL held; -1 where memory ran out. */
static int plan_phases(job_t *j) {
    for (int ph = FRAMES; ph <= WORDS; ph++) {
        phase_t *f = &j->phases[ph];
        Py_ssize_t n = 0;
        for (Py_ssize_t x = 0; x < j->n_tasks; x++) n += units_of(&j->tasks[x], ph, NULL, 0);
        f->units = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(unit_t));
        if (f->units == NULL) return -1;
        for (Py_ssize_t x = 0; x < j->n_tasks; x++)
            f->n += units_of(&j->tasks[x], ph, f->units, f->n);
    }
    return 0;
}

static int outside(const int64_t *at, Py_ssize_t count, Py_ssize_t m) {
    uint64_t out = 0;
    for (Py_ssize_t j = 0; j < count; j++) out |= (uint64_t)at[j] >= (uint64_t)m;
    return out != 0;
}

/* One record from its tuple; 0, or -1 with a Python error set. */
static int parse_record(PyObject *item, task_t *t, record_t *r) {
    PyObject *data, *frames, *where = Py_None;
    if (!PyArg_ParseTuple(item, "OOnni|O", &data, &frames, &r->chunk, &r->raw, &r->mode, &where))
        return -1;
    PyObject *fast = PySequence_Fast(frames, "frames must be a sequence of sizes");
    if (fast == NULL) return -1;
    r->count = PySequence_Fast_GET_SIZE(fast);
    r->at = PyMem_Malloc((size_t)(r->count + 1) * sizeof(Py_ssize_t));
    if (r->at == NULL) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    r->at[0] = 0;
    for (Py_ssize_t i = 0; i < r->count; i++) {
        Py_ssize_t len = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fast, i));
        if (len <= 0 || len > PY_SSIZE_T_MAX - r->at[i]) {
            Py_DECREF(fast);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "frame sizes must be positive");
            return -1;
        }
        r->at[i + 1] = r->at[i] + len;
    }
    Py_DECREF(fast);
    r->fd = -1;
    if (PyTuple_Check(data)) { /* (descriptor, offset) */
        if (!PyArg_ParseTuple(data, "in", &r->fd, &r->base)) return -1;
        if (r->fd < 0 || r->base < 0) {
            PyErr_SetString(PyExc_ValueError, "no such descriptor or offset");
            return -1;
        }
    } else if (PyObject_GetBuffer(data, &r->data, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    t->got++; /* released as a task ends (a zeroed buffer, where read from a descriptor) */
    if ((r->mode == SPARSE) != (where != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "positions go with a sparse delta, and only there");
        return -1;
    }
    if (r->mode == SPARSE && PyObject_GetBuffer(where, &r->where, PyBUF_SIMPLE) < 0) return -1;
    const char *bad = NULL;
    const Py_ssize_t m = t->out.len / t->width;
    if (!(r->mode >= KEY && r->mode <= 3) && r->mode != SPARSE)
        bad = "no such record mode";
    else if ((r->mode == KEY) != (t->got == 1))
        bad = "a keyframe first, then residuals";
    else if (r->mode != SPARSE && r->raw != t->out.len)
        bad = "a record's stream differs in size from the words";
    else if (r->mode == SPARSE && (r->where.len % 8 || (uintptr_t)r->where.buf % 8 ||
                                   r->raw != r->where.len / 8 * t->width))
        bad = "a sparse delta needs an int64 position for each of its words";
    else if (r->mode == SPARSE && outside((const int64_t *)r->where.buf, r->where.len / 8, m))
        bad = "a position lies outside the words";
    else if (r->chunk <= 0 || r->count != (r->raw + r->chunk - 1) / r->chunk)
        bad = "chunk count does not match the stream's raw size";
    else if (r->fd < 0 && r->at[r->count] > r->data.len)
        bad = "frames run past the record's bytes";
    else if ((Py_ssize_t)t->width * (r->chunk + JOIN_WORDS) > MAX_BUFFERS)
        bad = "a record's frames are too large to rebuild here";
    if (bad) {
        PyErr_SetString(PyExc_ValueError, bad);
        return -1;
    }
    return 0;
}

/* One task from its tuple; 0, or -1 with a Python error set. */
static int parse_task(PyObject *item, task_t *t) {
    PyObject *out, *records;
    unsigned long long high, low;
    if (!PyArg_ParseTuple(item, "OipKKO", &out, &t->width, &t->check, &high, &low, &records))
        return -1;
    t->high = high;
    t->low = low;
    if (PyObject_GetBuffer(out, &t->out, PyBUF_WRITABLE) < 0) return -1;
    if (!P->fits(t->out.buf, t->width) || t->out.len % t->width) {
        PyErr_SetString(PyExc_ValueError, "words not aligned to a width of 1, 2, 4 or 8 bytes");
        return -1;
    }
    PyObject *fast = PySequence_Fast(records, "records must be a sequence");
    if (fast == NULL) return -1;
    t->n_records = PySequence_Fast_GET_SIZE(fast);
    t->records = PyMem_Calloc(t->n_records ? (size_t)t->n_records : 1, sizeof(record_t));
    int bad = t->records == NULL ? (PyErr_NoMemory(), -1) : 0;
    if (!bad && t->n_records == 0) {
        PyErr_SetString(PyExc_ValueError, "a task needs its keyframe");
        bad = -1;
    }
    for (Py_ssize_t j = 0; !bad && j < t->n_records; j++)
        bad = parse_record(PySequence_Fast_GET_ITEM(fast, j), t, &t->records[j]);
    Py_DECREF(fast);
    return bad;
}

static void release(task_t *tasks, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        task_t *t = &tasks[i];
        for (Py_ssize_t j = 0; t->records && j < t->n_records; j++) {
            if (j < t->got) PyBuffer_Release(&t->records[j].data);
            if (t->records[j].where.obj) PyBuffer_Release(&t->records[j].where);
            free(t->records[j].values);
            PyMem_Free(t->records[j].at);
        }
        PyMem_Free(t->records);
        free(t->planes);
        if (t->out.obj) PyBuffer_Release(&t->out);
    }
    PyMem_Free(tasks);
}

/* Planes for the first tasks that fit in PLANES_BYTES together, and in the others a buffer
 * for each sparse delta's values (tpde.chain.native plans no more than SPARSE_BYTES of them
 * and their positions), decompressed once, not once for each range; -1 where memory ran
 * out. */
static int planes_for(task_t *tasks, Py_ssize_t n) {
    Py_ssize_t left = PLANES_BYTES;
    for (Py_ssize_t i = 0; i < n; i++) {
        task_t *t = &tasks[i];
        const Py_ssize_t raw = raw_of(t);
        if (raw <= left) {
            if ((t->planes = malloc((size_t)raw + 1)) == NULL) return -1;
            t->small = 1;
            left -= raw;
            continue;
        }
        for (Py_ssize_t j = 0; j < t->n_records; j++) {
            record_t *r = &t->records[j];
            if (r->mode == SPARSE && (r->values = malloc((size_t)r->raw + 1)) == NULL) return -1;
        }
    }
    return 0;
}

/* Where the kernel backs memory with huge pages on request (transparent huge pages, "madvise"),
 * ask for them in the whole 2 MiB pages of words not yet written: faulting in a restore's
 * fresh words a 4 KiB page at a time costs several times what huge pages do. */
static void huge_pages(task_t *tasks, Py_ssize_t n) {
#if defined(REBUILD_DLOPEN) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    for (Py_ssize_t i = 0; i < n; i++) {
        uintptr_t a = (uintptr_t)tasks[i].out.buf, b = a + (uintptr_t)tasks[i].out.len;
        a = (a + huge - 1) & ~(huge - 1);
        b &= ~(huge - 1);
        if (b > a) (void)madvise((void *)a, b - a, MADV_HUGEPAGE);
    }
#else
    (void)tasks;
    (void)n;
#endif
}

static PyObject *rebuild(PyObject *self, PyObject *args) {
    PyObject *seq;
    int threads, fresh;
    if (!PyArg_ParseTuple(args, "Oip", &seq, &threads, &fresh)) return NULL;
    if (xxh3_128 == NULL || !Z->found()) {
        PyErr_SetString(PyExc_RuntimeError, "no zstd or XXH3-128 was found (open first)");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "tasks must be a sequence");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), parsed = 0;
    task_t *tasks = PyMem_Calloc(n ? (size_t)n : 1, sizeof(task_t));
    int bad = tasks == NULL ? (PyErr_NoMemory(), -1) : 0;
    for (; !bad && parsed < n; parsed++)
        bad = parse_task(PySequence_Fast_GET_ITEM(fast, parsed), &tasks[parsed]);
    Py_DECREF(fast);
    job_t job = {.tasks = tasks, .n_tasks = n};
    if (!bad && (planes_for(tasks, n) < 0 || plan_phases(&job) < 0)) bad = (PyErr_NoMemory(), -1);
    PyObject *failed = NULL;
    if (!bad && fresh) huge_pages(tasks, n);
    if (!bad) {
        /* A team of the calling thread's: torch's own threads on the forward's thread. */
        void (*parallel)(void (*)(void *), void *, unsigned, unsigned) = gomp_parallel;
        job.barrier = threads > 1 && parallel != NULL ? gomp_barrier : NULL;
        Py_BEGIN_ALLOW_THREADS
        if (job.barrier != NULL)
            parallel(team_body, &job, (unsigned)threads, 0);
        else
            team_body(&job);
        Py_END_ALLOW_THREADS
        failed = PyList_New(0);
        for (Py_ssize_t i = 0; failed != NULL && i < n; i++) {
            if (!tasks[i].failed) continue;
            PyObject *one = Py_BuildValue("(ns)", i, tasks[i].why);
            if (one == NULL || PyList_Append(failed, one) < 0) Py_CLEAR(failed);
            Py_XDECREF(one);
        }
    }
    for (int ph = 0; ph < PHASES; ph++) PyMem_Free(job.phases[ph].units);
    if (tasks) release(tasks, parsed);
    return failed;
}

static PyObject *open_libraries(PyObject *self, PyObject *args) {
    const char *xxhash, *openmp = NULL;
    if (!PyArg_ParseTuple(args, "sz", &xxhash, &openmp)) return NULL;
#ifdef REBUILD_DLOPEN
    /* Both are in the process already (their Python modules, torch): RTLD_NOLOAD takes the
     * copies loaded, and opens nothing new. */
    /* Once a process (tpde.chain.native holds a lock for it), and again in a forked child,
     * which has no team. A call under way keeps the entry points it began with. */
    void *parallel = NULL, *barrier = NULL;
    void *x = dlopen(xxhash, RTLD_NOW | RTLD_NOLOAD);
    if (x != NULL) *(void **)&xxh3_128 = dlsym(x, "XXH3_128bits");
    if (openmp != NULL) {
        void *g = dlopen(openmp, RTLD_NOW | RTLD_NOLOAD);
        if (g != NULL) {
            parallel = dlsym(g, "GOMP_parallel");
            barrier = dlsym(g, "GOMP_barrier");
        }
    }
    if (parallel == NULL || barrier == NULL) parallel = barrier = NULL;
    *(void **)&gomp_barrier = barrier;
    *(void **)&gomp_parallel = parallel;
#endif
    return PyBool_FromLong(xxh3_128 != NULL && Z->found());
}

static PyMethodDef methods[] = {
    {"open", open_libraries, METH_VARARGS,
     "open(xxhash, openmp): find XXH3-128 and GOMP_parallel in those loaded libraries; whether "
     "records can be rebuilt here."},
    {"rebuild", rebuild, METH_VARARGS,
     "rebuild(tasks, threads, fresh): rebuild each task's words from its records outside the "
     "GIL (over an OpenMP team of the calling thread of that many threads, where more than one; "
     "with fresh, words not yet written, in huge pages where the kernel has them); "
     "[(index, why)] of the tasks that failed."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rebuild",
                                    "Records rebuilt in one call (tpde.chain.native).",
                                    -1, methods};

PyMODINIT_FUNC PyInit__rebuild(void) {
    Z = PyCapsule_Import(ZFRAMES_API, 0);
    if (Z == NULL) return NULL;
    P = PyCapsule_Import(PLANES_API, 0);
    if (P == NULL) return NULL;
    return PyModule_Create(&module);
}
