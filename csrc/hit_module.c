/* The extension sbp_torch._dispatch._hit: the functions of the dispatcher's hit path (dispatch_hit.c) and of the
   frontend's local calls (local_calls_hit.c) in one module, and what both parts use to set themselves up (hit.h).
   Built by setup.py against Python's C API alone (no torch headers): a plain C compiler is enough. */

#include "hit.h"

int a_dict(const char *keyword, PyObject *value) {
    if (PyDict_Check(value)) return 0;
    PyErr_Format(PyExc_TypeError, "%s must be a dict", keyword);
    return -1;
}

int a_set(const char *keyword, PyObject *value) {
    if (PyAnySet_Check(value)) return 0;
    PyErr_Format(PyExc_TypeError, "%s must be a set or a frozenset", keyword);
    return -1;
}

int keep_configured(const char *function, const Configured *table, size_t rows, PyObject *args, PyObject *kwargs) {
    Py_ssize_t given = kwargs == NULL ? 0 : PyDict_GET_SIZE(kwargs);
    if (PyTuple_GET_SIZE(args) > 0 || given != (Py_ssize_t)rows) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zu keyword arguments and nothing else", function, rows);
        return -1;
    }
    for (size_t i = 0; i < rows; i++) { /* (all checked before anything is kept) */
        PyObject *value = PyDict_GetItemString(kwargs, table[i].keyword);
        if (value == NULL) {
            PyErr_Format(PyExc_TypeError, "%s() is missing the keyword argument %s", function, table[i].keyword);
            return -1;
        }
        if (table[i].check != NULL && table[i].check(table[i].keyword, value) < 0) return -1;
    }
    for (size_t i = 0; i < rows; i++) {
        PyObject *value = PyDict_GetItemString(kwargs, table[i].keyword);
        Py_INCREF(value);
        Py_XSETREF(*table[i].slot, value);
    }
    return 0;
}

int intern_strings(const Interned *table, size_t rows) {
    for (size_t i = 0; i < rows; i++) {
        *table[i].slot = PyUnicode_InternFromString(table[i].text);
        if (*table[i].slot == NULL) return -1;
    }
    return 0;
}

static PyMethodDef methods[] = {
    {"torch_dispatch", (PyCFunction)(void (*)(void))torch_dispatch, METH_FASTCALL,
     "GlobalTensor.__torch_dispatch__: a hit of a simple cached plan runs here, any other call in Python."},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "Give the hit path the objects it reads (once, at import)."},
    {"eager_torch_function", (PyCFunction)(void (*)(void))eager_torch_function, METH_FASTCALL,
     "The eager part of __torch_function__: NOT_HANDLED where Python must see the call."},
    {"local_or_below_autograd", (PyCFunction)(void (*)(void))local_or_below_autograd, METH_FASTCALL,
     "_local_or_below_autograd: a learnt local call that returns a tensor, an argument or None runs here."},
    {"configure_local", (PyCFunction)(void (*)(void))configure_local, METH_VARARGS | METH_KEYWORDS,
     "Give the local-call hit path the objects it reads (once, at import)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_hit", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hit(void) {
    if (dispatch_hit_init() < 0 || local_calls_hit_init() < 0) return NULL;
    return PyModule_Create(&module_def);
}
