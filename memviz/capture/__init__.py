"""Capture, the Python side: finding libcupti (cupti.py), call sites
(callsite.py), the device and NVML reader (device.py), which tracker is
running (running.py), and the floors the tracker composes: the views of the
C store (store.py) and the reading methods over them (reading.py), thread
names (threads.py), whether capture can run and the fork rule (availability.py), labels (labels.py),
the track() options (options.py), what nested trackers share (nesting.py)
and get_traced_memory / reset_peak (traced.py). Imports only the bottom
floor, the model and the C core; nothing here imports the tracker.

See docs/architecture.md for the floors and what each may import."""
