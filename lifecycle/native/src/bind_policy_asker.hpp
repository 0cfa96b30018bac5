// PyPolicyAsker: the native core's PolicyAsker, a mirror of policies/stack.py PolicyStack.ask
// over the stack's own chains (``_chains``: per hook, (policy name, hook function) top-down),
// the same watchdog (``_watch.seq`` odd while a hook runs; ``native_asking``'s slots say which one),
// and the reference's view classes, filled without running Python:
//
// * views: policies/base.py's RequestView, EngineView, LoadView and PrefetchView are attrs
//   frozen slots classes; an instance is allocated and its slots written directly (what
//   attrs' __init__ does, without the interpreter), so a policy gets the very classes the
//   Python engine hands it. A class whose fields are not plain slots is called instead.
// * answers: a ``Decision`` whose value and reason are plainly well formed (exact str, int,
//   float, bool) is taken here; anything else goes through the reference's _check_decision.
// * errors: whatever a hook (or that check) raises goes through the reference's hook_failure,
//   which says what PolicyStack.ask raises instead.
//
// A binding-only header: the core's plain C++ never includes it.
#pragma once

#include <Python.h>
#include <pybind11/pybind11.h>
#include <structmember.h>

#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bind_core_convert.hpp"
#include "bind_slots.hpp"
#include "core_lifecycle.hpp"
#include "core_request.hpp"

namespace kvlife {

namespace py = pybind11;

// An attrs slots class whose instances are made by writing their slots (``make``), in the
// order of ``fields``; a class with a field that is not a plain object slot is called.
class SlotClass {
  public:
    SlotClass() = default;
    SlotClass(py::object cls, std::initializer_list<const char*> fields) : cls_(std::move(cls)) {
        py::object attrs_fields = py::module_::import("attrs").attr("fields")(cls_);
        std::vector<std::string> declared;
        for (py::handle a : attrs_fields) declared.push_back(a.attr("name").cast<std::string>());
        std::vector<std::string> wanted(fields.begin(), fields.end());
        if (declared != wanted) {
            throw std::logic_error(py::repr(cls_).cast<std::string>() +
                                   ": its fields are not the ones the native core fills, in that order");
        }
        type_ = reinterpret_cast<PyTypeObject*>(cls_.ptr());
        direct_ = type_->tp_alloc != nullptr;
        for (const std::string& name : wanted) {
            const Py_ssize_t offset = slot_offset(type_, name.c_str());
            if (offset < 0) {
                direct_ = false;
                break;
            }
            offsets_.push_back(offset);
        }
    }

    // An instance holding ``values`` (new references, stolen; one per field).
    template <std::size_t N>
    py::object make(std::array<PyObject*, N> values) const {
        for (PyObject* v : values) {
            if (v == nullptr) {
                for (PyObject* o : values) Py_XDECREF(o);
                throw py::error_already_set();
            }
        }
        if (direct_) {
            PyObject* obj = type_->tp_alloc(type_, 0);
            if (obj == nullptr) {
                for (PyObject* v : values) Py_DECREF(v);
                throw py::error_already_set();
            }
            char* base = reinterpret_cast<char*>(obj);
            for (std::size_t i = 0; i < N; ++i) *reinterpret_cast<PyObject**>(base + offsets_[i]) = values[i];
            return py::reinterpret_steal<py::object>(obj);
        }
        py::tuple args(N);
        for (std::size_t i = 0; i < N; ++i) PyTuple_SET_ITEM(args.ptr(), i, values[i]);
        return cls_(*args);
    }

