/* zkv.scheduler._chainhash: the native path of zkv/scheduler/hashing.py.
 *
 * The same chain as the pure-Python reference, one XXH3-128 per block over
 *
 *     +-----------------+-------------------------------+---------------------+
 *     | parent (16 B)   | payload: block_size x int32 LE | extra (0 or more B) |
 *     +-----------------+-------------------------------+---------------------+
 *
 * (for hash_id_list the payload is one int64 LE id), each digest in XXH3-128's canonical
 * (big-endian) form, as ``xxhash.xxh3_128_digest`` returns it. One buffer is reused for
 * every block: the digest of block i is written over the parent slot for block i+1, so
 * a token list is converted and hashed in one pass with no intermediate array.
 *
 *     hash_tokens(tokens, block_size, parent, extras) -> list[bytes] | None
 *     hash_id_list(ids, parent)                       -> list[bytes] | None
 *
 * ``tokens`` is a list or tuple of ints, or a bytes-like object of int32 LE token ids;
 * ``ids`` a list or tuple; ``extras`` is None or a dict {block index: extra bytes}. Both
 * return None (nothing hashed) when a list element is not an exact int or does not fit
 * (int32 tokens, int64 ids): the caller then takes the Python path, which raises its
 * ValueError or hashes what numpy makes of it, so both paths agree on every input.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#define DIGEST 16
#define STACK_BUF 4096
#define PREFETCH_AHEAD 16

/* An exact int as a C long: the compact-int fast path of the running CPython (one digit
 * or fewer, which every token id is), else PyLong_AsLongAndOverflow. */
static inline long
as_long(PyObject *o, int *overflow)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        *overflow = 0;
        return (long)PyUnstable_Long_CompactValue((PyLongObject *)o);
    }
#elif PY_VERSION_HEX >= 0x030B0000
    Py_ssize_t size = Py_SIZE(o);
    if (size >= -1 && size <= 1) {
        *overflow = 0;
        return (long)size * (long)((PyLongObject *)o)->ob_digit[0];
    }
#endif
    return PyLong_AsLongAndOverflow(o, overflow);
}

static void
put_le32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
}

static void
put_le64(unsigned char *p, uint64_t v)
{
    put_le32(p, (uint32_t)v);
    put_le32(p + 4, (uint32_t)(v >> 32));
}

/* Hash buf[0 : len], write the canonical digest over buf[0 : 16] (the next block's
 * parent) and set it as bytes at ``out[i]`` (a list made with its length: a slot not set
 * yet is NULL, which freeing the list skips). -1 with an exception set on failure. */
static int
chain_step(unsigned char *buf, size_t len, PyObject *out, Py_ssize_t i)
{
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(buf, len));
    memcpy(buf, c.digest, DIGEST);
    PyObject *h = PyBytes_FromStringAndSize((const char *)c.digest, DIGEST);
    if (h == NULL) {
        return -1;
    }
    PyList_SET_ITEM(out, i, h);
    return 0;
}

/* Hash one block whose payload is already in buf[16 : 16 + payload]; with an extra for
 * this block, hash a copy that carries it (rare: multimodal blocks only). */
