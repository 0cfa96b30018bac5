// kvlife's scheduler, vLLM 0.33's v1 Scheduler for one full-attention KV cache group: a mirror
// of lifecycle/engine/scheduler.py, decision for decision, with the same calls to the connector.
//
// The connector is a template parameter (no virtual dispatch). It provides:
//   void begin_pass(); void begin_output(); void take_events();
//   void on_new_request(SchedRequest&, bool early);
//   bool request_finished(SchedRequest&, const std::vector<BlockId>& blocks);   // hold the blocks?
//   std::pair<std::optional<int64_t>, bool> get_num_new_matched_tokens(SchedRequest&, int64_t local_tokens);
//   void update_state_after_alloc(SchedRequest&, const std::vector<BlockId>& blocks, int64_t external);
//   Meta build_connector_meta(const SchedulerOutput&);  // Meta: sync_lookup_keys, flush (vectors of int64)
//   void update_connector_output(const KVConnectorOutput&);
//   bool knows(const std::string& request_id);          // the core has it, or retired it
//   void warn_duplicate_arrival(const std::string& request_id);
//   void freed(const std::vector<BlockId>& blocks);     // a "free" record and a FreeBlocks command
//   using Dormant = ...;                                 // what it keeps of a dormant request
//   std::optional<Dormant> doze(const SchedRequest&);    // drop its record (nullopt: it keeps it)
//   void wake(const SchedRequest&, Dormant&&);           // rebuild the record it dropped
//   bool is_dormant(const std::string& request_id);      // its record dropped by doze, not woken
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "blocks.hpp"
#include "events.hpp"
#include "sched_request.hpp"

namespace kvlife {

using RequestPtr = std::shared_ptr<SchedRequest>;

// Python's -(-a // b) for b > 0 (floor division, so exact for negative a too).
inline std::int64_t cdiv(std::int64_t a, std::int64_t b) {
    std::int64_t n = -a;
    std::int64_t q = n / b;
    if ((n % b != 0) && (n < 0)) {
        q -= 1;
    }
    return -q;
}

struct SchedulerConfig {
    std::int64_t block_tokens;
    std::int64_t device_blocks;
    std::int64_t max_batched_tokens;
    std::int64_t max_running;
    bool async_scheduling;
    bool fail_on_load_failure;  // kv_load_failure_policy == "fail"
};

// vllm_shapes: what the scheduler hands the connector.
// The ids of the scheduled requests point at their records' request_id (each record is held
// by the pass's step until its output is taken), not copies: one pointer per request per list.
struct NewRequestData {
    const std::string* req_id;
    std::int64_t num_computed_tokens;
    std::vector<BlockId> block_ids;  // the one KV cache group's
};

struct CachedRequestData {
    std::vector<const std::string*> req_ids;
    std::vector<std::int64_t> num_computed_tokens;
    std::vector<std::optional<std::vector<BlockId>>> new_block_ids;
    std::vector<const std::string*> resumed_req_ids;  // a set in Python: order carries no meaning
};

struct SchedulerOutput {
    std::vector<NewRequestData> scheduled_new_reqs;
    CachedRequestData scheduled_cached_reqs;
    // In scheduling order; each id the same pointer as in the new or cached list.
    std::vector<std::pair<const std::string*, std::int64_t>> num_scheduled_tokens;
    // kvlife's: each scheduled request's record, in num_scheduled_tokens' order.
    std::vector<const SchedRequest*> records;
    std::vector<std::string> preempted_req_ids;  // sets in Python, kept here in the order added
    std::vector<std::string> finished_req_ids;
};

struct WorkerReport {
    std::int64_t job_id;
    std::int64_t rank;
    std::vector<BlockHash> failed;
};

struct KVConnectorOutput {
    std::optional<std::vector<std::string>> finished_sending;  // None, or a non-empty set
    std::optional<std::vector<std::string>> finished_recving;
    std::optional<std::vector<WorkerReport>> reports;  // kv_connector_worker_meta
    std::vector<BlockId> invalid_block_ids;            // a set
};

template <class Connector>
class Scheduler {
  public:
    // One scheduled request of a step in flight: (request, tokens, samples a token).
    struct Entry {
        RequestPtr req;
        std::int64_t n;
        bool samples;
    };
    struct Step {
        std::vector<Entry> scheduled;
        std::int64_t total;
        // The device blocks the step writes (each entry's block_table[computed_before / bt,
        // cdiv(computed_before + num_tokens, bt)) as planned): all a failed step needs.
        std::vector<BlockId> written;
    };
    // Whether a plan's entries carry their block tables, hashes and ids: a live worker and the
    // Python bindings read them; the native simulator's loop never reads the first two and
    // reads each id through the entry's owner (Scheduled::id), so it turns them off.
    bool plan_tables = true;
    // kvlife's, not vLLM's: whether an arrival that nothing but its arrival happened to waits
    // dormant. Its record and the connector's are dropped, and what rebuilds them waits in its
    // place in the queue (tail_), until the scheduler reaches it or an abort names it. Nothing
    // the scheduler decides changes: a woken request is the record it was. Under a backlog a
    // waiting request then costs its id, prompt, hashes and decisions, not two whole records.
    // The native simulator's loop turns it on; the Python bindings, which read the queues, do not.
    bool dormant_arrivals = false;
    using Meta = decltype(std::declval<Connector&>().build_connector_meta(std::declval<const SchedulerOutput&>()));

