"""The ``kvlife`` command line: ``main`` parses, each file in ``commands/`` adds a subcommand."""
