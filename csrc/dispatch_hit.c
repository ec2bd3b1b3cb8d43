/* The dispatcher's hit path in C: GlobalTensor.__torch_dispatch__ for a call whose plan is cached and simple.

   It does what sbp_torch/_dispatch/_dispatcher.py's ``dispatch`` does on a hit with a simple plan (``call_key``,
   one lookup in the call cache, ``_run_simple``, ``checked_global``, ``wrap_fresh``), with no Python frame. Any other
   call (keyword arguments, a plain tensor argument, the recorder on, a miss, a plan that is not simple) goes to the
   Python ``dispatch``, which keys and looks the call up again: this file only ever answers what the Python hit path
   would answer, and the cache it reads is the Python one. Built by setup.py as sbp_torch._dispatch._hit, against
   Python's C API alone (no torch headers): a plain C compiler is enough. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *GlobalTensorType;  /* sbp_torch's GlobalTensor */
static PyObject *TensorType;        /* torch.Tensor */
static PyObject *CallPlanType;      /* _call_plan.CallPlan */
static PyObject *Entries;           /* CALLS._entries: key -> [entry, stamp] */
static PyObject *Clock;             /* CALLS._clock: the stamps */
static PyObject *Recorder;          /* the ContextVar of _dispatcher.recording */
static PyObject *Detach;            /* aten.detach.default */
static PyObject *SlowDispatch;      /* _dispatcher.dispatch(func, args, kwargs) */
static PyObject *ScalarPositions;   /* func -> op_schema(func).scalar_positions */
static PyObject *CheckedGlobal;     /* _call_plan.checked_global(func, local, meta, shape) */
static PyObject *LocalFailure;      /* _comm.local_failure(func, err, placement, local_inputs) */
static PyObject *MakeWrapper;       /* torch.Tensor._make_wrapper_subclass */
static PyObject *Strided;           /* torch.strided */
static PyObject *OpOverloadType;    /* torch._ops.OpOverload: its __call__ is ``self._op(*args)`` */
static PyObject *Facts;             /* id(func) -> (func, scalar positions, func._op) */

static PyObject *s_local, *s_meta, *s_func, *s_simple, *s_op, *s_decision, *s_outputs, *s_local_shapes,
    *s_returns_written, *s_shape, *s_strides, *s_dtype, *s_device, *s_is_conj, *s_is_neg, *s_placement,
    *s_local_inputs, *s_detach;

static int configured = 0;

/* The key of one argument, as _bound._key_of gives it; NULL without an error where only Python can key it (a plain
   tensor), NULL with an error on failure. */
static PyObject *key_of(PyObject *value, int is_scalar) {
    PyTypeObject *type = Py_TYPE(value);
    if ((PyObject *)type == GlobalTensorType) return PyObject_GetAttr(value, s_meta);
    if (PyList_Check(value) || PyTuple_Check(value)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
        PyObject **items = PySequence_Fast_ITEMS(value);
        PyObject *inner = PyTuple_New(n);
        if (inner == NULL) return NULL;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *k = key_of(items[i], is_scalar);
            if (k == NULL) {
                Py_DECREF(inner);
                return NULL;
            }
            PyTuple_SET_ITEM(inner, i, k);
        }
        PyObject *key = PyTuple_Pack(2, (PyObject *)type, inner);
        Py_DECREF(inner);
        return key;
    }
    int instance = PyObject_IsInstance(value, GlobalTensorType);
    if (instance < 0) return NULL;
    if (instance) return PyObject_GetAttr(value, s_meta);
    instance = PyObject_IsInstance(value, TensorType);
    if (instance < 0) return NULL;
    if (instance) return NULL; /* keyed by Python */
    if (is_scalar && (PyLong_Check(value) || PyFloat_Check(value) || PyComplex_Check(value))) {
        Py_INCREF(type);
        return (PyObject *)type;
    }
    Py_INCREF(value);
    return value;
}

/* (scalar positions, op callable) of ``func``, read once per op; borrowed references, NULL on error. */
static PyObject *facts_of(PyObject *func) {
    PyObject *id = PyLong_FromVoidPtr(func);
    if (id == NULL) return NULL;
    PyObject *entry = PyDict_GetItemWithError(Facts, id);
    if (entry == NULL && PyErr_Occurred()) {
        Py_DECREF(id);
        return NULL;
    }
    if (entry == NULL || PyTuple_GET_ITEM(entry, 0) != func) { /* new, or a freed op's id reused */
        PyObject *positions = PyObject_CallOneArg(ScalarPositions, func);
        PyObject *op = NULL;
        if (positions != NULL) { /* (a subclass's __call__ may do more: it is called as it is) */
            op = (PyObject *)Py_TYPE(func) == OpOverloadType ? PyObject_GetAttr(func, s_op) : (Py_INCREF(func), func);
        }
        entry = op ? PyTuple_Pack(3, func, positions, op) : NULL;
        Py_XDECREF(positions);
        Py_XDECREF(op);
        if (entry == NULL || PyDict_SetItem(Facts, id, entry) < 0) {
            Py_XDECREF(entry);
            Py_DECREF(id);
            return NULL;
        }
        Py_DECREF(entry); /* the dict holds it */
    }
    Py_DECREF(id);
    return entry;
}

