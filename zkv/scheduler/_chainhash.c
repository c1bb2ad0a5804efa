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
 *     hash_token_list(tokens, block_size, parent, extras) -> list[bytes] | None
 *     hash_token_bytes(data, block_size, parent, extras)  -> list[bytes]
 *     hash_id_list(ids, parent)                           -> list[bytes] | None
 *
 * ``tokens`` / ``ids`` are a list or tuple; ``data`` is a bytes-like object of int32 LE
 * token ids; ``extras`` is None or a dict {block index: extra bytes}. The list functions
 * return None (nothing hashed) when an element is not an exact int or does not fit
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
 * parent) and append it to ``out`` as bytes. -1 with an exception set on failure. */
static int
chain_step(unsigned char *buf, size_t len, PyObject *out)
{
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(buf, len));
    memcpy(buf, c.digest, DIGEST);
    PyObject *h = PyBytes_FromStringAndSize((const char *)c.digest, DIGEST);
    if (h == NULL) {
        return -1;
    }
    int rc = PyList_Append(out, h);
    Py_DECREF(h);
    return rc;
}

/* Hash one block whose payload is already in buf[16 : 16 + payload]; with an extra for
 * this block, hash a copy that carries it (rare: multimodal blocks only). */
static int
chain_block(unsigned char *buf, size_t payload, PyObject *extras, Py_ssize_t b, PyObject *out)
{
    if (extras == Py_None) {
        return chain_step(buf, DIGEST + payload, out);
    }
    PyObject *key = PyLong_FromSsize_t(b);
    if (key == NULL) {
        return -1;
    }
    PyObject *extra = PyDict_GetItemWithError(extras, key); /* borrowed */
    Py_DECREF(key);
    if (extra == NULL) {
        return PyErr_Occurred() ? -1 : chain_step(buf, DIGEST + payload, out);
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
    int rc = chain_step(tmp, DIGEST + payload + (size_t)elen, out);
    memcpy(buf, tmp, DIGEST); /* the digest is the next parent */
    PyMem_Free(tmp);
    return rc;
}

/* Common argument checks: block size, parent digest, extras. */
static int
check_common(Py_ssize_t block_size, Py_buffer *parent, PyObject *extras)
{
    if (block_size <= 0 || block_size > (PY_SSIZE_T_MAX - DIGEST) / 8) {
        PyErr_SetString(PyExc_ValueError, "block_size must be > 0");
        return -1;
    }
    if (parent->len != DIGEST) {
        PyErr_SetString(PyExc_ValueError, "parent digest must be 16 bytes");
        return -1;
    }
    if (extras != Py_None && !PyDict_Check(extras)) {
        PyErr_SetString(PyExc_TypeError, "extras must be None or a dict");
        return -1;
    }
    return 0;
}

static unsigned char *
get_buf(unsigned char *stack, size_t need)
{
    if (need <= STACK_BUF) {
        return stack;
    }
    unsigned char *p = PyMem_Malloc(need);
    if (p == NULL) {
        PyErr_NoMemory();
    }
    return p;
}

static PyObject *
hash_token_list(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "hash_token_list(tokens, block_size, parent, extras)");
        return NULL;
    }
    PyObject *tokens = args[0];
    PyObject *extras = args[3];
    if (!PyList_Check(tokens) && !PyTuple_Check(tokens)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer parent;
    if (PyObject_GetBuffer(args[2], &parent, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    unsigned char stack[STACK_BUF];
    unsigned char *buf = NULL;
    PyObject *out = NULL;
    if (check_common(bs, &parent, extras) < 0) {
        goto done;
    }
    size_t payload = 4 * (size_t)bs;
    buf = get_buf(stack, DIGEST + payload);
    if (buf == NULL) {
        goto done;
    }
    memcpy(buf, parent.buf, DIGEST);
    /* The list is not mutated below: nothing here runs Python code. */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
    PyObject **items = PySequence_Fast_ITEMS(tokens);
    Py_ssize_t num_full = n / bs;
    out = PyList_New(0);
    if (out == NULL) {
        goto done;
    }
    for (Py_ssize_t b = 0; b < num_full; b++) {
        PyObject **blk = items + b * bs;
        unsigned char *p = buf + DIGEST;
        for (Py_ssize_t j = 0; j < bs; j++, p += 4) {
            PyObject *o = blk[j];
            int overflow;
            long v;
            if (!PyLong_CheckExact(o)) {
                goto fallback;
            }
            v = as_long(o, &overflow);
            if (overflow || v < INT32_MIN || v > INT32_MAX) {
                goto fallback;
            }
            put_le32(p, (uint32_t)(int32_t)v);
        }
        if (chain_block(buf, payload, extras, b, out) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
    /* The tail past the last full block is not hashed, but the Python path validates
     * every token: leave a bad one in it to that path too. */
    for (Py_ssize_t j = num_full * bs; j < n; j++) {
        PyObject *o = items[j];
        int overflow;
        long v;
        if (!PyLong_CheckExact(o)) {
            goto fallback;
        }
        v = PyLong_AsLongAndOverflow(o, &overflow);
        if (overflow || v < INT32_MIN || v > INT32_MAX) {
            goto fallback;
        }
    }
    goto done;
fallback:
    Py_CLEAR(out);
    out = Py_None;
    Py_INCREF(out);
done:
    if (buf != NULL && buf != stack) {
        PyMem_Free(buf);
    }
    PyBuffer_Release(&parent);
    return out;
}

static PyObject *
hash_token_bytes(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "hash_token_bytes(data, block_size, parent, extras)");
        return NULL;
    }
    PyObject *extras = args[3];
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer data, parent;
    if (PyObject_GetBuffer(args[0], &data, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &parent, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    unsigned char stack[STACK_BUF];
    unsigned char *buf = NULL;
    PyObject *out = NULL;
    if (check_common(bs, &parent, extras) < 0) {
        goto done;
    }
    size_t payload = 4 * (size_t)bs;
    buf = get_buf(stack, DIGEST + payload);
    if (buf == NULL) {
        goto done;
    }
    memcpy(buf, parent.buf, DIGEST);
    Py_ssize_t num_full = data.len / (Py_ssize_t)payload;
    out = PyList_New(0);
    if (out == NULL) {
        goto done;
    }
    const unsigned char *src = data.buf;
    for (Py_ssize_t b = 0; b < num_full; b++) {
        memcpy(buf + DIGEST, src + (size_t)b * payload, payload);
        if (chain_block(buf, payload, extras, b, out) < 0) {
            Py_CLEAR(out);
            goto done;
        }
    }
done:
    if (buf != NULL && buf != stack) {
        PyMem_Free(buf);
    }
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
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
    PyObject *out = PyList_New(0);
    if (out == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        put_le64(buf + DIGEST, (uint64_t)v);
        if (chain_step(buf, sizeof buf, out) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyMethodDef chainhash_methods[] = {
    {"hash_token_list", (PyCFunction)(void (*)(void))hash_token_list, METH_FASTCALL,
     "Chained hashes of the full blocks of a list/tuple of int tokens, or None (fallback)."},
    {"hash_token_bytes", (PyCFunction)(void (*)(void))hash_token_bytes, METH_FASTCALL,
     "Chained hashes of the full blocks of int32 LE token bytes."},
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
