/* The hit paths in C: GlobalTensor.__torch_dispatch__ for a call whose plan is cached and simple, and the learnt
   local calls of the frontend (after the dispatcher's part below).

   It does what sbp_torch/_dispatch/_dispatcher.py's ``dispatch`` does on a hit with a simple plan (``call_key``,
   one lookup in the call cache, ``_run_simple``, ``checked_global``, ``wrap_fresh``), with a plan that runs the op
   on the parts as they are (``CallPlan.runs_as_is``: ``_run`` with nothing to box or write) or with a view's plan
   that reshapes the part (``CallPlan.reshapes_part``), with no Python frame. Any other
   call (keyword arguments, a plain tensor argument, the recorder on, a miss, any other plan) goes to the
   Python ``dispatch``, which keys and looks the call up again: this file only ever answers what the Python hit path
   would answer, and the cache it reads is the Python one. Built by setup.py as sbp_torch._dispatch._hit, against
   Python's C API alone (no torch headers): a plain C compiler is enough. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

/* One object a configure call keeps: the keyword it comes by, where it is kept, and a check it must pass (NULL:
   none), which raises a TypeError naming the keyword and returns -1 where the object does not pass. */
typedef struct {
    const char *keyword;
    PyObject **slot;
    int (*check)(const char *keyword, PyObject *value);
} Configured;

/* One string the hit paths read attributes by: its text and where the interned string is kept. */
typedef struct {
    const char *text;
    PyObject **slot;
} Interned;

#define ROWS(table) (sizeof(table) / sizeof((table)[0]))

static int a_dict(const char *keyword, PyObject *value) {
    if (PyDict_Check(value)) return 0;
    PyErr_Format(PyExc_TypeError, "%s must be a dict", keyword);
    return -1;
}

static int a_set(const char *keyword, PyObject *value) {
    if (PyAnySet_Check(value)) return 0;
    PyErr_Format(PyExc_TypeError, "%s must be a set or a frozenset", keyword);
    return -1;
}

/* Keep, for each row of ``table``, the keyword argument of its keyword: 0, or -1 with an error set where any is
   missing or fails its check, where another keyword or a positional argument is given (nothing is kept then). */