    Scheduler(const SchedulerConfig& config, Connector& connector)
        : config_(config),
          connector_(connector),
          pool_(config.device_blocks),
          bt_(config.block_tokens),
          async_scheduling_(config.async_scheduling),
          defer_block_free_(config.async_scheduling) {}

    // ---- requests in and out ------------------------------------------------------------------
    void add_request(const std::string& request_id, std::int64_t prompt_tokens, const std::vector<BlockHash>& block_hashes,
                     std::optional<std::int64_t> max_tokens, bool resumable) {
        if (requests_.count(request_id) || connector_.knows(request_id)) {
            connector_.warn_duplicate_arrival(request_id);
            return;
        }
        std::size_t keep = static_cast<std::size_t>(std::max<std::int64_t>(0, prompt_tokens / bt_));
        std::vector<BlockHash> hashes(block_hashes.begin(), block_hashes.begin() + std::min(keep, block_hashes.size()));
        auto req = std::make_shared<SchedRequest>(request_id, prompt_tokens, max_tokens, std::move(hashes), bt_, resumable);
        if (cdiv(prompt_tokens + 1, bt_) > pool_.capacity()) {
            // kvlife's liveness rule: a prompt that can never fit fails at its arrival.
            req->hash_cap = pool_.capacity() + 1;
            connector_.on_new_request(*req, false);
            req->finish_note = "prompt needs more than the " + std::to_string(pool_.capacity()) + " device blocks";
            finish(*req, "error", Status::FINISHED_IGNORED);
            return;
        }
        req->arrival = next_arrival_++;
        list(req);
        order_.push_back(req);
        waiting_.push_back(req);
        connector_.on_new_request(*req, true);
        if (dormant_arrivals && !waiting_.empty() && waiting_.back() == req) {
            waiting_.pop_back();
            to_tail(req);
        }
    }

    // The waiting queue is waiting_ followed by tail_ (with dormant_arrivals on; tail_ is empty
    // otherwise): every dormant request, and each arrival after the first dormant one.
    std::size_t dormant() const {
        std::size_t n = 0;
        for (const Tail& item : tail_) {
            n += item.live ? 0 : 1;
        }
        return n;
    }
    // Wake every dormant request (each stays in its place): before the requests are read whole.
    void wake_all() {
        for (Tail& item : tail_) {
            if (!item.live) {
                wake_in_place(item);
            }
        }
    }

    // vLLM's finish_requests (an abort): false if it is unknown or finished.
    bool finish_requests(const std::string& request_id, const char* reason = "aborted") {
        auto it = requests_.find(request_id);
        if (it == requests_.end() && connector_.is_dormant(request_id)) {
            wake_named(request_id);
            it = requests_.find(request_id);
        }
        if (it == requests_.end() || it->second->finished) {
            return false;
        }
        RequestPtr req = it->second;
        if (req->status == Status::RUNNING) {
            remove_from(running_, req.get());
        } else {
            unqueue(req.get());
        }
        bool delay = req->status == Status::WAITING_FOR_REMOTE_KVS && !finished_recving_.count(request_id);
        finished_recving_.erase(request_id);
        failed_recving_.erase(request_id);
        free_request(req, reason, delay);
        return true;
    }

    // The connector core lets go of blocks it held (a quarantined job ended).
    void release_held(const std::vector<BlockId>& blocks) { release(blocks.data(), blocks.size()); }

    // ---- the pass -------------------------------------------------------------------------------
    std::pair<StepPlan, Meta> schedule() {
        connector_.begin_pass();
        std::int64_t budget = config_.max_batched_tokens;
        std::vector<Entry> scheduled;
        scheduled.swap(spare_scheduled_);  // (an emptied list of an earlier step: no growth per step)
        NewBlocks new_blocks;
        bool preempted = false;
        std::size_t index = 0;
        std::int64_t capacity = pool_.capacity();
        while (index < running_.size() && budget > 0) {
            SchedRequest* req = running_[index].get();  // (no shared_ptr copy per request per step)
            std::int64_t computed = req->num_computed_tokens;
            std::int64_t placeholders = req->num_output_placeholders;
            if (placeholders > 0 && req->max_tokens.has_value() &&
                computed + 2 - placeholders >= req->prompt_tokens + *req->max_tokens) {
                index += 1;  // async: a step in flight already samples its last token
                continue;
            }
            std::int64_t known = req->prompt_tokens + req->output_tokens;
            std::int64_t n = known + placeholders - computed;
            if (n > budget) {
                n = budget;
            }
            if (n <= 0) {
                index += 1;
                continue;
            }
            std::int64_t need = cdiv(computed + n, bt_);
            if (need > capacity) {
                // It outgrew the whole device: preempting anything could never make room.
                RequestPtr owned = running_[index];
                running_.erase(running_.begin() + static_cast<std::ptrdiff_t>(index));
                free_request(owned, "error", false,
                             "needs " + std::to_string(need) + " blocks for " + std::to_string(req->num_computed_tokens) +
                                 " computed tokens and the chunk, the device has " + std::to_string(pool_.capacity()),
                             Status::FINISHED_IGNORED);
                continue;
            }
            bool fits = true;
            while (need - static_cast<std::int64_t>(req->blocks.size()) > pool_.free()) {
                RequestPtr victim = running_.back();
                if (!can_free(*victim)) {
                    fits = false;  // its blocks are still written by a step in flight
                    break;
                }
                running_.pop_back();
                preempt(victim);
                preempted = true;
                if (victim.get() == req) {
                    break;
                }
            }
            if (!fits || req->status != Status::RUNNING) {
                break;
            }
            std::int64_t more = need - static_cast<std::int64_t>(req->blocks.size());
            if (more > 0) {
                std::vector<BlockId> added;
                pool_.allocate(more, added);
                req->blocks.insert(req->blocks.end(), added.begin(), added.end());
                new_blocks.set(req, std::move(added), false);
            }
            std::int64_t end = computed + n;
            std::int64_t upto = end < known ? end : known;
            if (upto / bt_ > req->num_cached_blocks) {
                cache_blocks(*req, upto);
            }
            scheduled.push_back(Entry{running_[index], n, end >= known});  // (req: still at index)
            budget -= n;
            index += 1;
        }
        if (!preempted) {
            budget = admit(budget, scheduled, new_blocks);
        }
        return emit(scheduled, new_blocks);
    }