  private:
    py::object cls_;
    PyTypeObject* type_ = nullptr;
    std::vector<Py_ssize_t> offsets_;
    bool direct_ = false;
};

class PyPolicyAsker final : public PolicyAsker {
  public:
    explicit PyPolicyAsker(py::object stack) : stack_(std::move(stack)) {
        py::module_ base = py::module_::import("kvlife.policies.base");
        py::module_ stack_module = py::module_::import("kvlife.policies.stack");
        request_view_ = SlotClass(base.attr("RequestView"),
                                  {"request_id", "state", "arrival_ms", "prompt_tokens", "generated_tokens",
                                   "computed_tokens", "confirmed_tokens", "placeholder_tokens", "block_tokens",
                                   "block_hashes", "stored_blocks", "resumable", "preemptions"});
        engine_view_ = SlotClass(base.attr("EngineView"), {"now_ms", "running", "waiting", "loading",
                                                           "free_device_blocks", "device_blocks"});
        load_view_ = SlotClass(base.attr("LoadView"), {"device_hit_blocks", "external_hit_blocks", "tiers",
                                                       "in_flight"});
        prefetch_view_ = SlotClass(base.attr("PrefetchView"), {"blocks", "tokens", "source_tiers", "started_ms"});
        decision_ = base.attr("Decision");
        value_offset_ = slot_offset(reinterpret_cast<PyTypeObject*>(decision_.ptr()), "value");
        reason_offset_ = slot_offset(reinterpret_cast<PyTypeObject*>(decision_.ptr()), "reason");
        reason_max_ = stack_module.attr("REASON_MAX").cast<Py_ssize_t>();
        check_decision_ = stack_module.attr("_check_decision");
        hook_failure_ = stack_module.attr("hook_failure");
        origin_ = stack_module.attr("_origin");
        watch_ = stack_.attr("_watch");
        seq_ = py::str("seq");
        seq_offset_ = slot_offset(Py_TYPE(watch_.ptr()), "seq");
        asking_ = stack_.attr("native_asking");
        for (std::size_t i = 0; i < kAskingFields.size(); ++i) {
            asking_names_[i] = py::str(kAskingFields[i]);
            asking_offsets_[i] = slot_offset(Py_TYPE(asking_.ptr()), kAskingFields[i]);
        }
        py::dict chains = stack_.attr("_chains");
        py::dict values = base.attr("HOOK_VALUES");
        py::dict fallbacks = base.attr("FALLBACKS");
        py::object builtins = py::module_::import("builtins");
        for (std::size_t i = 0; i < kNumHooks; ++i) {
            HookAsk& h = hooks_[i];
            h.name = py::str(std::string(hook_name(static_cast<Hook>(i))));
            for (py::handle link : chains[h.name]) {
                py::tuple pair = py::reinterpret_borrow<py::tuple>(link);
                h.chain.push_back(Link{py::reinterpret_borrow<py::str>(pair[0]), pair[0].cast<std::string>(),
                                       py::reinterpret_borrow<py::object>(pair[1])});
            }
            py::object allowed = values[h.name];
            if (py::isinstance<py::tuple>(allowed)) {
                h.kind = Kind::CHOICE;
                for (py::handle choice : allowed) h.choices.push_back(py::reinterpret_borrow<py::str>(choice));
            } else if (allowed.is(builtins.attr("float"))) {
                h.kind = Kind::NUMBER;
            } else if (allowed.is(builtins.attr("bool"))) {
                h.kind = Kind::BOOL;
            } else {
                h.kind = Kind::INT;  // the only other: int
            }
            if (fallbacks.contains(h.name)) {
                py::object fallback = fallbacks[h.name];
                h.has_fallback = true;
                h.fallback.policy = fallback.attr("policy").cast<std::string>();
                h.fallback.value = answer_value(fallback.attr("value"));
                h.fallback.reason = fallback.attr("reason").cast<std::string>();
            }
        }
        py::object members = py::module_::import("kvlife.specs.names").attr("RequestState");
        for (std::size_t i = 0; i < kNumStates; ++i) {
            states_[i] = py::str(std::string(state_name(static_cast<RequestState>(i))));
            members_[i] = members(states_[i]);
        }
    }

