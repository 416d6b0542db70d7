"""Steps and diagnoses: step records and sinks, the findings and their rules.

See docs/architecture.md for the floors and what each may import."""
