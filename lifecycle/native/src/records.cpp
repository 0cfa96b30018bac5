// Mirrors lifecycle/engine/records.py (one Trace member per record kind, the keys in the order
// each function builds its dict) and events.input_to_record, rendered as the trace writer renders
// a record (lifecycle/traces/trace.py: kind first, orjson, a newline).
#include "records.hpp"

namespace kvlife {

namespace {

// The opening of every record but the header: {"kind":KIND,"t":T
void open_record(JsonWriter& out, std::string_view kind, double t) {
    out.begin_object();
    out.key("kind");
    out.string(kind);
    out.key("t");
    out.float64(t);
}

void close_record(JsonWriter& out) {
    out.end_object();
    out.newline();
}

template <class I>
void int_list(JsonWriter& out, const I* values, std::size_t n) {
    out.begin_array();
    for (std::size_t i = 0; i < n; ++i) out.int64(static_cast<std::int64_t>(values[i]));
    out.end_array();
}

void chunks(JsonWriter& out, const std::vector<StepChunk>& list) {
    out.begin_array();
    for (const StepChunk& c : list) {
        out.begin_array();
        out.string(c.request_id);
        out.int64(c.computed_before);
        out.int64(c.num_tokens);
        out.end_array();
    }
    out.end_array();
}

// count_tiers: {tier: blocks} in order of first appearance, over ``n`` names read by ``name_of``.
template <class M, class NameOf>
void tier_counts(JsonWriter& out, const M* moves, std::size_t n, NameOf name_of) {
    out.begin_object();
    for (std::size_t i = 0; i < n; ++i) {
        const std::string& tier = name_of(moves[i]);
        bool seen = false;
        for (std::size_t j = 0; j < i && !seen; ++j) seen = name_of(moves[j]) == tier;
        if (seen) continue;
        std::int64_t count = 1;
        for (std::size_t j = i + 1; j < n; ++j) count += name_of(moves[j]) == tier;
        out.key(tier);
        out.int64(count);
    }
    out.end_object();
}

void fields(JsonWriter& out, const Field* list, std::size_t n) {
    for (std::size_t i = 0; i < n; ++i) {
        out.key(list[i].key());
        list[i].write_value(out);
    }
}

}  // namespace

void write_json_value(JsonWriter& out, const JsonValue& value) {
    switch (value.type) {
        case JsonValue::Type::NONE:
            out.null();
            break;
        case JsonValue::Type::BOOL:
            out.boolean(value.b);
            break;
        case JsonValue::Type::INT:
            out.int64(value.i);
            break;
        case JsonValue::Type::FLOAT:
            out.float64(value.d);
            break;
        case JsonValue::Type::STR:
            out.string(value.s);
            break;
        case JsonValue::Type::LIST:
            out.begin_array();
            for (const JsonValue& item : value.items) write_json_value(out, item);
            out.end_array();
            break;
        case JsonValue::Type::OBJECT:
            out.begin_object();
            for (const auto& [key, item] : value.fields) {
                out.key(key);
                write_json_value(out, item);
            }
            out.end_object();
            break;
    }
}

void Field::write_value(JsonWriter& out) const {
    switch (type_) {
        case Type::NONE:
            out.null();
            break;
        case Type::BOOL:
            out.boolean(b_);
            break;
        case Type::INT:
            out.int64(i_);
            break;
        case Type::FLOAT:
            out.float64(d_);
            break;
        case Type::STR:
            out.string(s_);
            break;
        case Type::INTS:
            int_list(out, ints_, n_);
            break;
        case Type::JSON:
            write_json_value(out, *json_);
            break;
    }
}

void Trace::header(std::int64_t schema, const JsonValue& config, const std::vector<std::string>& policies,
                   std::int64_t seed, const Field* extra, std::size_t n_extra) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    out.begin_object();
    out.key("kind");
    out.string("header");
    out.key("schema");
    out.int64(schema);
    out.key("config");
    write_json_value(out, config);
    out.key("policies");
    out.begin_array();
    for (const std::string& p : policies) out.string(p);
    out.end_array();
    out.key("seed");
    out.int64(seed);
    fields(out, extra, n_extra);
    close_record(out);
}

