/* tiers._verify: copy a block out of the nvme tier's map and check its xxh3-64 in one pass.
 *
 * verified_copy(src, dst, checksum) -> bool
 *   src       a readable contiguous buffer (a value of an LMDB read transaction)
 *   dst       a writable contiguous buffer of at least len(src) bytes
 *   checksum  the xxh3-64 put stored for src, an int in [0, 2**64)
 *
 * Copies all of src into the start of dst and returns whether its xxh3-64 equals checksum. The
 * map's pages are read from memory once: a block of at most WHOLE_MAX is hashed whole and then
 * copied from L2 (and not copied at all when it fails); a longer one goes PIECE bytes at a time,
 * each hashed while the next is prefetched and then copied from L1, and from STREAM_FROM on the
 * copy bypasses the caches (non-temporal stores) as glibc's memcpy does for copies that size, so
 * a destination larger than the cache is not read in before it is overwritten. A long block that
 * fails leaves dst holding what was copied; the caller reports it corrupt and never hands dst's
 * bytes on. Python's version (tiers.nvme.verified_copy without this module) hashes and copies
 * 1 MiB chunks, one call each, and a warm 32 MiB read paid 10-15% for it against raw LMDB's
 * bare copy (BENCHMARKS.md, "Tiers").
 *
 * The GIL is released for the pass: src stays valid because the caller's read transaction is
 * open on its own thread until the call returns, and LMDB never rewrites a page a live reader
 * sees. The hash is xxHash's own (tiers/native/xxhash, vendored unchanged): on x86-64 its
 * dispatcher picks SSE2, AVX2 or AVX-512 at run time as the xxhash Python package does;
 * elsewhere the portable build, and plain copies.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include "xxhash/xxh_x86dispatch.c"
#include <emmintrin.h>
#define HASH_UPDATE XXH3_64bits_update_dispatch
#define HASH_ONESHOT XXH3_64bits_dispatch
#define HAVE_STREAM 1
#else
#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"
#define HASH_UPDATE XXH3_64bits_update
#define HASH_ONESHOT XXH3_64bits
#define HAVE_STREAM 0
#endif

/* Chosen on a 2-vCPU AMD EPYC (L2 1 MiB a core, L3 32 MiB), each against the others and a bare
 * copy of the same pages (BENCHMARKS.md, "Tiers", sitting 25): pieces of 2-16 KiB, prefetched
 * 4-16 KiB ahead, the whole block up to 0-512 KiB, streamed stores from 1-16 MiB, and a fused
 * loop (each 1 KiB block of XXH3's long loop copied, then accumulated from L1: 0.47x at 256 KiB,
 * slower than any of these). */
#define WHOLE_MAX (512 * 1024)
#define PIECE (4 * 1024)
#define STREAM_FROM (16 * 1024 * 1024)

#if HAVE_STREAM
static void stream_copy(char *to, const char *from, size_t n) {
    size_t head = (16 - ((uintptr_t)to & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(to, from, head);
    to += head, from += head, n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(from + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(from + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(from + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(from + i + 48));
        _mm_stream_si128((__m128i *)(to + i), a);
        _mm_stream_si128((__m128i *)(to + i + 16), b);
        _mm_stream_si128((__m128i *)(to + i + 32), c);
        _mm_stream_si128((__m128i *)(to + i + 48), d);
    }
    memcpy(to + i, from + i, n - i);
}
#endif

static int copy_in_pieces(char *to, const char *from, size_t n, XXH64_hash_t checksum) {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    int stream = HAVE_STREAM && n >= STREAM_FROM;
    for (size_t at = 0; at < n; at += PIECE) {
        size_t piece = n - at < PIECE ? n - at : PIECE;
        for (size_t ahead = at + PIECE; ahead < at + 2 * PIECE && ahead < n; ahead += 64)
            __builtin_prefetch(from + ahead, 0, 3);
        HASH_UPDATE(&state, from + at, piece);
#if HAVE_STREAM
        if (stream) {
            stream_copy(to + at, from + at, piece);
            continue;
        }
#endif
        memcpy(to + at, from + at, piece);
    }
#if HAVE_STREAM
    if (stream)
        _mm_sfence(); /* the streamed stores are visible before the caller reads dst */
#endif
    return XXH3_64bits_digest(&state) == checksum;
}

static PyObject *verified_copy(PyObject *self, PyObject *args) {
    Py_buffer src, dst;
    PyObject *checksum_obj;
    if (!PyArg_ParseTuple(args, "y*w*O", &src, &dst, &checksum_obj))
        return NULL;
    PyObject *result = NULL;
    unsigned long long checksum = PyLong_AsUnsignedLongLong(checksum_obj);
    if (checksum == (unsigned long long)-1 && PyErr_Occurred())
        goto done;
    if (dst.len < src.len) {
        PyErr_Format(PyExc_ValueError, "the destination holds %zd bytes, the block %zd", dst.len, src.len);
        goto done;
    }
    const char *from = (const char *)src.buf;
    char *to = (char *)dst.buf;
    size_t n = (size_t)src.len;
    int good;
    Py_BEGIN_ALLOW_THREADS
    if (n <= WHOLE_MAX) {
        good = HASH_ONESHOT(from, n) == (XXH64_hash_t)checksum;
        if (good)
            memcpy(to, from, n);
    } else {
        good = copy_in_pieces(to, from, n, (XXH64_hash_t)checksum);
    }
    Py_END_ALLOW_THREADS
    result = PyBool_FromLong(good);
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static PyMethodDef methods[] = {
    {"verified_copy", verified_copy, METH_VARARGS, "Copy a block and check its xxh3-64; see the module source."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_verify", NULL, -1, methods};

PyMODINIT_FUNC PyInit__verify(void) { return PyModule_Create(&module); }