    // ---- the step's output ----------------------------------------------------------------------
    bool update_from_output(std::int64_t step_id, const std::unordered_map<std::string, std::string>& stops,
                            const KVConnectorOutput* output,
                            const std::unordered_set<std::string>& given_up = std::unordered_set<std::string>()) {
        auto found = steps_.find(step_id);
        if (found == steps_.end()) {
            return false;
        }
        Step step = std::move(found->second);
        steps_.erase(found);
        connector_.begin_output();
        if (defer_block_free_ && step.total > 0) {
            processed_step_seq_ += 1;
            while (!deferred_frees_.empty() && deferred_frees_.front().first <= processed_step_seq_) {
                std::vector<BlockId> blocks = std::move(deferred_frees_.front().second);
                deferred_frees_.pop_front();
                std::reverse(blocks.begin(), blocks.end());
                release(blocks.data(), blocks.size());
            }
        }
        std::vector<std::string> failed_loads;
        if ((output != nullptr && !output->invalid_block_ids.empty()) || !given_up.empty()) {
            static const std::vector<BlockId> none;
            failed_loads = invalid_blocks(output != nullptr ? output->invalid_block_ids : none, given_up);
        }
        for (Entry& entry : step.scheduled) {
            SchedRequest& req = *entry.req;
            req.num_in_flight_tokens -= entry.n;
            bool stale = req.num_stale_output_tokens > 0;
            if (stale) {
                req.num_stale_output_tokens -= entry.n;
            }
            if (req.finished || !entry.samples) {
                continue;  // aborted while the step ran; or no token sampled
            }
            req.output_tokens += 1;
            if (!stale && req.num_output_placeholders > 0) {
                req.num_output_placeholders -= 1;
                if (req.status == Status::RUNNING) {
                    cache_blocks(req, req.num_computed_tokens - req.num_in_flight_tokens);
                }
            }
            if (stops.empty()) {
                continue;  // (most steps finish nothing: no lookup by id)
            }
            auto reason = stops.find(req.request_id);
            if (reason != stops.end()) {
                if (req.status == Status::RUNNING) {
                    remove_from(running_, &req);
                } else {
                    unqueue(&req);  // preempted, its stale token was its last
                }
                free_request(entry.req, reason->second.c_str());
            }
        }
        for (const std::string& rid : failed_loads) {
            auto it = requests_.find(rid);
            if (it != requests_.end() && !it->second->finished) {
                finish_requests(rid, "error");
            }
        }
        if (output != nullptr) {
            transfers_finished(*output);
        }
        connector_.take_events();
        step.scheduled.clear();  // (the lists go back, emptied, for later steps)
        spare_scheduled_ = std::move(step.scheduled);
        step.written.clear();
        spare_written_ = std::move(step.written);
        return true;
    }

    // ---- what drivers and checks read ---------------------------------------------------------
    DeviceBlockPool& pool() { return pool_; }
    const DeviceBlockPool& pool() const { return pool_; }
    std::int64_t results() const { return results_; }
    std::int64_t next_step_id() const { return next_step_id_; }
    const std::map<std::int64_t, Step>& steps() const { return steps_; }
    const std::vector<RequestPtr>& running() const { return running_; }
    const std::deque<RequestPtr>& waiting() const { return waiting_; }
    const std::deque<RequestPtr>& kv_holding() const { return kv_holding_; }
    bool finished_recving_has(const std::string& rid) const { return finished_recving_.count(rid) > 0; }

