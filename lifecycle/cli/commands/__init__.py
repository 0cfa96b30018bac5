"""Subcommands beyond the core ones: each module here exposes ``register(sub)``.

``kvlife.lifecycle.cli.main`` imports every module of this package in name order and lets it add
its parser, so a new command is one new file.
"""
