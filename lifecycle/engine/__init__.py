"""The sans-IO engine: input events in, commands out (``core.Engine``)."""