    // The live requests, in the order they were added (the reference's dict order).
    std::vector<RequestPtr> requests() {
        std::vector<RequestPtr> out;
        for (const RequestPtr& req : order_) {
            auto it = requests_.find(req->request_id);
            if (it != requests_.end() && it->second == req) {
                out.push_back(req);
            }
        }
        // (a woken request joined order_ at its waking: its arrival puts it back in its place)
        std::stable_sort(out.begin(), out.end(),
                         [](const RequestPtr& a, const RequestPtr& b) { return a->arrival < b->arrival; });
        return out;
    }
    RequestPtr request(const std::string& rid) const {
        auto it = requests_.find(rid);
        return it == requests_.end() ? nullptr : it->second;
    }
    // Tokens output so far (none: it left the scheduler).
    std::optional<std::int64_t> output_tokens(const std::string& rid) const {
        auto it = requests_.find(rid);
        if (it == requests_.end()) {
            if (connector_.is_dormant(rid)) {
                return 0;  // (only arrived: nothing output)
            }
            return std::nullopt;
        }
        return it->second->output_tokens;
    }
    bool any_finished() const {
        for (const auto& item : requests_) {
            if (item.second->finished) {
                return true;
            }
        }
        return false;
    }
    std::int64_t waiting_for_remote_kvs() const {
        std::int64_t count = 0;
        for (const auto& item : requests_) {
            count += item.second->status == Status::WAITING_FOR_REMOTE_KVS ? 1 : 0;
        }
        return count;
    }

  private:
    // new_blocks: request -> (blocks added this pass, whether it was admitted this pass). A
    // request gets its blocks just before its entry joins the pass's scheduled list, once per
    // pass, and an entry is never preempted later in its pass: the items are in the scheduled
    // list's order, so emit walks them with one cursor (no lookup by id).
    struct NewBlocks {
        struct Item {
            const SchedRequest* req;
            std::vector<BlockId> blocks;
            bool admitted;
        };
        std::vector<Item> items;
        void set(const SchedRequest* req, std::vector<BlockId> blocks, bool admitted) {
            items.push_back(Item{req, std::move(blocks), admitted});
        }
    };

    template <class Seq>
    static void remove_from(Seq& seq, const SchedRequest* req) {
        for (auto it = seq.begin(); it != seq.end(); ++it) {
            if (it->get() == req) {
                seq.erase(it);
                return;
            }
        }
    }
    template <class Seq>
    static bool contains(const Seq& seq, const SchedRequest* req) {
        for (const RequestPtr& each : seq) {
            if (each.get() == req) {
                return true;
            }
        }
        return false;
    }

    bool finish(SchedRequest& req, const char* reason, std::optional<Status> status = std::nullopt) {
        req.finished = true;
        req.status = status.has_value() ? *status : finished_status(reason);
        add_unique(finished_ids_, req.request_id);
        return connector_.request_finished(req, req.blocks);
    }

    template <class Id>
    static void add_unique(std::vector<Id>& ids, const Id& rid) {
        if (std::find(ids.begin(), ids.end(), rid) == ids.end()) {
            ids.push_back(rid);
        }
    }

    void unqueue(const SchedRequest* req) {
        if (contains(waiting_, req)) {
            remove_from(waiting_, req);
        } else if (contains(kv_holding_, req)) {
            remove_from(kv_holding_, req);
        } else {
            for (auto it = tail_.begin(); it != tail_.end(); ++it) {
                if (it->live.get() == req) {
                    tail_.erase(it);
                    break;
                }
            }
        }
    }

    void free_request(const RequestPtr& req, const char* reason, bool delay = false,
                      std::optional<std::string> why = std::nullopt, std::optional<Status> status = std::nullopt) {
        prefill_landed(*req);
        req->finish_note = std::move(why);
        bool hold = finish(*req, reason, status);
        if (delay) {
            req->free_on_recving = true;
        } else if (hold) {
            req->free_on_sending = true;
        } else {
            free_blocks(req);
        }
    }

    void free_blocks(const RequestPtr& req) {
        free_request_blocks(*req);
        if (req->listed) {
            unlist(*req);
            dead_in_order_ += 1;
            if (dead_in_order_ * 2 > order_.size() && order_.size() > 64) {
                compact_order();
            }
        }
    }

    void compact_order() {
        std::vector<RequestPtr> live;
        live.reserve(requests_.size());
        for (const RequestPtr& req : order_) {
            auto it = requests_.find(req->request_id);
            if (it != requests_.end() && it->second == req) {
                live.push_back(req);
            }
        }
        order_ = std::move(live);
        dead_in_order_ = 0;
    }

    bool can_free(const SchedRequest& req) const {
        return !defer_block_free_ || req.last_sched_seq <= processed_step_seq_;
    }

    // Give the request's blocks back, tail first, or, while a step in flight may still write
    // them, once it has produced output.
    void free_request_blocks(SchedRequest& req) {
        std::vector<BlockId> blocks = std::move(req.blocks);
        req.blocks.clear();
        req.num_cached_blocks = 0;
        if (blocks.empty()) {
            return;
        }
        if (can_free(req)) {
            std::reverse(blocks.begin(), blocks.end());
            release(blocks.data(), blocks.size());
        } else {
            deferred_frees_.emplace_back(sched_step_seq_, std::move(blocks));
        }
    }

    void release(const BlockId* blocks, std::size_t n) {
        freed_scratch_.clear();
        pool_.release(blocks, n, freed_scratch_);
        if (!freed_scratch_.empty()) {
            connector_.freed(freed_scratch_);
        }
    }

