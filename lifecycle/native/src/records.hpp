// Trace records: a mirror of lifecycle/engine/records.py (one member of ``Trace`` per record kind,
// the same fields in the same order) and of events.input_to_record (``Trace::input``).
//
// Python builds a record dict and the trace writer renders it (lifecycle/traces/trace.py:
// kind first, orjson, a newline). ``Trace`` writes the same bytes straight to a JsonWriter, one
// JSON line per record, without building anything. A Trace with no writer is disabled: every
// member returns at once (Python's ``recorder is None``), so a caller that would compute
// something only for a record checks ``enabled()`` first, as the Python checks the recorder.
//
// Where Python passes arbitrary keyword fields (``warning(t, what, **fields)``, ``header``'s
// ``**extra``, ``interrupted``'s ``**open_work``) the native members take a list of typed
// ``Field``s, written in the order given (the call's keyword order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "blocks.hpp"
#include "core_request.hpp"
#include "events.hpp"
#include "json_writer.hpp"
#include "ordered_dict.hpp"
#include "phase_clock.hpp"

namespace kvlife {

// Any JSON value a record's free-form part may hold (a header's config, a field of a type the
// Field constructors do not name). std::vector of an incomplete type is allowed since C++17.
struct JsonValue {
    enum class Type : std::uint8_t { NONE, BOOL, INT, FLOAT, STR, LIST, OBJECT };
    Type type = Type::NONE;
    bool b = false;
    std::int64_t i = 0;
    double d = 0.0;
    std::string s;
    std::vector<JsonValue> items;                           // LIST
    std::vector<std::pair<std::string, JsonValue>> fields;  // OBJECT, in insertion order
};

void write_json_value(JsonWriter& out, const JsonValue& value);

// One keyword field of a record: its key and a value of one of a few types. Views (key, str,
// int list, JsonValue) refer to the caller's data, which must outlive the call it is passed to.
class Field {
  public:
    enum class Type : std::uint8_t { NONE, BOOL, INT, FLOAT, STR, INTS, JSON };

    Field(std::string_view key, std::nullopt_t) : key_(key), type_(Type::NONE) {}
    Field(std::string_view key, bool v) : key_(key), type_(Type::BOOL), b_(v) {}
    template <class I, std::enable_if_t<std::is_integral_v<I> && !std::is_same_v<I, bool>, int> = 0>
    Field(std::string_view key, I v) : key_(key), type_(Type::INT), i_(static_cast<std::int64_t>(v)) {}
    Field(std::string_view key, double v) : key_(key), type_(Type::FLOAT), d_(v) {}
    Field(std::string_view key, std::string_view v) : key_(key), type_(Type::STR), s_(v) {}
    Field(std::string_view key, const char* v) : key_(key), type_(Type::STR), s_(v) {}
    Field(std::string_view key, const std::string& v) : key_(key), type_(Type::STR), s_(v) {}
    // A str or None (``state=req.state if req else None``).
    Field(std::string_view key, std::optional<std::string_view> v)
        : key_(key), type_(v ? Type::STR : Type::NONE), s_(v ? *v : std::string_view{}) {}
    Field(std::string_view key, const std::vector<std::int64_t>& v)
        : key_(key), type_(Type::INTS), ints_(v.data()), n_(v.size()) {}
    Field(std::string_view key, const JsonValue& v) : key_(key), type_(Type::JSON), json_(&v) {}

    std::string_view key() const { return key_; }
    void write_value(JsonWriter& out) const;

  private:
    std::string_view key_;
    Type type_;
    bool b_ = false;
    std::int64_t i_ = 0;
    double d_ = 0.0;
    std::string_view s_;
    const std::int64_t* ints_ = nullptr;
    std::size_t n_ = 0;
    const JsonValue* json_ = nullptr;
};

// state.py moves_record's ``positions``: block hash -> its position in its request, for stored
// blocks whose name a reader cannot derive (jobs.py _underivable).
using Positions = OrderedDict<BlockHash, std::int64_t>;

// One [request id, tokens computed before, tokens] of a step record's "prompt" or "fills".
struct StepChunk {
    std::string_view request_id;
    std::int64_t computed_before;
    std::int64_t num_tokens;
};

class Trace {
  public:
    Trace() = default;                               // disabled
    explicit Trace(JsonWriter* out) : out_(out) {}  // nullptr: disabled
    // ``clock``: a PhaseClock (breakdown.py) fed the transition records and arrival inputs, as
    // a Python recorder ``clock.record`` beside the writer would be, even with no writer
    // (the records are then not rendered: enabled() stays false).
    Trace(JsonWriter* out, PhaseClock* clock) : out_(out), clock_(clock) {}
    bool enabled() const { return out_ != nullptr; }
    JsonWriter* writer() const { return out_; }
    PhaseClock* clock() const { return clock_; }

