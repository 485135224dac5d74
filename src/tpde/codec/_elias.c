/* The Elias-delta position coder of tpde.codec.elias, in C.
 *
 * It writes and reads exactly the stream that tpde/elias.py specifies and codes with numpy
 * (docs/format.md, "Positions"); tpde.codec.elias uses this module when it is built and falls back to
 * numpy when it is not. The numpy coder works a whole piece at a time in about fifteen passes
 * over temporaries; here each code is a few shifts, and the GIL is released for the whole loop,
 * so the encode and restore threads code positions side by side.
 *
 * A code of gap g >= 1: N = floor(log2 g), L = floor(log2(N + 1)); L zero bits, N + 1 in L + 1
 * bits, then the low N bits of g, most significant bit first.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_POSITION ((((uint64_t)1) << 56) - 1)
#define HEADER_SIZE 24

static int bit_length(uint64_t x) { return x ? 64 - __builtin_clzll(x) : 0; }

static void put_u64(unsigned char *at, uint64_t v) {
    for (int i = 0; i < 8; i++) at[i] = (unsigned char)(v >> (8 * i));
}

static void put_u32(unsigned char *at, uint32_t v) {
    for (int i = 0; i < 4; i++) at[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t get_u64(const unsigned char *at) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | at[i];
    return v;
}

/* Appends codes most significant bit first: `fill` bits (fewer than 8 between calls) wait at
 * the top of `acc`. Every call stores all 8 bytes of `acc` and moves on by the whole bytes it
 * completed, with no branch (a branch per code mispredicts on codes of a few bits), so the
 * output has 8 bytes of room past its end. */
typedef struct {
    unsigned char *out;
    uint64_t acc;
    int fill;
} Writer;

static inline void put_bits(Writer *w, uint64_t v, int n) { /* 1 <= n <= 56 */
    w->acc |= v << (64 - w->fill - n);
    w->fill += n;
    uint64_t be = __builtin_bswap64(w->acc);
    memcpy(w->out, &be, 8);
    int bytes = w->fill >> 3;
    w->out += bytes;
    w->acc <<= 8 * bytes;
    w->fill &= 7;
}

/* The length of the code of a gap g by N = floor(log2 g): 2 floor(log2(N + 1)) + 1 + N, filled
 * in when the module loads. */
static unsigned char length_of_n[64];

/* The size in bits of the codes of `count` positions, or why they cannot be coded. */
static const char *measure(const int64_t *p, Py_ssize_t count, uint64_t *nbits) {
    const char *problem = NULL;
    uint64_t bits = 0; /* not *nbits: a store per code, as it may alias `p` */
    if (count && (p[0] < 0 || (uint64_t)p[count - 1] > MAX_POSITION))
        return "positions must lie in [0, 2**56 - 1]";
    Py_BEGIN_ALLOW_THREADS
    int64_t prev = -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (p[i] <= prev) { problem = "positions must be strictly increasing"; break; }
        bits += length_of_n[bit_length((uint64_t)(p[i] - prev)) - 1];
        prev = p[i];
    }
    Py_END_ALLOW_THREADS
    *nbits = bits;
    return problem;
}

/* encoded_bits(positions) -> int: the size of their codes, without writing them (a save
 * sizes a sparse coding before it chooses one). */
static PyObject *encoded_bits(PyObject *self, PyObject *args) {
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "y*", &view)) return NULL;
    uint64_t nbits = 0;
    const char *problem = view.len % 8 ? "positions must be int64"
                                       : measure((const int64_t *)view.buf, view.len / 8, &nbits);
    PyBuffer_Release(&view);
    if (problem) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(nbits);
}

