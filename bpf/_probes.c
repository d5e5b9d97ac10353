/* USDT probe for token events: the runtime calls token() where tokens leave for the client.
 *
 * Detached, a USDT site is a single nop in the machine code; the call costs what a Python
 * call into a C function costs (argument parsing, no allocation: "s" borrows the UTF-8 buffer
 * CPython caches in the str object). Attached, the kernel traps on the nop and runs the BPF
 * program (bpf/token_events.bpf.c) with these arguments.
 *
 * Probe zerolayer:token, arguments (USDT numbering from 1):
 *   1 runtime_id  u64   random id of the emitting runtime instance
 *   2 seq         u64   per-runtime sequence number (1, 2, ...): the event id with runtime_id
 *   3 tenant      char* NUL-terminated
 *   4 model       char*
 *   5 request_id  char*
 *   6 input       u32   prompt tokens billed by this event
 *   7 output      u32   generated tokens billed by this event
 *   8 flags       u32   bit 0: first event of a request
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sys/sdt.h>

static PyObject *
probes_token(PyObject *self, PyObject *args)
{
    unsigned long long runtime_id, seq;
    const char *tenant, *model, *request_id;
    unsigned int input, output, flags;

    if (!PyArg_ParseTuple(args, "KKsssIII", &runtime_id, &seq, &tenant, &model, &request_id,
                          &input, &output, &flags))
        return NULL;
    DTRACE_PROBE8(zerolayer, token, runtime_id, seq, tenant, model, request_id, input, output, flags);
    Py_RETURN_NONE;
}

static PyObject *
probes_noop(PyObject *self, PyObject *args)
{
    /* Same argument parsing, no probe site: the comparison for bench/audit_probe.py. */
    unsigned long long runtime_id, seq;
    const char *tenant, *model, *request_id;
    unsigned int input, output, flags;

    if (!PyArg_ParseTuple(args, "KKsssIII", &runtime_id, &seq, &tenant, &model, &request_id,
                          &input, &output, &flags))
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef probes_methods[] = {
    {"token", probes_token, METH_VARARGS,
     "token(runtime_id, seq, tenant, model, request_id, input, output, flags): fire USDT zerolayer:token."},
    {"noop", probes_noop, METH_VARARGS, "Parse the same arguments as token() and fire nothing."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef probes_module = {
    PyModuleDef_HEAD_INIT, "_probes", "USDT probe sites of the zerolayer runtime.", -1, probes_methods,
};

PyMODINIT_FUNC
PyInit__probes(void)
{
    return PyModule_Create(&probes_module);
}