static PyObject *slow(PyObject *func, PyObject *args, PyObject *kwargs) {
    PyObject *empty = NULL;
    if (kwargs == NULL || kwargs == Py_None) kwargs = empty = PyDict_New();
    if (kwargs == NULL) return NULL;
    PyObject *result = PyObject_CallFunctionObjArgs(SlowDispatch, func, args, kwargs, NULL);
    Py_XDECREF(empty);
    return result;
}

/* ``wrap_fresh(local, meta)``: a new GlobalTensor holding ``local`` (an op's new result) as a part of ``meta``. */
static PyObject *wrap_fresh(PyObject *local, PyObject *meta) {
    PyObject *result = NULL;
    PyObject *shape = PyObject_GetAttr(meta, s_shape);
    PyObject *strides = shape ? PyObject_GetAttr(meta, s_strides) : NULL;
    PyObject *dtype = strides ? PyObject_GetAttr(meta, s_dtype) : NULL;
    PyObject *device = dtype ? PyObject_GetAttr(local, s_device) : NULL;
    if (device != NULL) {
        PyObject *argv[8] = {GlobalTensorType, shape, strides, Py_None, Py_None, dtype, Strided, device};
        result = PyObject_Vectorcall(MakeWrapper, argv, 8, NULL);
        if (result != NULL &&
            (PyObject_SetAttr(result, s_local, local) < 0 || PyObject_SetAttr(result, s_meta, meta) < 0)) {
            Py_CLEAR(result);
        }
    }
    Py_XDECREF(shape);
    Py_XDECREF(strides);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    return result;
}

/* ``detach`` of a global tensor: its part detached, the layout kept (every gradient accumulated into .grad is
   detached). */
static PyObject *detached(PyObject *x) {
    PyObject *local = PyObject_GetAttr(x, s_local);
    PyObject *meta = local ? PyObject_GetAttr(x, s_meta) : NULL;
    PyObject *part = meta ? PyObject_CallMethodNoArgs(local, s_detach) : NULL;
    PyObject *result = part ? wrap_fresh(part, meta) : NULL;
    Py_XDECREF(local);
    Py_XDECREF(meta);
    Py_XDECREF(part);
    return result;
}

/* The op's local result wrapped as the plan's first output (``checked_global``); steals ``local``. */
static PyObject *wrap(PyObject *func, PyObject *plan, PyObject *local) {
    PyObject *decision = NULL, *outputs = NULL, *shapes = NULL, *shape = NULL, *result = NULL;
    decision = PyObject_GetAttr(plan, s_decision);
    outputs = decision ? PyObject_GetAttr(decision, s_outputs) : NULL;
    shapes = outputs ? PyObject_GetAttr(plan, s_local_shapes) : NULL;
    shape = shapes ? PyObject_GetAttr(local, s_shape) : NULL;
    if (shape == NULL) goto done;
    if (!PyTuple_Check(outputs) || PyTuple_GET_SIZE(outputs) < 1 || !PyTuple_Check(shapes) ||
        PyTuple_GET_SIZE(shapes) < 1) {
        PyErr_SetString(PyExc_RuntimeError, "sbp_torch internal error: a simple call plan without an output");
        goto done;
    }
    PyObject *meta = PyTuple_GET_ITEM(outputs, 0), *want = PyTuple_GET_ITEM(shapes, 0);
    int same = PyObject_RichCompareBool(shape, want, Py_EQ);
    if (same < 0) goto done;
    int plain = same;
    for (int i = 0; plain && i < 2; i++) { /* a lazy conjugate or negative bit: the Python constructor resolves it */
        PyObject *bit = PyObject_CallMethodNoArgs(local, i ? s_is_neg : s_is_conj);
        if (bit == NULL) goto done;
        plain = bit == Py_False;
        Py_DECREF(bit);
    }
    if (!plain) { /* raises on a wrong shape */
        result = PyObject_CallFunctionObjArgs(CheckedGlobal, func, local, meta, want, NULL);
        goto done;
    }
    result = wrap_fresh(local, meta);
done:
    Py_XDECREF(decision);
    Py_XDECREF(outputs);
    Py_XDECREF(shapes);
    Py_XDECREF(shape);
    Py_DECREF(local);
    return result;
}