/* encode(positions, block) -> bytes: positions is a contiguous buffer of int64. */
static PyObject *encode(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "y*n", &view, &block)) return NULL;
    const int64_t *p = (const int64_t *)view.buf;
    Py_ssize_t count = view.len / 8;
    const char *problem = NULL;
    uint64_t nbits = 0;
    if (view.len % 8) problem = "positions must be int64";
    else if (block < 1 || block >= ((Py_ssize_t)1 << 32)) problem = "block must be in [1, 2**32)";
    else problem = measure(p, count, &nbits);
    if (problem) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    Py_ssize_t nsync = (count + block - 1) / block;
    Py_ssize_t size = HEADER_SIZE + 16 * nsync + (Py_ssize_t)((nbits + 7) / 8);
    PyObject *result = PyBytes_FromStringAndSize(NULL, size + 8); /* see Writer */
    if (!result) {
        PyBuffer_Release(&view);
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    Py_BEGIN_ALLOW_THREADS
    put_u64(out, (uint64_t)count);
    put_u32(out + 8, (uint32_t)block);
    put_u32(out + 12, 0);
    put_u64(out + 16, nbits);
    unsigned char *sync = out + HEADER_SIZE;
    Writer w = {sync + 16 * nsync, 0, 0};
    const unsigned char *start = w.out;
    int64_t prev = -1;
    for (Py_ssize_t lo = 0; lo < count; lo += block) {
        put_u64(sync, 8 * (uint64_t)(w.out - start) + (uint64_t)w.fill);
        put_u64(sync + 8, (uint64_t)(prev + 1));
        sync += 16;
        Py_ssize_t hi = count - lo > block ? lo + block : count;
        for (Py_ssize_t i = lo; i < hi; i++) {
            uint64_t gap = (uint64_t)(p[i] - prev);
            int n = bit_length(gap) - 1;
            int length = length_of_n[n];
            prev = p[i];
            /* The L zeros, N + 1 in L + 1 bits and the low N bits of the gap, at once: with
             * the gap's own top bit, N + 1 after it is N << N added to the gap. */
            if (length <= 56) {
                put_bits(&w, gap + ((uint64_t)n << n), length);
            } else {
                put_bits(&w, (uint64_t)n + 1, length - n);
                put_bits(&w, gap & ((((uint64_t)1) << n) - 1), n);
            }
        }
    }
    if (w.fill) *w.out++ = (unsigned char)(w.acc >> 56);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (_PyBytes_Resize(&result, size) < 0) return NULL;
    return result;
}

/* 64 bits of `codes` (`size` bytes; bits past the end read 0) whose top 57 at least start at
 * bit `at`. */
static inline uint64_t window(const unsigned char *codes, uint64_t size, uint64_t at) {
    uint64_t byte = at >> 3, v = 0;
    if (byte + 8 <= size) {
        memcpy(&v, codes + byte, 8);
        v = __builtin_bswap64(v);
    } else {
        for (int i = 0; i < 8; i++) v = (v << 8) | (byte + i < size ? codes[byte + i] : 0);
    }
    return v << (at & 7);
}

/* One block of codes decoded, one code after another, as the format spells it out: whatever is
 * wrong with a block is found here, and named as the numpy decoder names it. `*last` is the
 * last position before the block (-1 for none), then the block's last. */
static const char *decode_block(const unsigned char *c, uint64_t size, uint64_t at, uint64_t end,
                                uint64_t base, int64_t *p, Py_ssize_t count, int64_t *last) {
    uint64_t pos = base - 1;
    if (*last >= 0 && base != (uint64_t)*last + 1)
        return "position stream decodes to positions that are not increasing";
    for (Py_ssize_t i = 0; i < count; i++) {
        if (at >= end) return "position stream ends inside a code";
        /* One window holds the whole code unless it is longer than 57 bits (rare). */
        uint64_t w = window(c, size, at);
        int ell = w ? __builtin_clzll(w) : 64;
        if (ell > 6) return "position stream has an invalid Elias-delta prefix";
        uint64_t n = ((w << ell) >> (63 - ell)) - 1;
        if (n > 56) return "position stream codes a gap beyond 2**57";
        uint64_t head = 2 * (uint64_t)ell + 1;
        uint64_t low = 0;
        if (n && head + n <= 57) low = (w << head) >> (64 - n);
        else if (n) low = window(c, size, at + head) >> (64 - n);
        uint64_t gap = (((uint64_t)1) << n) | low;
        at += head + n;
        pos += gap;
        if ((int64_t)pos < 0 || (int64_t)pos <= *last)
            return "position stream decodes to positions that are not increasing";
        p[i] = *last = (int64_t)pos;
    }
    return at != end ? "position stream blocks do not end at the next sync point" : NULL;
}