    void ask(Hook hook, const Request& req, const HookArg& arg, const EngineView& engine, Answer& out) override {
        const HookAsk& h = hooks_[static_cast<std::size_t>(hook)];
        std::array<PyObject*, 4> args{};  // the request view, the hook's own argument, the engine view
        py::object view = request_view(req);
        py::object middle;
        switch (arg.index()) {
            case 1:
                middle = load_view(*std::get<const LoadView*>(arg));
                break;
            case 2:
                middle = prefetch_view(*std::get<const PrefetchView*>(arg));
                break;
            case 3:
                middle = py::int_(std::get<std::int64_t>(arg));
                break;
            default:
                break;
        }
        py::object ev = engine_view(engine);
        std::size_t nargs = 0;
        args[nargs++] = view.ptr();
        if (middle) args[nargs++] = middle.ptr();
        args[nargs++] = ev.ptr();

        Seq running(watch_, seq_, seq_offset_);  // PolicyStack.ask's watch.seq += 1, before and after
        for (const Link& link : h.chain) {
            mark_asking(link, h, view.ptr());
            PyObject* decision = PyObject_Vectorcall(link.fn.ptr(), args.data(), nargs, nullptr);
            if (decision == nullptr) fail(link, h);
            py::object held = py::reinterpret_steal<py::object>(decision);
            if (decision == Py_None) continue;
            PyObject* value = nullptr;
            PyObject* reason = nullptr;
            if (!well_formed(h, decision, value, reason)) {
                PyObject* checked = PyObject_CallFunctionObjArgs(check_decision_.ptr(), link.name.ptr(), h.name.ptr(),
                                                                 decision, link.fn.ptr(), nullptr);
                if (checked == nullptr) fail(link, h);
                Py_DECREF(checked);
                py::object v = held.attr("value");  // (well formed: it has both)
                py::object r = held.attr("reason");
                take(link, h, v.ptr(), r.ptr(), out);
                return;
            }
            take(link, h, value, reason, out);
            return;
        }
        if (h.has_fallback) {
            out.policy = h.fallback.policy;
            out.value = h.fallback.value;
            out.reason = h.fallback.reason;
            return;
        }
        py::object error = py::module_::import("kvlife.policies.base").attr("PolicyError");
        PyErr_SetString(error.ptr(), ("no policy in the stack answered " + h.name.cast<std::string>()).c_str());
        throw py::error_already_set();
    }

    // The request left the engine: its view parts are dropped (a run that retires requests
    // keeps only the live ones'; otherwise kCacheMax bounds them).
    void forget(const std::string& request_id) { cache_.erase(request_id); }

  private:
    enum class Kind { CHOICE, NUMBER, INT, BOOL };
    struct Link {
        py::str name;
        std::string policy;
        py::object fn;
    };
    struct HookAsk {
        py::str name;
        std::vector<Link> chain;
        Kind kind = Kind::CHOICE;
        std::vector<py::str> choices;
        bool has_fallback = false;
        Answer fallback;
    };

    // The stack's native_asking (policies/stack.py NativeAsking) says this hook of this request
    // is asked: its four slots written in place (by name where one is not a plain slot).
    static constexpr std::array<const char*, 4> kAskingFields{"ident", "policy", "hook", "request"};
    void mark_asking(const Link& link, const HookAsk& h, PyObject* view) {
        const unsigned long ident = PyThread_get_thread_ident();
        if (!ident_ || ident != ident_value_) {
            ident_ = py::reinterpret_steal<py::object>(PyLong_FromUnsignedLong(ident));
            if (!ident_) throw py::error_already_set();
            ident_value_ = ident;
        }
        const std::array<PyObject*, 4> values{ident_.ptr(), link.name.ptr(), h.name.ptr(), view};
        for (std::size_t i = 0; i < values.size(); ++i) {
            if (asking_offsets_[i] >= 0) {
                Py_INCREF(values[i]);
                slot_set(asking_.ptr(), asking_offsets_[i], values[i]);
            } else if (PyObject_SetAttr(asking_.ptr(), asking_names_[i].ptr(), values[i]) != 0) {
                throw py::error_already_set();
            }
        }
    }

    // watch.seq += 1 now and again when it goes out of scope (as PolicyStack.ask's finally:
    // also when the hook raised; by then the error is held by the C++ exception).
    // (``offset``: the watch's seq slot, written in place; -1: got and set by name.)
    class Seq {
      public:
        Seq(const py::object& watch, const py::str& name, Py_ssize_t offset)
            : watch_(watch), name_(name), offset_(offset) {
            if (!bump()) throw py::error_already_set();
        }
        ~Seq() {
            if (!bump()) PyErr_Clear();
        }
        Seq(const Seq&) = delete;
        Seq& operator=(const Seq&) = delete;

