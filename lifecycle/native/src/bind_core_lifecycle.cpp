// Binding of the connector core's kernel (core_state.hpp, core_lifecycle.hpp): the compiled
// transition table (its edges given from specs/lifecycle_table.json by the caller), the core's
// config, IllegalTransition translated to kvlife.specs.table.IllegalTransition, the PolicyAsker
// that asks a Python PolicyStack (PyPolicyAsker, as lifecycle.py asks it), and CoreKernel: a
// CoreState + Lifecycle pair a differential test drives as it drives the Python ones.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "bind_core_convert.hpp"
#include "bind_core_shared.hpp"
#include "blocks.hpp"
#include "core_lifecycle.hpp"
#include "core_state.hpp"
#include "jobs.hpp"
#include "json_writer.hpp"

namespace py = pybind11;

namespace kvlife {

namespace {

Hook hook_of(const std::string& name) {
    std::optional<Hook> hook = hook_from_name(name);
    if (!hook) throw py::key_error(name);
    return *hook;
}

// BlockHolds calling two Python callables (Transfers.hold_blocks / unhold_blocks) with a list.
class PyBlockHolds final : public BlockHolds {
  public:
    PyBlockHolds(py::object hold, py::object unhold) : hold_(std::move(hold)), unhold_(std::move(unhold)) {}
    void hold_blocks(const std::vector<BlockId>& blocks) override { hold_(py::cast(blocks)); }
    void unhold_blocks(const std::vector<BlockId>& blocks) override { unhold_(py::cast(blocks)); }

  private:
    py::object hold_, unhold_;
};

// A CoreState, a Lifecycle and Transfers over it, asking a Python PolicyStack, tracing into a buffer.
class CoreKernel {
  public:
    CoreKernel(CoreConfig config, const TransitionTable& table, py::object stack, py::object device, bool trace)
        : device_obj_(std::move(device)),
          state_(std::move(config), Trace(trace ? &out_ : nullptr)),
          asker_(std::move(stack)),
          table_(table),
          lifecycle_(state_, &asker_, table_,
                     device_obj_.is_none() ? nullptr : device_obj_.cast<const DeviceBlockPool*>()) {}

    CoreState& state() { return state_; }
    Lifecycle& lifecycle() { return lifecycle_; }
    Transfers& transfers() { return transfers_; }
    void set_holds(py::object hold, py::object unhold) {
        if (hold.is_none()) {
            holds_.reset();
            transfers_.holds = nullptr;
        } else {
            holds_ = std::make_unique<PyBlockHolds>(std::move(hold), std::move(unhold));
            transfers_.holds = holds_.get();
        }
    }

    Request& request(const std::string& rid) {
        CoreRequestPtr* req = state_.requests.find(rid);
        if (req == nullptr) throw py::key_error(rid);
        return **req;
    }

    void add_request(const std::string& rid, double arrival_ms, std::int64_t prompt_tokens,
                     std::vector<BlockHash> hashes, bool resumable) {
        auto req = std::make_shared<Request>(rid, state_.next_seq++, arrival_ms, prompt_tokens, HashList(std::move(hashes)),
                                             resumable, state_.config.block_tokens);
        state_.list_request(rid, std::move(req));
        state_.state_counts[static_cast<std::size_t>(RequestState::WAITING)] += 1;
    }

    py::bytes take_trace() {
        py::bytes result(out_.data(), out_.size());
        out_.clear();
        return result;
    }