/* Blocks decoded side by side. A code's length is known only once the code before it is read,
 * so one block's decode is a chain of dependent steps (a load, a count of leading zeros,
 * shifts). LANES blocks in one loop keep the core busy during each other's waits, the more so
 * where most codes are of gaps under 128 and come from a table (the figures are in
 * benchmarks/README.md). Only the checks that cost nothing on the way are made: a lane that
 * finds anything wrong gives the group back to `decode_block`, block by block, which names
 * the first problem as it always has. */
#define LANES 4

typedef struct {
    uint64_t at, pos;
    int64_t *p;
} Lane;

/* By the next SHORT_BITS bits of a stream, the code they start with where it is no longer:
 * its gap << 4 | its length (0: a longer code). Codes of gaps up to 127 fit. */
#define SHORT_BITS 12
#define SHORT_AVERAGE 10
static uint32_t short_code[1 << SHORT_BITS];

static void fill_short_codes(void) {
    for (uint64_t v = 1; v < (1u << SHORT_BITS); v++) {
        uint64_t w = v << (64 - SHORT_BITS);
        int ell = __builtin_clzll(w);
        if (ell > 6) continue;
        uint64_t n = ((w << ell) >> (63 - ell)) - 1, head = 2 * (uint64_t)ell + 1;
        if (head + n > SHORT_BITS) continue;
        uint64_t gap = (((uint64_t)1) << n) | (((w << head) >> 1) >> (63 - n));
        short_code[v] = (uint32_t)(gap << 4 | (head + n));
    }
}

/* The code at `L->at`: from the table when `table` says to and it is short, else read as the
 * format spells it out; 0 when it is not a well-formed code of at most 57 bits in front of
 * `end`. Where about half the codes miss the table (gaps around 128: positions at a density
 * near 1%) its branch mispredicts, nearly doubling a code's time; `decode_lanes`
 * asks for it for groups of blocks whose codes average at most SHORT_AVERAGE bits. */
static inline int lane_step(const unsigned char *c, uint64_t size, Lane *L, uint64_t end,
                            int table) {
    if (L->at >= end) return 0;
    uint64_t w = window(c, size, L->at), length, gap;
    uint32_t e = table ? short_code[w >> (64 - SHORT_BITS)] : 0;
    if (e) {
        length = e & 15;
        gap = e >> 4;
    } else {
        int ell = w ? __builtin_clzll(w) : 64;
        if (ell > 6) return 0;
        uint64_t n = ((w << ell) >> (63 - ell)) - 1;
        uint64_t head = 2 * (uint64_t)ell + 1;
        if (head + n > 57) return 0; /* a long code (or a damaged one): left to decode_block */
        /* The low N bits, with no branch on N = 0: the word is shifted one bit less than
         * wanted and once more, so no shift is by 64. */
        length = head + n;
        gap = (((uint64_t)1) << n) | (((w << head) >> 1) >> (63 - n));
    }
    L->at += length;
    L->pos += gap;
    if ((int64_t)L->pos < 0) return 0;
    *L->p++ = (int64_t)L->pos;
    return 1;
}

/* `block` codes of each lane, one of each in turn; 0 when a lane found anything wrong. Built
 * once for each `table`, a constant where it is called, so that no code asks again. */
static inline __attribute__((always_inline)) int read_lanes(
    const unsigned char *c, uint64_t size, Lane *L, const uint64_t *end, Py_ssize_t block,
    int table) {
    int ok = 1;
    for (Py_ssize_t i = 0; i < block; i++) {
        ok &= lane_step(c, size, &L[0], end[0], table);
        ok &= lane_step(c, size, &L[1], end[1], table);
        ok &= lane_step(c, size, &L[2], end[2], table);
        ok &= lane_step(c, size, &L[3], end[3], table);
    }
    return ok;
}