/* The simple plan run on the local parts (``_run_simple``), the op called as ``op``. */
static PyObject *run_simple(PyObject *func, PyObject *op, PyObject *plan, PyObject *args) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *locals = PyTuple_New(n);
    if (locals == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(args, i);
        int global = PyObject_IsInstance(a, GlobalTensorType);
        if (global < 0) {
            Py_DECREF(locals);
            return NULL;
        }
        PyObject *v = global ? PyObject_GetAttr(a, s_local) : (Py_INCREF(a), a);
        if (v == NULL) {
            Py_DECREF(locals);
            return NULL;
        }
        PyTuple_SET_ITEM(locals, i, v);
    }
    PyObject *out = PyObject_Call(op, locals, NULL);
    Py_DECREF(locals);
    if (out == NULL) { /* the others went on: closes this rank's world (docs/faults.md), then raises */
        if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        if (traceback != NULL) PyException_SetTraceback(value, traceback);
        PyObject *placement = PyObject_GetAttr(plan, s_placement);
        PyObject *inputs = placement ? PyObject_GetAttr(plan, s_local_inputs) : NULL;
        PyObject *noted = inputs ? PyObject_CallFunctionObjArgs(LocalFailure, func, value, placement, inputs, NULL)
                                 : NULL;
        Py_XDECREF(placement);
        Py_XDECREF(inputs);
        if (noted == NULL) { /* its own error wins, chained to the op's */
            PyObject *t2, *v2, *tb2;
            PyErr_Fetch(&t2, &v2, &tb2);
            PyErr_NormalizeException(&t2, &v2, &tb2);
            PyException_SetContext(v2, value); /* steals value */
            Py_XDECREF(type);
            Py_XDECREF(traceback);
            PyErr_Restore(t2, v2, tb2);
            return NULL;
        }
        Py_DECREF(noted);
        PyErr_Restore(type, value, traceback);
        return NULL;
    }
    PyObject *returns_written = PyObject_GetAttr(plan, s_returns_written);
    if (returns_written == NULL) {
        Py_DECREF(out);
        return NULL;
    }
    int written = PyObject_IsTrue(returns_written);
    Py_DECREF(returns_written);
    if (written) {
        Py_DECREF(out);
        PyObject *self = PyTuple_GET_ITEM(args, 0);
        Py_INCREF(self);
        return self;
    }
    return wrap(func, plan, out);
}

/* GlobalTensor.__torch_dispatch__(cls, func, types, args=(), kwargs=None) */
static PyObject *torch_dispatch(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
    if (argc < 3 || argc > 5) {
        PyErr_SetString(PyExc_TypeError, "__torch_dispatch__(cls, func, types, args=(), kwargs=None)");
        return NULL;
    }
    PyObject *func = argv[1];
    PyObject *args = argc > 3 ? argv[3] : NULL;
    PyObject *kwargs = argc > 4 ? argv[4] : NULL;
    PyObject *empty_args = NULL;
    if (args == NULL) args = empty_args = PyTuple_New(0);
    if (args == NULL) return NULL;
    PyObject *result = NULL;
    if (!configured || !PyTuple_Check(args) ||
        (kwargs != NULL && kwargs != Py_None && (!PyDict_Check(kwargs) || PyDict_GET_SIZE(kwargs) > 0))) {
        result = slow(func, args, kwargs);
        goto done;
    }
    PyObject *recording = NULL;
    if (PyContextVar_Get(Recorder, Py_None, &recording) < 0) goto done;
    int recorded = recording != Py_None;
    Py_DECREF(recording);
    if (recorded) {
        result = slow(func, args, kwargs);
        goto done;
    }
    if (func == Detach) {
        if (PyTuple_GET_SIZE(args) == 1 && (PyObject *)Py_TYPE(PyTuple_GET_ITEM(args, 0)) == GlobalTensorType) {
            result = detached(PyTuple_GET_ITEM(args, 0));
        } else {
            result = slow(func, args, kwargs);
        }
        goto done;
    }
    PyObject *facts = facts_of(func);
    if (facts == NULL) goto done;
    PyObject *positions = PyTuple_GET_ITEM(facts, 1), *op = PyTuple_GET_ITEM(facts, 2);
    Py_INCREF(op);
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *key = PyTuple_New(n + 1);
    PyObject *id = key ? PyLong_FromVoidPtr(func) : NULL;
    if (id == NULL) {
        Py_XDECREF(key);
        Py_DECREF(op);
        goto done;
    }
    PyTuple_SET_ITEM(key, 0, id);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *index = PyLong_FromSsize_t(i);
        int is_scalar = index ? PySet_Contains(positions, index) : -1;
        Py_XDECREF(index);
        PyObject *k = is_scalar < 0 ? NULL : key_of(PyTuple_GET_ITEM(args, i), is_scalar);
        if (k == NULL) {
            Py_DECREF(key);
            Py_DECREF(op);
            if (PyErr_Occurred()) goto done;
            result = slow(func, args, kwargs); /* an argument only Python keys */
            goto done;
        }
        PyTuple_SET_ITEM(key, i + 1, k);
    }
    PyObject *slot = PyDict_GetItemWithError(Entries, key); /* borrowed */
    Py_DECREF(key);
    if (slot == NULL) { /* a miss, or an unhashable key: Python decides */
        Py_DECREF(op);
        PyErr_Clear();
        result = slow(func, args, kwargs);
        goto done;
    }
    PyObject *plan = PyList_GET_ITEM(slot, 0);
    Py_INCREF(slot);
    Py_INCREF(plan);
    int fits = (PyObject *)Py_TYPE(plan) == CallPlanType;
    if (fits) {
        PyObject *planned = PyObject_GetAttr(plan, s_func);
        PyObject *simple = planned ? PyObject_GetAttr(plan, s_simple) : NULL;
        fits = simple != NULL && planned == func && simple == Py_True;
        Py_XDECREF(planned);
        Py_XDECREF(simple);
        if (simple == NULL) {
            Py_DECREF(slot);
            Py_DECREF(plan);
            Py_DECREF(op);
            goto done;
        }
    }
    if (!fits) {
        result = slow(func, args, kwargs);
    } else {
        PyObject *stamp = PyIter_Next(Clock); /* a hit, as LruCache.get counts it */
        if (stamp != NULL && PyList_SetItem(slot, 1, stamp) == 0) result = run_simple(func, op, plan, args);
    }
    Py_DECREF(slot);
    Py_DECREF(plan);
    Py_DECREF(op);
