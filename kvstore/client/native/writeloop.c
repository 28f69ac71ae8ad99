/* kvstore.client._writeloop: the steady state of a pipelined same-host write, in one call.
 *
 * steps(fd, region, name, deadline, op_timeout, buffered, coming, counts, requests, blocks,
 *       unconfirmed, k, ahead) -> (k, stored, leftover)
 *
 * The loop of ``kvstore.client.inplace.write_pipelined`` from chunk ``k`` on: read the answers
 * due (``coming``: chunk j's reserve for j >= 0, a commit for -1) until chunk k's reserve is
 * in, copy chunk k's blocks into the slots it names, send chunk k's commit with the reserve of
 * chunk k + ahead (``requests[k + ahead]``), and so on; after the last chunk, read the commits
 * still due. ``coming`` and ``unconfirmed`` are updated as in Python (a reserve's id appended
 * when its answer is read, the oldest popped when a commit's answer is), so a failure leaves
 * them exact for the caller's abort.
 *
 * It stops, without consuming it, at any answer that is not the plain case: a status other
 * than OK, a reserve answer naming another arena or a block without a slot, a slot outside the
 * region or smaller than its block, a block whose buffer it cannot take as it is. It returns the chunk it stopped at (len(counts) when all
 * are done and every answer read), the blocks the commits it read stored, and the bytes read
 * past what it consumed, for the caller's stream to read first; the caller's Python loop goes
 * on from there and deals with that answer as it always has.
 *
 * Socket reads and writes are non-blocking calls waited for with poll: each bounded by
 * ``deadline`` (a time.monotonic() value) or, when it is negative, by ``op_timeout`` seconds;
 * past it, TimeoutError. The peer closing: ConnectionError. The GIL is released while waiting
 * and copying. The same-host data port is a Unix socket: no TLS here.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#include "copy.h"

#define OP_COMMIT 7
#define SLOT_RECORD 17 /* present (1), offset (8), size (8) */