    // The waiting half of the pass (vLLM's second loop); returns the budget left.
    std::int64_t admit(std::int64_t budget, std::vector<Entry>& scheduled, NewBlocks& new_blocks) {
        std::deque<RequestPtr>& skipped_waiting = skipped_waiting_;  // (members: a deque allocates as it is made)
        std::deque<RequestPtr>& skipped_holding = skipped_holding_;
        skipped_waiting.clear();
        skipped_holding.clear();
        auto skip = [&](std::deque<RequestPtr>& queue) {
            RequestPtr req = queue.front();
            queue.pop_front();
            if (req->num_computed_tokens > 0 || req->status == Status::WAITING_FOR_REMOTE_KVS) {
                skipped_holding.push_front(req);
            } else {
                skipped_waiting.push_front(req);
            }
        };
        while (budget > 0) {
            if (waiting_.empty() && kv_holding_.empty() && !tail_.empty() &&
                static_cast<std::int64_t>(running_.size()) < config_.max_running) {
                waiting_.push_back(take_tail());  // the queue goes on in its tail
            }
            std::deque<RequestPtr>& queue = !kv_holding_.empty() ? kv_holding_ : waiting_;
            if (queue.empty() || static_cast<std::int64_t>(running_.size()) >= config_.max_running) {
                break;
            }
            RequestPtr req = queue.front();
            const std::string& rid = req->request_id;
            if (req->status == Status::WAITING_FOR_REMOTE_KVS) {
                if (!finished_recving_.count(rid)) {
                    skip(queue);
                    continue;
                }
                landed(req);
                req->status = req->num_preemptions ? Status::PREEMPTED : Status::WAITING;
            }
            if (req->num_stale_output_tokens) {
                skip(queue);  // its in-flight output (preempted under async scheduling) comes first
                continue;
            }
            if (cdiv(req->num_tokens() + 1, bt_) > pool_.capacity()) {
                queue.pop_front();
                free_request(req, "error", false,
                             "needs " + std::to_string(cdiv(req->num_tokens() + 1, bt_)) + " blocks for its " +
                                 std::to_string(req->num_tokens()) + " known tokens and the next, the device has " +
                                 std::to_string(pool_.capacity()),
                             Status::FINISHED_IGNORED);
                continue;
            }
            std::vector<BlockId>& local = local_scratch_;  // (a member: emptied here, its room kept)
            local.clear();
            std::int64_t external = 0;
            bool load_async = false;
            std::int64_t computed;
            if (req->num_computed_tokens == 0) {
                std::int64_t limit = (req->num_tokens() - 1) / bt_;
                const HashList& hashes = req->block_hashes();
                std::size_t upto = limit < 0 ? 0 : std::min<std::size_t>(static_cast<std::size_t>(limit), hashes.size());
                pool_.cached_prefix(hashes.data(), upto, local);
                auto answer = connector_.get_num_new_matched_tokens(*req, static_cast<std::int64_t>(local.size()) * bt_);
                load_async = answer.second;
                if (!answer.first.has_value()) {
                    skip(queue);
                    continue;
                }
                external = *answer.first;
                computed = static_cast<std::int64_t>(local.size()) * bt_ + external;
            } else {
                computed = req->num_computed_tokens;
            }
            std::int64_t n = load_async ? 0 : std::min(req->num_tokens() - computed, budget);
            std::int64_t reserved = load_async ? reserved_blocks() : 0;
            if (!allocate(*req, n, local, external, load_async, reserved)) {
                break;
            }
            connector_.update_state_after_alloc(*req, req->blocks, external);
            if (load_async) {
                req->status = Status::WAITING_FOR_REMOTE_KVS;
                req->num_computed_tokens = computed;
                prefill_in_flight(*req);
                skip(queue);
                continue;
            }
            queue.pop_front();
            running_.push_back(req);
            if (req->status == Status::PREEMPTED) {
                resumed_.insert(rid);
            }
            req->status = Status::RUNNING;
            req->num_computed_tokens = computed;
            new_blocks.set(req.get(), req->blocks, true);
            scheduled.push_back(Entry{req, n, computed + n >= req->num_tokens()});
            budget -= n;
            if (computed + n < req->num_tokens()) {
                prefill_in_flight(*req);
            }
        }
        // deque.extendleft: each at the front in turn (the first skipped ends up first).
        for (const RequestPtr& req : skipped_holding) {
            kv_holding_.push_front(req);
        }
        for (const RequestPtr& req : skipped_waiting) {
            waiting_.push_front(req);
        }
        skipped_waiting.clear();
        skipped_holding.clear();
        return budget;
    }

    // KVCacheManager.allocate_slots for a waiting request (see the reference's docstring).
    bool allocate(SchedRequest& req, std::int64_t n, const std::vector<BlockId>& local, std::int64_t external,
                  bool delay_cache, std::int64_t reserved) {
        std::int64_t total = req.num_computed_tokens + static_cast<std::int64_t>(local.size()) * bt_ + external;
        std::int64_t held = static_cast<std::int64_t>(req.blocks.size());
        std::int64_t hits_taken = pool_.evictable(local.data(), local.size());
        std::int64_t full_need;
        std::int64_t need;
        std::int64_t nlocal = static_cast<std::int64_t>(local.size());
        if (held) {  // it holds blocks already (a landed load): no new hit
            full_need = std::max<std::int64_t>(cdiv(req.num_tokens(), bt_) - held, 0);
            need = std::max<std::int64_t>(cdiv(total + n, bt_) - held, 0);
        } else {
            full_need = std::max<std::int64_t>(cdiv(req.num_tokens(), bt_) - nlocal, 0) + hits_taken;
            need = std::max<std::int64_t>(cdiv(total + n, bt_) - nlocal, 0) + hits_taken;
        }
        if (full_need > pool_.free() || need > pool_.free() - reserved) {
            return false;
        }
        if (!local.empty()) {
            pool_.touch(local.data(), local.size());
            req.blocks.insert(req.blocks.end(), local.begin(), local.end());
            req.num_cached_blocks = static_cast<std::int64_t>(req.blocks.size());
        }
        if (external) {
            pool_.allocate(std::max<std::int64_t>(0, cdiv(total, bt_) - static_cast<std::int64_t>(req.blocks.size())),
                           req.blocks);
        }
        std::int64_t more = cdiv(total + n, bt_) - static_cast<std::int64_t>(req.blocks.size());
        if (more > 0) {
            pool_.allocate(more, req.blocks);
        }
        if (!delay_cache) {
            cache_blocks(req, std::min(total + n, req.num_tokens()));
        }
        return true;
    }