      private:
        bool bump() {
            const bool in_slot = offset_ >= 0;
            PyObject* seq = in_slot ? slot_get(watch_.ptr(), offset_, name_.ptr())
                                    : PyObject_GetAttr(watch_.ptr(), name_.ptr());
            if (seq == nullptr) return false;
            if (in_slot) Py_INCREF(seq);  // (a borrowed slot value, held across the add, whatever it runs)
            PyObject* next = PyNumber_Add(seq, one());
            Py_DECREF(seq);
            if (next == nullptr) return false;
            if (in_slot) {
                slot_set(watch_.ptr(), offset_, next);
                return true;
            }
            const int failed = PyObject_SetAttr(watch_.ptr(), name_.ptr(), next);
            Py_DECREF(next);
            return failed == 0;
        }
        static PyObject* one() {
            static PyObject* value = PyLong_FromLong(1);  // (small ints are immortal in practice)
            return value;
        }
        const py::object& watch_;
        const py::str& name_;
        Py_ssize_t offset_;
    };

    // _decision_problem's plain cases, answered here: an exact Decision whose reason is a
    // non-empty exact str within REASON_MAX and whose value is an exact str among the hook's
    // choices, an int (store_limit), a bool, or a number of ms >= 0. ``value``/``reason`` borrowed.
    bool well_formed(const HookAsk& h, PyObject* decision, PyObject*& value, PyObject*& reason) const {
        if (Py_TYPE(decision) != reinterpret_cast<PyTypeObject*>(decision_.ptr()) || value_offset_ < 0 ||
            reason_offset_ < 0) {
            return false;
        }
        char* base = reinterpret_cast<char*>(decision);
        value = *reinterpret_cast<PyObject**>(base + value_offset_);
        reason = *reinterpret_cast<PyObject**>(base + reason_offset_);
        if (value == nullptr || reason == nullptr || !PyUnicode_CheckExact(reason)) return false;
        const Py_ssize_t length = PyUnicode_GET_LENGTH(reason);
        if (length == 0 || length > reason_max_) return false;
        switch (h.kind) {
            case Kind::CHOICE:
                if (!PyUnicode_CheckExact(value)) return false;
                for (const py::str& choice : h.choices) {
                    if (value == choice.ptr() || PyUnicode_Compare(value, choice.ptr()) == 0) return true;
                }
                return false;
            case Kind::INT:
                return PyLong_CheckExact(value);
            case Kind::BOOL:
                return PyBool_Check(value);
            case Kind::NUMBER:
                if (PyFloat_CheckExact(value)) {
                    const double ms = PyFloat_AS_DOUBLE(value);
                    return !std::isnan(ms) && ms >= 0;
                }
                if (PyLong_CheckExact(value)) {
                    int overflow = 0;
                    const long long ms = PyLong_AsLongLongAndOverflow(value, &overflow);
                    return overflow > 0 || (overflow == 0 && ms >= 0);
                }
                return false;
        }
        return false;
    }

    // Answer(name, decision.value, decision.reason), into ``out``.
    void take(const Link& link, const HookAsk& h, PyObject* value, PyObject* reason, Answer& out) {
        if (PyLong_Check(value) && !PyBool_Check(value)) {
            int overflow = 0;
            PyLong_AsLongLongAndOverflow(value, &overflow);
            if (overflow != 0) {  // a valid answer (store_limit 2**70) the native core cannot hold
                py::object error = py::module_::import("kvlife.policies.base").attr("PolicyError");
                std::string origin = origin_(link.fn).cast<std::string>();  // as every policy error names it
                PyErr_SetString(error.ptr(), ("policy " + link.policy + " (" + origin + "): hook " +
                                              h.name.cast<std::string>() +
                                              " answered " + py::repr(value).cast<std::string>() +
                                              ": the native engine takes integers within 64 bits; "
                                              "run it with --engine python")
                                                 .c_str());
                throw py::error_already_set();
            }
        }
        out.policy = link.policy;
        out.value = answer_value(value);
        Py_ssize_t size = 0;
        const char* text = PyUnicode_Check(reason) ? PyUnicode_AsUTF8AndSize(reason, &size) : nullptr;
        if (text == nullptr) {
            PyErr_Clear();
            out.reason = py::str(reason).cast<std::string>();
        } else {
            out.reason.assign(text, static_cast<std::size_t>(size));
        }
    }

