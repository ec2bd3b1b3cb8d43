/* What the two parts of the extension sbp_torch._dispatch._hit share.

   dispatch_hit.c is the dispatcher's hit path (GlobalTensor.__torch_dispatch__); local_calls_hit.c is the frontend's
   local calls (sbp_torch/_frontend/_local_calls.py). As sbp_torch/_frontend imports from sbp_torch/_dispatch and
   never the other way, the local calls' part uses what the dispatcher's part lends it (below) and the dispatcher's
   part knows nothing of the local calls. hit_module.c makes the module of both (its table of functions) and holds what
   each part uses to set itself up: a table of the objects its configure call keeps and a table of the strings it
   interns, one row each. */

#ifndef SBP_TORCH_HIT_H
#define SBP_TORCH_HIT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define ROWS(table) (sizeof(table) / sizeof((table)[0]))

/* One object a part's configure call keeps: the keyword it comes by, where it is kept, and a check it must pass
   (NULL: none), which raises a TypeError naming the keyword and returns -1 where the object does not pass. */
typedef struct {
    const char *keyword;
    PyObject **slot;
    int (*check)(const char *keyword, PyObject *value);
} Configured;

/* One string a part reads attributes by: its text and where the interned string is kept. */
typedef struct {
    const char *text;
    PyObject **slot;
} Interned;

/* hit_module.c */
int a_dict(const char *keyword, PyObject *value);
int a_set(const char *keyword, PyObject *value);
/* Keep, for each row of ``table``, the keyword argument of its keyword: 0, or -1 with an error set where any is
   missing or fails its check, where another keyword or a positional argument is given (nothing is kept then). */
int keep_configured(const char *function, const Configured *table, size_t rows, PyObject *args, PyObject *kwargs);
/* Intern each row's text into its slot: 0, or -1 with an error set. */
int intern_strings(const Interned *table, size_t rows);

/* dispatch_hit.c: what hit_module.c makes the module of */
int dispatch_hit_init(void); /* interns its strings: 0, or -1 with an error set */
PyObject *torch_dispatch(PyObject *module, PyObject *const *argv, Py_ssize_t argc);
PyObject *configure(PyObject *module, PyObject *args, PyObject *kwargs);

/* dispatch_hit.c: what it lends the local calls' part */
extern int dispatch_configured; /* whether configure has run */
extern PyObject *GlobalTensorType, *TensorType, *LocalFailure;
extern PyObject *s_local, *s_meta, *s_outputs, *s_local_shapes, *s_shape, *s_dtype, *s_device;
PyObject *number_class(PyObject *value);
PyObject *wrap_fresh(PyObject *local, PyObject *meta);
PyObject *raise_after(PyObject *callable, PyObject *func, PyObject *more0, PyObject *more1);

/* local_calls_hit.c: what hit_module.c makes the module of */
int local_calls_hit_init(void); /* interns its strings: 0, or -1 with an error set */
PyObject *local_or_below_autograd(PyObject *module, PyObject *const *argv, Py_ssize_t argc);
PyObject *eager_torch_function(PyObject *module, PyObject *const *argv, Py_ssize_t argc);
PyObject *configure_local(PyObject *module, PyObject *args, PyObject *kwargs);

#endif
