/* The Elias-delta position coder of tpde.elias, in C.
 *
 * It writes and reads exactly the stream that tpde/elias.py specifies and codes with numpy
 * (docs/format.md, "Positions"); tpde.elias uses this module when it is built and falls back to
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

static inline int code_length(uint64_t gap) {
    int n = bit_length(gap) - 1;
    int ell = bit_length((uint64_t)n + 1) - 1;
    return 2 * ell + 1 + n;
}

/* The size in bits of the codes of `count` positions, or why they cannot be coded. */
static const char *measure(const int64_t *p, Py_ssize_t count, uint64_t *nbits) {
    const char *problem = NULL;
    *nbits = 0;
    if (count && (p[0] < 0 || (uint64_t)p[count - 1] > MAX_POSITION))
        return "positions must lie in [0, 2**56 - 1]";
    Py_BEGIN_ALLOW_THREADS
    int64_t prev = -1;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (p[i] <= prev) { problem = "positions must be strictly increasing"; break; }
        *nbits += (uint64_t)code_length((uint64_t)(p[i] - prev));
        prev = p[i];
    }
    Py_END_ALLOW_THREADS
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
    uint64_t at = 0;
    int64_t prev = -1;
    Py_ssize_t left = 0; /* codes until the next block starts: no division per code */
    for (Py_ssize_t i = 0; i < count; i++) {
        if (left == 0) {
            put_u64(sync, at);
            put_u64(sync + 8, (uint64_t)(prev + 1));
            sync += 16;
            left = block;
        }
        left--;
        uint64_t gap = (uint64_t)(p[i] - prev);
        int n = bit_length(gap) - 1;
        int ell = bit_length((uint64_t)n + 1) - 1;
        uint64_t low = gap & ((((uint64_t)1) << n) - 1);
        int length = 2 * ell + 1 + n;
        if (length <= 56) { /* the L zeros, N + 1 and the low N bits of the gap, at once */
            put_bits(&w, (((uint64_t)n + 1) << n) | low, length);
        } else {
            put_bits(&w, (uint64_t)n + 1, 2 * ell + 1);
            put_bits(&w, low, n);
        }
        at += (uint64_t)length;
        prev = p[i];
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

/* decode(codes, nbits, sync, count, block, out): fills `out` (count int64) with the positions
 * of a stream whose header and sync table tpde.elias._parse has checked already. Damage raises
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
        for (Py_ssize_t b = 0; b < nsync && !problem; b++) {
            uint64_t at = get_u64(s + 16 * b);
            uint64_t end = b + 1 < nsync ? get_u64(s + 16 * (b + 1)) : nbits;
            uint64_t base = get_u64(s + 16 * b + 8);
            uint64_t pos = base - 1;
            if (b && base != (uint64_t)last + 1) {
                problem = "position stream decodes to positions that are not increasing";
                break;
            }
            Py_ssize_t lo = b * block, hi = lo + block < count ? lo + block : count;
            for (Py_ssize_t i = lo; i < hi; i++) {
                if (at >= end) { problem = "position stream ends inside a code"; break; }
                /* One window holds the whole code unless it is longer than 57 bits (rare). */
                uint64_t w = window(c, size, at);
                int ell = w ? __builtin_clzll(w) : 64;
                if (ell > 6) { problem = "position stream has an invalid Elias-delta prefix"; break; }
                uint64_t n = ((w << ell) >> (63 - ell)) - 1;
                if (n > 56) { problem = "position stream codes a gap beyond 2**57"; break; }
                uint64_t head = 2 * (uint64_t)ell + 1;
                uint64_t low = 0;
                if (n && head + n <= 57) low = (w << head) >> (64 - n);
                else if (n) low = window(c, size, at + head) >> (64 - n);
                uint64_t gap = (((uint64_t)1) << n) | low;
                at += head + n;
                pos += gap;
                if ((int64_t)pos < 0 || (int64_t)pos <= last) {
                    problem = "position stream decodes to positions that are not increasing";
                    break;
                }
                p[i] = last = (int64_t)pos;
            }
            if (!problem && at != end)
                problem = "position stream blocks do not end at the next sync point";
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

PyMODINIT_FUNC PyInit__elias(void) { return PyModule_Create(&module); }
