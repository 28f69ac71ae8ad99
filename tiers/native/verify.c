/* tiers._verify: copy a block out of the nvme tier's map and check its xxh3-64 on the way.
 *
 * verified_copy(src, dst, checksum) -> bool
 *   src       a readable contiguous buffer (a value of an LMDB read transaction)
 *   dst       a writable contiguous buffer of at least len(src) bytes
 *   checksum  the xxh3-64 put stored for src, an int in [0, 2**64)
 *
 * Copies all of src into the start of dst and returns whether its xxh3-64 equals checksum; when
 * it does not, dst holds unspecified bytes (the caller reports the block corrupt and never hands
 * them on). ``verified_copy`` is one of the two ways below, chosen at import (``ONE_PASS`` says
 * which); both are exported for the tests and the benchmarks.
 *
 * one_pass: the map is read from memory once. Each 64-byte stripe of XXH3's long-input loop is
 * accumulated and then stored into dst from the registers and L1 the accumulation just filled,
 * the map prefetched PREFETCH_AHEAD bytes ahead (the stripes' loads wait on memory otherwise:
 * 0.46-0.56x of raw LMDB at 256 KiB without it, 0.78-0.86x with it), and from STREAM_FROM on dst
 * is written with non-temporal stores, as glibc's memcpy does for copies that size, so a
 * destination larger than the cache is not read in before it is overwritten. The steps and
 * their order are XXH3_hashLong_64b_internal's, with xxHash's own kernels, so the digest is
 * XXH3_64bits' (tests/test_nvme_tier.py checks every length class against xxhash). Chosen where
 * xxHash's dispatcher picks AVX-512: at 256 KiB it copies and checks at 0.96-0.99x of a bare
 * memcpy here, where with AVX2 kernels the same loop (or one accumulating a whole 1 KiB block
 * before copying it) ran at 0.70-0.77x and two_pass with xxHash's AVX2 kernel at 0.81-0.86x.
 *
 * two_pass: a block of at most WHOLE_MAX bytes is hashed whole and then copied out of L2 (not
 * copied when it fails); a longer one in PIECE-byte pieces, each hashed while the next is
 * prefetched and then copied out of L1, streamed from STREAM_FROM on. What Python's version (tiers.nvme_stored.verified_copy_py) does,
 * in one call.
 *
 * read_plain(get, keys, entries, ops, dsts, plain_codec, start, sizes, corrupt) -> int
 *   The loop of tiers.nvme_stored.read_batch over its plain blocks, from ``start``: for
 *   block i, ``stored = get(keys[i])`` (the get of a read transaction begun on the payloads'
 *   database: no keyword to parse, ~0.06 us a block), then
 *   verified_copy(stored, dsts[i], entries[i].checksum) after checking len(stored) against
 *   entries[i].stored_len; appends entries[i].payload_len to ``sizes`` (None when the key is
 *   gone since the index lookup, None and i to ``corrupt`` when the check fails). It stops, and
 *   returns i, at a block that is not plain: no entry, a queued put (ops[i] not None), a codec
 *   other than ``plain_codec``; len(keys) when done. ``entries`` are the tier's Entry named
 *   tuples (payload_len, stored_len, codec and checksum at 1, 2, 4 and 5). In C because the
 *   Python loop spent ~0.9 us a block around each copy, more than raw LMDB's own loop (~0.6).
 *
 * The GIL is released for the copy: src stays valid because the caller's read transaction is
 * open on its own thread until the call returns, and LMDB never rewrites a page a live reader
 * sees. xxHash is vendored unchanged in tiers/native/xxhash; on x86-64 its kernels are chosen
 * as its dispatcher chooses (SSE2, AVX2 or AVX-512); elsewhere the portable build, two_pass
 * only, and plain stores.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "copy.h"

#if defined(__x86_64__) || defined(_M_X64)
#include "xxhash/xxh_x86dispatch.c"
#include <emmintrin.h>
#define HASH_ONESHOT XXH3_64bits_dispatch
#define HASH_UPDATE XXH3_64bits_update_dispatch
#define X86 1
#else
#define XXH_INLINE_ALL
#include "xxhash/xxhash.h"
#define HASH_ONESHOT XXH3_64bits
#define HASH_UPDATE XXH3_64bits_update
#define X86 0
#endif

/* Chosen on a 2-vCPU AMD EPYC (L2 1 MiB a core, L3 32 MiB) against a bare copy of the same
 * pages and against each other; the figures are each copy's speed against the bare one. */
