"""Many simulated runs: grids of config values (``kvlife sweep``) and the highest arrival rate a
stack serves within an SLO (``kvlife capacity``).

- ``points``: one run's inputs (workload, limit, a ``RunConfig``), its stable key and the row
  of columns it gives (``execute``); config keys set by their dotted names (``apply``).
- ``grid``: a TOML grid spec (and flags) expanded into points, bad values named by file, line
  and field.
- ``executors``: runs points in this process, in ``--jobs N`` local processes or on Ray, and
  hands back rows as they finish.
- ``results``: the JSON-lines results file, appended row by row, read back to resume.
- ``capacity``: SLO specs, the search for the highest scale that meets them.
- ``plots``: heatmaps and Pareto fronts of a results file; load-latency curves of a search.
"""