namespace {

// A state's name (specs/names.py RequestState) as the PhaseClock numbers it.
PhaseClock::State clock_state(std::string_view name) {
    switch (name.empty() ? '\0' : name[0]) {
        case 'w':
            return PhaseClock::State::WAITING;
        case 'l':
            return name.size() == 7 ? PhaseClock::State::LOADING : PhaseClock::State::LOOKUP_PENDING;
        case 'r':
            return PhaseClock::State::RUNNING;
        case 's':
            return PhaseClock::State::SENDING;
        default:
            return PhaseClock::State::FINISHED;
    }
}

}  // namespace

void Trace::input(const InputEvent& event) {
    if (clock_ != nullptr && event.index() == 0) {
        const Arrival& e = std::get<Arrival>(event);
        clock_->arrival(e.request_id, e.t);
    }
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    out.begin_object();
    out.key("kind");
    out.string("input");
    out.key("type");
    switch (event.index()) {
        case 0: {
            const Arrival& e = std::get<Arrival>(event);
            out.string("arrival");
            out.key("t");
            out.float64(e.t);
            out.key("request_id");
            out.string(e.request_id);
            out.key("prompt_tokens");
            out.int64(e.prompt_tokens);
            out.key("block_hashes");
            int_list(out, e.block_hashes.data(), e.block_hashes.size());
            out.key("resumable");
            out.boolean(e.resumable);
            if (e.max_tokens) {  // a None max_tokens is left out (traces before the field)
                out.key("max_tokens");
                out.int64(*e.max_tokens);
            }
            break;
        }
        case 1: {
            const Abort& e = std::get<Abort>(event);
            out.string("abort");
            out.key("t");
            out.float64(e.t);
            out.key("request_id");
            out.string(e.request_id);
            break;
        }
        case 2:
            out.string("tick");
            out.key("t");
            out.float64(std::get<Tick>(event).t);
            break;
        case 3: {
            const LookupAnswer& e = std::get<LookupAnswer>(event);
            out.string("lookup_answer");
            out.key("t");
            out.float64(e.t);
            out.key("request_id");
            out.string(e.request_id);
            out.key("epoch");
            out.int64(e.epoch);
            out.key("tiers");
            if (e.tiers) {
                out.begin_array();
                for (const std::string& tier : *e.tiers) out.string(tier);
                out.end_array();
            } else {
                out.null();
            }
            break;
        }
        case 4: {
            const TransferReport& e = std::get<TransferReport>(event);
            out.string("transfer_report");
            out.key("t");
            out.float64(e.t);
            out.key("job_id");
            out.int64(e.job_id);
            out.key("rank");
            out.int64(e.rank);
            out.key("failed");
            int_list(out, e.failed.data(), e.failed.size());
            break;
        }
        default: {
            const StepOutput& e = std::get<StepOutput>(event);
            out.string("step_output");
            out.key("t");
            out.float64(e.t);
            out.key("step_id");
            out.int64(e.step_id);
            out.key("finished");
            out.begin_array();
            for (const auto& [rid, reason] : e.finished) {
                out.begin_array();
                out.string(rid);
                out.string(reason);
                out.end_array();
            }
            out.end_array();
            if (!e.reports.empty()) {
                out.key("reports");
                out.begin_array();
                for (const StepReport& r : e.reports) {
                    out.begin_array();
                    out.int64(r.job_id);
                    out.int64(r.rank);
                    int_list(out, r.failed.data(), r.failed.size());
                    out.end_array();
                }
                out.end_array();
            }
            if (!e.failed_ranks.empty()) {
                out.key("failed_ranks");
                int_list(out, e.failed_ranks.data(), e.failed_ranks.size());
            }
            break;
        }
    }
    close_record(out);
}

void Trace::transition(double t, std::string_view rid, std::string_view source, std::string_view target,
                       std::string_view trigger, std::string_view reason) {
    if (clock_ != nullptr) {
        clock_->transition(std::string(rid), clock_state(source), clock_state(target), t);
    }
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "transition", t);
    out.key("req");
    out.string(rid);
    out.key("from");
    out.string(source);
    out.key("to");
    out.string(target);
    out.key("trigger");
    out.string(trigger);
    out.key("reason");
    out.string(reason);
    close_record(out);
}