#define PREFETCH_AHEAD (8 * 1024)       /* 4, 16 and 32 KiB: 0.77 / 0.80 / 0.78x at 256 KiB */
#define STREAM_FROM (16 * 1024 * 1024) /* streamed from 2 MiB: 0.51-0.67x, dst stays in L3 */
#define WHOLE_MAX (512 * 1024)         /* two_pass: hashed whole, then copied out of L2 */
#define PIECE (4 * 1024)               /* two_pass: 2-16 KiB pieces measured the same */

/* Non-temporal stores (x86-64 only): whether a copy of n bytes into ``to`` takes them; a
 * stripe, or n bytes (to 16-byte aligned, a tail under a stripe stored plainly), copied so; the
 * fence after the last, before the caller reads dst. */
static int streams(const char *to, size_t n) { return X86 && n >= STREAM_FROM && ((uintptr_t)to & 15) == 0; }

XXH_FORCE_INLINE void store_stripe(char *to, const xxh_u8 *from, int stream) {
#if X86
    if (stream) {
        for (int i = 0; i < XXH_STRIPE_LEN; i += 16)
            _mm_stream_si128((__m128i *)(to + i), _mm_loadu_si128((const __m128i *)(from + i)));
        return;
    }
#endif
    memcpy(to, from, XXH_STRIPE_LEN);
}

static void copy_piece(char *to, const char *from, size_t n, int stream) {
    size_t i = 0;
    if (stream)
        for (; i + XXH_STRIPE_LEN <= n; i += XXH_STRIPE_LEN)
            store_stripe(to + i, (const xxh_u8 *)from + i, 1);
    kv_copy(to + i, from + i, n - i);
}

static void end_streaming(int stream) {
#if X86
    if (stream)
        _mm_sfence();
#else
    (void)stream;
#endif
}

#if X86
typedef void (*accumulate_512_fn)(void *XXH_RESTRICT, const void *XXH_RESTRICT, const void *XXH_RESTRICT);

/* Stripes [first, first + count) of the block at in, each accumulated, then stored at to. */
XXH_FORCE_INLINE void stripes(xxh_u64 *acc, char *to, const xxh_u8 *in, size_t count, const xxh_u8 *secret,
                              const xxh_u8 *prefetch_end, int stream, accumulate_512_fn f_acc512) {
    for (size_t s = 0; s < count; s++) {
        const xxh_u8 *p = in + s * XXH_STRIPE_LEN;
        if (p + PREFETCH_AHEAD < prefetch_end)
            XXH_PREFETCH(p + PREFETCH_AHEAD);
        f_acc512(acc, p, secret + s * XXH_SECRET_CONSUME_RATE);
        store_stripe(to + s * XXH_STRIPE_LEN, p, stream);
    }
}

