// kvlife's model of vLLM's Request as its scheduler sees it: a mirror of
// lifecycle/engine/request.py (Status, FINISHED_STATUS, SchedRequest).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "blocks.hpp"
#include "events.hpp"

namespace kvlife {

struct Request;

// vLLM's RequestStatus, as far as kvlife's scheduler models it (request.Status).
enum class Status : std::uint8_t {
    WAITING,
    WAITING_FOR_REMOTE_KVS,
    RUNNING,
    PREEMPTED,
    FINISHED_STOPPED,
    FINISHED_LENGTH_CAPPED,
    FINISHED_ABORTED,
    FINISHED_ERROR,
    FINISHED_IGNORED,
};

// FINISHED_STATUS: kvlife's finish reasons -> vLLM's status of a finished request.
// std::invalid_argument for a reason that is not one of them (the reference's KeyError).
Status finished_status(std::string_view reason);

struct SchedRequest {
    SchedRequest(std::string id, std::int64_t prompt, std::optional<std::int64_t> max, std::vector<BlockHash> prompt_hashes,
                 std::int64_t bt, bool resumable_)
        : request_id(std::move(id)),
          prompt_tokens(prompt),
          max_tokens(max),
          hashes(std::move(prompt_hashes)),
          block_tokens(bt),
          resumable(resumable_) {}

    std::string request_id;
    std::int64_t prompt_tokens;
    std::optional<std::int64_t> max_tokens;  // none: the driver says when it stops
    HashList hashes;                         // full prompt blocks, then derived names as outputs fill blocks
    std::int64_t block_tokens;
    bool resumable = false;
    Status status = Status::WAITING;
    std::int64_t output_tokens = 0;
    std::int64_t num_computed_tokens = 0;
    std::int64_t num_output_placeholders = 0;
    std::int64_t num_in_flight_tokens = 0;
    std::int64_t num_stale_output_tokens = 0;
    std::int64_t num_preemptions = 0;
    std::vector<BlockId> blocks;  // its block table
    std::int64_t num_cached_blocks = 0;
    std::int64_t last_sched_seq = 0;
    bool is_prefill_chunk = false;
    bool finished = false;
    bool free_on_recving = false;
    bool free_on_sending = false;
    std::optional<std::string> finish_note;
    std::int64_t hash_cap = std::int64_t{1} << 62;
    std::int64_t arrival = 0;  // its place among the scheduler's arrivals (requests() order)
    bool listed = false;       // the scheduler's map of requests by id names this record
    bool prefill_in_flight = false;  // in the scheduler's inflight_prefills_
    // The connector core's record of it, as the native connector made it (connector.hpp
    // ConnectorAPI: at its arrival or its wake); weak, so it never keeps a record alive.
    std::weak_ptr<Request> core_record;
    // The simulator's stop rule for it (simulator.hpp StopRule), kept here once looked up so a
    // step's end reads it without a lookup by id (stop_known: it has been).
    std::int64_t stop_limit = 0;
    bool stop_length = false;
    bool stop_known = false;

    // Whether nothing but its arrival happened to it: every field the constructor does not set
    // still holds its default (its hashes aside: they only ever get derived ones appended).
    bool only_arrived() const {
        return status == Status::WAITING && output_tokens == 0 && num_computed_tokens == 0 &&
               num_output_placeholders == 0 && num_in_flight_tokens == 0 && num_stale_output_tokens == 0 &&
               num_preemptions == 0 && blocks.empty() && num_cached_blocks == 0 && last_sched_seq == 0 &&
               !is_prefill_chunk && !finished && !free_on_recving && !free_on_sending && !finish_note.has_value() &&
               hash_cap == (std::int64_t{1} << 62);
    }

    std::int64_t num_tokens() const { return prompt_tokens + output_tokens; }

    // block_hashes: the hashes of its full blocks of known tokens (derived past the prompt).
    const HashList& block_hashes() {
        std::int64_t full = (prompt_tokens + output_tokens) / block_tokens;
        if (full > hash_cap) {
            full = hash_cap;
        }
        hashes.extend(request_id, full);
        return hashes;
    }
};

inline const std::string& Scheduled::id() const { return owner != nullptr ? owner->request_id : request_id; }

}  // namespace kvlife