typedef struct {
    int fd;
    double deadline;   /* time.monotonic(), or negative: op_timeout per wait */
    double op_timeout; /* seconds */
    char *buf;
    size_t cap, start, end;
} conn_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Wait until fd is ready for ``events``; -1 with a Python error set on timeout or failure. */
static int wait_for(conn_t *c, short events) {
    for (;;) {
        int ms;
        if (c->deadline >= 0) {
            double left = c->deadline - now_s();
            if (left <= 0) {
                PyErr_SetString(PyExc_TimeoutError, "timed out");
                return -1;
            }
            ms = (int)(left * 1000.0) + 1;
        } else {
            ms = (int)(c->op_timeout * 1000.0) + 1;
        }
        struct pollfd p = {c->fd, events, 0};
        int r;
        Py_BEGIN_ALLOW_THREADS
        r = poll(&p, 1, ms);
        Py_END_ALLOW_THREADS
        if (r > 0)
            return 0;
        if (r == 0) {
            if (c->deadline >= 0)
                continue; /* re-checked against the deadline above */
            PyErr_SetString(PyExc_TimeoutError, "timed out");
            return -1;
        }
        if (errno == EINTR) {
            if (PyErr_CheckSignals() < 0)
                return -1;
            continue;
        }
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
}

/* After a recv or sendmsg that failed: 0 to try again (it would have blocked and fd is ready
 * now, or a signal came and its handler did not raise); -1 with a Python error set. */
static int after_failure(conn_t *c, short events) {
    if (errno == EAGAIN || errno == EWOULDBLOCK)
        return wait_for(c, events);
    if (errno == EINTR)
        return PyErr_CheckSignals();
    PyErr_SetFromErrno(PyExc_OSError);
    return -1;
}

/* Have at least ``n`` unread bytes buffered; -1 with a Python error set. */
static int fill(conn_t *c, size_t n) {
    if (c->end - c->start >= n)
        return 0;
    if (c->start + n > c->cap) { /* move what is left to the front, growing if it must */
        size_t left = c->end - c->start;
        if (n > c->cap) {
            size_t cap = n > 2 * c->cap ? n : 2 * c->cap;
            char *bigger = PyMem_Malloc(cap);
            if (bigger == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            memcpy(bigger, c->buf + c->start, left);
            PyMem_Free(c->buf);
            c->buf = bigger;
            c->cap = cap;
        } else {
            memmove(c->buf, c->buf + c->start, left);
        }
        c->start = 0;
        c->end = left;
    }
    while (c->end - c->start < n) {
        ssize_t got;
        Py_BEGIN_ALLOW_THREADS
        got = recv(c->fd, c->buf + c->end, c->cap - c->end, MSG_DONTWAIT);
        Py_END_ALLOW_THREADS
        if (got > 0) {
            c->end += (size_t)got;
            continue;
        }
        if (got == 0) {
            PyErr_SetString(PyExc_ConnectionError, "peer closed the data connection mid-message");
            return -1;
        }
        if (after_failure(c, POLLIN) < 0)
            return -1;
    }
    return 0;
}

static int send_all(conn_t *c, struct iovec *iov, int count) {
    while (count > 0) {
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)count;
        ssize_t sent;
        Py_BEGIN_ALLOW_THREADS
        sent = sendmsg(c->fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        Py_END_ALLOW_THREADS
        if (sent < 0) {
            if (after_failure(c, POLLOUT) < 0)
                return -1;
            continue;
        }
        while (count > 0 && (size_t)sent >= iov->iov_len) {
            sent -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov->iov_base = (char *)iov->iov_base + sent;
            iov->iov_len -= (size_t)sent;
        }
    }
    return 0;
}

static uint64_t le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

static const unsigned char OK_FRAME[5] = {0, 0, 0, 0, 0};

/* 1: the next answer starts with an OK status frame (not consumed); 0: it does not; -1 error. */
static int next_is_ok(conn_t *c) {
    if (fill(c, 5) < 0)
        return -1;
    return memcmp(c->buf + c->start, OK_FRAME, 5) == 0;
}

/* Pop coming[0]; -2 with a Python error set when it is empty or not an int. */
static long pop_coming(PyObject *coming) {
    if (PyList_GET_SIZE(coming) == 0) {
        PyErr_SetString(PyExc_RuntimeError, "no answer is due");
        return -2;
    }
    long kind = PyLong_AsLong(PyList_GET_ITEM(coming, 0));
    if (kind == -1 && PyErr_Occurred())
        return -2;
    if (PySequence_DelItem(coming, 0) < 0)
        return -2;
    return kind;
}

static int append_long(PyObject *list, long long v) {
    PyObject *o = PyLong_FromLongLong(v);
    if (o == NULL)
        return -1;
    int r = PyList_Append(list, o);
    Py_DECREF(o);
    return r;
}

/* A commit's answer, when it is the next one due: 1 read (its blocks added to ``stored``, the
 * oldest reservation popped from ``unconfirmed``); 0 not OK, left unread; -1 error. */
static int read_commit(conn_t *c, PyObject *coming, PyObject *unconfirmed, long long *stored) {
    int ok = next_is_ok(c);
    if (ok <= 0)
        return ok;
    if (fill(c, 9) < 0)
        return -1;
    *stored += le32((unsigned char *)c->buf + c->start + 5);
    c->start += 9;
    if (pop_coming(coming) == -2 || PySequence_DelItem(unconfirmed, 0) < 0)
        return -1;
    return 1;
}

static PyObject *steps(PyObject *self, PyObject *args) {
    (void)self;
    int fd;
    PyObject *region_obj, *name_obj, *buffered_obj, *coming, *counts, *requests, *blocks, *unconfirmed;
    double deadline, op_timeout;
    Py_ssize_t k, ahead;
    if (!PyArg_ParseTuple(args, "iOSddSO!O!O!O!O!nn", &fd, &region_obj, &name_obj, &deadline, &op_timeout,
                          &buffered_obj, &PyList_Type, &coming, &PyList_Type, &counts, &PyList_Type, &requests,
                          &PyList_Type, &blocks, &PyList_Type, &unconfirmed, &k, &ahead))
        return NULL;
    Py_ssize_t n_chunks = PyList_GET_SIZE(counts);
    if (PyList_GET_SIZE(requests) != n_chunks || PyList_GET_SIZE(blocks) != n_chunks || ahead < 1 || k < 0) {
        PyErr_SetString(PyExc_ValueError, "counts, requests and blocks differ in length, or bad k/ahead");
        return NULL;
    }
    Py_buffer region;
    if (PyObject_GetBuffer(region_obj, &region, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return NULL;
    const char *name = PyBytes_AS_STRING(name_obj);
    size_t name_len = (size_t)PyBytes_GET_SIZE(name_obj);
    conn_t c = {fd, deadline, op_timeout, NULL, 0, 0, 0};
    size_t given = (size_t)PyBytes_GET_SIZE(buffered_obj);
    c.cap = given > 65536 ? given : 65536;
    c.buf = PyMem_Malloc(c.cap);
    PyObject *result = NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t bufs_cap = 0;
    long long stored = 0;
    if (c.buf == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    memcpy(c.buf, PyBytes_AS_STRING(buffered_obj), given);
    c.end = given;

    while (k < n_chunks) {
        /* Read the answers due until chunk k's reserve is the next one. */
        for (;;) {
            if (PyList_GET_SIZE(coming) == 0) {
                PyErr_SetString(PyExc_RuntimeError, "chunk's reserve answer is not due");
                goto done;
            }
            long kind = PyLong_AsLong(PyList_GET_ITEM(coming, 0));
            if (kind == -1 && PyErr_Occurred())
                goto done;
            if (kind == -1) { /* a commit's answer: OK, then the blocks it stored */
                int read = read_commit(&c, coming, unconfirmed, &stored);
                if (read < 0)
                    goto done;
                if (read == 0)
                    goto stop;
                continue;
            }
            int ok = next_is_ok(&c);
            if (ok < 0)
                goto done;
            if (!ok)
                goto stop;
            if (kind != k) {
                PyErr_Format(PyExc_RuntimeError, "answer of chunk %ld due before chunk %zd's", kind, k);
                goto done;
            }
            break;
        }
        /* Chunk k's reserve answer: OK, name, id, a slot a block. Consumed only if plain. */
        Py_ssize_t n = PyLong_AsSsize_t(PyList_GET_ITEM(counts, k));
        if (n < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "negative block count");
            goto done;
        }
        if (fill(&c, 7) < 0)
            goto done;
        size_t got_name = (size_t)((unsigned char)c.buf[c.start + 5] | ((unsigned char)c.buf[c.start + 6] << 8));
        size_t whole = 7 + got_name + 8 + (size_t)n * SLOT_RECORD;
        if (fill(&c, whole) < 0)
            goto done;
        const unsigned char *p = (unsigned char *)c.buf + c.start;
        if (got_name != name_len || memcmp(p + 7, name, name_len) != 0)
            goto stop;
        uint64_t reservation = le64(p + 7 + got_name);
        const unsigned char *rec = p + 7 + got_name + 8;
        PyObject *chunk = PyList_GET_ITEM(blocks, k);
        if (!PyList_Check(chunk) || PyList_GET_SIZE(chunk) != n) {
            PyErr_SetString(PyExc_ValueError, "a chunk's blocks must be a list of its block count");
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            const unsigned char *r = rec + (size_t)i * SLOT_RECORD;
            uint64_t off = le64(r + 1), size = le64(r + 9);
            if (r[0] == 0 || off > (uint64_t)region.len || size > (uint64_t)region.len - off)
                goto stop; /* a block without a slot, or a slot this mapping cannot hold */
        }
        if (n > bufs_cap) {
            PyMem_Free(bufs);
            bufs = PyMem_Malloc((size_t)n * sizeof(Py_buffer));
            if (bufs == NULL) {
                bufs_cap = 0;
                PyErr_NoMemory();
                goto done;
            }
            bufs_cap = n;
        }
        Py_ssize_t held = 0;
        int fits = 1;
        for (; held < n; held++) {
            if (PyObject_GetBuffer(PyList_GET_ITEM(chunk, held), &bufs[held], PyBUF_C_CONTIGUOUS) < 0)
                break;
            if ((uint64_t)bufs[held].len > le64(rec + (size_t)held * SLOT_RECORD + 9)) {
                fits = 0; /* larger than its slot: the Python loop says so */
                held++;
                break;
            }
        }
        if (held < n || !fits) {
            /* A block whose buffer cannot be had as it is, or larger than its slot: the Python
             * loop meets the same at this chunk and fails it as it always has (its copy raises
             * with the stream between messages, so the reservations sent ahead are read and
             * given back). */
            for (Py_ssize_t i = 0; i < held; i++)
                PyBuffer_Release(&bufs[i]);
            PyErr_Clear();
            goto stop;
        }
        /* Plain: consume it, note the reservation, copy, send the commit with the next reserve. */
        c.start += whole;
        if (pop_coming(coming) == -2 || append_long(unconfirmed, (long long)reservation) < 0) {
            for (Py_ssize_t i = 0; i < n; i++)
                PyBuffer_Release(&bufs[i]);
            goto done;
        }
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            kv_copy((char *)region.buf + le64(rec + (size_t)i * SLOT_RECORD + 1), bufs[i].buf, (size_t)bufs[i].len);
        Py_END_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            PyBuffer_Release(&bufs[i]);
        unsigned char commit[9];
        commit[0] = OP_COMMIT;
        for (int b = 0; b < 8; b++)
            commit[1 + b] = (unsigned char)(reservation >> (8 * b));
        struct iovec iov[2] = {{commit, 9}, {NULL, 0}};
        int count = 1;
        PyObject *next = NULL;
        if (k + ahead < n_chunks) {
            next = PyList_GET_ITEM(requests, k + ahead);
            if (!PyBytes_Check(next)) {
                PyErr_SetString(PyExc_TypeError, "a chunk's reserve request must be bytes");
                goto done;
            }
            iov[1].iov_base = PyBytes_AS_STRING(next);
            iov[1].iov_len = (size_t)PyBytes_GET_SIZE(next);
            count = 2;
        }
        Py_XINCREF(next);
        int sent = send_all(&c, iov, count);
        Py_XDECREF(next);
        if (sent < 0)
            goto done;
        if (append_long(coming, -1) < 0 || (k + ahead < n_chunks && append_long(coming, (long long)(k + ahead)) < 0))
            goto done;
        k++;
    }
    /* Every chunk copied: the commits still due. */
    while (PyList_GET_SIZE(coming) > 0) {
        long kind = PyLong_AsLong(PyList_GET_ITEM(coming, 0));
        if (kind == -1 && PyErr_Occurred())
            goto done;
        if (kind != -1) {
            PyErr_SetString(PyExc_RuntimeError, "a reserve answer is due after the last chunk");
            goto done;
        }
        int read = read_commit(&c, coming, unconfirmed, &stored);
        if (read < 0)
            goto done;
        if (read == 0)
            goto stop;
    }
stop:
    result = Py_BuildValue("nLy#", k, stored, c.buf + c.start, (Py_ssize_t)(c.end - c.start));
done:
    PyMem_Free(bufs);
    PyMem_Free(c.buf);
    PyBuffer_Release(&region);
    return result;
}

static PyMethodDef methods[] = {
    {"steps", steps, METH_VARARGS, "A pipelined same-host write's steady state; see the module source."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_writeloop", NULL, -1, methods};

PyMODINIT_FUNC PyInit__writeloop(void) { return PyModule_Create(&module); }
