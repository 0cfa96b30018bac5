// A mirror of lifecycle/engine/worker_book.py (WorkerBook.add, hold, done, _read_done, take,
// busy; OutputAggregator.aggregate, _count), statement for statement.
#include "worker_book.hpp"

#include <algorithm>

namespace kvlife {

namespace {

BookJobKind kind_tag(const std::string& kind) {
    if (kind == "load") {
        return BookJobKind::LOAD;
    }
    if (kind == "store") {
        return BookJobKind::STORE;
    }
    return BookJobKind::OTHER;
}

// Python's ``ids.add(job_id)``.
void set_add(WorkerBook::JobIds& ids, int64_t job_id) {
    if (std::find(ids.begin(), ids.end(), job_id) == ids.end()) {
        ids.push_back(job_id);
    }
}

// Python's ``ids.discard(job_id)``.
void set_discard(WorkerBook::JobIds& ids, int64_t job_id) {
    auto it = std::find(ids.begin(), ids.end(), job_id);
    if (it != ids.end()) {
        ids.erase(it);
    }
}

template <class T>
void sort_unique(std::vector<T>& items) {
    std::sort(items.begin(), items.end());
    items.erase(std::unique(items.begin(), items.end()), items.end());
}

}  // namespace

void WorkerBook::add(int64_t job_id, const std::string& kind, const std::string& request_id,
                     const std::vector<BlockHash>& hashes, const std::vector<int64_t>& device_blocks,
                     std::optional<int64_t> after) {
    add(job_id, kind, request_id, hashes.data(), hashes.size(), device_blocks.data(), device_blocks.size(), after);
}

void WorkerBook::add(int64_t job_id, const std::string& kind, const std::string& request_id,
                     const BlockHash* hashes, std::size_t n_hashes, const int64_t* device_blocks,
                     std::size_t n_device_blocks, std::optional<int64_t> after) {
    JobEntry& entry = *jobs_.try_emplace(job_id).first;  // assigned in full: a reused node holds old values
    entry.kind = kind;
    entry.tag = kind_tag(kind);
    entry.request_id = request_id;
    entry.moves.clear();
    std::size_t n = std::min(n_hashes, n_device_blocks);  // zip(strict=False)
    entry.moves.reserve(n);
    for (std::size_t i = 0; i != n; ++i) {
        entry.moves.emplace_back(hashes[i], device_blocks[i]);
    }
    if (after.has_value()) {
        // Looked up after the job itself went in, as in Python (a job ``after`` itself joins itself).
        const JobEntry* owner = jobs_.find(*after);
        if (owner != nullptr) {  // (an owner this rank already finished has nothing left to read)
            set_add(readers_[*after], job_id);
            owner_request_set(*after, owner->request_id);
            join_of_[job_id] = *after;
        }
    }
    if (entry.tag != BookJobKind::OTHER) {
        auto& book = entry.tag == BookJobKind::LOAD ? loads_of_ : stores_of_;
        auto [ids, inserted] = book.try_emplace(request_id);
        if (inserted) {
            ids->clear();  // a reused node's old set
        }
        set_add(*ids, job_id);
    }
}

void WorkerBook::owner_request_set(int64_t owner, const std::string& request_id) {
    auto [it, inserted] = owner_request_.try_emplace(owner, request_id);
    if (!inserted) {
        if (it->second == request_id) {
            return;
        }
        auto old = owner_count_.find(it->second);
        if (--old->second == 0) {
            owner_count_.erase(old);
        }
        it->second = request_id;
    }
    ++owner_count_[request_id];
}

void WorkerBook::hold(const std::vector<std::string>& request_ids) {
    for (const std::string& rid : request_ids) {
        if (held_.insert(rid).second) {
            holds_.push_back(rid);
        }
    }
}

void WorkerBook::done(int64_t job_id, const std::vector<BlockHash>& failed) {
    const JobEntry* entry = jobs_.find(job_id);
    if (entry == nullptr) {
        return;
    }
    // Python pops the entry first; nothing below reads ``jobs``, so it goes last here.
    finish(job_id, *entry, failed);
    jobs_.erase(job_id);
}

void WorkerBook::finish(int64_t job_id, const JobEntry& entry, const std::vector<BlockHash>& failed) {
    auto join = join_of_.find(job_id);
    if (join != join_of_.end()) {
        int64_t owner = join->second;
        join_of_.erase(join);
        read_done(owner, job_id);
    }
    if (entry.tag == BookJobKind::LOAD && !failed.empty()) {
        bad_.assign(failed.begin(), failed.end());
        std::sort(bad_.begin(), bad_.end());
        for (const auto& [hash, device] : entry.moves) {
            if (std::binary_search(bad_.begin(), bad_.end(), hash)) {
                invalid_.push_back(device);
            }
        }
    }
    if (entry.tag == BookJobKind::OTHER) {
        return;
    }
    auto& book = entry.tag == BookJobKind::LOAD ? loads_of_ : stores_of_;
    JobIds* ids = book.find(entry.request_id);
    if (ids == nullptr) {
        return;
    }
    set_discard(*ids, job_id);
    if (ids->empty()) {
        book.erase(entry.request_id);
        if (entry.tag == BookJobKind::LOAD) {
            if (is_owner_request(entry.request_id)) {
                read_waiting_.insert(entry.request_id);  // joins still copy its blocks
            } else {
                recving_.push_back(entry.request_id);
            }
        }
    }
}

void WorkerBook::read_done(int64_t owner, int64_t join) {
    auto readers = readers_.find(owner);
    if (readers == readers_.end()) {
        return;
    }
    set_discard(readers->second, join);
    if (!readers->second.empty()) {
        return;
    }
    readers_.erase(readers);
    // Python's ``_owner_request.pop(owner)``: present, as it is set with every reader added.
    auto it = owner_request_.find(owner);
    std::string rid = std::move(it->second);
    owner_request_.erase(it);
    auto count = owner_count_.find(rid);
    if (--count->second == 0) {
        owner_count_.erase(count);
    }
    if (read_waiting_.count(rid) != 0 && !is_owner_request(rid)) {
        read_waiting_.erase(rid);
        recving_.push_back(std::move(rid));
    }
}

void WorkerBook::take(KVOutput& out) {
    out.sending.clear();
    // Held requests with no store left on this rank leave ``holds``; the rest keep their order.
    auto kept = holds_.begin();
    for (auto it = holds_.begin(); it != holds_.end(); ++it) {
        if (stores_of_.find(*it) == nullptr) {
            held_.erase(*it);
            out.sending.push_back(std::move(*it));
        } else {
            if (kept != it) {
                *kept = std::move(*it);
            }
            ++kept;
        }
    }
    holds_.erase(kept, holds_.end());
    std::sort(out.sending.begin(), out.sending.end());
    out.recving.clear();
    out.recving.swap(recving_);
    sort_unique(out.recving);
    out.invalid.clear();
    out.invalid.swap(invalid_);
    sort_unique(out.invalid);
}

KVOutput WorkerBook::take() {
    KVOutput out;
    take(out);
    return out;
}

KVOutput OutputAggregator::aggregate(const std::vector<KVOutput>& outputs) {
    KVOutput combined;
    aggregate(outputs, combined);
    return combined;
}

void OutputAggregator::aggregate(const std::vector<KVOutput>& outputs, KVOutput& combined) {
    combined.recving.clear();
    combined.sending.clear();
    combined.invalid.clear();
    for (const KVOutput& output : outputs) {
        count(recving_, output.recving, combined.recving);
    }
    for (const KVOutput& output : outputs) {
        count(sending_, output.sending, combined.sending);
    }
    for (const KVOutput& output : outputs) {
        combined.invalid.insert(combined.invalid.end(), output.invalid.begin(), output.invalid.end());
    }
    sort_unique(combined.invalid);
}

void OutputAggregator::count(std::unordered_map<std::string, int64_t>& counts,
                             const std::vector<std::string>& finished, std::vector<std::string>& done) {
    sorted_.clear();
    for (const std::string& rid : finished) {
        sorted_.push_back(&rid);
    }
    std::sort(sorted_.begin(), sorted_.end(), [](const std::string* a, const std::string* b) { return *a < *b; });
    for (const std::string* rid : sorted_) {
        auto it = counts.find(*rid);
        int64_t seen = (it == counts.end() ? 0 : it->second) + 1;
        if (seen == world_size) {
            if (it != counts.end()) {
                counts.erase(it);
            }
            done.push_back(*rid);
        } else if (it == counts.end()) {
            counts.emplace(*rid, seen);
        } else {
            it->second = seen;
        }
    }
}

}  // namespace kvlife
