/* The dispatcher's hit path in C: GlobalTensor.__torch_dispatch__ for a call whose plan is cached and simple.

   It does what sbp_torch/_dispatch/_dispatcher.py's ``dispatch`` does on a hit with a simple plan (``call_key``,
   one lookup in the call cache, ``_run_simple``, ``checked_global``, ``wrap_fresh``), with a plan that runs the op
   on the parts as they are (``CallPlan.runs_as_is``: ``_run`` with nothing to box or write) or with a view's plan
   that reshapes the part (``CallPlan.reshapes_part``), with no Python frame. Any other
   call (keyword arguments, a plain tensor argument, the recorder on, a miss, any other plan) goes to the
   Python ``dispatch``, which keys and looks the call up again: this file only ever answers what the Python hit path
   would answer, and the cache it reads is the Python one. Part of sbp_torch._dispatch._hit (hit_module.c); what it
   lends the frontend's local calls (local_calls_hit.c) is named in hit.h. */

#include <math.h>

#include "hit.h"

PyObject *GlobalTensorType, *TensorType, *LocalFailure; /* lent to the local calls' part (hit.h) */
static PyObject *CallPlanType, *Entries, *Clock, *Recorder, *Detach, *SlowDispatch, *ScalarPositions, *CheckedGlobal,
    *MakeWrapper, *Strided, *OpOverloadType;
static PyObject *Facts; /* id(func) -> (func, scalar positions, func._op), kept for good */

/* What configure keeps: the keyword sbp_torch/_dispatch/_native.py gives it by, where it is kept, its check. */
static const Configured OBJECTS[] = {
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

PyObject *s_local, *s_meta, *s_outputs, *s_local_shapes, *s_shape, *s_dtype, *s_device; /* lent too (hit.h) */
static PyObject *s_func, *s_simple, *s_op, *s_decision, *s_returns_written, *s_strides, *s_is_conj, *s_is_neg,
    *s_placement, *s_local_inputs, *s_detach, *s_reshapes_part, *s_reshape, *s_runs_as_is, *s_zero, *s_finite,
    *s_not_finite;

/* The names of the attributes the hit path reads, and the values of _signatures.NumberClass, interned once. */
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
};

int dispatch_configured = 0;

/* The value of the ``NumberClass`` of a Python number (borrowed), as _signatures.number_class gives it; NULL on
   error. */
PyObject *number_class(PyObject *value) {
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
PyObject *wrap_fresh(PyObject *local, PyObject *meta) {
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
PyObject *raise_after(PyObject *callable, PyObject *func, PyObject *more0, PyObject *more1) {
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
PyObject *torch_dispatch(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
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
    if (!dispatch_configured) {
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

PyObject *configure(PyObject *module, PyObject *args, PyObject *kwargs) {
    if (keep_configured("configure", OBJECTS, ROWS(OBJECTS), args, kwargs) < 0) return NULL;
    dispatch_configured = 1;
    Py_RETURN_NONE;
}

int dispatch_hit_init(void) {
    Facts = PyDict_New();
    return Facts == NULL ? -1 : intern_strings(STRINGS, ROWS(STRINGS));
}
