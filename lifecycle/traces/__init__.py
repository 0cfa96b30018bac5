"""Traces: writing and reading JSON lines, replay, validate, export, plot, explain."""