    // requests_, with each record's flag saying whether the map names it (the only ways in and
    // out; ids are unique, so a listed record is the one a lookup by its id finds).
    void list(const RequestPtr& req) {
        requests_.emplace(req->request_id, req);
        req->listed = true;
    }
    void unlist(SchedRequest& req) {
        requests_.erase(req.request_id);
        req.listed = false;
    }

    // inflight_prefills_, with each member's flag saying so (most passes ask of every running
    // request, and the flag answers without hashing).
    void prefill_in_flight(SchedRequest& req) {
        inflight_prefills_.insert(&req);
        req.prefill_in_flight = true;
    }
    void prefill_landed(SchedRequest& req) {
        if (req.prefill_in_flight) {
            inflight_prefills_.erase(&req);
            req.prefill_in_flight = false;
        }
    }

    // Blocks the prefills in flight still need for their whole known sequence.
    std::int64_t reserved_blocks() const {
        std::int64_t sum = 0;
        for (const SchedRequest* r : inflight_prefills_) {
            sum += std::max<std::int64_t>(0, cdiv(r->num_tokens(), bt_) - static_cast<std::int64_t>(r->blocks.size()));
        }
        return sum;
    }

    // Publish the request's full blocks of its first tokens in the prefix cache.
    void cache_blocks(SchedRequest& req, std::int64_t tokens) {
        std::int64_t full = tokens / bt_;  // tokens >= 0 here, as in every call of the reference
        if (full <= req.num_cached_blocks) {
            return;
        }
        const HashList& hashes = req.block_hashes();
        for (std::int64_t i = req.num_cached_blocks; i < full; ++i) {
            pool_.cache(req.blocks.at(static_cast<std::size_t>(i)), hashes.at(static_cast<std::size_t>(i)));
        }
        req.num_cached_blocks = full;
    }

    // vLLM's _update_waiting_for_remote_kv: a load reported.
    void landed(const RequestPtr& req) {
        const std::string& rid = req->request_id;
        if (failed_recving_.count(rid)) {
            failed_recving_.erase(rid);
            if (req->num_computed_tokens) {
                cache_blocks(*req, req->num_computed_tokens);
            } else {
                free_request_blocks(*req);
                prefill_landed(*req);
            }
        } else {
            cache_blocks(*req, req->num_computed_tokens);
        }
        if (req->num_computed_tokens == req->num_tokens()) {
            req->num_computed_tokens = req->num_tokens() - 1;  // the last token is computed again, to sample
        }
        finished_recving_.erase(rid);
    }

    // vLLM's _preempt_request.
    void preempt(const RequestPtr& req) {
        free_request_blocks(*req);
        prefill_landed(*req);
        req->status = Status::PREEMPTED;
        req->num_computed_tokens = 0;
        req->num_stale_output_tokens = req->num_in_flight_tokens;
        req->num_output_placeholders = 0;
        req->num_preemptions += 1;
        waiting_.push_front(req);
        add_unique(preempted_ids_, req->request_id);
    }

