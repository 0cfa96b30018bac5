"""Built-in policies by name, with one line each for ``kvlife policies``."""

from __future__ import annotations

from collections.abc import Callable

from kvlife.policies.async_lookup import AsyncLookup
from kvlife.policies.baseline import Baseline
from kvlife.policies.defer_while_loading import DeferWhileLoading
from kvlife.policies.early_prefetch import EarlyLookup, EarlyPrefetch
from kvlife.policies.keep_lookup_answers import KeepLookupAnswers
from kvlife.policies.prefetch_patience import PrefetchBestEffort, PrefetchTimeout, PrefetchWaitComplete
from kvlife.policies.shared_loads import SharedLoads
from kvlife.policies.stores import NaiveStoresUnsafe
from kvlife.policies.sync_lookup import SyncLookup

BUILTIN: dict[str, Callable[[], object]] = {
    "baseline": Baseline,
    "sync-lookup": SyncLookup,
    "async-lookup": AsyncLookup,
    "keep-lookup-answers": KeepLookupAnswers,
    "early-lookup": EarlyLookup,
    "early-prefetch": EarlyPrefetch,
    "shared-loads": SharedLoads,
    "defer-while-loading": DeferWhileLoading,
    "naive-stores-unsafe": NaiveStoresUnsafe,
    "prefetch-best-effort": PrefetchBestEffort,
    "prefetch-wait-complete": PrefetchWaitComplete,
    "prefetch-timeout": PrefetchTimeout,
}

DESCRIPTIONS: dict[str, str] = {
    "baseline": "sync lookup, admit all (no load sharing), store confirmed blocks only, hold while sending",
    "sync-lookup": "lookup inline on the scheduler tick, re-paid each time a waiting request is considered",
    "async-lookup": "lookup on a background worker; request waits in lookup_pending (Mooncake, vLLM #45659)",
    "keep-lookup-answers": "reuse an async answer until admitted instead of looking up again (staleness traced)",
    "early-lookup": "lookup at arrival, even while the token budget is saturated (skips resumable requests)",
    "early-prefetch": "early-lookup plus a pull of disk/remote hits into the host tier (LMCache on_new_request)",
    "shared-loads": "join an in-flight load of the same blocks, load only the rest: 0 redundant loads",
    "defer-while-loading": "defer the whole request while another loads its blocks (vLLM plain; convoys)",
    "naive-stores-unsafe": "UNSAFE: store up to computed tokens incl. in-flight steps (for comparison/tests)",
    "prefetch-best-effort": "never wait for a prefetch: compute what has not landed (SGLang HiCache)",
    "prefetch-wait-complete": "wait until the whole prefetch has landed (SGLang HiCache)",
    "prefetch-timeout": "wait up to 1 s + 0.25 s per 1k tokens, capped at 3 s, then compute (SGLang HiCache)",
}

# Names that were built-in policies and became the baseline's documented behaviour (issue 26:
# each changed nothing the baseline did not already do). Naming one is an error that says so.
RETIRED: dict[str, str] = {
    "placeholder-safe-stores": "the baseline stores only blocks whose every token a step output confirmed "
                               "(never a placeholder); naive-stores-unsafe is the unsafe counterpart",
    "hold-while-sending": "the baseline holds a finished request in sending until every rank reported its stores",
}
