/* engine_plugin._blockcopy: whole KV blocks between host buffers and a host KV cache, by address.
 *
 * copy_blocks(gather, blocks, ids, parts, threads)
 *   blocks  u64[n]   address of each stored block's buffer (an arena slot, a staging buffer)
 *   ids     i64[n]   the cache block each one belongs to
 *   parts   i64[p*4] per part of a block (a layer's K or V half): cache base address, bytes
 *                    between cache blocks, offset inside the stored block, size
 *   gather  0: stored blocks into the cache (a restore); 1: the cache into the stored blocks
 *   threads the blocks are split between this many threads (1: the caller's alone)
 *
 * copy_layers(blocks, ids, parts, starts, progress)
 *   a restore a layer at a time, beside the forward pass, on a thread of its own started here
 *   (returns at once; True, or False where no thread could be had and it copied before
 *   returning): layer l is the parts starts[l] .. starts[l+1] (i64[L+1]) of every block; after
 *   each layer the count of layers done is stored into progress[0] (i64[2], writable) with
 *   release ordering, and at the end the copy's nanoseconds into progress[1] first. The thread
 *   takes its own copy of blocks, ids, parts and starts; the caller keeps progress, every
 *   stored block and the cache alive and unchanged until the count reaches L.
 * layers_done(progress)
 *   that count, read with acquire ordering: layer l is in once it exceeds l
 * addresses(buffers, writable)
 *   the address of each contiguous buffer (writable ones only, if asked) as u64[n] bytes: ~0.1 us
 *   a buffer, where numpy's frombuffer takes ~3 us. The caller keeps the buffers alive.
 *
 * One copy (kv_copy, tiers/native/copy.h) per part of each block, block after block (the stored block is read or written in
 * order), without the GIL: copy_layers' thread never takes it, so neither its start nor its
 * layers wait for the forward pass, which holds the GIL, and the forward never waits for it. The caller (kv_layout.BlockCopier)
 * has checked every id against the cache and every buffer's size: this module trusts them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "copy.h"

#define MAX_THREADS 16

typedef struct {
    const uint64_t *blocks;
    const int64_t *ids;
    const int64_t *parts;
    Py_ssize_t first, last, nparts;
    int gather;
} job_t;

static void *run(void *arg) {
    const job_t *j = (const job_t *)arg;
    for (Py_ssize_t i = j->first; i < j->last; i++) {
        char *block = (char *)(uintptr_t)j->blocks[i];
        int64_t id = j->ids[i];
        for (Py_ssize_t p = 0; p < j->nparts; p++) {
            const int64_t *part = j->parts + 4 * p;
            char *cache = (char *)(uintptr_t)part[0] + id * part[1];
            if (j->gather)
                kv_copy(block + part[2], cache, (size_t)part[3]);
            else
                kv_copy(cache, block + part[2], (size_t)part[3]);
        }
    }
    return NULL;
}

static PyObject *copy_blocks(PyObject *self, PyObject *args) {
    int gather, threads;
    Py_buffer blocks, ids, parts;
    if (!PyArg_ParseTuple(args, "py*y*y*i", &gather, &blocks, &ids, &parts, &threads))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = blocks.len / 8, nparts = parts.len / 32;
    if (blocks.len % 8 || ids.len != blocks.len || parts.len % 32) {
        PyErr_SetString(PyExc_ValueError, "blocks, ids and parts have inconsistent lengths");
        goto done;
    }
    if (threads < 1)
        threads = 1;
    if (threads > MAX_THREADS)
        threads = MAX_THREADS;
    if (threads > n)
        threads = n > 0 ? (int)n : 1;
    job_t jobs[MAX_THREADS];
    pthread_t tids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < threads; t++) {
        jobs[t] = (job_t){blocks.buf, ids.buf, parts.buf, n * t / threads, n * (t + 1) / threads, nparts, gather};
        if (t > 0)
            started[t] = pthread_create(&tids[t], NULL, run, &jobs[t]) == 0;
    }
    for (int t = 1; t < threads; t++)
        if (!started[t])
            run(&jobs[t]); /* no thread to be had: this one copies that share too */
    run(&jobs[0]);
    for (int t = 1; t < threads; t++)
        if (started[t])
            pthread_join(tids[t], NULL);
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&blocks);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&parts);
    return result;
}

typedef struct {
    int64_t *progress;
    Py_ssize_t n, nlayers;
    const uint64_t *blocks;
    const int64_t *ids, *parts, *starts;
} layers_t; /* one allocation: this header, then blocks, ids, starts and parts */

