// The native scheduler bound with a connector written in Python (PyConnector): the seam
// tests/test_native_scheduler.py drives it through, with the same Python connector the
// reference scheduler (lifecycle/engine/scheduler.py) calls. A request crosses over as a
// SchedRequest object with the reference's attribute names; the scheduler's output and a
// step's connector output as the reference's own classes (vllm_shapes).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "scheduler.hpp"

namespace py = pybind11;

namespace kvlife {

namespace {

const char* status_name(Status status) {
    switch (status) {
        case Status::WAITING: return "WAITING";
        case Status::WAITING_FOR_REMOTE_KVS: return "WAITING_FOR_REMOTE_KVS";
        case Status::RUNNING: return "RUNNING";
        case Status::PREEMPTED: return "PREEMPTED";
        case Status::FINISHED_STOPPED: return "FINISHED_STOPPED";
        case Status::FINISHED_LENGTH_CAPPED: return "FINISHED_LENGTH_CAPPED";
        case Status::FINISHED_ABORTED: return "FINISHED_ABORTED";
        case Status::FINISHED_ERROR: return "FINISHED_ERROR";
        case Status::FINISHED_IGNORED: return "FINISHED_IGNORED";
    }
    return "?";
}

py::tuple hashes_tuple(const std::vector<BlockHash>& hashes) {
    py::tuple out(hashes.size());
    for (std::size_t i = 0; i < hashes.size(); ++i) {
        out[i] = py::int_(hashes[i]);
    }
    return out;
}

struct PyMeta {
    std::vector<std::int64_t> sync_lookup_keys;
    std::vector<std::int64_t> flush;
    py::object original;  // what the Python connector returned
};

class PyConnector {
  public:
    explicit PyConnector(py::object connector)
        : connector_(std::move(connector)),
          shapes_(py::module_::import("kvlife.lifecycle.engine.vllm_shapes")),
          records_(py::module_::import("kvlife.lifecycle.engine.records")),
          events_(py::module_::import("kvlife.lifecycle.engine.events")) {}

    // The Python face of a native request (the same object for the same request).
    py::object face(SchedRequest& req) {
        return py::cast(&req, py::return_value_policy::reference);
    }