XXH_FORCE_INLINE int fused_long(char *to, const char *from, size_t n, XXH64_hash_t checksum,
                                accumulate_512_fn f_acc512, XXH3_f_scrambleAcc f_scramble) {
    const xxh_u8 *secret = XXH3_kSecret;
    const size_t secret_size = sizeof(XXH3_kSecret);
    const size_t per_block = (secret_size - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE;
    const size_t block_len = XXH_STRIPE_LEN * per_block;
    const size_t blocks = (n - 1) / block_len;
    const xxh_u8 *in = (const xxh_u8 *)from, *end = in + n;
    int stream = streams(to, n);
    XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    for (size_t ahead = 0; ahead < PREFETCH_AHEAD && ahead < n; ahead += 64)
        XXH_PREFETCH(in + ahead);
    for (size_t b = 0; b < blocks; b++) {
        size_t at = b * block_len;
        stripes(acc, to + at, in + at, per_block, secret, end, stream, f_acc512);
        f_scramble(acc, secret + secret_size - XXH_STRIPE_LEN);
    }
    size_t at = blocks * block_len;
    size_t last = ((n - 1) - at) / XXH_STRIPE_LEN; /* the last block's whole stripes, not its end */
    stripes(acc, to + at, in + at, last, secret, end, stream, f_acc512);
    at += last * XXH_STRIPE_LEN;
    memcpy(to + at, in + at, n - at);
    f_acc512(acc, end - XXH_STRIPE_LEN, secret + secret_size - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);
    end_streaming(stream);
    return XXH3_finalizeLong_64b(acc, secret, (xxh_u64)n) == checksum;
}

#define FUSED_FOR(name, target)                                                                    \
    target static int fused_##name(char *to, const char *from, size_t n, XXH64_hash_t checksum) {   \
        return fused_long(to, from, n, checksum, XXH3_accumulate_512_##name, XXH3_scrambleAcc_##name); \
    }
FUSED_FOR(sse2, XXH_TARGET_SSE2)
#if XXH_DISPATCH_AVX2
FUSED_FOR(avx2, XXH_TARGET_AVX2)
#endif
#if XXH_DISPATCH_AVX512
FUSED_FOR(avx512, XXH_TARGET_AVX512)
#endif

static int (*fused)(char *, const char *, size_t, XXH64_hash_t) = fused_sse2;
#endif

static int two_pass_long(char *to, const char *from, size_t n, XXH64_hash_t checksum) {
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    int stream = streams(to, n);
    for (size_t at = 0; at < n; at += PIECE) {
        size_t piece = n - at < PIECE ? n - at : PIECE;
        for (size_t ahead = at + PIECE; ahead < at + 2 * PIECE && ahead < n; ahead += 64)
            XXH_PREFETCH(from + ahead); /* the next piece, while this one is hashed and copied */
        HASH_UPDATE(&state, from + at, piece);
        copy_piece(to + at, from + at, piece, stream);
    }
    end_streaming(stream);
    return XXH3_64bits_digest(&state) == checksum;
}

enum { TWO_PASS = 0, ONE_PASS = 1 };
static int chosen = TWO_PASS;

/* Without the GIL. */
static int copy_verified(char *to, const char *from, size_t n, XXH64_hash_t checksum, int how) {
#if X86
    if (how == ONE_PASS && n > XXH3_MIDSIZE_MAX)
        return fused(to, from, n, checksum);
#else
    (void)how;
#endif
    if (n > WHOLE_MAX)
        return two_pass_long(to, from, n, checksum);
    if (HASH_ONESHOT(from, n) != checksum)
        return 0;
    kv_copy(to, from, n);
    return 1;
}

/* copy_verified of src into dst without the GIL: 1 good, 0 failed its check, -1 error set
 * (dst too small, nothing copied). */
static int copy_buffers(Py_buffer *src, Py_buffer *dst, XXH64_hash_t checksum, int how) {
    if (dst->len < src->len) {
        PyErr_Format(PyExc_ValueError, "the destination holds %zd bytes, the block %zd", dst->len, src->len);
        return -1;
    }
    int good;
    Py_BEGIN_ALLOW_THREADS
    good = copy_verified((char *)dst->buf, (const char *)src->buf, (size_t)src->len, checksum, how);
    Py_END_ALLOW_THREADS
    return good;
}

static PyObject *call(PyObject *args, int how) {
    Py_buffer src, dst;
    PyObject *checksum_obj;
    if (!PyArg_ParseTuple(args, "y*w*O", &src, &dst, &checksum_obj))
        return NULL;
    PyObject *result = NULL;
    unsigned long long checksum = PyLong_AsUnsignedLongLong(checksum_obj);
    if (!(checksum == (unsigned long long)-1 && PyErr_Occurred())) {
        int good = copy_buffers(&src, &dst, (XXH64_hash_t)checksum, how);
        result = good < 0 ? NULL : PyBool_FromLong(good);
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}

static int append_index(PyObject *list, Py_ssize_t i) {
    PyObject *o = PyLong_FromSsize_t(i);
    if (o == NULL)
        return -1;
    int r = PyList_Append(list, o);
    Py_DECREF(o);
    return r;
}

/* One block of read_plain: 1 copied and verified, 0 failed its check, -1 error set. */
static int plain_block(PyObject *stored, PyObject *dst_obj, PyObject *entry) {
    Py_ssize_t stored_len = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 2));
    unsigned long long checksum = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(entry, 5));
    if (PyErr_Occurred())
        return -1;
    Py_buffer src, dst;
    if (PyObject_GetBuffer(stored, &src, PyBUF_SIMPLE) < 0)
        return -1;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&src);
        return -1;
    }
    int good = src.len == stored_len ? copy_buffers(&src, &dst, (XXH64_hash_t)checksum, chosen) : 0;
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return good;
}