static int keep_configured(const char *function, const Configured *table, size_t rows, PyObject *args,
                           PyObject *kwargs) {
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

static PyObject *GlobalTensorType, *TensorType, *CallPlanType, *Entries, *Clock, *Recorder, *Detach, *SlowDispatch,
    *ScalarPositions, *CheckedGlobal, *LocalFailure, *MakeWrapper, *Strided, *OpOverloadType;
static PyObject *Facts; /* id(func) -> (func, scalar positions, func._op), kept for good */

/* What configure keeps: the keyword sbp_torch/_dispatch/_native.py gives it by, where it is kept, its check. */
static const Configured DISPATCH_OBJECTS[] = {
    {"global_tensor", &GlobalTensorType, NULL},     /* sbp_torch's GlobalTensor */
    {"tensor", &TensorType, NULL},                  /* torch.Tensor */
    {"call_plan", &CallPlanType, NULL},             /* _call_plan.CallPlan */
    {"entries", &Entries, a_dict},                  /* CALLS._entries: key -> [entry, stamp] */
    {"clock", &Clock, NULL},                        /* CALLS._clock: the stamps */
    {"recorder", &Recorder, NULL},                  /* the ContextVar of _dispatcher.recording */
    {"detach", &Detach, NULL},                      /* aten.detach.default */
    {"slow_dispatch", &SlowDispatch, NULL},         /* _dispatcher.dispatch(func, args, kwargs) */
    {"scalar_positions", &ScalarPositions, NULL},   /* func -> op_schema(func).scalar_positions */
    {"checked_global", &CheckedGlobal, NULL},       /* _call_plan.checked_global(func, local, meta, shape) */
    {"local_failure", &LocalFailure, NULL},         /* _comm.local_failure(func, err, placement, local_inputs) */
    {"make_wrapper", &MakeWrapper, NULL},           /* torch.Tensor._make_wrapper_subclass */
    {"strided", &Strided, NULL},                    /* torch.strided */
    {"op_overload", &OpOverloadType, NULL},         /* torch._ops.OpOverload: its __call__ is ``self._op(*args)`` */
};

static PyObject *s_local, *s_meta, *s_func, *s_simple, *s_op, *s_decision, *s_outputs, *s_local_shapes,
    *s_returns_written, *s_shape, *s_strides, *s_dtype, *s_device, *s_is_conj, *s_is_neg, *s_placement,
    *s_local_inputs, *s_detach, *s_reshapes_part, *s_reshape, *s_runs_as_is, *s_zero, *s_finite, *s_not_finite;

static int configured = 0;

/* The value of the ``NumberClass`` of a Python number (borrowed), as _signatures.number_class gives it; NULL on
   error. */
static PyObject *number_class(PyObject *value) {
    if (PyFloat_Check(value)) {
        double d = PyFloat_AS_DOUBLE(value);
        return d == 0 ? s_zero : isfinite(d) ? s_finite : s_not_finite;
    }
    if (PyComplex_Check(value)) {
        Py_complex c = PyComplex_AsCComplex(value);
        if (c.real == 0 && c.imag == 0) return s_zero;
        return isfinite(c.real) && isfinite(c.imag) ? s_finite : s_not_finite;
    }
    int truth = PyObject_IsTrue(value); /* an integer, a bool included */
    return truth < 0 ? NULL : truth ? s_finite : s_zero;
}

/* The key of one argument, as _bound._key_of gives it; NULL without an error where only Python can key it (a plain
   tensor), NULL with an error on failure. */
static PyObject *key_of(PyObject *value, int is_scalar) {
    PyTypeObject *type = Py_TYPE(value);
    if ((PyObject *)type == GlobalTensorType) return PyObject_GetAttr(value, s_meta);
    if (PyList_Check(value) || PyTuple_Check(value)) {
        /* (a snapshot: keying an element may run Python code that changes a list) */
        PyObject *items = PySequence_Tuple(value);
        if (items == NULL) return NULL;
        Py_ssize_t n = PyTuple_GET_SIZE(items);
        PyObject *inner = PyTuple_New(n);
        if (inner == NULL || Py_EnterRecursiveCall(" while keying an sbp_torch call")) {
            Py_XDECREF(inner);
            Py_DECREF(items);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *k = key_of(PyTuple_GET_ITEM(items, i), is_scalar);
            if (k == NULL) {
                Py_LeaveRecursiveCall();
                Py_DECREF(inner);
                Py_DECREF(items);
                return NULL;
            }
            PyTuple_SET_ITEM(inner, i, k);
        }
        Py_LeaveRecursiveCall();
        Py_DECREF(items);
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
        PyObject *class = number_class(value); /* borrowed */
        return class == NULL ? NULL : PyTuple_Pack(2, (PyObject *)type, class);
    }
    /* (1, 1.0, True and 1+0j are equal keys: their results' dtypes differ) */
    if (PyFloat_Check(value) || PyBool_Check(value) || PyComplex_Check(value)) return PyTuple_Pack(2, type, value);
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
    if (entry == NULL) { /* (an entry holds its op, so no other op takes that id while it is kept) */
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

/* The op's local result wrapped as the plan's output ``k`` (``checked_global``); steals ``local``. */
static PyObject *wrap_at(PyObject *func, PyObject *plan, PyObject *local, Py_ssize_t k) {
    PyObject *decision = NULL, *outputs = NULL, *shapes = NULL, *shape = NULL, *result = NULL;
    decision = PyObject_GetAttr(plan, s_decision);
    outputs = decision ? PyObject_GetAttr(decision, s_outputs) : NULL;
    shapes = outputs ? PyObject_GetAttr(plan, s_local_shapes) : NULL;
    shape = shapes ? PyObject_GetAttr(local, s_shape) : NULL;
    if (shape == NULL) goto done;
    if (!PyTuple_Check(outputs) || PyTuple_GET_SIZE(outputs) <= k || !PyTuple_Check(shapes) ||
        PyTuple_GET_SIZE(shapes) <= k) {
        PyErr_SetString(PyExc_RuntimeError, "sbp_torch internal error: a call plan with fewer outputs than the op");
        goto done;
    }
    PyObject *meta = PyTuple_GET_ITEM(outputs, k), *want = PyTuple_GET_ITEM(shapes, k);
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

static PyObject *wrap(PyObject *func, PyObject *plan, PyObject *local) { return wrap_at(func, plan, local, 0); }

/* With the raised error (an ``Exception``) taken as the one being handled, as inside Python's ``except``:
   ``callable(func, err, *more)`` (``more``: up to two more arguments, NULL-terminated), then the error raised again;
   an error of the call itself wins, its context the first, as Python chains it. Always NULL. Errors that are not an
   ``Exception`` (KeyboardInterrupt) pass untouched, as ``except Exception`` lets them. */
static PyObject *raise_after(PyObject *callable, PyObject *func, PyObject *more0, PyObject *more1) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL) PyException_SetTraceback(value, traceback);
    PyObject *argv[4] = {func, value, more0, more1};
    size_t n = more0 == NULL ? 2 : more1 == NULL ? 3 : 4;
#if PY_VERSION_HEX >= 0x030B0000
    PyObject *handled = PyErr_GetHandledException();
    PyErr_SetHandledException(value);
    PyObject *noted = PyObject_Vectorcall(callable, argv, n, NULL);
    PyErr_SetHandledException(handled);
    Py_XDECREF(handled);
#else
    PyObject *h_type, *h_value, *h_traceback;
    PyErr_GetExcInfo(&h_type, &h_value, &h_traceback);
    Py_INCREF(type);
    Py_INCREF(value);
    Py_XINCREF(traceback);
    PyErr_SetExcInfo(type, value, traceback);
    PyObject *noted = PyObject_Vectorcall(callable, argv, n, NULL);
    PyErr_SetExcInfo(h_type, h_value, h_traceback);
#endif
    if (noted == NULL) { /* its own error wins (chained to ours by Python, which saw ours as being handled) */
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return NULL;
    }
    Py_DECREF(noted);
    PyErr_Restore(type, value, traceback);
    return NULL;
}

/* After an op failed on this rank (its error set): ``local_failure(func, err, placement, inputs)``, then the error
   raised again. Always NULL. */
static PyObject *failed(PyObject *func, PyObject *plan, int with_inputs) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback); /* (kept aside while the plan is read) */
    PyObject *placement = PyObject_GetAttr(plan, s_placement);
    PyObject *inputs = placement ? (with_inputs ? PyObject_GetAttr(plan, s_local_inputs) : (Py_INCREF(Py_None), Py_None))
                                 : NULL;
    if (inputs == NULL) {
        Py_XDECREF(placement);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return NULL;
    }
    PyErr_Restore(type, value, traceback);
    raise_after(LocalFailure, func, placement, inputs);
    Py_DECREF(placement);
    Py_DECREF(inputs);
    return NULL;
}

