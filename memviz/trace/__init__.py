"""The .memviz trace file: format, fields, writer, parser and reader.

See docs/architecture.md for the floors and what each may import."""
