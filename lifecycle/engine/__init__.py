"""The sans-IO engine: input events in, commands out (``core.Engine``): vLLM 0.33's
scheduler (``scheduler.Scheduler``, ``blocks.DeviceBlockPool``) calling kvlife's connector
core (``connector.ConnectorCore``: ``state.CoreState``, ``lifecycle.Lifecycle``,
``jobs.Transfers``) only through vLLM's connector calls (``connector_api.ConnectorAPI``);
see ``core``'s docstring for how a request goes through them."""
