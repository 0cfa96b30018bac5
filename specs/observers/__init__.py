"""The invariant observers: one small class per invariant family, fed in order by
``pipeline.Pipeline`` (see docs/design.md, "Invariants", for the numbers)."""

from __future__ import annotations

from kvlife.specs.observers.accounting import Counters, Hits, Tiers
from kvlife.specs.observers.admission import Admission
from kvlife.specs.observers.base import Observer
from kvlife.specs.observers.blocks import Blocks
from kvlife.specs.observers.epochs import Epochs
from kvlife.specs.observers.liveness import Liveness
from kvlife.specs.observers.prefetches import Prefetches
from kvlife.specs.observers.progress import Progress
from kvlife.specs.observers.provenance import Provenance
from kvlife.specs.observers.ranks import Ranks
from kvlife.specs.observers.release import Release
from kvlife.specs.observers.sharing import Sharing
from kvlife.specs.observers.steps import Steps
from kvlife.specs.observers.stores import Stores
from kvlife.specs.observers.transitions import Transitions
from kvlife.specs.observers.views import Views
from kvlife.specs.observers.work import Work

# The order findings of one event come in: the family a bug breaks first is named first.
OBSERVERS: tuple[type[Observer], ...] = (
    Transitions,  # 1
    Blocks,  # 2
    Ranks,  # 3
    Epochs,  # 4
    Stores,  # 5
    Sharing,  # 6
    Liveness,  # 7
    Progress,  # 7
    Provenance,  # 10
    Steps,  # 11
    Admission,  # 11
    Release,  # 11
    Work,  # 12
    Hits,  # 13
    Tiers,  # 13
    Counters,  # 13 (and 8)
    Views,  # 13
    Prefetches,  # 13
)