/* A plan whose local function reshapes the one input's part to the output's local shape (``reshapes_part``). */
static PyObject *run_reshape(PyObject *func, PyObject *plan, PyObject *args) {
    if (PyTuple_GET_SIZE(args) < 1) {
        PyErr_SetString(PyExc_RuntimeError, "sbp_torch internal error: a reshaping plan without its input");
        return NULL;
    }
    PyObject *local = PyObject_GetAttr(PyTuple_GET_ITEM(args, 0), s_local);
    PyObject *shapes = local ? PyObject_GetAttr(plan, s_local_shapes) : NULL;
    PyObject *out = NULL;
    if (shapes != NULL && PyTuple_Check(shapes) && PyTuple_GET_SIZE(shapes) == 1) {
        out = PyObject_CallMethodOneArg(local, s_reshape, PyTuple_GET_ITEM(shapes, 0));
        if (out == NULL) failed(func, plan, 0);
    } else if (shapes != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "sbp_torch internal error: a reshaping plan without one output");
    }
    Py_XDECREF(local);
    Py_XDECREF(shapes);
    return out == NULL ? NULL : wrap(func, plan, out);
}

/* ``value`` with a global tensor replaced by its part, and with ``lists``, each global tensor in a list too
   (``substitute``: a list or tuple becomes a new list). */
static PyObject *as_part(PyObject *value, int lists) {
    int global = PyObject_IsInstance(value, GlobalTensorType);
    if (global < 0) return NULL;
    if (global) return PyObject_GetAttr(value, s_local);
    if (!lists || (!PyList_Check(value) && !PyTuple_Check(value))) return (Py_INCREF(value), value);
    PyObject *items = PySequence_Tuple(value); /* (a snapshot, as the walks take) */
    if (items == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    PyObject *parts = PyList_New(n);
    for (Py_ssize_t i = 0; parts != NULL && i < n; i++) {
        PyObject *part = as_part(PyTuple_GET_ITEM(items, i), 0);
        if (part == NULL) Py_CLEAR(parts);
        else PyList_SET_ITEM(parts, i, part);
    }
    Py_DECREF(items);
    return parts;
}

/* The arguments the op runs on: each of ``args`` through ``as_part``. */
static PyObject *parts_of(PyObject *args, int lists) {
    Py_ssize_t n = PyTuple_GET_SIZE(args);
    PyObject *locals = PyTuple_New(n);
    for (Py_ssize_t i = 0; locals != NULL && i < n; i++) {
        PyObject *part = as_part(PyTuple_GET_ITEM(args, i), lists);
        if (part == NULL) Py_CLEAR(locals);
        else PyTuple_SET_ITEM(locals, i, part);
    }
    return locals;
}

/* The op (called as ``op``) on the parts of ``args`` (``parts_of``); where it raises, ``failed``: the others went
   on, so this closes the rank's world (docs/faults.md), then raises. */
static PyObject *on_parts(PyObject *func, PyObject *op, PyObject *plan, PyObject *args, int lists) {
    PyObject *locals = parts_of(args, lists);
    if (locals == NULL) return NULL;
    PyObject *out = PyObject_Call(op, locals, NULL);
    Py_DECREF(locals);
    return out == NULL ? failed(func, plan, 1) : out;
}

/* A plan that runs the op on the parts as they are (``runs_as_is``: ``_run`` with nothing boxed, no local function,
   nothing written), whatever the op returns: None, a tensor, or a tuple or list of tensors and other values. */
static PyObject *run_as_is(PyObject *func, PyObject *op, PyObject *plan, PyObject *args) {
    PyObject *out = on_parts(func, op, plan, args, 1);
    if (out == NULL) return NULL;
    if (out == Py_None) return out;
    int tensor = PyObject_IsInstance(out, TensorType);
    if (tensor < 0) {
        Py_DECREF(out);
        return NULL;
    }
    if (tensor) return wrap_at(func, plan, out, 0);
    PyObject *items = PySequence_Tuple(out);
    if (items == NULL) {
        Py_DECREF(out);
        return NULL;
    }
    Py_ssize_t m = PyTuple_GET_SIZE(items), k = 0;
    PyObject *results = PyList_New(m);
    for (Py_ssize_t i = 0; results != NULL && i < m; i++) {
        PyObject *o = PyTuple_GET_ITEM(items, i);
        int is_tensor = PyObject_IsInstance(o, TensorType);
        PyObject *r = is_tensor < 0 ? NULL : is_tensor ? (Py_INCREF(o), wrap_at(func, plan, o, k++)) : (Py_INCREF(o), o);
        if (r == NULL) Py_CLEAR(results);
        else PyList_SET_ITEM(results, i, r);
    }
    Py_DECREF(items);
    PyObject *result = NULL;
    if (results != NULL) { /* ``type(out)(results)`` for a tuple, the list itself otherwise, as ``_run`` returns */
        if (PyTuple_CheckExact(out)) result = PyList_AsTuple(results);
        else if (PyTuple_Check(out)) result = PyObject_CallOneArg((PyObject *)Py_TYPE(out), results);
        else result = (Py_INCREF(results), results);
        Py_DECREF(results);
    }
    Py_DECREF(out);
    return result;
}

/* The simple plan run on the local parts (``_run_simple``), the op called as ``op``. */
static PyObject *run_simple(PyObject *func, PyObject *op, PyObject *plan, PyObject *args) {
    PyObject *out = on_parts(func, op, plan, args, 0);
    if (out == NULL) return NULL;
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
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "sbp_torch._dispatch._hit is not configured");
        goto done;
    }
    if (!PyTuple_Check(args) ||
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
    Py_XINCREF(slot);
    Py_DECREF(key);
    if (slot == NULL) { /* a miss, or an unhashable key (as ``dispatch`` catches TypeError): Python decides */
        Py_DECREF(op);
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) goto done;
            PyErr_Clear();
        }
        result = slow(func, args, kwargs);
        goto done;
    }
    PyObject *plan = PyList_GET_ITEM(slot, 0);
    Py_INCREF(plan);
    int fits = (PyObject *)Py_TYPE(plan) == CallPlanType, simple_plan = 0, reshaping = 0;
    if (fits) {
        PyObject *planned = PyObject_GetAttr(plan, s_func);
        PyObject *simple = planned ? PyObject_GetAttr(plan, s_simple) : NULL;
        PyObject *reshapes = simple ? PyObject_GetAttr(plan, s_reshapes_part) : NULL;
        PyObject *as_is = reshapes ? PyObject_GetAttr(plan, s_runs_as_is) : NULL;
        simple_plan = simple == Py_True;
        reshaping = reshapes == Py_True;
        fits = as_is != NULL && planned == func && (simple_plan || reshaping || as_is == Py_True);
        Py_XDECREF(planned);
        Py_XDECREF(simple);
        Py_XDECREF(reshapes);
        Py_XDECREF(as_is);
        if (as_is == NULL) {
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
        if (stamp != NULL && PyList_SetItem(slot, 1, stamp) == 0) {
            result = simple_plan ? run_simple(func, op, plan, args)
                     : reshaping ? run_reshape(func, plan, args)
                                 : run_as_is(func, op, plan, args);
        }
    }
    Py_DECREF(slot);
    Py_DECREF(plan);
    Py_DECREF(op);
done:
    Py_XDECREF(empty_args);
    return result;
}

