// What the bind files of the connector core (bind_core_lifecycle.cpp, bind_engine.cpp) share: the
// PolicyAsker that asks a Python PolicyStack (PyPolicyAsker, bind_policy_asker.hpp), and the
// core's Stats as a dict (stats_dict: attrs.asdict(state.Stats) of the reference). A binding-only
// header: the core's plain C++ never includes it.
#pragma once

#include <pybind11/pybind11.h>

#include <array>
#include <string>
#include <unordered_map>
#include <utility>

#include "bind_core_convert.hpp"
#include "bind_policy_asker.hpp"
#include "core_lifecycle.hpp"
#include "core_request.hpp"
#include "core_state.hpp"

namespace kvlife {

namespace py = pybind11;

// attrs.asdict(stats): every counter, the two dicts in insertion order.
inline py::dict stats_dict(const Stats& s) {
    py::dict d;
    d["ticks"] = s.ticks;
    d["steps"] = s.steps;
    d["sync_lookups"] = s.sync_lookups;
    d["async_lookups"] = s.async_lookups;
    d["stale_lookup_answers"] = s.stale_lookup_answers;
    d["failed_lookups"] = s.failed_lookups;
    d["loads"] = s.loads;
    d["blocks_loaded"] = s.blocks_loaded;
    d["redundant_block_loads"] = s.redundant_block_loads;
    d["joined_blocks"] = s.joined_blocks;
    d["stores"] = s.stores;
    d["blocks_stored"] = s.blocks_stored;
    d["failed_blocks"] = s.failed_blocks;
    d["failed_loads"] = s.failed_loads;
    d["failed_stores"] = s.failed_stores;
    d["preemptions"] = s.preemptions;
    py::dict deferrals;
    for (const auto& node : s.deferrals) deferrals[py::str(node.key)] = node.value;
    d["deferrals"] = deferrals;
    py::dict warnings;
    for (const auto& node : s.warnings) warnings[py::str(node.key)] = node.value;
    d["warnings"] = warnings;
    d["rank_timeouts"] = s.rank_timeouts;
    d["duplicate_lookups"] = s.duplicate_lookups;
    d["prefetches"] = s.prefetches;
    d["blocks_prefetched"] = s.blocks_prefetched;
    d["prefetch_waits"] = s.prefetch_waits;
    d["prefetch_gave_up"] = s.prefetch_gave_up;
    d["expired_lookups"] = s.expired_lookups;
    d["reclaimed_jobs"] = s.reclaimed_jobs;
    d["late_reports"] = s.late_reports;
    d["flushed_stores"] = s.flushed_stores;
    return d;
}

}  // namespace kvlife
