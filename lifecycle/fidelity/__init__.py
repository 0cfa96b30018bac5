"""The fidelity report (``kvlife fidelity``, ``docs/fidelity.md``): how far to trust the simulator.

One idea per module:

- ``lru_replay``: an LRU replay of a Mooncake trace written independently of the engine (it
  imports nothing from kvlife), the yardstick for the engine's hit ratios;
- ``stability``: is a run at a stable operating point (TTFT p50 bound, last arrival decile
  against the first)? Reusable by any search over load;
- ``operating_point``: the search over the arrival time scale for the highest stable point;
- ``hit_ratio``, ``step_time``, ``policy_effects``: the three sections, each computing its rows;
- ``markdown``: tables, and rewriting only the generated blocks of a document;
- ``report``: the full and quick plans, running the sections, the JSON and Markdown output.
"""