static PyObject *configure(PyObject *module, PyObject *args, PyObject *kwargs) {
    if (keep_configured("configure", DISPATCH_OBJECTS, ROWS(DISPATCH_OBJECTS), args, kwargs) < 0) return NULL;
    configured = 1;
    Py_RETURN_NONE;
}

/* ---- Local calls (sbp_torch/_frontend/_local_calls.py): ``_local_or_below_autograd`` with torch functions off. ---- */

static int local_configured = 0;
static PyObject *LocalEntries, *LocalClock, *LocalPop, *FloatsByType, *Refused, *LocalCallType, *PythonLocalOrBelow,
    *ValuesRead, *IncrementVersion, *DispatchModes, *Autocast, *GradEnabled, *NotHandled, *SpecialFuncs, *CompileTLS;

/* What configure_local keeps: the keyword sbp_torch/_frontend/_torch_function.py gives it by, where it is kept, its
   check. */
static const Configured LOCAL_OBJECTS[] = {
    {"entries", &LocalEntries, a_dict},             /* LOCAL_CALLS._entries: key -> [entry, stamp] */
    {"clock", &LocalClock, NULL},                   /* LOCAL_CALLS._clock: the stamps */
    {"pop", &LocalPop, NULL},                       /* LOCAL_CALLS.pop */
    {"floats_by_type", &FloatsByType, a_set},       /* FLOATS_BY_TYPE */
    {"refused", &Refused, NULL},                    /* _REFUSED */
    {"local_call", &LocalCallType, NULL},           /* LocalCall */
    {"python", &PythonLocalOrBelow, NULL},          /* the Python _local_or_below_autograd, for what C leaves */
    {"values_read", &ValuesRead, NULL},             /* (func, err): raises that a C++ composite read values */
    {"increment_version", &IncrementVersion, NULL}, /* torch._C._increment_version */
    {"dispatch_modes", &DispatchModes, NULL},       /* torch._C._len_torch_dispatch_stack */
    {"autocast", &Autocast, NULL},                  /* torch._C._is_any_autocast_enabled */
    {"grad_enabled", &GradEnabled, NULL},           /* torch.is_grad_enabled */
    {"not_handled", &NotHandled, NULL},             /* _local_calls.NOT_HANDLED */
    {"special", &SpecialFuncs, a_set},              /* what __torch_function__ rewrites: matmuls, attention, writes */
    {"compile_tls", &CompileTLS, NULL},             /* torch._guards._TLS: its compile_context is set while compiling */
};

static PyObject *s_requires_grad, *s_dim, *s_returns, *s_argument, *s_bumped, *s_tensor, *s_none,
    *s_not_allocated, *s_compile_context, *s_compile_id;

/* ``t.requires_grad`` (torch functions are off: no Python entry): 1, 0, or -1 with an error set. */
static int requires_grad(PyObject *t) {
    PyObject *value = PyObject_GetAttr(t, s_requires_grad);
    if (value == NULL) return -1;
    int requires = value == Py_True;
    Py_DECREF(value);
    return requires;
}

/* A walk over ``values`` starts: a snapshot of them (reading an element may run Python code that changes a list),
   within Python's recursion limit (a list nested deeper raises RecursionError, as Python's walk does); NULL on error.
   ``leave_walk`` ends it. */
static PyObject *enter_walk(PyObject *values) {
    PyObject *seq = PySequence_Tuple(values);
    if (seq != NULL && Py_EnterRecursiveCall(" while walking an sbp_torch call's arguments")) Py_CLEAR(seq);
    return seq;
}

static void leave_walk(PyObject *seq) {
    Py_LeaveRecursiveCall();
    Py_DECREF(seq);
}

