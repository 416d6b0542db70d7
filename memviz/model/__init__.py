"""The data model: snapshots, allocations, frames and tracebacks, statistics,
segments, step records, filters, and the :class:`Recording` protocol that a
live tracker and a loaded trace both implement. Imports nothing above it.

See docs/architecture.md for the floors and what each may import."""
