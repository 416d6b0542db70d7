"""Capture, the Python side: the capture session, one per process
(session.py: the running capture's options, the CUPTI subscription, the
running trackers and their windows, nesting, the fork and exit hooks, and
the events its subscribers hear); finding libcupti (cupti.py), call sites
(callsite.py), the device and NVML reader (device.py), the views of the C
store (store.py) and the reading methods over them (reading.py), thread
names (threads.py), whether capture can run and the fork rule
(availability.py), labels (labels.py), the track() options (options.py),
per-rank file names (rank_files.py) and get_traced_memory / reset_peak
(traced.py). Imports only the bottom floor, the model and the C core;
nothing here imports the tracker.

See docs/architecture.md for the floors and what each may import."""