/* Append the key and the local value of each of ``values`` (``_walk``): 1, or 0 where the call cannot be a local
   call (autograd records it, a plain tensor with dims meets a global one), or -1 on error. */
static int walk(PyObject *values, int by_type, int grad, PyObject *key, PyObject *local) {
    PyObject *seq = enter_walk(values);
    if (seq == NULL) return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    int ok = 1;
    for (Py_ssize_t i = 0; ok == 1 && i < n; i++) {
        PyObject *v = PyTuple_GET_ITEM(seq, i), *k = NULL, *part = NULL;
        PyTypeObject *t = Py_TYPE(v);
        if ((PyObject *)t == GlobalTensorType) {
            int recorded = grad ? requires_grad(v) : 0; /* autograd records the call: not a local call */
            if (recorded) { ok = recorded < 0 ? -1 : 0; break; }
            k = PyObject_GetAttr(v, s_meta);
            part = k ? PyObject_GetAttr(v, s_local) : NULL;
        } else if (t == &PyFloat_Type) {
            PyObject *class = by_type ? number_class(v) : v; /* borrowed */
            k = class ? PyTuple_Pack(2, (PyObject *)t, class) : NULL;
            part = (Py_INCREF(v), v);
        } else if (t == &PyLong_Type || t == &PyBool_Type) {
            k = PyTuple_Pack(2, (PyObject *)t, v);
            part = (Py_INCREF(v), v);
        } else if (t == &PyList_Type || t == &PyTuple_Type) {
            PyObject *inner_key = PyList_New(0), *inner_local = PyList_New(0);
            int inner = inner_key && inner_local ? walk(v, by_type, grad, inner_key, inner_local) : -1;
            if (inner == 1) {
                PyObject *keys = PyList_AsTuple(inner_key);
                k = keys ? PyTuple_Pack(2, (PyObject *)t, keys) : NULL;
                Py_XDECREF(keys);
                part = t == &PyList_Type ? (Py_INCREF(inner_local), inner_local) : PyList_AsTuple(inner_local);
            }
            Py_XDECREF(inner_key);
            Py_XDECREF(inner_local);
            if (inner != 1) { ok = inner; break; }
        } else {
            int tensor = PyObject_IsInstance(v, TensorType);
            if (tensor < 0) { ok = -1; break; }
            if (tensor) {
                int global = PyObject_IsInstance(v, GlobalTensorType);
                if (global < 0) { ok = -1; break; }
                if (global) { ok = 0; break; }
                PyObject *dim = PyObject_CallMethodNoArgs(v, s_dim);
                if (dim == NULL) { ok = -1; break; }
                int has_dims = PyObject_IsTrue(dim);
                Py_DECREF(dim);
                if (has_dims) { ok = has_dims < 0 ? -1 : 0; break; }
                int recorded = grad ? requires_grad(v) : 0;
                if (recorded) { ok = recorded < 0 ? -1 : 0; break; }
                PyObject *dtype = PyObject_GetAttr(v, s_dtype);
                PyObject *device = dtype ? PyObject_GetAttr(v, s_device) : NULL;
                k = device ? PyTuple_Pack(3, s_tensor, dtype, device) : NULL;
                Py_XDECREF(dtype);
                Py_XDECREF(device);
            } else {
                k = (Py_INCREF(v), v);
            }
            part = (Py_INCREF(v), v);
        }
        if (k == NULL || part == NULL || PyList_Append(key, k) < 0 || PyList_Append(local, part) < 0) ok = -1;
        Py_XDECREF(k);
        Py_XDECREF(part);
    }
    leave_walk(seq);
    return ok;
}

/* ``func(*args, **kwargs)`` below autograd (``run_below_autograd``): torch functions are off already. */
static PyObject *below_autograd(PyObject *func, PyObject *args, PyObject *kwargs) {
    int keywords = kwargs != NULL && kwargs != Py_None && PyDict_GET_SIZE(kwargs) > 0;
    PyObject *result = PyObject_Call(func, args, keywords ? kwargs : NULL);
    if (result == NULL && PyErr_ExceptionMatches(PyExc_RuntimeError)) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        PyObject *text = PyObject_Str(value);
        Py_ssize_t at = text ? PyUnicode_Find(text, s_not_allocated, 0, PY_SSIZE_T_MAX, 1) : -2;
        Py_XDECREF(text);
        if (at == -2) { /* str() or the search failed: that error goes on */
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
            return NULL;
        }
        PyErr_Restore(type, value, traceback);
        if (at >= 0) { /* a C++ composite read a wrapper's own (empty) storage: the clear error */
            raise_after(ValuesRead, func, NULL, NULL);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_SystemError, "values_read returned instead of raising");
        }
    }
    return result;
}

static PyObject *argument_at(PyObject *args, PyObject *kwargs, PyObject *where) {
    if (PyLong_Check(where)) {
        Py_ssize_t i = PyLong_AsSsize_t(where);
        if (i == -1 && PyErr_Occurred()) return NULL;
        if (i < 0 || i >= PyTuple_GET_SIZE(args)) {
            PyErr_SetString(PyExc_IndexError, "sbp_torch internal error: a learnt call's argument is missing");
            return NULL;
        }
        PyObject *v = PyTuple_GET_ITEM(args, i);
        Py_INCREF(v);
        return v;
    }
    PyObject *v = kwargs != NULL && kwargs != Py_None ? PyDict_GetItemWithError(kwargs, where) : NULL;
    if (v == NULL && !PyErr_Occurred()) {
        PyErr_SetString(PyExc_KeyError, "sbp_torch internal error: a learnt call's keyword is missing");
    }
    Py_XINCREF(v);
    return v;
}