    void begin_pass() { connector_.attr("begin_pass")(); }
    void begin_output() { connector_.attr("begin_output")(); }
    void take_events() { connector_.attr("take_events")(); }
    void on_new_request(SchedRequest& req, bool early) {
        connector_.attr("on_new_request")(face(req), py::arg("early") = early);
    }
    // (its requests never go dormant: the bound scheduler keeps dormant_arrivals off)
    struct Dormant {};
    std::optional<Dormant> doze(const SchedRequest&) { return std::nullopt; }
    void wake(const SchedRequest&, Dormant&&) {}
    bool is_dormant(const std::string&) const { return false; }
    bool request_finished(SchedRequest& req, const std::vector<BlockId>& blocks) {
        py::tuple answer = connector_.attr("request_finished")(face(req), py::cast(blocks));
        return answer[0].cast<bool>();
    }
    std::pair<std::optional<std::int64_t>, bool> get_num_new_matched_tokens(SchedRequest& req, std::int64_t local) {
        py::tuple answer = connector_.attr("get_num_new_matched_tokens")(face(req), local);
        std::optional<std::int64_t> tokens;
        if (!answer[0].is_none()) {
            tokens = answer[0].cast<std::int64_t>();
        }
        return {tokens, answer[1].cast<bool>()};
    }
    void update_state_after_alloc(SchedRequest& req, const std::vector<BlockId>& blocks, std::int64_t external) {
        connector_.attr("update_state_after_alloc")(face(req), py::cast(blocks), external);
    }
    PyMeta build_connector_meta(const SchedulerOutput& output) {
        py::list news;
        for (const NewRequestData& n : output.scheduled_new_reqs) {
            news.append(shapes_.attr("NewRequestData")(*n.req_id, n.num_computed_tokens,
                                                      py::make_tuple(py::cast(n.block_ids))));
        }
        const CachedRequestData& c = output.scheduled_cached_reqs;
        py::list new_block_ids;
        for (const auto& blocks : c.new_block_ids) {
            if (blocks.has_value()) {
                new_block_ids.append(py::make_tuple(py::cast(*blocks)));
            } else {
                new_block_ids.append(py::none());
            }
        }
        py::list req_ids;
        for (const std::string* rid : c.req_ids) req_ids.append(py::str(*rid));
        py::set resumed;
        for (const std::string* rid : c.resumed_req_ids) resumed.add(py::str(*rid));
        py::object cached = shapes_.attr("CachedRequestData")(req_ids, py::cast(c.num_computed_tokens),
                                                              new_block_ids, resumed);
        py::dict tokens;
        for (const auto& item : output.num_scheduled_tokens) {
            tokens[py::str(*item.first)] = item.second;
        }
        py::object py_output = shapes_.attr("SchedulerOutput")(news, cached, tokens, as_set(output.preempted_req_ids),
                                                               as_set(output.finished_req_ids));
        py::object meta = connector_.attr("build_connector_meta")(py_output);
        return PyMeta{meta.attr("sync_lookup_keys").cast<std::vector<std::int64_t>>(),
                      meta.attr("flush").cast<std::vector<std::int64_t>>(), meta};
    }
    void update_connector_output(const KVConnectorOutput& output) { connector_.attr("update_connector_output")(to_python(output)); }
    bool knows(const std::string& rid) {
        py::object state = connector_.attr("core").attr("state");
        py::str key(rid);
        return state.attr("requests").contains(key) || state.attr("retired").contains(key);
    }
    void warn_duplicate_arrival(const std::string& rid) {
        connector_.attr("core").attr("lifecycle").attr("warn")("duplicate_arrival", py::arg("req") = rid);
    }
    void freed(const std::vector<BlockId>& blocks) {
        py::object core = connector_.attr("core");
        core.attr("lifecycle").attr("record")(records_.attr("free")(core.attr("state").attr("now"), py::cast(blocks)));
        py::tuple as_tuple = py::tuple(py::cast(blocks));
        core.attr("state").attr("commands").attr("append")(events_.attr("FreeBlocks")(as_tuple));
    }

    py::object to_python(const KVConnectorOutput& output) {
        py::object sending = output.finished_sending.has_value() ? py::object(as_set(*output.finished_sending)) : py::object(py::none());
        py::object recving = output.finished_recving.has_value() ? py::object(as_set(*output.finished_recving)) : py::object(py::none());
        py::object meta = py::none();
        if (output.reports.has_value()) {
            py::list reports;
            for (const WorkerReport& r : *output.reports) {
                reports.append(py::make_tuple(r.job_id, r.rank, hashes_tuple(r.failed)));
            }
            meta = shapes_.attr("WorkerMeta")(py::tuple(reports));
        }
        py::set invalid;
        for (BlockId block : output.invalid_block_ids) {
            invalid.add(py::int_(block));
        }
        return shapes_.attr("KVConnectorOutput")(sending, recving, meta, invalid);
    }

  private:
    static py::set as_set(const std::vector<std::string>& items) {
        py::set out;
        for (const std::string& item : items) {
            out.add(py::str(item));
        }
        return out;
    }

