"""Capture, the Python side: finding libcupti, call sites, the device and NVML
reader, and which tracker is running. Imports only the model and the C core.

See docs/architecture.md for the floors and what each may import."""