static int
chain_block(unsigned char *buf, size_t payload, PyObject *extras, Py_ssize_t b, PyObject *out)
{
    if (extras == Py_None) {
        return chain_step(buf, DIGEST + payload, out, b);
    }
    PyObject *key = PyLong_FromSsize_t(b);
    if (key == NULL) {
        return -1;
    }
    PyObject *extra = PyDict_GetItemWithError(extras, key); /* borrowed */
    Py_DECREF(key);
    if (extra == NULL) {
        return PyErr_Occurred() ? -1 : chain_step(buf, DIGEST + payload, out, b);
    }
    if (!PyBytes_Check(extra)) {
        PyErr_SetString(PyExc_TypeError, "extras values must be bytes");
        return -1;
    }
    Py_ssize_t elen = PyBytes_GET_SIZE(extra);
    unsigned char *tmp = PyMem_Malloc(DIGEST + payload + (size_t)elen);
    if (tmp == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(tmp, buf, DIGEST + payload);
    memcpy(tmp + DIGEST + payload, PyBytes_AS_STRING(extra), (size_t)elen);
    int rc = chain_step(tmp, DIGEST + payload + (size_t)elen, out, b);
    memcpy(buf, tmp, DIGEST); /* the digest is the next parent */
    PyMem_Free(tmp);
    return rc;
}

/* Convert ``count`` exact ints to int32 LE at ``p`` (``p`` NULL: check only). 1 when one
 * is not an exact int or does not fit: the caller leaves the input to the Python path.
 * ``end``: the list's end (items up to it may be prefetched). */
static int
put_tokens(unsigned char *p, PyObject **items, Py_ssize_t count, PyObject **end)
{
    for (Py_ssize_t j = 0; j < count; j++) {
        PyObject *o = items[j];
        int overflow;
        long v;
        /* Each int is its own object, anywhere in memory: fetch the one PREFETCH_AHEAD
         * on while this one is read (its cache miss costs more than the work). */
        if (items + j + PREFETCH_AHEAD < end) {
            __builtin_prefetch(items[j + PREFETCH_AHEAD]);
        }
        if (!PyLong_CheckExact(o)) {
            return 1;
        }
        v = as_long(o, &overflow);
        if (overflow || v < INT32_MIN || v > INT32_MAX) {
            return 1;
        }
        if (p != NULL) {
            put_le32(p + 4 * j, (uint32_t)(int32_t)v);
        }
    }
    return 0;
}

/* Hash the full blocks of ``src``: a list / tuple of ints (converted block by block into
 * the chain buffer) or a bytes-like object of int32 LE. Returns Py_None (a new reference)
 * for a list the Python path must take. */
static PyObject *
chain_tokens(PyObject *src, Py_ssize_t bs, Py_buffer *parent, PyObject *extras)
{
    int is_seq = PyList_Check(src) || PyTuple_Check(src);
    Py_buffer data = {0};
    if (!is_seq && PyObject_GetBuffer(src, &data, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    unsigned char stack[STACK_BUF];
    size_t payload = 4 * (size_t)bs;
    unsigned char *buf = DIGEST + payload <= STACK_BUF ? stack : PyMem_Malloc(DIGEST + payload);
    /* Nothing below runs Python code: the list cannot change while it is read. */
    PyObject **items = is_seq ? PySequence_Fast_ITEMS(src) : NULL;
    Py_ssize_t n = is_seq ? PySequence_Fast_GET_SIZE(src) : data.len / 4;
    Py_ssize_t num_full = n / bs;
    PyObject *out = buf == NULL ? PyErr_NoMemory() : PyList_New(num_full);
    if (out == NULL) {
        goto done;
    }
    memcpy(buf, parent->buf, DIGEST);
    for (Py_ssize_t b = 0; b < num_full; b++) {
        if (is_seq) {
            if (put_tokens(buf + DIGEST, items + b * bs, bs, items + n)) {
                goto fallback;
            }
        } else {
            memcpy(buf + DIGEST, (const unsigned char *)data.buf + (size_t)b * payload, payload);
        }
        if (chain_block(buf, payload, extras, b, out) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
    /* The partial tail is not hashed, but the Python path validates every token: leave a
     * bad one there to that path too. */
    if (is_seq && put_tokens(NULL, items + num_full * bs, n - num_full * bs, items + n)) {
        goto fallback;
    }
    goto done;
fallback:
    Py_CLEAR(out);
    out = Py_NewRef(Py_None);
done:
    if (buf != NULL && buf != stack) {
        PyMem_Free(buf);
    }
    if (!is_seq) {
        PyBuffer_Release(&data);
    }
    return out;
}

static PyObject *
hash_tokens(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "hash_tokens(tokens, block_size, parent, extras)");
        return NULL;
    }
    PyObject *extras = args[3];
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (bs <= 0 || bs > (PY_SSIZE_T_MAX - DIGEST) / 8) {
        PyErr_SetString(PyExc_ValueError, "block_size must be > 0");
        return NULL;
    }
    if (extras != Py_None && !PyDict_Check(extras)) {
        PyErr_SetString(PyExc_TypeError, "extras must be None or a dict");
        return NULL;
    }
    Py_buffer parent;
    if (PyObject_GetBuffer(args[2], &parent, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *out = NULL;
    if (parent.len != DIGEST) {
        PyErr_SetString(PyExc_ValueError, "parent digest must be 16 bytes");
    } else {
        out = chain_tokens(args[0], bs, &parent, extras);
    }
    PyBuffer_Release(&parent);
    return out;
}

static PyObject *
hash_id_list(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "hash_id_list(ids, parent)");
        return NULL;
    }
    PyObject *ids = args[0];
    if (!PyList_Check(ids) && !PyTuple_Check(ids)) {
        Py_RETURN_NONE;
    }
    Py_buffer parent;
    if (PyObject_GetBuffer(args[1], &parent, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (parent.len != DIGEST) {
        PyBuffer_Release(&parent);
        PyErr_SetString(PyExc_ValueError, "parent digest must be 16 bytes");
        return NULL;
    }
    unsigned char buf[DIGEST + 8];
    memcpy(buf, parent.buf, DIGEST);
    PyBuffer_Release(&parent);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ids);
    PyObject **items = PySequence_Fast_ITEMS(ids);
    for (Py_ssize_t i = 0; i < n; i++) { /* validate all first: all or nothing */
        int overflow;
        if (!PyLong_CheckExact(items[i])) {
            Py_RETURN_NONE;
        }
        (void)PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow) {
            Py_RETURN_NONE;
        }
    }
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        put_le64(buf + DIGEST, (uint64_t)v);
        if (chain_step(buf, sizeof buf, out, i) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyMethodDef chainhash_methods[] = {
    {"hash_tokens", (PyCFunction)(void (*)(void))hash_tokens, METH_FASTCALL,
     "Chained hashes of the full blocks of a list/tuple of ints or of int32 LE bytes;"
     " None when a list element is left to the Python path."},
    {"hash_id_list", (PyCFunction)(void (*)(void))hash_id_list, METH_FASTCALL,
     "Chained hashes of a list/tuple of int64 ids, or None (fallback)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef chainhash_module = {
    PyModuleDef_HEAD_INIT,
    "_chainhash",
    "Native chained XXH3-128 block hashing (see zkv/scheduler/hashing.py).",
    -1,
    chainhash_methods,
};

PyMODINIT_FUNC
PyInit__chainhash(void)
{
    return PyModule_Create(&chainhash_module);
}
