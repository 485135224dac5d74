/* A small stream's zstd frames decompressed in one call, with the GIL released once.
 *
 * Through zstandard a stream is decompressed a frame at a time: per frame a Python call to
 * parse its header, one to decompress it, and the GIL handed back and taken again around
 * each, while the other decode threads wait for it between their own frames. A restore of
 * many small records (a Lightning checkpoint's) spends a good part of its time there, and
 * restores faster with all of a small stream's frames decompressed in one loop outside the
 * GIL, as here (benchmarks/README.md):
 *
 *   unframe(frames, chunk, out)   frame i of the sequence `frames` (byte buffers) into
 *                                 out[i * chunk:], each exactly min(chunk, rest) bytes
 *   version()                     the zstd library's version number; 0 where none was found
 *
 * A capsule, tpde.codec._zframes.api (struct zframes_api, in _zframes.h), hands the checked frame
 * decode and each thread's context to tpde.codec._rebuild, which decompresses a mounted module's
 * frames on threads that never hold the GIL.
 *
 * zstd is the system's shared library (libzstd.so.1 and its kin), opened as the module loads:
 * zstandard links its own copy without exporting it. Where none is found, version() is 0 and
 * tpde.codec.unframe keeps to zstandard. Every frame's declared size is checked against its chunk's
 * before it is decompressed, and zstd is given exactly that much room, so a frame that claims
 * or produces more is refused, and so is one that produces less (or is followed by bytes that
 * are not a frame of their own).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

#include "_capsule.h"
#include "_zframes.h"

#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#include <pthread.h>
#define ZFRAMES_DLOPEN 1
#endif

typedef struct ZSTD_DCtx_s ZSTD_DCtx;
#define CONTENTSIZE_UNKNOWN (0ULL - 1)
#define CONTENTSIZE_ERROR (0ULL - 2)

/* The few entry points used, as zstd.h declares them (stable since zstd 1.3). */
static ZSTD_DCtx *(*create_dctx)(void);
static size_t (*free_dctx)(ZSTD_DCtx *);
static size_t (*decompress_dctx)(ZSTD_DCtx *, void *, size_t, const void *, size_t);
static unsigned (*is_error)(size_t);
static const char *(*error_name)(size_t);
static unsigned long long (*content_size)(const void *, size_t);
static unsigned (*version_number)(void);

#ifdef ZFRAMES_DLOPEN
static pthread_key_t dctx_key;  /* each thread's decompression context, freed as it ends */

static void drop_dctx(void *d) { free_dctx((ZSTD_DCtx *)d); }

static void open_zstd(void) {
    static const char *names[] = {"libzstd.so.1", "libzstd.so", "libzstd.1.dylib",
                                  "libzstd.dylib", NULL};
    void *lib = NULL;
    for (int i = 0; names[i] && !lib; i++) lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!lib) return;
    *(void **)&create_dctx = dlsym(lib, "ZSTD_createDCtx");
    *(void **)&free_dctx = dlsym(lib, "ZSTD_freeDCtx");
    *(void **)&decompress_dctx = dlsym(lib, "ZSTD_decompressDCtx");
    *(void **)&is_error = dlsym(lib, "ZSTD_isError");
    *(void **)&error_name = dlsym(lib, "ZSTD_getErrorName");
    *(void **)&content_size = dlsym(lib, "ZSTD_getFrameContentSize");
    *(void **)&version_number = dlsym(lib, "ZSTD_versionNumber");
    if (!create_dctx || !free_dctx || !decompress_dctx || !is_error || !error_name ||
        !content_size || !version_number ||
        pthread_key_create(&dctx_key, drop_dctx) != 0) {
        version_number = NULL;
        dlclose(lib);
    }
}

static void *thread_dctx(void) {
    ZSTD_DCtx *d = (ZSTD_DCtx *)pthread_getspecific(dctx_key);
    if (d == NULL) {
        d = create_dctx();
        if (d != NULL && pthread_setspecific(dctx_key, d) != 0) {
            free_dctx(d);
            d = NULL;
        }
    }
    return d;
}
#else
static void *thread_dctx(void) { return NULL; }  /* never called: no library opened */
#endif