done:
    Py_XDECREF(empty_args);
    return result;
}

static PyObject *configure(PyObject *module, PyObject *kw_args, PyObject *kwargs) {
    static char *names[] = {"global_tensor", "tensor", "call_plan", "entries", "clock", "recorder", "detach",
                            "slow_dispatch", "scalar_positions", "checked_global", "local_failure",
                            "make_wrapper", "strided", "op_overload", NULL};
    PyObject *values[14];
    if (!PyArg_ParseTupleAndKeywords(kw_args, kwargs, "OOOOOOOOOOOOOO", names, &values[0], &values[1],
                                     &values[2], &values[3], &values[4], &values[5], &values[6], &values[7],
                                     &values[8], &values[9], &values[10], &values[11], &values[12], &values[13]))
        return NULL;
    PyObject **slots[14] = {&GlobalTensorType, &TensorType, &CallPlanType, &Entries, &Clock, &Recorder, &Detach,
                            &SlowDispatch, &ScalarPositions, &CheckedGlobal, &LocalFailure, &MakeWrapper,
                            &Strided, &OpOverloadType};
    for (int i = 0; i < 14; i++) {
        Py_INCREF(values[i]);
        Py_XSETREF(*slots[i], values[i]);
    }
    if (!PyDict_Check(Entries)) {
        PyErr_SetString(PyExc_TypeError, "entries must be the call cache's dict");
        return NULL;
    }
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"torch_dispatch", (PyCFunction)(void (*)(void))torch_dispatch, METH_FASTCALL,
     "GlobalTensor.__torch_dispatch__: a hit of a simple cached plan runs here, any other call in Python."},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "Give the hit path the objects it reads (once, at import)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_hit", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hit(void) {
    Facts = PyDict_New();
    if (Facts == NULL) return NULL;
    const char *texts[] = {"_local", "_meta", "func", "simple", "_op", "decision", "outputs", "local_shapes",
                           "returns_written", "shape", "strides", "dtype", "device", "is_conj", "is_neg",
                           "placement", "local_inputs", "detach"};
    PyObject **strings[] = {&s_local, &s_meta, &s_func, &s_simple, &s_op, &s_decision, &s_outputs,
                            &s_local_shapes, &s_returns_written, &s_shape, &s_strides, &s_dtype, &s_device,
                            &s_is_conj, &s_is_neg, &s_placement, &s_local_inputs, &s_detach};
    for (size_t i = 0; i < sizeof(texts) / sizeof(texts[0]); i++) {
        *strings[i] = PyUnicode_InternFromString(texts[i]);
        if (*strings[i] == NULL) return NULL;
    }
    return PyModule_Create(&module_def);
}
