"""shared-loads: never load a block twice; join the load already bringing it in.

vLLM's OffloadingConnector defers the whole request while another request loads any of
its hit blocks (``defer-while-loading``), which convoys requests behind each other (up to
12x TTFT and -40 % throughput, vLLM #44294). Here the request joins the in-flight load:
the engine retains the device blocks that load is filling, waits on that job, starts its
own load only for the blocks nobody is loading, and runs as soon as all of them land.
"""

from __future__ import annotations

from kvlife.policies.base import Admission, Decision, EngineView, LoadView, RequestView


class SharedLoads:
    name = "shared-loads"

    def admission(self, req: RequestView, load: LoadView, engine: EngineView) -> Decision[Admission] | None:
        if not load.in_flight:
            return None
        owners = sorted({rid for _, rid in load.in_flight})
        own = load.external_hit_blocks - len(load.in_flight)
        return Decision(
            "join",
            f"joined {len(load.in_flight)} of {load.external_hit_blocks} hit blocks in flight for "
            f"{', '.join(owners[:3])}{'...' if len(owners) > 3 else ''}; loading the other {own}",
        )