    // The scheduler output, build_connector_meta, then _update_after_schedule.
    std::pair<StepPlan, Meta> emit(std::vector<Entry>& scheduled, NewBlocks& new_blocks) {
        std::int64_t step_id = next_step_id_++;
        std::int64_t total = 0;
        SchedulerOutput& output = output_scratch_;  // (its lists emptied, their room kept)
        output.scheduled_new_reqs.clear();
        output.num_scheduled_tokens.clear();
        output.records.clear();
        output.preempted_req_ids.clear();
        output.finished_req_ids.clear();
        CachedRequestData& cached = output.scheduled_cached_reqs;
        cached.req_ids.clear();
        cached.num_computed_tokens.clear();
        cached.new_block_ids.clear();
        cached.resumed_req_ids.clear();
        output.num_scheduled_tokens.reserve(scheduled.size());
        cached.req_ids.reserve(scheduled.size());
        cached.num_computed_tokens.reserve(scheduled.size());
        cached.new_block_ids.reserve(scheduled.size());
        std::size_t cursor = 0;
        for (const Entry& entry : scheduled) {
            const std::string* rid = &entry.req->request_id;
            output.num_scheduled_tokens.emplace_back(rid, entry.n);
            output.records.push_back(entry.req.get());
            total += entry.n;
            typename NewBlocks::Item* added = nullptr;
            if (cursor < new_blocks.items.size() && new_blocks.items[cursor].req == entry.req.get()) {
                added = &new_blocks.items[cursor++];
            }
            if (added == nullptr) {
                cached.req_ids.push_back(rid);
                cached.num_computed_tokens.push_back(entry.req->num_computed_tokens);
                cached.new_block_ids.emplace_back(std::nullopt);
            } else if (!added->admitted) {
                cached.req_ids.push_back(rid);
                cached.num_computed_tokens.push_back(entry.req->num_computed_tokens);
                cached.new_block_ids.emplace_back(std::move(added->blocks));
            } else if (resumed_.count(*rid)) {
                cached.req_ids.push_back(rid);
                cached.num_computed_tokens.push_back(entry.req->num_computed_tokens);
                cached.new_block_ids.emplace_back(std::move(added->blocks));
                add_unique(cached.resumed_req_ids, rid);
            } else {
                output.scheduled_new_reqs.push_back(
                    NewRequestData{rid, entry.req->num_computed_tokens, std::move(added->blocks)});
            }
        }
        output.preempted_req_ids.swap(preempted_ids_);  // (both emptied above: the lists trade places)
        output.finished_req_ids.swap(finished_ids_);
        Meta meta = connector_.build_connector_meta(output);
        preempted_ids_.clear();  // (as before the swap: whatever the build added is not carried over)
        finished_ids_.clear();
        resumed_.clear();
        if (defer_block_free_ && total > 0) {
            sched_step_seq_ += 1;
        }
        std::int64_t seq = sched_step_seq_;
        std::vector<Scheduled> entries;
        entries.reserve(scheduled.size());
        std::vector<BlockId> written;
        written.swap(spare_written_);
        for (const Entry& entry : scheduled) {
            SchedRequest& req = *entry.req;
            std::int64_t before = req.num_computed_tokens;
            std::int64_t end = before + entry.n;
            req.num_computed_tokens = end;
            req.num_in_flight_tokens += entry.n;
            if (defer_block_free_) {
                req.last_sched_seq = seq;
            }
            std::int64_t known = req.prompt_tokens + req.output_tokens;
            bool prefill = req.is_prefill_chunk = end < known + req.num_output_placeholders;
            if (!prefill) {
                prefill_landed(req);
                if (async_scheduling_) {
                    req.num_output_placeholders += 1;
                }
            }
            std::size_t first = static_cast<std::size_t>(before / bt_);
            std::size_t stop = std::min(static_cast<std::size_t>(cdiv(end, bt_)), req.blocks.size());
            for (std::size_t i = first; i < stop; ++i) {
                written.push_back(req.blocks[i]);
            }
            if (!plan_tables) {
                if (static_cast<std::int64_t>(req.hashes.size()) < known / bt_) {
                    req.block_hashes();  // (the request's own hashes grow as they do with tables)
                }
                Scheduled& made = entries.emplace_back();  // (made in place: no temporary to move)
                made.num_tokens = entry.n;
                made.computed_before = before;
                made.samples = entry.samples;
                made.owner = &req;
                continue;
            }
            std::vector<BlockHash> hashes = static_cast<std::int64_t>(req.hashes.size()) < known / bt_
                                                ? req.block_hashes().to_vector()
                                                : req.hashes.to_vector();
            if (static_cast<std::int64_t>(hashes.size()) < end / bt_) {
                // Blocks completed by output placeholders (async scheduling): named by their
                // derived hashes too, so a live worker writes their content.
                extend_hashes(hashes, req.request_id, end / bt_);
            }
            entries.push_back(
                Scheduled{req.request_id, entry.n, before, entry.samples, req.blocks, std::move(hashes), &req});
        }
        StepPlan plan{step_id, std::move(entries), static_cast<std::int64_t>(meta.sync_lookup_keys.size()),
                      meta.sync_lookup_keys, meta.flush};
        steps_.emplace(step_id, Step{std::move(scheduled), total, std::move(written)});
        return std::make_pair(std::move(plan), std::move(meta));
    }

    // ---- dormant arrivals (dormant_arrivals) ---------------------------------------------------
    // All a dormant request's record held (the rest is the defaults): only_arrived.
    struct Dormant {
        std::string request_id;
        std::int64_t prompt_tokens;
        std::optional<std::int64_t> max_tokens;
        HashList::Parts hashes;  // (no buffer: a dormant request's hashes are its alone)
        bool resumable;
        std::int64_t arrival;
        typename Connector::Dormant core;
    };
    struct Tail {
        RequestPtr live;  // null: dormant
        Dormant dormant;  // (left empty while live)
    };
    // libstdc++'s deque blocks hold 512 bytes of elements: three tails fill one (a fourth byte
    // on any of them would leave a third of each block empty).
    static_assert(sizeof(Tail) * 3 <= 512, "a queue tail grew past a third of a deque block");

    // An arrival just added, out of waiting_: dormant if it and the connector's record only
    // arrived, else live; in tail_ unless tail_ is empty and it stays live.
    void to_tail(const RequestPtr& req) {
        std::optional<typename Connector::Dormant> core;
        if (req->only_arrived()) {
            core = connector_.doze(*req);
        }
        if (!core.has_value()) {
            if (tail_.empty()) {
                waiting_.push_back(req);
            } else {
                tail_.push_back(Tail{req, Dormant{}});
            }
            return;
        }
        unlist(*req);
        order_.pop_back();  // (it was added last)
        tail_.push_back(Tail{nullptr, Dormant{req->request_id, req->prompt_tokens, req->max_tokens,
                                              req->hashes.take_parts(), req->resumable, req->arrival,
                                              std::move(*core)}});
    }