    py::object connector_;
    py::module_ shapes_;
    py::module_ records_;
    py::module_ events_;
};

std::vector<std::string> strings(const py::handle& items) {
    std::vector<std::string> out;
    for (py::handle item : items) {
        out.push_back(item.cast<std::string>());
    }
    return out;
}

// The reference's KVConnectorOutput (or None) read into the native one.
std::optional<KVConnectorOutput> from_python(const py::object& output) {
    if (output.is_none()) {
        return std::nullopt;
    }
    KVConnectorOutput out;
    py::object sending = output.attr("finished_sending");
    py::object recving = output.attr("finished_recving");
    if (!sending.is_none()) out.finished_sending = strings(sending);
    if (!recving.is_none()) out.finished_recving = strings(recving);
    py::object meta = output.attr("kv_connector_worker_meta");
    if (!meta.is_none()) {
        std::vector<WorkerReport> reports;
        for (py::handle r : meta.attr("reports")) {
            py::tuple t = py::reinterpret_borrow<py::tuple>(r);
            reports.push_back(WorkerReport{t[0].cast<std::int64_t>(), t[1].cast<std::int64_t>(),
                                           t[2].cast<std::vector<BlockHash>>()});
        }
        out.reports = std::move(reports);
    }
    for (py::handle block : output.attr("invalid_block_ids")) {
        out.invalid_block_ids.push_back(block.cast<BlockId>());
    }
    return out;
}

py::object plan_to_python(const StepPlan& plan, const py::module_& events) {
    py::list entries;
    for (const Scheduled& s : plan.entries) {
        entries.append(events.attr("Scheduled")(s.request_id, s.num_tokens, s.computed_before, s.samples,
                                                py::tuple(py::cast(s.block_table)), hashes_tuple(s.block_hashes)));
    }
    return events.attr("StepPlan")(plan.step_id, py::tuple(entries), plan.sync_lookups,
                                   py::tuple(py::cast(plan.sync_lookup_keys)), py::tuple(py::cast(plan.flush)));
}

// Scheduler<PyConnector>, owning its connector adapter.
class BoundScheduler {
  public:
    BoundScheduler(const SchedulerConfig& config, py::object connector)
        : adapter_(std::make_unique<PyConnector>(std::move(connector))),
          scheduler_(std::make_unique<Scheduler<PyConnector>>(config, *adapter_)),
          events_(py::module_::import("kvlife.lifecycle.engine.events")) {}

    Scheduler<PyConnector>& get() { return *scheduler_; }

    py::tuple schedule() {
        auto result = scheduler_->schedule();
        return py::make_tuple(plan_to_python(result.first, events_), result.second.original);
    }

    bool update_from_output(std::int64_t step_id, const std::unordered_map<std::string, std::string>& stops,
                            const py::object& output, const std::unordered_set<std::string>& given_up) {
        std::optional<KVConnectorOutput> native = from_python(output);
        return scheduler_->update_from_output(step_id, stops, native.has_value() ? &*native : nullptr, given_up);
    }