/* LANES whole blocks starting at block `b`; 0 when decode_block must decode them instead. */
static int decode_lanes(const unsigned char *c, uint64_t size, const unsigned char *s,
                        Py_ssize_t b, uint64_t nbits, Py_ssize_t nsync, int64_t *p,
                        Py_ssize_t block, int64_t last) {
    Lane L[LANES];
    uint64_t end[LANES];
    for (int k = 0; k < LANES; k++) {
        L[k].at = get_u64(s + 16 * (b + k));
        L[k].pos = get_u64(s + 16 * (b + k) + 8) - 1;
        L[k].p = p + (b + k) * block;
        end[k] = b + k + 1 < nsync ? get_u64(s + 16 * (b + k + 1)) : nbits;
    }
    /* The first block goes on from the last position before the group; the others from the
     * block before them, checked once all are read. */
    if (last >= 0 && L[0].pos != (uint64_t)last) return 0;
    int ok = end[LANES - 1] - L[0].at <= (uint64_t)(SHORT_AVERAGE * LANES * block)
                 ? read_lanes(c, size, L, end, block, 1)
                 : read_lanes(c, size, L, end, block, 0);
    if (!ok) return 0;
    for (int k = 0; k < LANES; k++) {
        if (L[k].at != end[k]) return 0;
        int64_t first = get_u64(s + 16 * (b + k) + 8), prev = p[(b + k) * block - 1];
        if (b + k && first != prev + 1) return 0;
    }
    return 1;
}

/* decode(codes, nbits, sync, count, block, out): fills `out` (count int64) with the positions
 * of a stream whose header and sync table tpde.codec.elias._parse has checked already. Damage raises
 * ValueError with the message the numpy decoder gives it. */
static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer codes, sync, out;
    unsigned long long nbits;
    Py_ssize_t count, block;
    if (!PyArg_ParseTuple(args, "y*Ky*nnw*", &codes, &nbits, &sync, &count, &block, &out))
        return NULL;
    const char *problem = NULL;
    Py_ssize_t nsync = block > 0 ? (count + block - 1) / block : 0;
    if (block < 1 || sync.len < 16 * nsync || out.len < 8 * count ||
        (uint64_t)codes.len < (nbits + 7) / 8)
        problem = "position stream does not match its header";
    if (!problem) {
        Py_BEGIN_ALLOW_THREADS
        const unsigned char *c = (const unsigned char *)codes.buf;
        const unsigned char *s = (const unsigned char *)sync.buf;
        uint64_t size = (uint64_t)codes.len;
        int64_t *p = (int64_t *)out.buf;
        int64_t last = -1;
        /* Groups of whole blocks with a block after them: the next block's sync point checks
         * the last lane's last position as each lane's checks the lane before it. */
        Py_ssize_t groups_end = count / block < nsync ? count / block : nsync - 1;
        for (Py_ssize_t b = 0; b < nsync && !problem;) {
            if (b + LANES <= groups_end &&
                decode_lanes(c, size, s, b, nbits, nsync, p, block, last)) {
                b += LANES;
                last = p[b * block - 1];
                continue;
            }
            Py_ssize_t lo = b * block, hi = lo + block < count ? lo + block : count;
            problem = decode_block(c, size, get_u64(s + 16 * b),
                                   b + 1 < nsync ? get_u64(s + 16 * (b + 1)) : nbits,
                                   get_u64(s + 16 * b + 8), p + lo, hi - lo, &last);
            b++;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&codes);
    PyBuffer_Release(&sync);
    PyBuffer_Release(&out);
    if (problem) {
        PyErr_SetString(PyExc_ValueError, problem);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS, "Code strictly increasing int64 positions into a stream."},
    {"encoded_bits", encoded_bits, METH_VARARGS, "The size in bits of those positions' codes."},
    {"decode", decode, METH_VARARGS, "Decode a checked stream's codes into an int64 buffer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_elias", NULL, -1, methods};

PyMODINIT_FUNC PyInit__elias(void) {
    fill_short_codes();
    for (int n = 0; n < 64; n++)
        length_of_n[n] = (unsigned char)(2 * (bit_length((uint64_t)n + 1) - 1) + 1 + n);
    return PyModule_Create(&module);
}