void Trace::decision(double t, std::string_view rid, std::string_view point, std::string_view policy,
                     const AnswerValue& value, std::string_view reason) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "decision", t);
    out.key("req");
    out.string(rid);
    out.key("point");
    out.string(point);
    out.key("policy");
    out.string(policy);
    out.key("value");
    switch (value.index()) {
        case 1:
            out.boolean(std::get<bool>(value));
            break;
        case 2:
            out.int64(std::get<std::int64_t>(value));
            break;
        case 3:
            out.float64(std::get<double>(value));
            break;
        case 4:
            out.string(std::get<std::string>(value));
            break;
        default:
            out.null();
            break;
    }
    out.key("reason");
    out.string(reason);
    close_record(out);
}

void Trace::warning(double t, std::string_view what, const Field* list, std::size_t n) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "warning", t);
    out.key("what");
    out.string(what);
    fields(out, list, n);
    close_record(out);
}

void Trace::stale_lookup(double t, std::string_view rid, std::int64_t epoch, std::optional<std::int64_t> current_epoch,
                         std::optional<std::string_view> state) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "stale_lookup", t);
    out.key("req");
    out.string(rid);
    out.key("epoch");
    out.int64(epoch);
    out.key("current_epoch");
    if (current_epoch) {
        out.int64(*current_epoch);
    } else {
        out.null();
    }
    out.key("state");
    if (state) {
        out.string(*state);
    } else {
        out.null();
    }
    close_record(out);
}

void Trace::lookup_reuse(double t, std::string_view rid, double answered, std::int64_t uses, std::int64_t blocks,
                         std::int64_t evicted) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "lookup_reuse", t);
    out.key("req");
    out.string(rid);
    out.key("answered");
    out.float64(answered);
    out.key("age_ms");
    out.float64(t - answered);
    out.key("uses");
    out.int64(uses);
    out.key("blocks");
    out.int64(blocks);
    out.key("evicted");
    out.int64(evicted);
    close_record(out);
}

void Trace::job(double t, std::int64_t job_id, std::string_view op, std::string_view rid, const BlockMove* moves,
                std::size_t n, const Positions* named, std::optional<std::int64_t> after) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "job", t);
    out.key("job");
    out.int64(job_id);
    out.key("op");
    out.string(op);
    out.key("req");
    out.string(rid);
    out.key("blocks");
    out.int64(static_cast<std::int64_t>(n));
    out.key("tiers");
    tier_counts(out, moves, n, [](const BlockMove& m) -> const std::string& { return m.tier; });
    out.key("moves");
    out.begin_array();
    const bool positions = named != nullptr && !named->empty();
    for (std::size_t i = 0; i < n; ++i) {
        const BlockMove& m = moves[i];
        out.begin_array();
        out.int64(m.block_hash);
        out.int64(m.device_block);
        out.string(m.tier);
        if (positions) {
            if (const std::int64_t* pos = named->find(m.block_hash)) out.int64(*pos);
        }
        out.end_array();
    }
    out.end_array();
    if (after) {
        out.key("after");
        out.int64(*after);
    }
    close_record(out);
}

void Trace::job_prefetch(double t, std::int64_t job_id, std::string_view rid, const TierMove* moves, std::size_t n) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "job", t);
    out.key("job");
    out.int64(job_id);
    out.key("op");
    out.string("prefetch");
    out.key("req");
    out.string(rid);
    out.key("blocks");
    out.int64(static_cast<std::int64_t>(n));
    out.key("tiers");
    tier_counts(out, moves, n, [](const TierMove& m) -> const std::string& { return m.src_tier; });
    out.key("moves");
    out.begin_array();
    for (std::size_t i = 0; i < n; ++i) {
        out.begin_array();
        out.int64(moves[i].block_hash);
        out.string(moves[i].src_tier);
        out.string(moves[i].dst_tier);
        out.end_array();
    }
    out.end_array();
    close_record(out);
}