static void copy_each_layer(const layers_t *j) {
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (Py_ssize_t l = 0; l < j->nlayers; l++) {
        const int64_t *s = j->starts;
        job_t job = {j->blocks, j->ids, j->parts + 4 * s[l], 0, j->n, s[l + 1] - s[l], 0};
        run(&job);
        if (l + 1 == j->nlayers) {
            clock_gettime(CLOCK_MONOTONIC, &t1);
            int64_t ns = (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000 + (t1.tv_nsec - t0.tv_nsec);
            __atomic_store_n(j->progress + 1, ns, __ATOMIC_RELAXED);
        }
        __atomic_store_n(j->progress, (int64_t)(l + 1), __ATOMIC_RELEASE);
    }
}

static void *run_layers(void *arg) {
    copy_each_layer((const layers_t *)arg);
    free(arg);
    return NULL;
}

static PyObject *copy_layers(PyObject *self, PyObject *args) {
    Py_buffer blocks, ids, parts, starts, progress;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*", &blocks, &ids, &parts, &starts, &progress))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = blocks.len / 8, nparts = parts.len / 32, nlayers = starts.len / 8 - 1;
    const int64_t *s = starts.buf;
    if (blocks.len % 8 || ids.len != blocks.len || parts.len % 32 || starts.len % 8 || nlayers < 0 ||
        progress.len < 16) {
        PyErr_SetString(PyExc_ValueError, "blocks, ids, parts, starts and progress have inconsistent lengths");
        goto done;
    }
    for (Py_ssize_t l = 0; l < nlayers; l++)
        if (s[l] < 0 || s[l] > s[l + 1] || s[l + 1] > nparts) {
            PyErr_SetString(PyExc_ValueError, "a layer's parts lie outside the parts given");
            goto done;
        }
    char *mem = malloc(sizeof(layers_t) + blocks.len + ids.len + starts.len + parts.len);
    if (mem == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    layers_t *job = (layers_t *)mem;
    char *at = mem + sizeof(layers_t);
    memcpy(at, blocks.buf, blocks.len);
    job->blocks = (const uint64_t *)at;
    at += blocks.len;
    memcpy(at, ids.buf, ids.len);
    job->ids = (const int64_t *)at;
    at += ids.len;
    memcpy(at, starts.buf, starts.len);
    job->starts = (const int64_t *)at;
    at += starts.len;
    memcpy(at, parts.buf, parts.len);
    job->parts = (const int64_t *)at;
    job->progress = progress.buf;
    job->n = n;
    job->nlayers = nlayers;
    int64_t *count = progress.buf;
    count[0] = 0;
    count[1] = 0;
    pthread_attr_t attr;
    pthread_t tid;
    int started = pthread_attr_init(&attr) == 0;
    if (started) {
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        started = pthread_create(&tid, &attr, run_layers, job) == 0;
        pthread_attr_destroy(&attr);
    }
    if (!started) { /* no thread to be had: copy here, still without the GIL */
        Py_BEGIN_ALLOW_THREADS
        copy_each_layer(job);
        Py_END_ALLOW_THREADS
        free(job);
    }
    result = PyBool_FromLong(started);
done:
    PyBuffer_Release(&blocks);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&parts);
    PyBuffer_Release(&starts);
    PyBuffer_Release(&progress);
    return result;
}

static PyObject *layers_done(PyObject *self, PyObject *args) {
    Py_buffer progress;
    if (!PyArg_ParseTuple(args, "y*", &progress))
        return NULL;
    if (progress.len < 8) {
        PyBuffer_Release(&progress);
        PyErr_SetString(PyExc_ValueError, "progress holds no count");
        return NULL;
    }
    int64_t done = __atomic_load_n((const int64_t *)progress.buf, __ATOMIC_ACQUIRE);
    PyBuffer_Release(&progress);
    return PyLong_FromLongLong(done);
}

static PyObject *addresses(PyObject *self, PyObject *args) {
    PyObject *seq;
    int writable;
    if (!PyArg_ParseTuple(args, "Op", &seq, &writable))
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "buffers must be a sequence");
    if (fast == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 8);
    if (out == NULL) {
        Py_DECREF(fast);
        return NULL;
    }
    uint64_t *dst = (uint64_t *)PyBytes_AS_STRING(out);
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer view;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, i), &view, flags) < 0) {
            Py_DECREF(out);
            Py_DECREF(fast);
            return NULL;
        }
        dst[i] = (uint64_t)(uintptr_t)view.buf;
        PyBuffer_Release(&view);
    }
    Py_DECREF(fast);
    return out;
}

static PyMethodDef methods[] = {
    {"addresses", addresses, METH_VARARGS, "The address of each buffer; see the module source."},
    {"copy_blocks", copy_blocks, METH_VARARGS, "Copy whole KV blocks by address; see the module source."},
    {"copy_layers", copy_layers, METH_VARARGS, "Restore KV blocks a layer at a time; see the module source."},
    {"layers_done", layers_done, METH_VARARGS, "Layers copy_layers has finished; see the module source."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockcopy(void) { return PyModule_Create(&module); }