  private:
    JsonWriter out_{4096};
    py::object device_obj_;
    CoreState state_;
    PyPolicyAsker asker_;
    TransitionTable table_;
    Lifecycle lifecycle_;
    Transfers transfers_{state_, lifecycle_};
    std::unique_ptr<PyBlockHolds> holds_;
};

py::tuple job_tuple(const Job& j) {
    py::list moves;
    for (const BlockMove& m : j.moves) moves.append(py::make_tuple(m.block_hash, m.device_block, m.tier, m.slot));
    return py::make_tuple(j.job_id, std::string(job_kind_name(j.kind)), j.request_id, j.epoch, py::tuple(moves),
                          j.started_ms, j.after ? py::object(py::int_(*j.after)) : py::object(py::none()), j.timed_out,
                          j.flushed, j.abandoned);
}

py::tuple prefetch_tuple(const PrefetchJob& j) {
    py::list moves;
    for (const TierMove& m : j.moves) {
        moves.append(py::make_tuple(m.block_hash, m.src_tier, m.src_slot, m.dst_tier, m.dst_slot));
    }
    return py::make_tuple(j.job_id, j.request_id, j.epoch, py::tuple(moves), j.started_ms, j.deadline_ms,
                          j.patience_policy, j.deferred, j.abandoned);
}

// A lookup's tiers as the core holds them (positions in ``state.tiers``) and as Python names
// them; a name that is no tier of the core is refused (KeyError: a core's lookup never holds one).
std::vector<std::size_t> tier_positions(const CoreState& state, const std::vector<std::string>& names) {
    std::vector<std::size_t> positions;
    for (const std::string& name : names) {
        positions.push_back(state.position(state.tier(name)));
    }
    return positions;
}

std::vector<std::string> tier_names(const CoreState& state, const std::vector<std::size_t>& positions) {
    std::vector<std::string> names;
    state.tier_names(positions, names);
    return names;
}

py::dict ordered_counts(const OrderedDict<std::string, std::int64_t>& d) {
    py::dict out;
    for (const auto& node : d) out[py::str(node.key)] = node.value;
    return out;
}

}  // namespace

void bind_core_lifecycle(py::module_& m) {
    py::register_exception_translator([](std::exception_ptr thrown) {
        try {
            if (thrown) std::rethrow_exception(thrown);
        } catch (const IllegalTransition& e) {
            py::object cls = py::module_::import("kvlife.specs.table").attr("IllegalTransition");
            py::module_ names = py::module_::import("kvlife.specs.names");
            py::object state = py::str(std::string(state_name(e.state)));
            if (e.state_is_member) state = names.attr("RequestState")(state);
            py::object trigger = names.attr("Trigger")(py::str(std::string(trigger_name(e.trigger))));
            py::object exc = cls(e.request_id, state, trigger);
            PyErr_SetObject(cls.ptr(), exc.ptr());
        }
    });

    py::class_<TransitionTable>(m, "TransitionTable",
                                "specs/table.py's compiled table from its [state, trigger, target] edges.")
        .def(py::init<const std::vector<std::tuple<std::string, std::string, std::string>>&>(), py::arg("edges"))
        .def("target", [](const TransitionTable& t, const std::string& rid, const std::string& state,
                          const std::string& trigger) {
            std::optional<RequestState> s = state_from_name(state);
            std::optional<Trigger> tr = trigger_from_name(trigger);
            if (!s || !tr) throw py::key_error(state + "/" + trigger);
            return std::string(state_name(t.target(rid, *s, *tr, false)));
        });

    py::class_<CoreTierConfig>(m, "CoreTierConfig")
        .def(py::init<std::string, std::int64_t, std::string>(), py::arg("name"), py::arg("capacity_blocks"),
             py::arg("eviction") = "lru");
    py::class_<CoreConfig>(m, "CoreConfig", "The EngineConfig fields the connector core reads.")
        .def(py::init<>())
        .def_readwrite("block_tokens", &CoreConfig::block_tokens)
        .def_readwrite("ranks", &CoreConfig::ranks)
        .def_readwrite("transfer_deadline_ms", &CoreConfig::transfer_deadline_ms)
        .def_readwrite("lookup_deadline_ms", &CoreConfig::lookup_deadline_ms)
        .def_readwrite("reclaim_deadline_ms", &CoreConfig::reclaim_deadline_ms)
        .def_readwrite("max_async_lookups", &CoreConfig::max_async_lookups)
        .def_readwrite("kv_load_failure_policy", &CoreConfig::kv_load_failure_policy)
        .def_readwrite("tiers", &CoreConfig::tiers);

    py::class_<CoreKernel>(m, "CoreKernel",
                           "A native CoreState and Lifecycle asking a Python PolicyStack (for differential tests).")
        .def(py::init<CoreConfig, const TransitionTable&, py::object, py::object, bool>(), py::arg("config"),
             py::arg("table"), py::arg("policies"), py::arg("device") = py::none(), py::arg("trace") = true)
        .def("add_request", &CoreKernel::add_request, py::arg("request_id"), py::arg("arrival_ms"),
             py::arg("prompt_tokens"), py::arg("hashes"), py::arg("resumable"))
        .def("set_request",
             [](CoreKernel& k, const std::string& rid, const py::kwargs& fields) {
                 Request& req = k.request(rid);
                 for (auto item : fields) {
                     const std::string name = item.first.cast<std::string>();
                     const std::int64_t v = item.second.cast<std::int64_t>();
                     if (name == "generated") req.generated = v;
                     else if (name == "computed") req.computed = v;
                     else if (name == "confirmed") req.confirmed = v;
                     else if (name == "placeholders") req.placeholders = v;
                     else if (name == "stored_blocks") req.stored_blocks = v;
                     else if (name == "preemptions") req.preemptions = v;
                     else if (name == "epoch") req.epoch = v;
                     else if (name == "pending_hit_tokens") req.pending_hit_tokens = v;
                     else throw py::key_error(name);
                 }
             })
        .def("set_block_table",
             [](CoreKernel& k, const std::string& rid, std::vector<BlockId> table) { k.request(rid).block_table = std::move(table); })
        .def("set_lookup",
             [](CoreKernel& k, const std::string& rid, std::optional<std::vector<std::string>> lookup) {
                 std::optional<std::vector<std::size_t>> positions;
                 if (lookup) positions = tier_positions(k.state(), *lookup);
                 k.request(rid).lookup = std::move(positions);
             })
        .def("set_observing", [](CoreKernel& k, bool observing) { k.state().observing = observing; })
        .def("set_holds", &CoreKernel::set_holds, py::arg("hold"), py::arg("unhold"))
        .def("start_load",
             [](CoreKernel& k, const std::string& rid, py::iterable moves, std::optional<std::int64_t> after) {
                 return k.transfers().start_load(k.request(rid), block_moves(moves), after)->job_id;
             },
             py::arg("request_id"), py::arg("moves"), py::arg("after") = py::none())
        .def("maybe_store", [](CoreKernel& k, const std::string& rid) { k.transfers().maybe_store(k.request(rid)); })
        .def("observe_job",
             [](CoreKernel& k, const std::string& rid, std::int64_t job_id, const std::string& kind, py::iterable moves) {
                 k.transfers().observe_job(k.request(rid), job_id, kind == "load" ? JobKind::LOAD : JobKind::STORE,
                                           block_moves(moves));
             })
        .def("flush_stores", [](CoreKernel& k, const std::string& rid) { k.transfers().flush_stores(k.request(rid)); })
        .def("on_report",
             [](CoreKernel& k, py::handle event) { k.transfers().on_report(std::get<TransferReport>(input_event(event))); })
        .def("expire_jobs",
             [](CoreKernel& k, double deadline, const std::vector<std::string>& kinds) {
                 bool loads = false;
                 bool stores = false;
                 for (const std::string& kind : kinds) {
                     loads = loads || kind == "load";
                     stores = stores || kind == "store";
                 }
                 k.transfers().expire_jobs(deadline, loads, stores);
             })
        .def("reclaim_jobs", [](CoreKernel& k, double deadline) { k.transfers().reclaim_jobs(deadline); })
        .def("start_prefetch", [](CoreKernel& k, const std::string& rid) { k.transfers().start_prefetch(k.request(rid)); })
        .def("prefetch_gate", [](CoreKernel& k, const std::string& rid) { return k.transfers().prefetch_gate(k.request(rid)); })
        .def("load_finished", [](CoreKernel& k, const std::string& rid) { k.transfers().load_finished(k.request(rid)); })
        .def("stats", [](CoreKernel& k) { return stats_dict(k.state().stats); })
        .def("jobs",
             [](CoreKernel& k) {
                 py::list out;
                 for (const auto& node : k.state().jobs) out.append(job_tuple(*node.value));
                 return out;
             })
        .def("prefetches",
             [](CoreKernel& k) {
                 py::list out;
                 for (const auto& node : k.state().prefetches) out.append(prefetch_tuple(*node.value));
                 return out;
             })
        .def("prefetch_waits",
             [](CoreKernel& k) {
                 py::list out;
                 for (const auto& node : k.state().prefetch_waits) out.append(py::make_tuple(node.key, prefetch_tuple(*node.value)));
                 return out;
             })
        .def("in_flight_loads",
             [](CoreKernel& k) {
                 py::list out;
                 for (const auto& node : k.state().in_flight_loads) {
                     py::list entries;
                     for (const Bringing& b : node.value) entries.append(py::make_tuple(b.job_id, b.device_block, b.request_id));
                     out.append(py::make_tuple(node.key, entries));
                 }
                 return out;
             })
        .def("held_blocks",
             [](CoreKernel& k) {
                 py::list out;
                 for (const auto& node : k.state().held_blocks) out.append(py::make_tuple(node.key, py::tuple(py::cast(node.value))));
                 return out;
             })
        .def("reclaimed",
             [](CoreKernel& k) {
                 py::list out;
                 for (const auto& node : k.state().reclaimed) {
                     std::vector<std::int64_t> ranks(node.value);
                     std::sort(ranks.begin(), ranks.end());
                     out.append(py::make_tuple(node.key, ranks));
                 }
                 return out;
             })
        .def("given_up_loads",
             [](CoreKernel& k) {
                 py::list out;
                 for (const auto& node : k.state().given_up_loads) out.append(py::str(node.key));
                 return out;
             })
        .def("outs",
             [](CoreKernel& k) {
                 CoreState& s = k.state();
                 py::list loads, stores, prefetches;
                 for (const JobPtr& j : s.out_loads) loads.append(j->job_id);
                 for (const JobPtr& j : s.out_stores) stores.append(j->job_id);
                 for (const PrefetchJobPtr& j : s.out_prefetches) prefetches.append(j->job_id);
                 return py::make_tuple(loads, stores, prefetches, s.out_flush, s.out_abandon, s.next_job_id,
                                       s.transfer_version);
             })
        .def("request_fields",
             [](CoreKernel& k, const std::string& rid) {
                 const Request& r = k.request(rid);
                 py::object lookup = py::none();
                 if (r.lookup) lookup = py::tuple(py::cast(tier_names(k.state(), *r.lookup)));
                 return py::make_tuple(std::string(state_name(r.state)), r.epoch, r.computed, r.confirmed,
                                       r.stored_blocks, py::tuple(py::cast(r.load_jobs)),
                                       py::tuple(py::cast(r.load_failed)), r.external_hit_limit, r.landed,
                                       r.store_jobs, lookup, r.lookup_uses, py::tuple(py::cast(r.hashes.to_vector())));
             })
        .def("tier_state",
             [](CoreKernel& k) {
                 py::list out;
                 for (const TierIndex& t : k.state().tiers) {
                     out.append(py::make_tuple(t.name, t.used(), t.free(), t.pinned(), py::cast(t.busy())));
                 }
                 return out;
             })
        .def("busy", [](CoreKernel& k) { return k.state().busy(); })
        .def("arrived", [](CoreKernel& k) { return k.state().arrived(); })
        .def("unfinished",
             [](CoreKernel& k) {
                 py::list out;
                 for (const CoreRequestPtr& r : k.state().unfinished()) out.append(py::str(r->request_id));
                 return out;
             })
        .def("next_wakeup", [](CoreKernel& k) { return k.state().next_wakeup(); })
        .def("hit_candidates",
             [](CoreKernel& k, const std::string& rid) {
                 Request& r = k.request(rid);
                 const std::size_t n = k.state().hit_candidates(r);
                 return py::tuple(py::cast(std::vector<BlockHash>(r.hashes.begin(), r.hashes.begin() + static_cast<std::ptrdiff_t>(n))));
             })
        .def("sync_lookup",
             [](CoreKernel& k, const std::vector<BlockHash>& hashes) {
                 std::vector<std::size_t> found;
                 k.state().sync_lookup(hashes.data(), hashes.size(), found);
                 return py::tuple(py::cast(tier_names(k.state(), found)));
             })
        .def_property("now", [](CoreKernel& k) { return k.state().now; },
                      [](CoreKernel& k, double now) { k.state().now = now; })
        .def("move",
             [](CoreKernel& k, const std::string& rid, const std::string& trigger, const std::string& reason) {
                 std::optional<Trigger> t = trigger_from_name(trigger);
                 if (!t) throw py::key_error(trigger);
                 k.lifecycle().move(k.request(rid), *t, reason);
             })
        .def("ask",
             [](CoreKernel& k, const std::string& rid, const std::string& hook, py::args args) {
                 Request& req = k.request(rid);
                 const Hook h = hook_of(hook);
                 LoadView load;
                 PrefetchView pull;
                 std::vector<std::string> tiers;  // (the views' tier names point into it)
                 auto name_tiers = [&tiers](py::handle names, std::vector<const std::string*>& out) {
                     tiers = names.cast<std::vector<std::string>>();
                     for (const std::string& name : tiers) out.push_back(&name);
                 };
                 HookArg arg;
                 if (args.size() == 1) {
                     py::handle a = args[0];
                     if (py::hasattr(a, "external_hit_blocks")) {
                         load.device_hit_blocks = a.attr("device_hit_blocks").cast<std::int64_t>();
                         load.external_hit_blocks = a.attr("external_hit_blocks").cast<std::int64_t>();
                         name_tiers(a.attr("tiers"), load.tiers);
                         load.in_flight = a.attr("in_flight").cast<std::vector<std::pair<BlockHash, std::string>>>();
                         arg = &load;
                     } else if (py::hasattr(a, "source_tiers")) {
                         pull.blocks = a.attr("blocks").cast<std::int64_t>();
                         pull.tokens = a.attr("tokens").cast<std::int64_t>();
                         name_tiers(a.attr("source_tiers"), pull.source_tiers);
                         pull.started_ms = a.attr("started_ms").cast<double>();
                         arg = &pull;
                     } else {
                         arg = a.cast<std::int64_t>();
                     }
                 }
                 return answer_value_py(k.lifecycle().ask(req, h, arg));
             })
        .def("warn",
             [](CoreKernel& k, const std::string& what, const py::kwargs& fields) {
                 // The typed fields records.hpp's warning takes: str, int, float, bool, None, list of ints.
                 std::vector<std::string> keys;
                 std::vector<std::string> strings;
                 std::vector<std::vector<std::int64_t>> lists;
                 std::vector<Field> list;
                 keys.reserve(fields.size());
                 strings.reserve(fields.size());
                 lists.reserve(fields.size());
                 for (auto item : fields) {
                     keys.push_back(item.first.cast<std::string>());
                     py::handle v = item.second;
                     if (v.is_none()) list.emplace_back(keys.back(), std::nullopt);
                     else if (PyBool_Check(v.ptr())) list.emplace_back(keys.back(), v.ptr() == Py_True);
                     else if (PyLong_Check(v.ptr())) list.emplace_back(keys.back(), v.cast<std::int64_t>());
                     else if (PyFloat_Check(v.ptr())) list.emplace_back(keys.back(), v.cast<double>());
                     else if (PyUnicode_Check(v.ptr())) {
                         strings.push_back(v.cast<std::string>());
                         list.emplace_back(keys.back(), std::string_view(strings.back()));
                     } else {
                         lists.push_back(v.cast<std::vector<std::int64_t>>());
                         list.emplace_back(keys.back(), lists.back());
                     }
                 }
                 k.lifecycle().warn(what, list.data(), list.size());
             })
        .def("engine_view",
             [](CoreKernel& k) {
                 EngineView v = k.lifecycle().engine_view();
                 return py::module_::import("kvlife.policies.base")
                     .attr("EngineView")(v.now_ms, v.running, v.waiting, v.loading, v.free_device_blocks,
                                         v.device_blocks);
             })
        .def("state_of", [](CoreKernel& k, const std::string& rid) { return std::string(state_name(k.request(rid).state)); })
        .def("state_counts",
             [](CoreKernel& k) {
                 py::dict out;
                 for (std::size_t i = 0; i < kNumStates; ++i) {
                     out[py::str(std::string(state_name(static_cast<RequestState>(i))))] = k.state().state_counts[i];
                 }
                 return out;
             })
        .def_property_readonly("moves", [](CoreKernel& k) { return k.state().moves; })
        .def("answers",
             [](CoreKernel& k) {
                 py::dict out;
                 for (const auto& node : k.lifecycle().answers) {
                     out[py::make_tuple(node.key.policy, std::string(hook_name(node.key.hook)), node.key.value)] =
                         node.value;
                 }
                 return out;
             })
        .def("last_decisions",
             [](CoreKernel& k, const std::string& rid) {
                 py::dict out;
                 for (const auto& entry : k.request(rid).last_decisions) {
                     const Decided& d = *entry.decided;
                     out[py::str(std::string(hook_name(entry.hook)))] =
                         py::make_tuple(d.policy, answer_value_py(d.value), d.reason);
                 }
                 return out;
             })
        .def("warnings", [](CoreKernel& k) { return ordered_counts(k.state().stats.warnings); })
        .def("deferrals", [](CoreKernel& k) { return ordered_counts(k.state().stats.deferrals); })
        .def("take_trace", &CoreKernel::take_trace);
}

}  // namespace kvlife