void Trace::job_done(double t, std::int64_t job_id, std::string_view op, std::int64_t failed, bool late,
                     bool abandoned) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "job_done", t);
    out.key("job");
    out.int64(job_id);
    out.key("op");
    out.string(op);
    out.key("failed");
    out.int64(failed);
    out.key("late");
    out.boolean(late);
    if (abandoned) {
        out.key("abandoned");
        out.boolean(true);
    }
    close_record(out);
}

void Trace::free(double t, const BlockId* blocks, std::size_t n) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "free", t);
    out.key("blocks");
    int_list(out, blocks, n);
    close_record(out);
}

void Trace::evict(double t, std::string_view tier, const std::int64_t* blocks, std::size_t n) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "evict", t);
    out.key("tier");
    out.string(tier);
    out.key("blocks");
    int_list(out, blocks, n);
    close_record(out);
}

void Trace::store_rejected(double t, std::string_view rid, std::string_view tier, std::int64_t blocks) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "store_rejected", t);
    out.key("req");
    out.string(rid);
    out.key("tier");
    out.string(tier);
    out.key("blocks");
    out.int64(blocks);
    close_record(out);
}

void Trace::step(double t, std::int64_t step_id, std::int64_t requests, std::int64_t prefill_tokens,
                 std::int64_t sync_lookups, const std::vector<StepChunk>& prompt, const std::vector<StepChunk>& fills,
                 const std::vector<std::int64_t>& flush) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "step", t);
    out.key("step");
    out.int64(step_id);
    out.key("requests");
    out.int64(requests);
    out.key("prefill_tokens");
    out.int64(prefill_tokens);
    out.key("sync_lookups");
    out.int64(sync_lookups);
    out.key("prompt");
    chunks(out, prompt);
    if (!fills.empty()) {
        out.key("fills");
        chunks(out, fills);
    }
    if (!flush.empty()) {
        out.key("flush");
        int_list(out, flush.data(), flush.size());
    }
    close_record(out);
}

void Trace::reclaim(double t, std::int64_t job_id, std::string_view op, std::string_view rid,
                    const std::vector<std::int64_t>& ranks, std::int64_t blocks, std::string_view reason) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "reclaim", t);
    out.key("job");
    out.int64(job_id);
    out.key("op");
    out.string(op);
    out.key("req");
    out.string(rid);
    out.key("ranks");
    int_list(out, ranks.data(), ranks.size());
    out.key("blocks");
    out.int64(blocks);
    out.key("reason");
    out.string(reason);
    close_record(out);
}

void Trace::abandon(double t, std::int64_t job_id, std::string_view op, std::string_view rid,
                    std::string_view reason) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "abandon", t);
    out.key("job");
    out.int64(job_id);
    out.key("op");
    out.string(op);
    out.key("req");
    out.string(rid);
    out.key("reason");
    out.string(reason);
    close_record(out);
}

void Trace::interrupted(double t, std::string_view signal, bool clean,
                        const std::vector<std::pair<std::string, std::int64_t>>& requests, std::int64_t finished,
                        std::int64_t not_arrived, std::int64_t jobs, std::int64_t quarantined_jobs,
                        std::int64_t prefetches, const std::vector<std::pair<std::string, std::int64_t>>& open_work) {
    if (out_ == nullptr) return;
    JsonWriter& out = *out_;
    open_record(out, "interrupted", t);
    out.key("signal");
    out.string(signal);
    out.key("clean");
    out.boolean(clean);
    out.key("requests");
    out.begin_object();
    for (const auto& [state, n] : requests) {
        out.key(state);
        out.int64(n);
    }
    out.end_object();
    out.key("finished");
    out.int64(finished);
    out.key("not_arrived");
    out.int64(not_arrived);
    out.key("jobs");
    out.int64(jobs);
    out.key("quarantined_jobs");
    out.int64(quarantined_jobs);
    out.key("prefetches");
    out.int64(prefetches);
    for (const auto& [key, n] : open_work) {
        out.key(key);
        out.int64(n);
    }
    close_record(out);
}

}  // namespace kvlife
