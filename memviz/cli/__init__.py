"""The command line: ``memviz run``, ``memviz report`` and ``memviz diff``.

See docs/architecture.md for the floors and what each may import."""