    RequestPtr wake(Dormant&& dormant) {
        auto req = std::make_shared<SchedRequest>(std::move(dormant.request_id), dormant.prompt_tokens,
                                                  dormant.max_tokens, std::vector<BlockHash>(), bt_, dormant.resumable);
        req->hashes = HashList(std::move(dormant.hashes));
        req->arrival = dormant.arrival;
        list(req);
        order_.push_back(req);
        connector_.wake(*req, std::move(dormant.core));
        return req;
    }

    void wake_in_place(Tail& item) {
        item.live = wake(std::move(item.dormant));
        item.dormant = Dormant{};
    }

    RequestPtr take_tail() {
        Tail item = std::move(tail_.front());
        tail_.pop_front();
        return item.live ? item.live : wake(std::move(item.dormant));
    }

    // An abort names a dormant request: woken in its place.
    void wake_named(const std::string& request_id) {
        for (Tail& item : tail_) {
            if (!item.live && item.dormant.request_id == request_id) {
                wake_in_place(item);
                return;
            }
        }
    }

    // vLLM's _handle_invalid_blocks for async loads; the requests to fail, in queue order.
    std::vector<std::string> invalid_blocks(const std::vector<BlockId>& invalid,
                                            const std::unordered_set<std::string>& given_up) {
        std::unordered_set<BlockId> bad(invalid.begin(), invalid.end());
        std::vector<std::string> affected;
        for (const RequestPtr& req : kv_holding_) {
            if (req->status != Status::WAITING_FOR_REMOTE_KVS) {
                continue;
            }
            if (given_up.count(req->request_id)) {  // (kvlife's drivers: a load given up at a deadline)
                req->num_computed_tokens = 0;
                affected.push_back(req->request_id);
                continue;
            }
            std::int64_t blocks = cdiv(req->num_computed_tokens, bt_);
            std::int64_t limit = std::min<std::int64_t>(blocks, static_cast<std::int64_t>(req->blocks.size()));
            for (std::int64_t index = 0; index < limit; ++index) {
                if (bad.count(req->blocks[static_cast<std::size_t>(index)])) {
                    req->num_computed_tokens = index * bt_;
                    affected.push_back(req->request_id);
                    break;
                }
            }
        }
        if (config_.fail_on_load_failure) {
            return affected;
        }
        failed_recving_.insert(affected.begin(), affected.end());
        return {};
    }

    // vLLM's _update_from_kv_xfer_finished.
    void transfers_finished(const KVConnectorOutput& output) {
        connector_.update_connector_output(output);
        std::vector<std::string> recving = output.finished_recving.value_or(std::vector<std::string>());
        std::vector<std::string> sending = output.finished_sending.value_or(std::vector<std::string>());
        std::sort(recving.begin(), recving.end());
        std::sort(sending.begin(), sending.end());
        results_ += static_cast<std::int64_t>(recving.size() + sending.size());
        for (const std::string& rid : recving) {
            RequestPtr req = request(rid);
            if (req == nullptr) {
                continue;
            }
            if (req->status == Status::WAITING_FOR_REMOTE_KVS) {
                finished_recving_.insert(rid);
            } else if (req->finished) {
                free_blocks(req);
            }
        }
        for (const std::string& rid : sending) {
            RequestPtr req = request(rid);
            if (req != nullptr && req->finished) {
                free_blocks(req);
            }
        }
    }

    SchedulerConfig config_;
    Connector& connector_;
    DeviceBlockPool pool_;
    std::int64_t bt_;
    bool async_scheduling_;
    bool defer_block_free_;
    std::unordered_map<std::string, RequestPtr> requests_;
    std::vector<RequestPtr> order_;  // requests_ in insertion order (dead entries skipped)
    std::size_t dead_in_order_ = 0;
    std::deque<RequestPtr> waiting_;
    std::deque<Tail> tail_;  // the waiting queue's rest (dormant_arrivals)
    std::int64_t next_arrival_ = 0;
    std::deque<RequestPtr> kv_holding_;
    std::vector<RequestPtr> running_;
    std::unordered_set<std::string> finished_recving_;
    std::unordered_set<std::string> failed_recving_;
    std::vector<std::string> preempted_ids_;
    std::vector<std::string> finished_ids_;
    std::unordered_set<std::string> resumed_;
    std::unordered_set<SchedRequest*> inflight_prefills_;
    std::int64_t sched_step_seq_ = 0;
    std::int64_t processed_step_seq_ = 0;
    std::deque<std::pair<std::int64_t, std::vector<BlockId>>> deferred_frees_;
    std::map<std::int64_t, Step> steps_;
    std::int64_t next_step_id_ = 0;
    std::int64_t results_ = 0;
    std::vector<BlockId> freed_scratch_;
    std::vector<Entry> spare_scheduled_;
    std::vector<BlockId> spare_written_;
    std::deque<RequestPtr> skipped_waiting_, skipped_holding_;  // admit's, empty between passes
    std::vector<BlockId> local_scratch_;  // admit's device hits of one request
    SchedulerOutput output_scratch_;
};

}  // namespace kvlife
