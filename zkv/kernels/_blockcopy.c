/* zkv.kernels._blockcopy: scattered copies of equal-sized contiguous chunks.
 *
 *     copy_chunks(src_base, src_stride, dst_base, dst_stride, chunk_bytes,
 *                 src_ids_addr, dst_ids_addr, n) -> None
 *
 * For j in [0, n):
 *     memcpy(dst_base + dst_ids[j] * dst_stride,
 *            src_base + src_ids[j] * src_stride, chunk_bytes)
 *
 * Addresses are plain integers (torch ``data_ptr()``, numpy ``ctypes.data``); the id
 * arrays are contiguous native-endian int64. The caller (zkv/kernels/cpu.py) has
 * already checked every id against its bound, that both sides are CPU memory, that
 * every chunk is contiguous, and keeps the tensors alive for the call: nothing here
 * can check a raw address. Strides are signed bytes. The loop runs with the GIL
 * released and touches no Python object, so other threads (the model) keep running.
 *
 * No numpy C API: the module builds against Python.h alone.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

static PyObject *
copy_chunks(PyObject *self, PyObject *args)
{
    unsigned long long src_base, dst_base, src_ids_addr, dst_ids_addr;
    Py_ssize_t src_stride, dst_stride, chunk, n;
    (void)self;

    if (!PyArg_ParseTuple(args, "KnKnnKKn:copy_chunks", &src_base, &src_stride, &dst_base,
                          &dst_stride, &chunk, &src_ids_addr, &dst_ids_addr, &n)) {
        return NULL;
    }
    if (chunk < 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "copy_chunks: chunk_bytes and n must be >= 0");
        return NULL;
    }
    if (chunk == 0 || n == 0) {
        Py_RETURN_NONE;
    }
    if (!src_base || !dst_base || !src_ids_addr || !dst_ids_addr) {
        PyErr_SetString(PyExc_ValueError, "copy_chunks: null address");
        return NULL;
    }
    if ((src_ids_addr | dst_ids_addr) % sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "copy_chunks: id arrays must be 8-byte aligned");
        return NULL;
    }

    {
        const char *src = (const char *)(uintptr_t)src_base;
        char *dst = (char *)(uintptr_t)dst_base;
        const int64_t *sid = (const int64_t *)(uintptr_t)src_ids_addr;
        const int64_t *did = (const int64_t *)(uintptr_t)dst_ids_addr;
        const size_t len = (size_t)chunk;
        Py_ssize_t j;

        Py_BEGIN_ALLOW_THREADS
        for (j = 0; j < n; j++) {
            memcpy(dst + (Py_ssize_t)did[j] * dst_stride, src + (Py_ssize_t)sid[j] * src_stride,
                   len);
        }
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyMethodDef blockcopy_methods[] = {
    {"copy_chunks", copy_chunks, METH_VARARGS,
     "copy_chunks(src_base, src_stride, dst_base, dst_stride, chunk_bytes, src_ids_addr, "
     "dst_ids_addr, n)\n--\n\n"
     "memcpy(dst_base + dst_ids[j]*dst_stride, src_base + src_ids[j]*src_stride, chunk_bytes)\n"
     "for j in range(n), GIL released. Ids: int64 arrays by address. No bounds checks."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef blockcopy_module = {
    PyModuleDef_HEAD_INIT,
    "_blockcopy",
    "Scattered copies of equal-sized contiguous chunks (zkv CPU copy backend).",
    -1,
    blockcopy_methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__blockcopy(void)
{
    return PyModule_Create(&blockcopy_module);
}
