"""Drivers of the one engine: the simulator (virtual time) and the live runtime (real bytes)."""