/* Bump the versions the learning call bumped (``LocalCall.finish``'s first loop); -1 on error. */
static int bump(PyObject *bumped, PyObject *args, PyObject *kwargs) {
    Py_ssize_t n = PyTuple_GET_SIZE(bumped);
    for (Py_ssize_t b = 0; b < n; b++) {
        PyObject *entry = PyTuple_GET_ITEM(bumped, b);
        PyObject *slot = PyTuple_GET_ITEM(entry, 0), *indices = PyTuple_GET_ITEM(entry, 1);
        long count = PyLong_AsLong(PyTuple_GET_ITEM(entry, 2));
        if (count == -1 && PyErr_Occurred()) return -1;
        PyObject *value = argument_at(args, kwargs, slot);
        if (value == NULL) return -1;
        PyObject *targets;
        if (indices == Py_None) {
            targets = PyTuple_Pack(1, value);
        } else if (PyUnicode_Check(indices)) { /* "all" */
            targets = (Py_INCREF(value), value);
        } else {
            Py_ssize_t m = PyTuple_GET_SIZE(indices);
            targets = PyList_New(m);
            for (Py_ssize_t j = 0; targets != NULL && j < m; j++) {
                Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(indices, j));
                PyObject *item = at == -1 && PyErr_Occurred() ? NULL : PySequence_GetItem(value, at);
                if (item == NULL) Py_CLEAR(targets);
                else PyList_SET_ITEM(targets, j, item);
            }
        }
        Py_DECREF(value);
        if (targets == NULL) return -1;
        for (long c = 0; c < count; c++) {
            PyObject *r = PyObject_CallOneArg(IncrementVersion, targets);
            if (r == NULL) { Py_DECREF(targets); return -1; }
            Py_DECREF(r);
        }
        Py_DECREF(targets);
    }
    return 0;
}

static int flag(PyObject *fn) {
    PyObject *r = PyObject_CallNoArgs(fn);
    if (r == NULL) return -1;
    int on = PyObject_IsTrue(r);
    Py_DECREF(r);
    return on;
}

/* What both entries of the local calls check first: (func, types, args, kwargs), and the objects configured. 1 where
   ``args`` is a tuple and ``kwargs`` None or a dict, 0 where not (Python answers), -1 with an error set. */
static int local_entry(const char *name, PyObject *const *argv, Py_ssize_t argc) {
    if (argc != 4) {
        PyErr_Format(PyExc_TypeError, "%s(func, types, args, kwargs)", name);
        return -1;
    }
    if (!local_configured) {
        PyErr_SetString(PyExc_RuntimeError, "sbp_torch._dispatch._hit's local calls are not configured");
        return -1;
    }
    return PyTuple_Check(argv[2]) && (argv[3] == Py_None || PyDict_Check(argv[3]));
}

/* _local_or_below_autograd(func, types, args, kwargs): a learnt local call where the key has one that returns a
   tensor, an argument or None; any first sight, learning or other kind of return goes to the Python function. */