    // records.header(schema, config, policies, seed, **extra)
    void header(std::int64_t schema, const JsonValue& config, const std::vector<std::string>& policies,
                std::int64_t seed, const Field* extra = nullptr, std::size_t n_extra = 0);
    // events.input_to_record(event)
    void input(const InputEvent& event);
    // records.transition(t, rid, source, target, trigger, reason)
    void transition(double t, std::string_view rid, std::string_view source, std::string_view target,
                    std::string_view trigger, std::string_view reason);
    // records.decision(t, rid, point, policy, value, reason)
    void decision(double t, std::string_view rid, std::string_view point, std::string_view policy,
                  const AnswerValue& value, std::string_view reason);
    // records.warning(t, what, **fields)
    void warning(double t, std::string_view what, const Field* fields, std::size_t n);
    void warning(double t, std::string_view what, std::initializer_list<Field> fields) {
        warning(t, what, fields.begin(), fields.size());
    }
    // records.stale_lookup(t, rid, epoch, current_epoch, state)
    void stale_lookup(double t, std::string_view rid, std::int64_t epoch, std::optional<std::int64_t> current_epoch,
                      std::optional<std::string_view> state);
    // records.lookup_reuse(t, rid, answered, uses, blocks, evicted): age_ms = t - answered
    void lookup_reuse(double t, std::string_view rid, double answered, std::int64_t uses, std::int64_t blocks,
                      std::int64_t evicted);
    // records.job(t, job_id, op, rid, count_tiers(m.tier for m in moves), moves_record(moves, named),
    //             **({} if after is None else {"after": after}))  -- a load or a store
    void job(double t, std::int64_t job_id, std::string_view op, std::string_view rid, const BlockMove* moves,
             std::size_t n, const Positions* named = nullptr, std::optional<std::int64_t> after = std::nullopt);
    // records.job(t, job_id, "prefetch", rid, count_tiers(m.src_tier for m in moves),
    //             [[m.block_hash, m.src_tier, m.dst_tier] for m in moves])
    void job_prefetch(double t, std::int64_t job_id, std::string_view rid, const TierMove* moves, std::size_t n);
    // records.job_done(t, job_id, op, failed, late, abandoned)
    void job_done(double t, std::int64_t job_id, std::string_view op, std::int64_t failed, bool late,
                  bool abandoned = false);
    // records.free(t, blocks)
    void free(double t, const BlockId* blocks, std::size_t n);
    // records.evict(t, tier, blocks)
    void evict(double t, std::string_view tier, const std::int64_t* blocks, std::size_t n);
    // records.store_rejected(t, rid, tier, blocks)
    void store_rejected(double t, std::string_view rid, std::string_view tier, std::int64_t blocks);
    // records.step(t, step_id, requests, prefill_tokens, sync_lookups, prompt, fills, flush)
    void step(double t, std::int64_t step_id, std::int64_t requests, std::int64_t prefill_tokens,
              std::int64_t sync_lookups, const std::vector<StepChunk>& prompt, const std::vector<StepChunk>& fills,
              const std::vector<std::int64_t>& flush);
    // records.reclaim(t, job_id, op, rid, ranks, blocks, reason)
    void reclaim(double t, std::int64_t job_id, std::string_view op, std::string_view rid,
                 const std::vector<std::int64_t>& ranks, std::int64_t blocks, std::string_view reason);
    // records.abandon(t, job_id, op, rid, reason)
    void abandon(double t, std::int64_t job_id, std::string_view op, std::string_view rid, std::string_view reason);
    // records.interrupted(t, signal, clean, requests, finished, not_arrived, jobs, quarantined_jobs,
    //                     prefetches, **open_work)
    void interrupted(double t, std::string_view signal, bool clean,
                     const std::vector<std::pair<std::string, std::int64_t>>& requests, std::int64_t finished,
                     std::int64_t not_arrived, std::int64_t jobs, std::int64_t quarantined_jobs,
                     std::int64_t prefetches, const std::vector<std::pair<std::string, std::int64_t>>& open_work);

  private:
    JsonWriter* out_ = nullptr;
    PhaseClock* clock_ = nullptr;
};

}  // namespace kvlife
