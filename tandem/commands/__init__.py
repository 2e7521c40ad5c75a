"""CLI commands: one module each, with ``configure(parser)`` and ``run(args) -> int``."""