static PyObject *local_or_below_autograd(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
    int usual = local_entry("_local_or_below_autograd", argv, argc);
    if (usual < 0) return NULL;
    if (!usual) return PyObject_Vectorcall(PythonLocalOrBelow, argv, 4, NULL);
    PyObject *func = argv[0], *args = argv[2], *kwargs = argv[3];
    int modes = flag(DispatchModes);
    int autocast = modes == 0 ? flag(Autocast) : 0;
    int grad = modes == 0 && autocast == 0 ? flag(GradEnabled) : 0;
    if (modes < 0 || autocast < 0 || grad < 0) return NULL;
    if (modes || autocast) return below_autograd(func, args, kwargs);
    int by_type = PySet_Contains(FloatsByType, func);
    if (by_type < 0) return NULL;
    int has_kwargs = kwargs != Py_None && PyDict_GET_SIZE(kwargs) > 0;
    PyObject *key = PyList_New(0), *local_args = PyList_New(0), *local_kwargs = NULL, *names = NULL;
    PyObject *result = NULL, *tuple_key = NULL, *local_tuple = NULL, *plan = NULL, *slot = NULL;
    if (key == NULL || local_args == NULL || PyList_Append(key, func) < 0) goto done;
    int ok = walk(args, by_type, grad, key, local_args);
    if (ok == 1 && has_kwargs) {
        names = PyDict_Keys(kwargs);
        PyObject *values = names ? PyDict_Values(kwargs) : NULL;
        PyObject *local_values = values ? PyList_New(0) : NULL;
        ok = local_values ? walk(values, by_type, grad, key, local_values) : -1;
        if (ok == 1) {
            PyObject *name_tuple = PyList_AsTuple(names);
            local_kwargs = name_tuple ? PyDict_New() : NULL;
            for (Py_ssize_t i = 0; local_kwargs && i < PyList_GET_SIZE(names); i++) {
                if (PyDict_SetItem(local_kwargs, PyList_GET_ITEM(names, i), PyList_GET_ITEM(local_values, i)) < 0)
                    Py_CLEAR(local_kwargs);
            }
            if (local_kwargs == NULL || PyList_Append(key, name_tuple) < 0) ok = -1;
            Py_XDECREF(name_tuple);
        }
        Py_XDECREF(values);
        Py_XDECREF(local_values);
    }
    if (ok < 0) goto done;
    if (ok == 0) { /* autograd records it, or a plain tensor with dims: the dispatch path */
        result = below_autograd(func, args, kwargs);
        goto done;
    }
    tuple_key = PyList_AsTuple(key);
    if (tuple_key == NULL) goto done;
    slot = PyDict_GetItemWithError(LocalEntries, tuple_key);
    if (slot == NULL) {
        if (PyErr_Occurred()) { /* an unhashable argument (a slice, say): not a local call */
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) goto done;
            PyErr_Clear();
            result = below_autograd(func, args, kwargs);
        } else { /* a first sight: Python notes it */
            result = PyObject_Vectorcall(PythonLocalOrBelow, argv, 4, NULL);
        }
        slot = NULL;
        goto done;
    }
    Py_INCREF(slot);
    plan = PyList_GET_ITEM(slot, 0);
    Py_INCREF(plan);
    if (plan == Refused) {
        PyObject *stamp = PyIter_Next(LocalClock);
        if (stamp == NULL || PyList_SetItem(slot, 1, stamp) < 0) goto done;
        result = below_autograd(func, args, kwargs);
        goto done;
    }
    PyObject *returns = (PyObject *)Py_TYPE(plan) == LocalCallType ? PyObject_GetAttr(plan, s_returns) : NULL;
    if (returns == NULL) { /* a key seen once: Python learns it */
        if (PyErr_Occurred()) goto done;
        result = PyObject_Vectorcall(PythonLocalOrBelow, argv, 4, NULL);
        goto done;
    }
    int kind = !PyUnicode_Check(returns)                      ? 0
               : PyUnicode_Compare(returns, s_tensor) == 0   ? 1
               : PyUnicode_Compare(returns, s_argument) == 0 ? 2
               : PyUnicode_Compare(returns, s_none) == 0     ? 3
                                                             : 0;
    Py_DECREF(returns);
    if (PyErr_Occurred()) goto done;
    if (kind == 0) { /* a list or tuple of outputs: Python runs it */
        result = PyObject_Vectorcall(PythonLocalOrBelow, argv, 4, NULL);
        goto done;
    }
    PyObject *stamp = PyIter_Next(LocalClock); /* a hit, as LruCache.get counts it */
    if (stamp == NULL || PyList_SetItem(slot, 1, stamp) < 0) goto done;
    local_tuple = PyList_AsTuple(local_args);
    if (local_tuple == NULL) goto done;
    PyObject *local = PyObject_Call(func, local_tuple, local_kwargs);
    if (local == NULL) { /* the others went on: closes this rank's world (docs/faults.md), then raises */
        raise_after(LocalFailure, func, NULL, NULL);
        goto done;
    }
    PyObject *bumped = PyObject_GetAttr(plan, s_bumped);
    if (bumped == NULL || bump(bumped, args, kwargs) < 0) {
        Py_XDECREF(bumped);
        Py_DECREF(local);
        goto done;
    }
    Py_DECREF(bumped);
    if (kind == 3) {
        Py_DECREF(local);
        result = (Py_INCREF(Py_None), Py_None);
    } else if (kind == 2) {
        Py_DECREF(local);
        PyObject *where = PyObject_GetAttr(plan, s_argument);
        result = where ? argument_at(args, kwargs, where) : NULL;
        Py_XDECREF(where);
    } else { /* one new tensor: its shape and dtype as learnt, else the key is forgotten and dispatch decides */
        PyObject *outputs = PyObject_GetAttr(plan, s_outputs);
        PyObject *shapes = outputs ? PyObject_GetAttr(plan, s_local_shapes) : NULL;
        PyObject *shape = shapes ? PyObject_GetAttr(local, s_shape) : NULL;
        PyObject *dtype = shape ? PyObject_GetAttr(local, s_dtype) : NULL;
        if (dtype != NULL) {
            PyObject *meta = PyTuple_GET_ITEM(outputs, 0);
            PyObject *want = PyObject_GetAttr(meta, s_dtype);
            int same = want ? PyObject_RichCompareBool(shape, PyTuple_GET_ITEM(shapes, 0), Py_EQ) : -1;
            if (same == 1) same = dtype == want;
            Py_XDECREF(want);
            if (same == 1) {
                result = wrap_fresh(local, meta);
            } else if (same == 0) { /* nothing was written (a call returning new tensors writes none): run again */
                PyObject *popped = PyObject_CallOneArg(LocalPop, tuple_key);
                if (popped != NULL) {
                    Py_DECREF(popped);
                    result = below_autograd(func, args, kwargs);
                }
            }
        }
        Py_XDECREF(outputs);
        Py_XDECREF(shapes);
        Py_XDECREF(shape);
        Py_XDECREF(dtype);
        Py_DECREF(local);
    }
done:
    Py_XDECREF(key);
    Py_XDECREF(local_args);
    Py_XDECREF(local_kwargs);
    Py_XDECREF(names);
    Py_XDECREF(tuple_key);
    Py_XDECREF(local_tuple);
    Py_XDECREF(plan);
    Py_XDECREF(slot);
    return result;
}

/* Whether ``values`` hold a plain tensor with dims (``_plain_inputs._plain_tensors``): 1, 0, or -1 on error. */
static int holds_plain_tensor(PyObject *values) {
    PyObject *seq = enter_walk(values);
    if (seq == NULL) return -1;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    int found = 0;
    for (Py_ssize_t i = 0; !found && i < n; i++) {
        PyObject *v = PyTuple_GET_ITEM(seq, i);
        PyTypeObject *t = Py_TYPE(v);
        if ((PyObject *)t == GlobalTensorType) continue;
        if (t == &PyList_Type || t == &PyTuple_Type) {
            found = holds_plain_tensor(v);
            continue;
        }
        int tensor = PyObject_IsInstance(v, TensorType);
        int global = tensor > 0 ? PyObject_IsInstance(v, GlobalTensorType) : 0;
        if (tensor < 0 || global < 0) {
            found = -1;
        } else if (tensor && !global) {
            PyObject *dim = PyObject_CallMethodNoArgs(v, s_dim);
            found = dim == NULL ? -1 : PyObject_IsTrue(dim);
            Py_XDECREF(dim);
        }
    }
    leave_walk(seq);
    return found;
}