  private:
    std::unique_ptr<PyConnector> adapter_;
    std::unique_ptr<Scheduler<PyConnector>> scheduler_;
    py::module_ events_;
};

py::list request_ids(const std::deque<RequestPtr>& queue) {
    py::list out;
    for (const RequestPtr& req : queue) out.append(req->request_id);
    return out;
}

}  // namespace

void bind_scheduler(py::module_& m) {
    py::class_<SchedRequest, std::shared_ptr<SchedRequest>>(m, "SchedRequest")
        .def_readonly("request_id", &SchedRequest::request_id)
        .def_readonly("prompt_tokens", &SchedRequest::prompt_tokens)
        .def_property_readonly("num_prompt_tokens", [](const SchedRequest& r) { return r.prompt_tokens; })
        .def_readonly("max_tokens", &SchedRequest::max_tokens)
        .def_readonly("block_tokens", &SchedRequest::block_tokens)
        .def_readonly("resumable", &SchedRequest::resumable)
        .def_property_readonly("status", [](const SchedRequest& r) { return status_name(r.status); })
        .def_readonly("output_tokens", &SchedRequest::output_tokens)
        .def_readonly("num_computed_tokens", &SchedRequest::num_computed_tokens)
        .def_readonly("num_output_placeholders", &SchedRequest::num_output_placeholders)
        .def_readonly("num_in_flight_tokens", &SchedRequest::num_in_flight_tokens)
        .def_readonly("num_stale_output_tokens", &SchedRequest::num_stale_output_tokens)
        .def_readonly("num_preemptions", &SchedRequest::num_preemptions)
        .def_property_readonly("blocks", [](const SchedRequest& r) { return r.blocks; })
        .def_property_readonly("hashes", [](const SchedRequest& r) { return hashes_tuple(r.hashes.to_vector()); })
        .def_readonly("num_cached_blocks", &SchedRequest::num_cached_blocks)
        .def_readonly("last_sched_seq", &SchedRequest::last_sched_seq)
        .def_readonly("is_prefill_chunk", &SchedRequest::is_prefill_chunk)
        .def_readonly("finished", &SchedRequest::finished)
        .def_readonly("free_on_recving", &SchedRequest::free_on_recving)
        .def_readonly("free_on_sending", &SchedRequest::free_on_sending)
        .def_readonly("finish_note", &SchedRequest::finish_note)
        .def_readonly("hash_cap", &SchedRequest::hash_cap)
        .def_property_readonly("num_tokens", &SchedRequest::num_tokens)
        .def_property_readonly("block_hashes", [](SchedRequest& r) { return hashes_tuple(r.block_hashes().to_vector()); });

    py::class_<BoundScheduler>(m, "Scheduler")
        .def(py::init([](std::int64_t block_tokens, std::int64_t device_blocks, std::int64_t max_batched_tokens,
                         std::int64_t max_running, bool async_scheduling, const std::string& kv_load_failure_policy,
                         py::object connector) {
                 return std::make_unique<BoundScheduler>(
                     SchedulerConfig{block_tokens, device_blocks, max_batched_tokens, max_running, async_scheduling,
                                     kv_load_failure_policy == "fail"},
                     std::move(connector));
             }),
             py::kw_only(), py::arg("block_tokens"), py::arg("device_blocks"), py::arg("max_batched_tokens"),
             py::arg("max_running"), py::arg("async_scheduling"), py::arg("kv_load_failure_policy"),
             py::arg("connector"))
        .def("add_request",
             [](BoundScheduler& s, const std::string& rid, std::int64_t prompt_tokens, const std::vector<BlockHash>& hashes,
                std::optional<std::int64_t> max_tokens, bool resumable) {
                 s.get().add_request(rid, prompt_tokens, hashes, max_tokens, resumable);
             },
             py::arg("request_id"), py::arg("prompt_tokens"), py::arg("block_hashes"), py::arg("max_tokens") = py::none(),
             py::arg("resumable") = false)
        .def("finish_requests",
             [](BoundScheduler& s, const std::string& rid, const std::string& reason) {
                 return s.get().finish_requests(rid, reason.c_str());
             },
             py::arg("request_id"), py::arg("reason") = "aborted")
        .def("schedule", &BoundScheduler::schedule)
        .def("update_from_output", &BoundScheduler::update_from_output, py::arg("step_id"), py::arg("stops"),
             py::arg("output"), py::arg("given_up") = std::unordered_set<std::string>())
        .def("release_held", [](BoundScheduler& s, const std::vector<BlockId>& blocks) { s.get().release_held(blocks); })
        .def_property_readonly("requests",
                               [](BoundScheduler& s) {
                                   py::dict out;
                                   for (const RequestPtr& req : s.get().requests()) out[py::str(req->request_id)] = req;
                                   return out;
                               })
        .def_property_readonly("running",
                               [](BoundScheduler& s) {
                                   py::list out;
                                   for (const RequestPtr& req : s.get().running()) out.append(req->request_id);
                                   return out;
                               })
        .def_property_readonly("waiting", [](BoundScheduler& s) { return request_ids(s.get().waiting()); })
        .def_property_readonly("kv_holding", [](BoundScheduler& s) { return request_ids(s.get().kv_holding()); })
        .def_property_readonly("steps",
                               [](BoundScheduler& s) {
                                   py::list out;
                                   for (const auto& item : s.get().steps()) out.append(item.first);
                                   return out;
                               })
        .def_property_readonly("results", [](BoundScheduler& s) { return s.get().results(); })
        .def_property_readonly("next_step_id", [](BoundScheduler& s) { return s.get().next_step_id(); })
        .def_property_readonly("free_blocks", [](BoundScheduler& s) { return s.get().pool().free(); })
        .def_property_readonly("refs", [](BoundScheduler& s) { return s.get().pool().refs(); })
        .def_property_readonly("block_hashes_on_device", [](BoundScheduler& s) { return s.get().pool().hashes(); })
        .def("output_tokens", [](BoundScheduler& s, const std::string& rid) { return s.get().output_tokens(rid); })
        .def("waiting_for_remote_kvs", [](BoundScheduler& s) { return s.get().waiting_for_remote_kvs(); })
        .def("any_finished", [](BoundScheduler& s) { return s.get().any_finished(); });
}

}  // namespace kvlife
