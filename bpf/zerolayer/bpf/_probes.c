/* USDT probe for token events: the runtime fires it where tokens leave for the client.
 *
 * The runtime does not trap into the kernel once per token. It appends each event to a Batch
 * (a C buffer: ~0.2 us, no Python objects) and fires the probe once per event-loop iteration for
 * everything that left in it (bpf/probes.py). Detached, the probe site is a single nop; attached,
 * the kernel traps once per batch and bpf/token_events.bpf.c copies the whole batch into the BPF
 * ring buffer.
 *
 * Probe zerolayer:tokens, arguments (USDT numbering from 1):
 *   1 buffer  char*  the batch: records in the journal format (zerolayer/bpf/events.py)
 *   2 length  u64    bytes in the buffer
 *   3 count   u32    events (records) in the buffer
 *
 * Record (little endian, as encode_record in events.py writes it): u32 total length, u64 runtime_id,
 * u64 seq, i64 wall_ns, u32 input, u32 output, u32 flags, then tenant NUL model NUL request_id.
 * (runtime_id, seq) is the event's identity: the auditor stores each one once.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <sys/sdt.h>

/* A batch holds fewer bytes than this: what the BPF program can copy (MAX_BATCH in token_events.bpf.c). */
#define MAX_BATCH 16384
#define LIMIT (MAX_BATCH - 1)
#define FIXED_SIZE (4 + 8 + 8 + 8 + 4 + 4 + 4)

typedef struct {
    PyObject_HEAD
    char *buf;
    Py_ssize_t len;
    unsigned int count;
} Batch;

static void
put_u32(char *p, unsigned int v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (char)((v >> (8 * i)) & 0xff);
}

static void
put_u64(char *p, unsigned long long v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (char)((v >> (8 * i)) & 0xff);
}

static int
Batch_init(Batch *self, PyObject *args, PyObject *kwds)
{
    if (!PyArg_ParseTuple(args, ":Batch"))
        return -1;
    if (self->buf == NULL) {
        self->buf = PyMem_Malloc(MAX_BATCH);
        if (self->buf == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    self->len = 0;
    self->count = 0;
    return 0;
}

static void
Batch_dealloc(Batch *self)
{
    PyMem_Free(self->buf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Batch_append(Batch *self, PyObject *args)
{
    unsigned long long runtime_id, seq;
    long long wall_ns;
    const char *tenant, *model, *request_id;
    Py_ssize_t tenant_len, model_len, request_len;
    unsigned int input, output, flags;

    if (!PyArg_ParseTuple(args, "KKLs#s#s#III:append", &runtime_id, &seq, &wall_ns, &tenant, &tenant_len,
                          &model, &model_len, &request_id, &request_len, &input, &output, &flags))
        return NULL;
    Py_ssize_t size = FIXED_SIZE + tenant_len + 1 + model_len + 1 + request_len;
    if (size > LIMIT) {
        PyErr_Format(PyExc_ValueError, "token event of %zd bytes exceeds the %d-byte batch", size, LIMIT);
        return NULL;
    }
    if (self->len + size > LIMIT) {
        PyErr_SetString(PyExc_OverflowError, "batch full: fire() and clear() it first");
        return NULL;
    }
    char *p = self->buf + self->len;
    put_u32(p, (unsigned int)size);
    put_u64(p + 4, runtime_id);
    put_u64(p + 12, seq);
    put_u64(p + 20, (unsigned long long)wall_ns);
    put_u32(p + 28, input);
    put_u32(p + 32, output);
    put_u32(p + 36, flags);
    p += FIXED_SIZE;
    memcpy(p, tenant, tenant_len);
    p[tenant_len] = '\0';
    p += tenant_len + 1;
    memcpy(p, model, model_len);
    p[model_len] = '\0';
    p += model_len + 1;
    memcpy(p, request_id, request_len);
    self->len += size;
    self->count += 1;
    return PyLong_FromSsize_t(self->len);
}

static PyObject *
Batch_fire(Batch *self, PyObject *Py_UNUSED(ignored))
{
    /* The probe site. Its arguments are plain registers: nothing is computed for it when detached. */
    if (self->count) {
        const char *buf = self->buf;
        unsigned long long len = (unsigned long long)self->len;
        unsigned int count = self->count;
        DTRACE_PROBE3(zerolayer, tokens, buf, len, count);
    }
    return PyLong_FromUnsignedLong(self->count);
}

static PyObject *
Batch_take(Batch *self, PyObject *Py_UNUSED(ignored))
{
    PyObject *data = PyBytes_FromStringAndSize(self->buf, self->len);
    if (data != NULL) {
        self->len = 0;
        self->count = 0;
    }
    return data;
}

static PyObject *
Batch_clear(Batch *self, PyObject *Py_UNUSED(ignored))
{
    self->len = 0;
    self->count = 0;
    Py_RETURN_NONE;
}

static PyObject *
Batch_get_count(Batch *self, void *closure)
{
    return PyLong_FromUnsignedLong(self->count);
}

static PyObject *
Batch_get_size(Batch *self, void *closure)
{
    return PyLong_FromSsize_t(self->len);
}

static PyMethodDef Batch_methods[] = {
    {"append", (PyCFunction)Batch_append, METH_VARARGS,
     "append(runtime_id, seq, wall_ns, tenant, model, request_id, input, output, flags) -> bytes used"},
    {"fire", (PyCFunction)Batch_fire, METH_NOARGS, "Fire USDT zerolayer:tokens with the batch; returns its count."},
    {"take", (PyCFunction)Batch_take, METH_NOARGS, "Return the batch as bytes (journal records) and empty it."},
    {"clear", (PyCFunction)Batch_clear, METH_NOARGS, "Empty the batch."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Batch_getset[] = {
    {"count", (getter)Batch_get_count, NULL, "events in the batch", NULL},
    {"size", (getter)Batch_get_size, NULL, "bytes in the batch", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "zerolayer.bpf._probes.Batch",
    .tp_doc = "Token events waiting to be fired together through USDT zerolayer:tokens.",
    .tp_basicsize = sizeof(Batch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Batch_init,
    .tp_dealloc = (destructor)Batch_dealloc,
    .tp_methods = Batch_methods,
    .tp_getset = Batch_getset,
};

static PyObject *
probes_noop(PyObject *self, PyObject *args)
{
    /* A C call with no probe site: the comparison for bench/audit_probe.py. */
    Py_RETURN_NONE;
}

static PyMethodDef probes_methods[] = {
    {"noop", probes_noop, METH_NOARGS, "Do nothing (the cost of a bare C call)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef probes_module = {
    PyModuleDef_HEAD_INIT, "_probes", "USDT probe site of the zerolayer runtime (zerolayer:tokens).", -1,
    probes_methods,
};

PyMODINIT_FUNC
PyInit__probes(void)
{
    if (PyType_Ready(&BatchType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&probes_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&BatchType);
    if (PyModule_AddObject(m, "Batch", (PyObject *)&BatchType) < 0) {
        Py_DECREF(&BatchType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "LIMIT", LIMIT);
    return m;
}
