// Plain object slots of Python classes, read and written in place by the bindings (a view's
// fields, a Decision's value and reason, the watchdog's seq, the interrupts gate's pending,
// which hook the native core asks).
// Binding-only (the Python C API).
#pragma once

#include <Python.h>
#include <structmember.h>

namespace kvlife {

// Where ``type`` itself declares ``name`` as a plain writable object slot (an attrs slots field,
// a __slots__ name): its offset in an instance; -1 for anything else (a property, an inherited
// or a dict attribute), which is then got and set by name.
inline Py_ssize_t slot_offset(PyTypeObject* type, const char* name) {
    PyObject* d = PyDict_GetItemString(type->tp_dict, name);
    if (d == nullptr || Py_TYPE(d) != &PyMemberDescr_Type) return -1;
    const PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(d)->d_member;
    return m->type == T_OBJECT_EX && (m->flags & READONLY) == 0 ? m->offset : -1;
}

// The object in the slot at ``offset`` of ``obj`` (borrowed), or null with AttributeError
// ``name`` set when the slot is empty (as getattr says).
inline PyObject* slot_get(PyObject* obj, Py_ssize_t offset, PyObject* name) {
    PyObject* value = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
    if (value == nullptr) PyErr_SetObject(PyExc_AttributeError, name);
    return value;
}

// ``value`` (a new reference, stolen) into the slot at ``offset`` of ``obj``; what the slot held
// is released after (its deallocation may run Python, by then the slot is whole again).
inline void slot_set(PyObject* obj, Py_ssize_t offset, PyObject* value) {
    PyObject** slot = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
    PyObject* old = *slot;
    *slot = value;
    Py_XDECREF(old);
}

}  // namespace kvlife
