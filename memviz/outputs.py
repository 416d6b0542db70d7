"""What a recording (memviz/model/recording.py) can be turned into: the HTML
report, the exports and the notebook display, for a live
:class:`~memviz.tracker.Tracker` and a :class:`~memviz.loaded.LoadedTrace`
alike. On the top floor: it reaches down to memviz/report and memviz/export
when asked. Writing the file itself, safely, is memviz/_output_files.py's."""

from __future__ import annotations

import memviz._progress as _progress


class Outputs:
    """Mixin: to_perfetto, to_torch_snapshot, to_html and notebook display,
    for any object the exporters and the report read (Tracker, LoadedTrace)."""

    def to_perfetto(self, path: str) -> None:
        """Chrome trace JSON for Perfetto / chrome://tracing."""
        from memviz.export.perfetto import write
        with _progress.shown("memviz: to_perfetto"):  # on stderr, when a terminal and slow
            write(self, path)

    def to_torch_snapshot(self, path: str) -> None:
        """A pickle in torch.cuda.memory._dump_snapshot's format (PyTorch's memory_viz)."""
        from memviz.export.torch_snapshot import write
        with _progress.shown("memviz: to_torch_snapshot"):
            write(self, path)

    def _repr_html_(self) -> str:
        from memviz.report.notebook import tracker_repr_html
        return tracker_repr_html(self)

    def to_html(self, path: str) -> str:
        """Write the self-contained HTML report (works offline); returns the path."""
        from memviz.report.html import write
        with _progress.shown("memviz: to_html"):
            return write(self, path)

    def whatif(self, *settings: str, device_memory=None):
        """Replay the recorded PyTorch requests under other allocator settings
        (PYTORCH_CUDA_ALLOC_CONF syntax: ``"expandable_segments:True"``), on a
        card of ``device_memory`` ('24GiB', or a fraction of the recorded card:
        0.9); a list of memviz.analysis.whatif.WhatIfRow, the recorded
        settings first. Needs every request: a trace file (a tracker needs
        ``trace=``)."""
        from memviz.analysis.whatif import whatif
        with _progress.shown("memviz: whatif"):
            return whatif(self._whatif_source(), settings, device_memory)

    def _whatif_source(self):
        return self
