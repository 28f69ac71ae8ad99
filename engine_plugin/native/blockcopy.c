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
 * One memcpy per part of each block, block after block (the stored block is read or written in
 * order), without the GIL. The caller (kv_layout.BlockCopier) has checked every id against the
 * cache and every buffer's size: this module trusts its arguments.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

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
                memcpy(block + part[2], cache, (size_t)part[3]);
            else
                memcpy(cache, block + part[2], (size_t)part[3]);
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

static PyMethodDef methods[] = {
    {"copy_blocks", copy_blocks, METH_VARARGS, "Copy whole KV blocks by address; see the module source."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_blockcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__blockcopy(void) { return PyModule_Create(&module); }
