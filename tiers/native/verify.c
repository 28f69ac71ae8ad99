/* tiers._verify: copy a block out of the nvme tier's map and check its xxh3-64 on the way.
 *
 * verified_copy(src, dst, checksum) -> bool
 *   src       a readable contiguous buffer (a value of an LMDB read transaction)
 *   dst       a writable contiguous buffer of at least len(src) bytes
 *   checksum  the xxh3-64 put stored for src, an int in [0, 2**64)
 *
 * Copies all of src into the start of dst and returns whether its xxh3-64 equals checksum; when
 * it does not, dst holds unspecified bytes (the caller reports the block corrupt and never hands
 * them on). ``verified_copy`` copies the way hashed_copy.h chooses for this CPU (``ONE_PASS``
 * says which); one_pass and two_pass, each way alone, are exported for the tests and the
 * benchmarks. A block of at most WHOLE_MAX bytes that two_pass takes is hashed whole and not
 * copied when it fails. What Python's version (tiers.nvme_stored.verified_copy_py) does, in one
 * call.
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
 * sees.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "hashed_copy.h"

/* Without the GIL. */
static int copy_verified(char *to, const char *from, size_t n, XXH64_hash_t checksum, int how) {
    if (!in_one_pass(n, how) && n <= WHOLE_MAX) { /* hashed whole: a block that fails is not copied */
        if (HASH_ONESHOT(from, n) != checksum)
            return 0;
        kv_copy(to, from, n);
        return 1;
    }
    return copy_hashing(to, from, n, how) == checksum;
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
    hashed_copy_choose();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObject(m, "ONE_PASS", PyBool_FromLong(chosen == ONE_PASS)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