static PyObject *read_plain(PyObject *self, PyObject *args) {
    PyObject *get, *keys, *entries, *ops, *dsts, *plain_codec, *sizes, *corrupt;
    Py_ssize_t i;
    if (!PyArg_ParseTuple(args, "OO!O!O!O!OnO!O!", &get, &PyList_Type, &keys, &PyList_Type, &entries,
                          &PyList_Type, &ops, &PyList_Type, &dsts, &plain_codec, &i, &PyList_Type, &sizes,
                          &PyList_Type, &corrupt))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    if (PyList_GET_SIZE(entries) < n || PyList_GET_SIZE(ops) < n || PyList_GET_SIZE(dsts) < n || i < 0) {
        PyErr_SetString(PyExc_ValueError, "entries, ops and dsts must cover keys, and start be >= 0");
        return NULL;
    }
    PyObject *result = NULL;
    for (; i < n; i++) {
        PyObject *entry = PyList_GET_ITEM(entries, i);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) < 6 || PyList_GET_ITEM(ops, i) != Py_None ||
            PyTuple_GET_ITEM(entry, 4) != plain_codec)
            break; /* not plain: the caller's Python loop reads it */
        PyObject *stored = PyObject_CallOneArg(get, PyList_GET_ITEM(keys, i));
        if (stored == NULL)
            goto done;
        PyObject *size = Py_None;
        Py_INCREF(size);
        if (stored != Py_None) {
            int good = plain_block(stored, PyList_GET_ITEM(dsts, i), entry);
            if (good < 0) {
                Py_DECREF(stored);
                Py_DECREF(size);
                goto done;
            }
            if (good) {
                Py_DECREF(size);
                size = PyTuple_GET_ITEM(entry, 1);
                Py_INCREF(size);
            } else if (append_index(corrupt, i) < 0) {
                Py_DECREF(stored);
                Py_DECREF(size);
                goto done;
            }
        }
        Py_DECREF(stored);
        int appended = PyList_Append(sizes, size);
        Py_DECREF(size);
        if (appended < 0)
            goto done;
    }
    result = PyLong_FromSsize_t(i);
done:
    return result;
}

static PyObject *verified_copy(PyObject *self, PyObject *args) { return call(args, chosen); }
static PyObject *one_pass(PyObject *self, PyObject *args) { return call(args, ONE_PASS); }
static PyObject *two_pass(PyObject *self, PyObject *args) { return call(args, TWO_PASS); }

static PyMethodDef methods[] = {
    {"verified_copy", verified_copy, METH_VARARGS, "Copy a block and check its xxh3-64; see the module source."},
    {"one_pass", one_pass, METH_VARARGS, "verified_copy, hashing and storing each stripe in one pass."},
    {"two_pass", two_pass, METH_VARARGS, "verified_copy, hashing each piece and then copying it."},
    {"read_plain", read_plain, METH_VARARGS, "get_into_many's loop over plain blocks; see the module source."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_verify", NULL, -1, methods};

PyMODINIT_FUNC PyInit__verify(void) {
#if X86
    int vector = XXH_featureTest();
#if XXH_DISPATCH_AVX2
    if (vector >= XXH_AVX2)
        fused = fused_avx2;
#endif
#if XXH_DISPATCH_AVX512
    if (vector >= XXH_AVX512) {
        fused = fused_avx512;
        chosen = ONE_PASS;
    }
#endif
    (void)vector;
#endif
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObject(m, "ONE_PASS", PyBool_FromLong(chosen == ONE_PASS)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
