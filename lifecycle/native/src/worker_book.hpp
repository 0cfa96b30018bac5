// What a worker reports with each step output, and how vLLM combines the workers' reports:
// a mirror of WorkerBook and OutputAggregator (lifecycle/engine/worker_book.py).
//
// Orders (Python's sets have none that holds across processes; these are deterministic):
// - ``jobs``, ``loads_of``, ``stores_of`` iterate as Python's dicts do (first insertion; a key
//   removed and added again goes to the end); the job ids in one ``loads_of`` / ``stores_of``
//   entry are in the order they were first added; ``holds`` in the order first held.
// - ``take`` returns each of its three sets sorted ascending (request ids by byte, which for
//   UTF-8 is Python's code-point order), without repeats.
// - ``aggregate`` returns the finished request ids in Python's order (rank by rank, each rank's
//   ids sorted), repeats and all, and the invalid device blocks sorted ascending, no repeats.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "ordered_dict.hpp"
#include "ranks.hpp"

namespace kvlife {

enum class BookJobKind { LOAD, STORE, OTHER };  // "load", "store", anything else (no request's book); not core_state.hpp's JobKind

struct JobEntry {
    std::string kind;
    std::string request_id;
    std::vector<std::pair<BlockHash, int64_t>> moves;  // (block hash, device block)
    BookJobKind tag;
};

// One rank's report (``WorkerBook.take``), or the combined one (``OutputAggregator.aggregate``).
struct KVOutput {
    std::vector<std::string> recving;  // finished_recving
    std::vector<std::string> sending;  // finished_sending
    std::vector<int64_t> invalid;      // invalid_block_ids
};

// One rank's view: jobs it was given, requests it may report finished.
class WorkerBook {
  public:
    using JobIds = std::vector<int64_t>;  // a set: no repeats, in first-added order

    // A job came with a step's metadata (``after``: a join, copying that load's blocks).
    // ``moves`` pairs ``hashes`` with ``device_blocks`` up to the shorter of the two.
    void add(int64_t job_id, const std::string& kind, const std::string& request_id,
             const std::vector<BlockHash>& hashes, const std::vector<int64_t>& device_blocks,
             std::optional<int64_t> after = std::nullopt);
    // The same from arrays (a caller with its own storage builds no vectors).
    void add(int64_t job_id, const std::string& kind, const std::string& request_id, const BlockHash* hashes,
             std::size_t n_hashes, const int64_t* device_blocks, std::size_t n_device_blocks,
             std::optional<int64_t> after = std::nullopt);
    // Finished requests whose blocks the scheduler holds until this rank's stores end.
    void hold(const std::vector<std::string>& request_ids);
    // This rank finished ``job_id`` (``failed``: its blocks that failed).
    void done(int64_t job_id, const std::vector<BlockHash>& failed = {});
    // What this rank reports with the step output (each set sorted, see above).
    KVOutput take();
    // The same into ``out`` (its old contents dropped), swapping buffers: no allocation.
    void take(KVOutput& out);
    bool busy() const { return !jobs_.empty(); }

    const OrderedDict<int64_t, JobEntry>& jobs() const { return jobs_; }
    const OrderedDict<std::string, JobIds>& loads_of() const { return loads_of_; }
    const OrderedDict<std::string, JobIds>& stores_of() const { return stores_of_; }
    const std::vector<std::string>& holds() const { return holds_; }

  private:
    void finish(int64_t job_id, const JobEntry& entry, const std::vector<BlockHash>& failed);
    void read_done(int64_t owner, int64_t join);
    void owner_request_set(int64_t owner, const std::string& request_id);
    bool is_owner_request(const std::string& request_id) const { return owner_count_.count(request_id) != 0; }

    OrderedDict<int64_t, JobEntry> jobs_;
    OrderedDict<std::string, JobIds> loads_of_;
    OrderedDict<std::string, JobIds> stores_of_;
    std::vector<std::string> holds_;  // Python's ``holds`` in first-held order
    std::unordered_set<std::string> held_;  // its members
    std::vector<std::string> recving_;  // repeats allowed; take sorts and drops them
    std::vector<int64_t> invalid_;      // likewise
    // Joins in flight by the load they copy from, and that load's request.
    std::unordered_map<int64_t, JobIds> readers_;
    std::unordered_map<int64_t, std::string> owner_request_;
    std::unordered_map<std::string, int64_t> owner_count_;  // request -> owners in owner_request_ (> 0)
    std::unordered_map<int64_t, int64_t> join_of_;  // join job -> the load it copies from
    std::unordered_set<std::string> read_waiting_;  // loads all done, joins still reading their blocks
    std::vector<BlockHash> bad_;  // scratch: ``done``'s failed hashes, sorted
};

// vLLM's KVOutputAggregator for the transfer results: a request is in the combined
// finished_recving (finished_sending) once every one of ``world_size`` ranks has reported it
// there; failed blocks are the union over ranks. ``world_size`` is not checked (as in Python).
class OutputAggregator {
  public:
    explicit OutputAggregator(int64_t ranks) : world_size(ranks) {}

    // Each output's lists are read as sets (sorted here before counting, as Python does).
    KVOutput aggregate(const std::vector<KVOutput>& outputs);
    // The same into ``combined`` (its old contents dropped, its buffers reused).
    void aggregate(const std::vector<KVOutput>& outputs, KVOutput& combined);

    int64_t world_size;

  private:
    void count(std::unordered_map<std::string, int64_t>& counts, const std::vector<std::string>& finished,
               std::vector<std::string>& done);

    std::unordered_map<std::string, int64_t> recving_;
    std::unordered_map<std::string, int64_t> sending_;
    std::vector<const std::string*> sorted_;  // scratch
};

}  // namespace kvlife