    // The hook (or the check of its answer) raised: raise what hook_failure says, as
    // PolicyStack.ask does (raised inside its except clause: the hook's error is the context).
    [[noreturn]] void fail(const Link& link, const HookAsk& h) {
        PyObject* type = nullptr;
        PyObject* value = nullptr;
        PyObject* traceback = nullptr;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        if (traceback != nullptr) PyException_SetTraceback(value, traceback);
        Py_XDECREF(type);
        Py_XDECREF(traceback);
        PyObject* raised = PyObject_CallFunctionObjArgs(hook_failure_.ptr(), link.name.ptr(), h.name.ptr(),
                                                        link.fn.ptr(), value, nullptr);
        if (raised == nullptr) {
            Py_DECREF(value);
            throw py::error_already_set();
        }
        if (raised != value) {
            PyException_SetContext(raised, value);  // (steals value)
        } else {
            Py_DECREF(value);
        }
        PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(raised)), raised);
        Py_DECREF(raised);
        throw py::error_already_set();
    }

    // Request.view(): the id and the hashes tuple are kept per request; the tuple is made again
    // when the hashes grew (within an epoch they only get derived ones appended: the kept items
    // serve again) or the epoch changed (a next input chunk replaces them).
    py::object request_view(const Request& req) {
        if (cache_.size() >= kCacheMax && cache_.find(req.request_id) == cache_.end()) cache_.clear();
        Cached& c = cache_[req.request_id];
        if (!c.hashes || c.size != req.hashes.size() || c.epoch != req.epoch) {
            py::tuple hashes(req.hashes.size());
            const std::size_t kept = c.hashes && c.epoch == req.epoch && c.size < req.hashes.size() ? c.size : 0;
            for (std::size_t i = 0; i < kept; ++i) {
                PyObject* item = PyTuple_GET_ITEM(c.hashes.ptr(), i);
                Py_INCREF(item);
                PyTuple_SET_ITEM(hashes.ptr(), i, item);
            }
            for (std::size_t i = kept; i < req.hashes.size(); ++i) {
                PyTuple_SET_ITEM(hashes.ptr(), i, PyLong_FromLongLong(req.hashes[i]));
            }
            c.hashes = std::move(hashes);
            c.size = req.hashes.size();
            c.epoch = req.epoch;
            if (!c.rid) c.rid = py::str(req.request_id);
        }
        const std::size_t state = static_cast<std::size_t>(req.state);
        PyObject* state_obj = req.state_is_member ? members_[state].ptr() : states_[state].ptr();
        Fields& f = fields_;
        return request_view_.make(std::array<PyObject*, 13>{
            c.rid.inc_ref().ptr(), (Py_INCREF(state_obj), state_obj), f.arrival_ms.get(req.arrival_ms),
            f.prompt_tokens.get(req.prompt_tokens), f.generated.get(req.generated), f.computed.get(req.computed),
            f.confirmed.get(req.confirmed), f.placeholders.get(req.placeholders), f.block_tokens.get(req.block_tokens),
            c.hashes.inc_ref().ptr(), f.stored_blocks.get(req.stored_blocks), PyBool_FromLong(req.resumable ? 1 : 0),
            f.preemptions.get(req.preemptions)});
    }

    // A view field's last object, handed out again (a new reference) while the field's value is
    // the same: ints and floats are immutable, so an equal one serves, and consecutive asks about
    // one request (lookup mode, then admission) or one run constant (the block size) make none.
    // A float is compared bit for bit (-0.0 is not 0.0; a NaN is made anew or kept alike).
    template <class T>
    class Last {
      public:
        PyObject* get(T value) {
            if (!obj_ || !same(value)) {
                PyObject* made = make(value);
                if (made == nullptr) return nullptr;  // (SlotClass::make raises it)
                obj_ = py::reinterpret_steal<py::object>(made);
                value_ = value;
            }
            return obj_.inc_ref().ptr();
        }

      private:
        bool same(T value) const {
            if constexpr (std::is_same_v<T, double>) {
                return std::memcmp(&value, &value_, sizeof value) == 0;
            } else {
                return value == value_;
            }
        }
        static PyObject* make(T value) {
            if constexpr (std::is_same_v<T, double>) {
                return PyFloat_FromDouble(value);
            } else {
                return PyLong_FromLongLong(value);
            }
        }
        T value_{};
        py::object obj_;
    };
    struct Fields {
        Last<double> arrival_ms;
        Last<std::int64_t> prompt_tokens, generated, computed, confirmed, placeholders, block_tokens, stored_blocks,
            preemptions;
    };

    // The engine view, kept while nothing in it changed (a frozen view: the same object serves).
    py::object engine_view(const EngineView& e) {
        if (!last_engine_ || e.now_ms != last_.now_ms || e.running != last_.running || e.waiting != last_.waiting ||
            e.loading != last_.loading || e.free_device_blocks != last_.free_device_blocks ||
            e.device_blocks != last_.device_blocks) {
            last_engine_ = engine_view_.make(std::array<PyObject*, 6>{
                PyFloat_FromDouble(e.now_ms), PyLong_FromLongLong(e.running), PyLong_FromLongLong(e.waiting),
                PyLong_FromLongLong(e.loading), PyLong_FromLongLong(e.free_device_blocks),
                PyLong_FromLongLong(e.device_blocks)});
            last_ = e;
        }
        return last_engine_;
    }

    py::object load_view(const LoadView& load) {
        py::tuple tiers = tier_names(load.tiers);
        py::tuple in_flight(load.in_flight.size());
        for (std::size_t i = 0; i < load.in_flight.size(); ++i) {
            in_flight[i] = py::make_tuple(load.in_flight[i].first, py::str(load.in_flight[i].second));
        }
        return load_view_.make(std::array<PyObject*, 4>{PyLong_FromLongLong(load.device_hit_blocks),
                                                        PyLong_FromLongLong(load.external_hit_blocks),
                                                        tiers.release().ptr(), in_flight.release().ptr()});
    }

    py::object prefetch_view(const PrefetchView& pull) {
        py::tuple tiers = tier_names(pull.source_tiers);
        return prefetch_view_.make(std::array<PyObject*, 4>{PyLong_FromLongLong(pull.blocks),
                                                            PyLong_FromLongLong(pull.tokens), tiers.release().ptr(),
                                                            PyFloat_FromDouble(pull.started_ms)});
    }

    // A tuple of tier names, one str object per name (a view names a tier once per block; a run
    // has a handful of tiers, so a short list searched in order, and a run of blocks named by
    // one pointer, the common case, searches it once).
    py::tuple tier_names(const std::vector<const std::string*>& names) {
        PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(names.size()));
        if (tuple == nullptr) throw py::error_already_set();
        py::tuple out = py::reinterpret_steal<py::tuple>(tuple);
        const std::string* last = nullptr;
        PyObject* name = nullptr;
        for (std::size_t i = 0; i < names.size(); ++i) {
            if (names[i] != last) {
                name = tier_name(*names[i]);
                last = names[i];
            }
            Py_INCREF(name);
            PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), name);
        }
        return out;
    }
    // (borrowed: tier_names_ holds it)
    PyObject* tier_name(const std::string& name) {
        for (const auto& [text, object] : tier_names_) {
            if (text == name) return object.ptr();
        }
        tier_names_.emplace_back(name, py::str(name));
        return tier_names_.back().second.ptr();
    }

    // Requests whose view parts are kept: past this many, the cache starts over (it only saves
    // building the id and the hashes tuple again).
    static constexpr std::size_t kCacheMax = 1 << 10;
    struct Cached {
        std::size_t size = 0;
        std::int64_t epoch = -1;  // the request's epoch when the hashes tuple was made
        py::object hashes;
        py::object rid;
    };

    py::object stack_, watch_, decision_, check_decision_, hook_failure_, origin_;
    py::str seq_;
    py::object asking_, ident_;  // the stack's NativeAsking; the asking thread's ident, as an int
    unsigned long ident_value_ = 0;
    std::array<py::str, 4> asking_names_;
    std::array<Py_ssize_t, 4> asking_offsets_{};
    SlotClass request_view_, engine_view_, load_view_, prefetch_view_;
    Py_ssize_t value_offset_ = -1, reason_offset_ = -1, seq_offset_ = -1, reason_max_ = 0;
    std::array<HookAsk, kNumHooks> hooks_;
    std::array<py::str, kNumStates> states_;
    std::array<py::object, kNumStates> members_;  // RequestState members
    std::unordered_map<std::string, Cached> cache_;
    std::vector<std::pair<std::string, py::str>> tier_names_;
    Fields fields_;  // the request view's number fields' last objects
    py::object last_engine_;
    EngineView last_{};
};

}  // namespace kvlife
