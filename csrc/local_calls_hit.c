/* The frontend's local calls in C (sbp_torch/_frontend/_local_calls.py): ``_local_or_below_autograd`` and the eager
   part of GlobalTensor.__torch_function__, run with torch functions off. A learnt local call that returns a tensor,
   an argument or None runs here; first sights, learning and other returns go to the Python function, so both answer
   every call alike. Part of sbp_torch._dispatch._hit (hit_module.c), configured after the dispatcher's hit path,
   whose objects and helpers it uses (hit.h). */

#include "hit.h"

static PyObject *LocalEntries, *LocalClock, *LocalPop, *FloatsByType, *Refused, *LocalCallType, *PythonLocalOrBelow,
    *ValuesRead, *IncrementVersion, *DispatchModes, *Autocast, *GradEnabled, *NotHandled, *SpecialFuncs, *CompileTLS;

/* What configure_local keeps: the keyword sbp_torch/_frontend/_torch_function.py gives it by, where it is kept, its
   check. */
static const Configured OBJECTS[] = {
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

/* The names of the attributes the local calls read, and the texts they compare, interned once. */
static const Interned STRINGS[] = {
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

static int local_configured = 0;

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
PyObject *local_or_below_autograd(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
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
PyObject *eager_torch_function(PyObject *module, PyObject *const *argv, Py_ssize_t argc) {
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

PyObject *configure_local(PyObject *module, PyObject *args, PyObject *kwargs) {
    if (!dispatch_configured) { /* (checked before anything is kept) */
        PyErr_SetString(PyExc_RuntimeError, "configure the dispatcher's hit path first");
        return NULL;
    }
    if (keep_configured("configure_local", OBJECTS, ROWS(OBJECTS), args, kwargs) < 0) return NULL;
    local_configured = 1;
    Py_RETURN_NONE;
}

int local_calls_hit_init(void) { return intern_strings(STRINGS, ROWS(STRINGS)); }
