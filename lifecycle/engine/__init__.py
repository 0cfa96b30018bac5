"""The sans-IO engine: input events in, commands out (``core.Engine``), composed of
``state.EngineState``, ``lifecycle.Lifecycle``, ``transfers.Transfers`` and
``scheduler.Scheduler`` (see ``core``'s docstring for how a request goes through them)."""