/* Whether torch.compile's AOTAutograd or a backend runs (``_comm.compiling`` past Dynamo's own flag): 1, 0, -1. */
static int compile_context_set(void) {
    PyObject *context = PyObject_GetAttr(CompileTLS, s_compile_context);
    if (context == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    int set = 0;
    if (context != Py_None) {
        PyObject *id = PyObject_GetAttr(context, s_compile_id);
        set = id == NULL ? -1 : id != Py_None;
        Py_XDECREF(id);
    }
    Py_DECREF(context);
    return set;
}

/* The eager part of GlobalTensor.__torch_function__ for a function that is not a getter, run with torch functions
   off: ``NOT_HANDLED`` (nothing done) where Python must see the call (a plain tensor with dims among the arguments, a
   batched matmul or attention, a compilation under way), else ``_local_or_below_autograd``. */
static PyObject *eager_torch_function(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
    int usual = local_entry("eager_torch_function", argv, argc);
    if (usual < 0) return NULL;
    if (!usual) {
        Py_INCREF(NotHandled);
        return NotHandled;
    }
    PyObject *func = argv[0], *args = argv[2], *kwargs = argv[3];
    int special = PySet_Contains(SpecialFuncs, func);
    int compiling = special == 0 ? compile_context_set() : 0;
    int plain = special == 0 && compiling == 0 ? holds_plain_tensor(args) : 0;
    if (plain == 0 && special == 0 && compiling == 0 && kwargs != Py_None && PyDict_GET_SIZE(kwargs) > 0) {
        PyObject *values = PyDict_Values(kwargs);
        plain = values ? holds_plain_tensor(values) : -1;
        Py_XDECREF(values);
    }
    if (special < 0 || compiling < 0 || plain < 0) return NULL;
    if (special || compiling || plain) {
        Py_INCREF(NotHandled);
        return NotHandled;
    }
    return local_or_below_autograd(module, argv, argc);
}

static PyObject *configure_local(PyObject *module, PyObject *args, PyObject *kwargs) {
    if (!configured) { /* (checked before anything is kept) */
        PyErr_SetString(PyExc_RuntimeError, "configure the dispatcher's hit path first");
        return NULL;
    }
    if (keep_configured("configure_local", LOCAL_OBJECTS, ROWS(LOCAL_OBJECTS), args, kwargs) < 0) return NULL;
    local_configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"eager_torch_function", (PyCFunction)(void (*)(void))eager_torch_function, METH_FASTCALL,
     "The eager part of __torch_function__: NOT_HANDLED where Python must see the call."},
    {"local_or_below_autograd", (PyCFunction)(void (*)(void))local_or_below_autograd, METH_FASTCALL,
     "_local_or_below_autograd: a learnt local call that returns a tensor, an argument or None runs here."},
    {"configure_local", (PyCFunction)(void (*)(void))configure_local, METH_VARARGS | METH_KEYWORDS,
     "Give the local-call hit path the objects it reads (once, at import)."},
    {"torch_dispatch", (PyCFunction)(void (*)(void))torch_dispatch, METH_FASTCALL,
     "GlobalTensor.__torch_dispatch__: a hit of a simple cached plan runs here, any other call in Python."},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "Give the hit path the objects it reads (once, at import)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_hit", NULL, -1, methods};

/* The names of the attributes the hit paths read, and the texts they compare, interned once. */
static const Interned STRINGS[] = {
    {"_local", &s_local},
    {"_meta", &s_meta},
    {"outputs", &s_outputs},
    {"local_shapes", &s_local_shapes},
    {"shape", &s_shape},
    {"dtype", &s_dtype},
    {"device", &s_device},
    {"func", &s_func},
    {"simple", &s_simple},
    {"_op", &s_op},
    {"decision", &s_decision},
    {"returns_written", &s_returns_written},
    {"strides", &s_strides},
    {"is_conj", &s_is_conj},
    {"is_neg", &s_is_neg},
    {"placement", &s_placement},
    {"local_inputs", &s_local_inputs},
    {"detach", &s_detach},
    {"reshapes_part", &s_reshapes_part},
    {"reshape", &s_reshape},
    {"runs_as_is", &s_runs_as_is},
    {"zero", &s_zero},
    {"finite, nonzero", &s_finite},
    {"inf or nan", &s_not_finite},
    {"requires_grad", &s_requires_grad},
    {"dim", &s_dim},
    {"returns", &s_returns},
    {"argument", &s_argument},
    {"bumped", &s_bumped},
    {"tensor", &s_tensor},
    {"none", &s_none},
    {"data is not allocated", &s_not_allocated},
    {"compile_context", &s_compile_context},
    {"compile_id", &s_compile_id},
};

PyMODINIT_FUNC PyInit__hit(void) {
    Facts = PyDict_New();
    if (Facts == NULL) return NULL;
    for (size_t i = 0; i < ROWS(STRINGS); i++) {
        *STRINGS[i].slot = PyUnicode_InternFromString(STRINGS[i].text);
        if (*STRINGS[i].slot == NULL) return NULL;
    }
    return PyModule_Create(&module_def);
}
