/* tpde's extensions hand their C interfaces to one another as capsules: a module's `api`. */
#ifndef TPDE_CAPSULE_H
#define TPDE_CAPSULE_H
#include <Python.h>

/* The module `def` describes, with `api` as its capsule `name` (its attribute `api`). */
static inline PyObject *module_with_api(struct PyModuleDef *def, const void *api,
                                        const char *name) {
    PyObject *m = PyModule_Create(def);
    if (m == NULL) return NULL;
    PyObject *cap = PyCapsule_New((void *)api, name, NULL);
    if (cap == NULL || PyModule_AddObject(m, "api", cap) < 0) {
        Py_XDECREF(cap);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
#endif
