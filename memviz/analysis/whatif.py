"""What if: a recorded run's PyTorch requests replayed, in order and on
their streams, through a model of PyTorch's native caching allocator under
other settings (src/whatif.h), to rank remedies without re-running.

A setting is written as PyTorch reads ``PYTORCH_CUDA_ALLOC_CONF``
(``"expandable_segments:True,max_split_size_mb:128"``), with a card's memory
(``device_memory="24GiB"``) or a fraction of the recorded card
(``device_memory=0.9``: ``torch.cuda.set_per_process_memory_fraction``).
The first row is always the recorded settings replayed: its reserved peak
against the recorded one checks the model on every use.

What the replay keeps from the recording: the lines, sizes, streams and
order of the requests, and the memory outside PyTorch. What it cannot
change: which tensors exist (AMP, checkpointing, batch size: out of scope).
What it does not model: see :data:`NOT_MODELLED`.

Imports the trace floor and below (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import memviz._core as _core
from memviz._errors import InvalidArgument
from memviz._units import format_size, parse_size
from memviz.model.lines import backward_frame, location
from memviz.model.snapshot import decode_label
from memviz.model.traceback import Frame, Traceback
from memviz.torch import rules as _rules

__all__ = ["WhatIfRow", "WhatIfOOM", "whatif", "parse_setting", "NOT_MODELLED", "rows_text", "rows_json"]

MiB = 1 << 20

#: the allocator's features the model leaves out (said with every result)
NOT_MODELLED = (
    "which tensors exist is the recording's (AMP, checkpointing, batch size are out of scope)",
    "frees are taken when recorded (events of other streams, recordStream, are not replayed)",
    "a tensor's stream: PyTorch's allocate() does not say it, so tensors are replayed on one stream "
    "(raw allocations, caching_allocator_alloc, keep theirs)",
    "CUDA graph private pools and the cudaMallocAsync backend",
    "where the driver puts a segment (PyTorch breaks ties between equal free blocks by address): the "
    "recorded address while a setting makes the recording's segments, then the placement the H200's "
    "driver was seen to use; memory outside PyTorch and from before the recording does not take part",
    "expandable segments: a stream's segment spans 1 TiB of address space (PyTorch's spans 9/8 of the "
    "card, which a run rarely fills)",
)

#: keys of PYTORCH_CUDA_ALLOC_CONF the model follows
_MODELLED = {"max_split_size_mb", "roundup_power2_divisions", "expandable_segments",
             "garbage_collection_threshold"}
#: keys that do not change device memory (accepted, said so)
_NO_EFFECT = {"release_lock_on_cudamalloc", "pinned_use_cuda_host_register", "pinned_num_register_threads",
              "pinned_use_background_threads", "pinned_reserve_segment_size_mb", "pinned_use_host_register",
              "graph_capture_record_stream_reuse"}
#: keys refused, with the reason
_REFUSED = {
    "backend": "the cudaMallocAsync backend is the driver's own pool, which the model does not follow",
    "max_non_split_rounding_mb": "the model keeps PyTorch's default of 20 MiB",
    "per_process_memory_fraction": "give the fraction as device_memory= (--device-memory 0.9)",
}


@dataclass(frozen=True)
class WhatIfOOM:
    """The first request the card or the fraction would refuse (after the
    allocator's retries): when, what, where, and what was live."""
    at_ns: int
    requested: int
    rounded: int
    stream: int
    line: str
    reserved: int
    allocated: int
    outside: int
    top: Tuple[Tuple[str, int], ...]  # (line, live bytes), the largest first
    #: a request of the backward pass: its autograd node and forward line
    #: (``line`` is then the line that called backward(), where PyTorch raises)
    backward: Optional[str] = None

    def to_dict(self) -> Dict[str, Any]:
        return {"at_ns": self.at_ns, "requested": self.requested, "rounded": self.rounded,
                "stream": self.stream, "line": self.line, "backward": self.backward,
                "reserved": self.reserved, "allocated": self.allocated, "outside": self.outside,
                "top": [{"line": ln, "bytes": b} for ln, b in self.top]}


@dataclass(frozen=True)
class WhatIfRow:
    """One setting's prediction on one device (plain data, for a notebook's sweep)."""
    setting: str               # the alloc conf as given ("" : PyTorch's defaults)
    device_memory: Optional[str]
    device: int
    recorded: bool             # the row of the recorded settings
    reserved_peak: int
    allocated_at_peak: int
    unused_at_peak: int
    largest_free_at_peak: int
    peak_at_ns: Optional[int]
    allocated_peak: int
    cuda_mallocs: int
    retries: int
    flushes: int
    limit: Optional[int]       # bytes PyTorch may reserve (the card less what else it holds, or the fraction)
    headroom: Optional[int]    # limit - reserved_peak (negative: it does not fit)
    oom: Optional[WhatIfOOM]
    notes: Tuple[str, ...] = field(default=())

    @property
    def label(self) -> str:
        name = self.setting or "defaults"
        if self.device_memory:
            name += f" on {self.device_memory}"
        return name + (" (recorded)" if self.recorded else "")

    def to_dict(self) -> Dict[str, Any]:
        d = {k: getattr(self, k) for k in ("setting", "device_memory", "device", "recorded", "reserved_peak",
                                           "allocated_at_peak", "unused_at_peak", "largest_free_at_peak",
                                           "peak_at_ns", "allocated_peak", "cuda_mallocs", "retries",
                                           "flushes", "limit", "headroom")}
        d["oom"] = self.oom.to_dict() if self.oom else None
        d["notes"] = list(self.notes)
        return d


def parse_setting(conf: str) -> Tuple[_rules.Settings, float, Tuple[str, ...]]:
    """(rules, garbage_collection_threshold, notes) from an alloc conf in
    PyTorch's syntax. Raises InvalidArgument for what PyTorch would refuse
    or the model cannot follow."""
    if not isinstance(conf, str):
        raise InvalidArgument(f"a what-if setting is a string such as 'expandable_segments:True', "
                              f"got {type(conf).__name__}")
    notes: List[str] = []
    gc = 0.0
    for key, value in _rules._split(conf):
        if key in _REFUSED:
            raise InvalidArgument(f"what-if cannot replay {key}:{value}: {_REFUSED[key]}")
        if key in _NO_EFFECT:
            notes.append(f"{key} does not change device memory: left out")
            continue
        if key not in _MODELLED:
            raise InvalidArgument(f"{key!r} is not a PyTorch allocator setting (in {conf!r}); the model "
                                  f"follows {', '.join(sorted(_MODELLED))}")
        try:
            if key == "max_split_size_mb":
                mb = float(value)
                if mb <= 20:
                    raise InvalidArgument(f"max_split_size_mb:{value}: PyTorch wants more than 20")
            elif key == "garbage_collection_threshold":
                gc = float(value)
                if not 0.0 < gc < 1.0:
                    raise InvalidArgument(f"garbage_collection_threshold:{value}: PyTorch wants a number "
                                          "between 0 and 1 (exclusive)")
            elif key == "expandable_segments":
                if value.strip().lower() not in ("true", "false"):
                    raise InvalidArgument(f"expandable_segments:{value}: PyTorch wants True or False")
            elif key == "roundup_power2_divisions":
                for n in _rules._divisions(value):
                    if n and (n & (n - 1)):
                        raise InvalidArgument(f"roundup_power2_divisions:{value}: each number must be a "
                                              "power of two")
        except ValueError as e:
            raise InvalidArgument(f"{key}:{value} cannot be read ({e}) in {conf!r}") from None
    settings = _rules.parse(conf)
    if gc and settings.expandable:
        notes.append("garbage_collection_threshold does not apply to expandable segments")
    return settings, gc, tuple(notes)


def _recorded(trace: Any) -> Dict[int, Dict[str, Any]]:
    """{device: END's pytorch_peak entry} (alloc_conf, total_memory, memory_stats)."""
    from memviz.model.pytorch import END_KEY
    end = getattr(trace, "end", None) or {}
    out = {}
    for dev, entry in (end.get(END_KEY) or {}).items():
        try:
            out[int(dev)] = entry if isinstance(entry, dict) else {}
        except ValueError:
            continue
    return out


def _context(trace: Any) -> Dict[int, int]:
    """{device: bytes the process held beyond what memviz saw, when it stopped}
    (the CUDA context, loaded kernels): carried over to every setting."""
    out: Dict[int, int] = {}
    held = getattr(trace, "outside", None) or {}
    try:
        totals = trace.totals()
    except Exception:  # noqa: BLE001
        totals = {}
    for dev, pair in held.items():
        try:
            out[int(dev)] = max(int(pair[0]) - int(totals.get(int(dev), {}).get("current", 0)), 0)
        except (TypeError, ValueError, IndexError):
            continue
    return out


def _device_memory(value: Any, total: Optional[int]) -> Tuple[Optional[int], Optional[int], str]:
    """(card bytes or None, fraction limit or None, how written) of device_memory=."""
    if value is None:
        return None, None, ""
    if isinstance(value, float) or (isinstance(value, str) and value.strip().replace(".", "", 1).isdigit()
                                    and "." in value):
        f = float(value)
        if not 0.0 < f <= 1.0:
            raise InvalidArgument(f"device_memory={value!r}: a fraction is between 0 and 1, or give a "
                                  "size such as '24GiB'")
        if not total:
            raise InvalidArgument(f"device_memory={value!r} is a fraction of the recorded card, but this "
                                  "trace does not record the card's memory (a trace of an older memviz, or "
                                  "no GPU): give a size instead, such as '24GiB'")
        return None, int(f * total), f"{f:g} of {format_size(total)}"
    try:
        size = parse_size(value)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(f"device_memory={value!r}: give a size such as '24GiB' or a fraction such "
                              f"as 0.9 ({e})") from None
    if size <= 0:
        raise InvalidArgument(f"device_memory={value!r}: the card needs some memory")
    return size, None, format_size(size)


def whatif(trace: Any, settings: Sequence[str] = (), device_memory: Union[None, str, float] = None
           ) -> List[WhatIfRow]:
    """Replay ``trace``'s PyTorch requests under the recorded settings and
    each of ``settings``; one :class:`WhatIfRow` per setting and device,
    the recorded settings first. ``device_memory``: a card's size ('24GiB')
    or a fraction (0.9) of the recorded card, for every row."""
    from memviz.trace import format as F

    if isinstance(settings, str):
        settings = [settings]
    recorded = _recorded(trace)
    confs = {d: e.get("alloc_conf") for d, e in recorded.items() if isinstance(e.get("alloc_conf"), str)}
    rec_conf = next(iter(confs.values()), None)
    base_notes: List[str] = []
    if rec_conf is None:
        rec_conf = ""
        base_notes.append("the trace does not record its allocator settings (an older memviz): PyTorch's "
                          "defaults are taken as the recorded ones")
    parsed = []
    for conf in [rec_conf, *settings]:
        try:
            parsed.append((conf, *parse_setting(conf)))
        except InvalidArgument:
            if conf is rec_conf:  # the recording's own: replayed as far as it can be
                parsed.append((conf, _rules.parse(conf), 0.0, ("some recorded settings are not modelled",)))
            else:
                raise
    totals = {d: e.get("total_memory") for d, e in recorded.items() if isinstance(e.get("total_memory"), int)}
    total = next(iter(totals.values()), None)
    card, fraction, dm_text = _device_memory(device_memory, total)
    context = _context(trace)
    ctx = max(context.values(), default=0)
    if card is not None and not context:
        base_notes.append("the memory the process held beyond memviz's record (the CUDA context) is not "
                          "known for this trace: leave a margin for it in the card's size")
    # the card each model allocates on: the one given, else the recorded one; less what the
    # process held beyond memviz's record (the CUDA context), carried over as recorded
    on = card if card is not None else (total if fraction is None else None)
    args = []
    for conf, s, gc, _notes in parsed:
        args.append((s.max_split or 0, list(s.divisions), bool(s.expandable), float(gc),
                     fraction or 0, max(on - ctx, 1) if on is not None else 0))
    width = getattr(trace, "event_width", None) or _core.EVENT_SIZE
    import os
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # the recorded settings first: the pass reads a recording made with expandable segments by them
    wi = _core.WhatIf(trace._start_ns(), width, args, threads=max(1, min(len(args), cores)))
    for _rp, payload, count, layout in trace._again("what if"):
        wi.feed(payload, F.EVENTS_HEAD.size, count, layout)
    res = wi.results()
    rows: List[WhatIfRow] = []
    for k, (conf, s, gc, notes) in enumerate(parsed):
        for dev, r in sorted(res["settings"][k].items()):
            rec = res["recorded"].get(dev, {})
            if fraction is not None:
                limit, headroom = fraction, fraction - r["reserved_peak"]
            elif on is not None and r["min_room"] != 2 ** 63 - 1:
                headroom = r["min_room"]  # the card less what was held, at its least
                limit = r["reserved_peak"] + headroom
            else:
                limit = headroom = None
            row_notes = list(base_notes if k == 0 else ()) + list(notes)
            if k == 0 and card is None and fraction is None:  # the recorded run, on its own card
                # under expandable segments PyTorch's memory is its mapped granules (whatif_pass.h)
                real = rec.get("reserved_peak_expandable" if s.expandable else "reserved_peak")
                if real is not None and real != r["reserved_peak"]:
                    row_notes.append(f"the recorded reserved peak was {format_size(real)} "
                                     f"({real:,} B): the model is off by "
                                     f"{(r['reserved_peak'] - real) / max(real, 1):+.1%} on this run")
            if gc and fraction is None:
                row_notes.append("garbage_collection_threshold acts only with a memory fraction "
                                 "(device_memory=0.9): no effect here, as in PyTorch")
            rows.append(WhatIfRow(
                setting=conf, device_memory=dm_text or None, device=dev, recorded=k == 0,
                reserved_peak=r["reserved_peak"], allocated_at_peak=r["allocated_at_peak"],
                unused_at_peak=r["reserved_peak"] - r["allocated_at_peak"],
                largest_free_at_peak=r["largest_free_at_peak"], peak_at_ns=r["peak_ts"] or None,
                allocated_peak=r["allocated_peak"], cuda_mallocs=r["mallocs"], retries=r["retries"],
                flushes=r["flushes"], limit=limit, headroom=headroom,
                oom=_oom(trace, r["oom"]),
                notes=tuple(row_notes)))
    return rows


def _traceback(trace: Any, stack: int) -> Optional[Traceback]:
    """The traceback of a stack id of the recording; None: not resolved."""
    try:
        frames = trace._resolve({stack}).get(stack) if stack else None
    except Exception:  # noqa: BLE001 - a line for the report
        frames = None
    if not frames:
        return None
    # raw (file, line, name) from the innermost out, as the C core walks (model/rows.py)
    out = [Frame(f or "<unknown>", max(ln or 0, 0), n or "") for f, ln, n in (tuple(x) for x in frames)]
    return Traceback(out[::-1], getattr(trace, "frame_filter", None))


def _user_frame(trace: Any, stack: int) -> Tuple[bool, Optional[Frame]]:
    """(resolved?, the user's frame or None) of a stack id of the recording."""
    tb = _traceback(trace, stack)
    return (False, None) if tb is None else (True, tb.user_frame)


def _backward_line(trace: Any, label: int) -> Optional[str]:
    """A request made with no Python frames in the backward: its node's
    forward line, as every other view names it (``train.py:15 (backward:
    AddmmBackward0)``); None when the label names no node."""
    names = getattr(trace, "_labels", None)
    if not label or not isinstance(names, dict):
        return None
    _user, node, forward = decode_label(names.get(label))
    if not node:
        return None
    if forward and forward[0] == "#":  # labelled in the callback: the forward line's stack id
        try:
            _ok, uf = _user_frame(trace, int(forward[1:]))
        except ValueError:
            uf = None
        forward = f"{uf.filename}:{uf.lineno}" if uf is not None else None
    return location(backward_frame(node, forward))


#: (file suffix, function) of PyTorch's ways into the autograd engine; the
#: first gradient is asked for inside them, on the calling thread
_BACKWARD_ENTRIES = (("torch/autograd/__init__.py", "backward"), ("torch/autograd/__init__.py", "grad"),
                     ("torch/_tensor.py", "backward"), ("torch/autograd/graph.py", "_engine_run_backward"))


def _backward_caller(trace: Any, caller: int) -> Optional[Frame]:
    """The user's frame of stack ``caller`` (the last request with Python
    frames before a backward's request) when that stack is inside one of
    PyTorch's ways into the autograd engine: the line that called
    backward(), where PyTorch raises the backward's out-of-memory error.
    None otherwise (another thread's request came last)."""
    tb = _traceback(trace, caller)
    if tb is None or not any(fr.name == name and fr.filename.replace("\\", "/").endswith(suffix)
                             for fr in tb for suffix, name in _BACKWARD_ENTRIES):
        return None
    return tb.user_frame


def _line(trace: Any, stack: int, label: int = 0) -> str:
    resolved, frame = _user_frame(trace, stack)
    if frame is not None:
        return location(frame)
    back = _backward_line(trace, label)
    if back is not None:
        return back
    return "<no Python frames>" if stack == 0 or resolved else f"<stack {stack}>"


def _oom(trace: Any, o: Optional[Dict[str, Any]]) -> Optional[WhatIfOOM]:
    if not o:
        return None
    top = tuple(sorted(((_line(trace, s), b) for s, b in o["top"]), key=lambda x: -x[1]))
    line, backward = _line(trace, o["stack"], o.get("label", 0)), None
    if not o["stack"]:  # no Python frames: in the backward, the line that called it
        caller = _backward_caller(trace, o.get("caller", 0))
        if caller is not None:
            backward = _backward_line(trace, o.get("label", 0)) or "a backward pass"
            line = location(caller)
    return WhatIfOOM(at_ns=o["ts"], requested=o["requested"], rounded=o["rounded"], stream=o["stream"],
                     line=line, reserved=o["reserved"], allocated=o["allocated"],
                     outside=o["outside"], top=top, backward=backward)


# ---- text and JSON --------------------------------------------------------------------


def rows_json(rows: Sequence[WhatIfRow]) -> Dict[str, Any]:
    return {"format": "memviz-whatif", "version": 1, "rows": [r.to_dict() for r in rows],
            "not_modelled": list(NOT_MODELLED)}


def rows_text(rows: Sequence[WhatIfRow]) -> str:
    """The table: one row per setting and device, the recorded settings first,
    then each out-of-memory point and the notes."""
    if not rows:
        return ("memviz whatif: no PyTorch block in this trace (no allocator route, or no PyTorch): "
                "nothing to replay.\n")
    head = ("setting", "device", "reserved peak", "allocated then", "unused", "largest free", "cudaMalloc",
            "retries", "fits", "headroom")
    body = []
    for r in rows:
        body.append((r.label, f"cuda:{r.device}", format_size(r.reserved_peak),
                     format_size(r.allocated_at_peak), format_size(r.unused_at_peak),
                     format_size(r.largest_free_at_peak), f"{r.cuda_mallocs:,}", f"{r.retries:,}",
                     "OOM" if r.oom else ("yes" if r.limit is not None else "-"),
                     "-" if r.headroom is None else (format_size(r.headroom) if r.headroom >= 0
                                                     else format_size(-r.headroom) + " short")))
    widths = [max(len(str(x[i])) for x in [head, *body]) for i in range(len(head))]
    lines = ["memviz whatif: the recorded PyTorch requests replayed under each setting", ""]
    fmt = lambda cells: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths)))
    lines += [fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]
    best = min((r for r in rows if not r.recorded and not r.oom), key=lambda r: r.reserved_peak, default=None)
    base = next((r for r in rows if r.recorded), None)
    if best is not None and base is not None and best.reserved_peak < base.reserved_peak:
        lines += ["", f"Lowest reserved peak: {best.label}, {format_size(best.reserved_peak)} "
                      f"({(best.reserved_peak - base.reserved_peak) / max(base.reserved_peak, 1):+.1%} "
                      "against the recorded settings)."]
    for r in rows:
        if r.oom:
            o = r.oom
            where = o.line + (f" (in the backward: {o.backward})" if o.backward else "")
            lines += ["", f"{r.label}, cuda:{r.device}: out of memory at {where}: {format_size(o.requested)} "
                          f"asked ({format_size(o.rounded)} rounded) with {format_size(o.reserved)} reserved, "
                          f"{format_size(o.allocated)} allocated, {format_size(o.outside)} outside PyTorch. "
                          "Live then:"]
            lines += [f"    {format_size(b):>10}  {ln}" for ln, b in o.top]
        for n in r.notes:
            lines.append(f"  note ({r.label}): {n}.")
    lines += ["", "Not modelled: " + "; ".join(NOT_MODELLED) + "."]
    return "\n".join(lines) + "\n"