/* Frame `f` of `n` bytes into `dst`, exactly `want` bytes; 0, or -1 with `why` filled. */
static int one_frame(void *d, const char *f, size_t n, char *dst, size_t want, char *why) {
    unsigned long long declared = content_size(f, n);
    if (declared == CONTENTSIZE_ERROR) {
        snprintf(why, MAX_WHY, "zstd frame cannot be decoded: its header is damaged");
        return -1;
    }
    if (declared != CONTENTSIZE_UNKNOWN && declared != (unsigned long long)want) {
        snprintf(why, MAX_WHY, "zstd frame declares %llu bytes where %llu are expected",
                 declared, (unsigned long long)want);
        return -1;
    }
    size_t got = decompress_dctx(d, dst, want, f, n);
    if (is_error(got)) {
        snprintf(why, MAX_WHY, "zstd frame cannot be decoded: %s", error_name(got));
        return -1;
    }
    if (got != want) {
        snprintf(why, MAX_WHY, "a zstd frame decoded to the wrong number of bytes");
        return -1;
    }
    return 0;
}

static PyObject *unframe(PyObject *self, PyObject *args) {
    PyObject *seq;
    Py_ssize_t chunk;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "Onw*", &seq, &chunk, &out)) return NULL;
    if (version_number == NULL) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_RuntimeError, "no zstd library was found");
        return NULL;
    }
    PyObject *fast = PySequence_Fast(seq, "frames must be a sequence of byte buffers");
    if (fast == NULL) {
        PyBuffer_Release(&out);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast), got = 0;
    Py_buffer *frames = PyMem_Calloc(count ? count : 1, sizeof(Py_buffer));
    char why[MAX_WHY] = "";
    int bad = frames == NULL ? (PyErr_NoMemory(), -1) : 0;
    if (!bad && (chunk <= 0 || count != (out.len + chunk - 1) / chunk)) {
        PyErr_SetString(PyExc_ValueError, "chunk count does not match the stream's raw size");
        bad = -1;
    }
    for (; !bad && got < count; got++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &frames[got],
                               PyBUF_SIMPLE) < 0)
            bad = -1;
    if (!bad) {
        char *dst = (char *)out.buf;
        Py_BEGIN_ALLOW_THREADS
        ZSTD_DCtx *d = thread_dctx();
        if (d == NULL) snprintf(why, MAX_WHY, "zstd could not make a decompression context");
        for (Py_ssize_t i = 0; d != NULL && i < count; i++) {
            Py_ssize_t at = i * chunk, want = out.len - at < chunk ? out.len - at : chunk;
            if (one_frame(d, (const char *)frames[i].buf, (size_t)frames[i].len, dst + at,
                          (size_t)want, why) < 0)
                break;
        }
        Py_END_ALLOW_THREADS
        if (why[0]) {
            PyErr_SetString(PyExc_ValueError, why);
            bad = -1;
        }
    }
    for (Py_ssize_t k = 0; k < got; k++) PyBuffer_Release(&frames[k]);
    PyMem_Free(frames);
    Py_DECREF(fast);
    PyBuffer_Release(&out);
    if (bad) return NULL;
    Py_RETURN_NONE;
}

static PyObject *version(PyObject *self, PyObject *args) {
    return PyLong_FromUnsignedLong(version_number ? version_number() : 0);
}

static PyMethodDef methods[] = {
    {"unframe", unframe, METH_VARARGS,
     "unframe(frames, chunk, out): frame i of frames decompressed into out[i * chunk:], "
     "exactly min(chunk, rest) bytes each, outside the GIL."},
    {"version", version, METH_NOARGS, "The zstd library's version number; 0: none found."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_zframes",
                                    "A small stream's zstd frames in one call (tpde.codec.unframe).",
                                    -1, methods};

static int zstd_found(void) { return version_number != NULL; }

static const zframes_api api = {zstd_found, thread_dctx, one_frame};

PyMODINIT_FUNC PyInit__zframes(void) {
#ifdef ZFRAMES_DLOPEN
    open_zstd();
#endif
    return module_with_api(&module, &api, ZFRAMES_API);
}
