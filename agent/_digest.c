/* The CPU kernel of cohortgate's weight digest (format cohortgate.digest.v2), fused: one
 * pass over the bytes, two widening 32x32->64 multiply-adds per word, no temporaries.
 * agent/digest.py defines the algorithm (and computes it with torch ops on other devices
 * and where this extension was not built); both must give the same sums, bit for bit.
 *
 *   chunk_sums(address, nbytes, keys, out)
 *     address, nbytes: the tensor's bytes (a contiguous CPU tensor's data_ptr(), 4-byte
 *           aligned; read only). The caller keeps the tensor alive for the call: this is a
 *           private module, called by agent/digest.py only.
 *     keys: bytes-like, LANES * CHUNK uint32 (native order: little-endian hosts only)
 *     out:  writable bytes-like, ceil(nbytes / (4 * CHUNK)) * LANES int64
 *   For chunk c and lane l: out[c][l] = sum over i of word[c][i] * keys[l][i] mod 2^64,
 *   words the unsigned little-endian 32-bit words of the bytes, the last chunk zero-padded.
 *   The GIL is released while it runs, so callers may split one tensor across threads.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the digest kernel reads words in native order: little-endian hosts only"
#endif

#define CHUNK 4096
#define LANES 2
#define CHUNK_BYTES (CHUNK * 4)

/* AVX2 (vpmuludq: four 32x32->64 products per instruction) where the CPU has it, chosen at
 * load time; the portable build elsewhere. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__)
#define KERNEL_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define KERNEL_CLONES
#endif

KERNEL_CLONES
static void sums(const uint32_t *restrict words, size_t chunks, const uint32_t *restrict k0,
                 const uint32_t *restrict k1, char *restrict out)
{
    for (size_t c = 0; c < chunks; c++, words += CHUNK) {
        uint64_t a = 0, b = 0;
        for (size_t i = 0; i < CHUNK; i++) {
            a += (uint64_t)words[i] * k0[i];
            b += (uint64_t)words[i] * k1[i];
        }
        uint64_t lanes[LANES] = {a, b};
        memcpy(out + c * sizeof lanes, lanes, sizeof lanes); /* out may be unaligned */
    }
}

static PyObject *chunk_sums(PyObject *self, PyObject *args)
{
    Py_buffer keys, out;
    unsigned long long address, nbytes;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKy*w*", &address, &nbytes, &keys, &out))
        return NULL;
    const char *data = (const char *)(uintptr_t)address;
    size_t len = (size_t)nbytes;
    size_t whole = len / CHUNK_BYTES;
    size_t chunks = whole + (len % CHUNK_BYTES != 0);
    PyObject *result = NULL;
    if ((size_t)keys.len != (size_t)LANES * CHUNK * 4) {
        PyErr_Format(PyExc_ValueError, "keys are %zd bytes; expected %d", keys.len,
                     LANES * CHUNK * 4);
        goto done;
    }
    if ((size_t)out.len != chunks * LANES * 8) {
        PyErr_Format(PyExc_ValueError, "out is %zd bytes; %zu chunks need %zu", out.len,
                     chunks, chunks * LANES * 8);
        goto done;
    }
    if (len && data == NULL) {
        PyErr_SetString(PyExc_ValueError, "address is 0");
        goto done;
    }
    if ((uintptr_t)data % 4 || (uintptr_t)keys.buf % 4) {
        PyErr_SetString(PyExc_ValueError, "data and keys must be 4-byte aligned");
        goto done;
    }
    const uint32_t *k = keys.buf;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    sums((const uint32_t *)data, whole, k, k + CHUNK, out.buf);
    if (whole < chunks) {
        uint32_t *tail = calloc(CHUNK, 4);
        if (tail == NULL) {
            failed = 1;
        } else {
            memcpy(tail, data + whole * CHUNK_BYTES, len - whole * CHUNK_BYTES);
            sums(tail, 1, k, k + CHUNK, (char *)out.buf + whole * LANES * 8);
            free(tail);
        }
    }
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_NoMemory();
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"chunk_sums", chunk_sums, METH_VARARGS, "chunk_sums(address, nbytes, keys, out): see agent/digest.py"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "agent._digest",
    .m_doc = "cohortgate's fused CPU digest kernel",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__digest(void) { return PyModule_Create(&module); }
