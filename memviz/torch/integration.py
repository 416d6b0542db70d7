"""The PyTorch integration, put together: TorchIntegration subscribes to the
capture session for a tracker (memviz/capture/session.py), installs memviz
into PyTorch when tracking starts and removes it when it stops (nothing is left on the user's graph, modules or
optimizers; one process-wide optimizer pre-hook, and an import watcher
where torch came later, stay, and do nothing while no tracker runs: see
_listeners). It composes the parts of memviz.torch: the probes of
PyTorch's build (probe), the node labels, backward gate and saved tensors
of graphs (hooks), categories (categories), the allocator route
(allocator), precise mode (precise), out-of-memory reports (oom) and the
hook for a torch imported later (import_hook); here are only their wiring,
the allocator route's choice and the patch of PyTorch's backward entry.

May import: memviz._core, memviz.model, memviz.capture and memviz.torch's
other modules (floors: docs/architecture.md); torch only inside functions.
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from typing import Optional

import memviz._core as _core
from memviz._interrupts import deferred_interrupt
from memviz.capture.availability import CaptureWarning
from memviz.capture.events import OOM, CaptureEvents, Trigger
from memviz.torch import allocator as _alloc, precise as _precise
from memviz.torch.categories import Categories
from memviz.torch.compiled import warn_if_trees_exist
from memviz.torch.graph import GraphRecorder, pop_inert
from memviz.torch.hooks import BACKWARD, AutogradLabels
from memviz.torch.import_hook import PostImport
from memviz.torch import before as _before, rules as _rules
from memviz.torch.probe import attach_node_numbers, attach_nodes

__all__ = ["TorchIntegration"]

#: The running trackers' integrations (weak references) that hear each
#: optimizer step, and those waiting for torch's import, each through one
#: hook put in at the first need and never taken out. Hooks added at each
#: start and removed at each stop changed what another thread was looping
#: over in Python: PyTorch's dict of global optimizer pre-hooks ("OrderedDict
#: mutated during iteration", raised in that thread's opt.step()), and
#: sys.meta_path (a finder removed ahead of an import's loop skips the next
#: one: a ModuleNotFoundError). The tuples are replaced whole under the lock
#: and read without it; with no listener a hook returns at once.
_listeners = {"step": (), "torch": ()}
_listen_lock = threading.Lock()
_hooks: dict = {}  # "step": the optimizer pre-hook's handle; "torch": the import watcher


def _on_any_optimizer_step(optimizer, args, kwargs) -> None:
    for ref in _listeners["step"]:
        integ = ref()
        if integ is not None:
            integ._on_optimizer_step(optimizer, args, kwargs)


def _on_torch_imported() -> None:
    for ref in _listeners["torch"]:
        integ = ref()
        if integ is not None:
            integ._install()


def _listen(integ: "TorchIntegration", on: bool, to: str) -> None:
    """``integ`` hears (on) or stops hearing ``to``: "step" (every optimizer
    step) or "torch" (torch's import)."""
    with _listen_lock:
        keep = tuple(r for r in _listeners[to] if r() is not None and r() is not integ)
        _listeners[to] = keep + ((weakref.ref(integ),) if on else ())
        if not on or to in _hooks:
            return
        if to == "torch":
            _hooks[to] = watcher = PostImport("torch", _on_torch_imported)
            sys.meta_path.insert(0, watcher)  # an insert ahead of a loop repeats a finder: harmless
            return
        try:
            from torch.optim.optimizer import register_optimizer_step_pre_hook
        except ImportError:  # very old torch
            return
        _hooks[to] = register_optimizer_step_pre_hook(_on_any_optimizer_step)


class TorchIntegration(AutogradLabels, Categories, CaptureEvents):
    """memviz's subscriber for PyTorch (one per tracker): installs at start
    (or when torch is imported), removes everything at stop.

    Autograd labels and graph recording are installed once per process
    (PyTorch has one node-counter hook and one saved-tensor hook stack), so a
    nested tracker's integration uses the ones a running tracker's installed,
    and installs them itself only where none did. Precise mode's wrappers and
    the allocator route belong to the tracker that started the capture.

    What a tracker's integration installed serves every tracker started while
    it ran (its ``_users``), so it comes off when the last of them stops: a
    tracker stopped before the trackers nested in it leaves its parts on
    (``_teardown_pending``) until they stop too. Taken off at once, a nested
    tracker went on with no allocator route (none of PyTorch's blocks), no
    autograd labels and no graph recording, and said nothing."""

    def __init__(self, tracker, session) -> None:
        self._session = session
        self.autograd = tracker.autograd
        self._hooks_allowed = getattr(tracker, "autograd_requested", True)
        self.record_graph = tracker.record_graph
        self.graph = GraphRecorder(on_unpack=self._on_unpack, frame_filter=tracker.frame_filter)
        #: the graph recorder the tracker reads (``tracker.graph``): this one's,
        #: or the running tracker's it shares; None where none records
        self.graph_kept: Optional[GraphRecorder] = self.graph if self.record_graph else None
        self._init_labels()
        self._init_categories()
        #: precise mode's wrappers are the capture's first tracker's
        self._wraps_precise = tracker.precise and tracker.outer is None
        self._wrapped = False
        #: How precise mode captures PyTorch's allocations (None outside it).
        self.precise_capture: Optional[str] = None
        self._tracker = weakref.ref(tracker)
        self._patched = []
        self._active = False
        self.oom_report = None
        #: why the out-of-memory report could not be made (None: it was, or none was asked)
        self.oom_error: Optional[str] = None
        #: how PyTorch's memory is seen (memviz.torch.allocator.Route)
        self.route: Optional[_alloc.Route] = None
        #: what PyTorch held when this tracker attached the route (memviz.torch.before.seed)
        self.before_tracking: Optional[dict] = None
        self._answers = None  # the allocator route's answers while attached by this tracker
        #: the running tracker's integration whose allocator route this nested one reads
        self.route_from: Optional["TorchIntegration"] = None
        self._pool_segments: set = set()  # (device, address) of segments PyTorch showed
        #: how PyTorch's segments are seen without CUPTI: "allocator" (its cudaMalloc and
        #: cudaFree wrapped), or None with segments_reason (with CUPTI: CUPTI sees them)
        self.segments_route: Optional[str] = None
        self.segments_reason: Optional[str] = None
        self._segments_wrapped = False
        #: the integrations whose parts this one uses (their trackers ran when it started)
        self._borrowed: tuple = ()
        #: the integrations using this one's parts (started while its tracker ran)
        self._users: set = set()
        #: stopped, with its parts left on for _users still running
        self._teardown_pending = False
        if tracker.outer is not None:
            self._share_with_running()

    def _share_with_running(self) -> None:
        """A nested tracker's integration: the running trackers' allocator
        route, autograd labels and graph recorder (see the class docstring)."""
        providers: list = []
        for p in self._session.running_subscribers(TorchIntegration):
            if p._active:  # first the stopped ones whose parts it uses (they installed them)
                providers.extend(q for q in (*p._borrowed, p) if q not in providers)
        self._borrowed = tuple(providers)
        for p in providers:
            p._users.add(self)
        route_owner = next((p for p in providers if p.route is not None), None)
        if route_owner is not None:
            self.route_from = route_owner  # one vtable swap per process: the allocator route too
        if self.autograd and any(p.autograd for p in providers):
            self.autograd = False  # the capture already carries the labels
        if self.record_graph:
            owner = next((p for p in providers if p.record_graph), None)
            if owner is not None:
                self.record_graph = False
                self.graph_kept = owner.graph

    # -- lifecycle ---------------------------------------------------------

    def on_start(self, tracker) -> None:
        self._active = True
        self._hooks_on[0] = True
        if "torch" in sys.modules:
            self._install()
        else:  # e.g. `python -m memviz run`: hook in once the script imports torch
            _listen(self, True, to="torch")

    def _install(self) -> None:
        if not self._active:
            return
        try:
            self._install_parts()
        except BaseException:
            # Undo what went in (a failed start left PyTorch's backward entry patched for
            # the rest of the process: later trackers took it for theirs, and every
            # later snapshot left gradients unread)
            with deferred_interrupt():
                self.on_stop(None)
            raise

    def _install_parts(self) -> None:
        import torch

        self._current_node = torch._C._current_autograd_node
        if self._wraps_precise and _precise.active():
            self.precise_capture = _precise.attach_wrappers()
            self._wrapped = self.precise_capture.startswith("wrappers")
        self._choose_route(torch)
        if self.autograd:  # before the graph hooks: the probes run a tiny backward
            self._function_cls = torch.autograd.Function
            self._seq_attached = attach_node_numbers(torch)
            self._nodes_attached = attach_nodes(torch)
        import torch.autograd.graph as agraph
        if getattr(agraph._engine_run_backward, "__module__", None) != __name__:
            # Counts the backward passes running (BACKWARD), so that a snapshot on another
            # thread never reads what the engine writes without the GIL; and, with
            # autograd=True where the callback cannot name nodes, the pre-hooks.
            BACKWARD.reset()
            self._patch_backward(torch)
        if self.record_graph:
            try:
                self.graph.start()  # first pops this thread's inert hooks that are innermost again
            except RuntimeError as e:  # started under disable_saved_tensors_hooks (a torch.func transform)
                self.record_graph, self.graph_kept = False, None
                warnings.warn(CaptureWarning(
                    f"memviz: graph recording (graph=True, or autograd=True) is off for this tracker: "
                    f"PyTorch refused saved-tensor hooks here ({e}). Start the tracker outside that "
                    f"block (torch.func transforms turn the hooks off) to record graphs."), stacklevel=2)
        else:
            pop_inert()  # hooks of a recorder stopped elsewhere, innermost on this thread again
        if self.route_from is None:  # the tracker that owns the capture
            self._patch_profiler()
        _listen(self, True, to="step")
        observer = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if observer is not None and torch.cuda.is_available():
            ref = weakref.ref(self)

            def on_oom(device, alloc, device_total, device_free):
                me = ref()
                if me is not None and me._active:
                    me._on_oom(device, alloc, device_total, device_free)

            try:
                observer(on_oom)  # torch offers no detach: the closure goes inert at stop
            except Exception:  # noqa: BLE001 - e.g. an allocator without observers
                pass

    # -- how PyTorch's memory is seen ----------------------------------------

    def _choose_route(self, torch) -> None:
        """The allocator route where it can be had (memviz.torch.allocator),
        else why not."""
        if self.route_from is not None:  # nested: the outer tracker's route, read not owned
            self.route = self.route_from.route
            return
        if _precise.active():
            self.route = _alloc.Route(
                "cudaMallocAsync", "PyTorch runs its cudaMallocAsync backend: every tensor is a "
                "driver call memviz sees" + (f" ({self.precise_capture})" if self.precise_capture else ""))
            return
        try:
            available = torch.cuda.is_available()
            backend = torch.cuda.get_allocator_backend() if available else None
        except Exception as e:  # noqa: BLE001 - a CPU build
            available, backend = False, f"{type(e).__name__}: {e}"
        if not available:
            self.route = _alloc.Route("segments", "this PyTorch sees no CUDA device")
        elif backend != "native":
            self.route = _alloc.Route("segments", f"PyTorch runs the {backend!r} allocator backend, "
                                      "which memviz cannot see block by block")
        elif not torch.cuda.is_initialized():
            # Probing allocates; let the user's first CUDA use initialise CUDA.
            self.route = _alloc.Route("segments", "waiting for PyTorch to initialise CUDA "
                                      "(memviz attaches to its allocator then)")
            ref = weakref.ref(self)

            def attach_later(_ref=ref, _torch=torch):
                me = _ref()
                if me is not None and me._serving and me._answers is None:
                    me._attach_route(_torch)

            torch.cuda._lazy_call(attach_later)
        else:
            self._attach_route(torch)

    def _attach_route(self, torch) -> None:
        try:
            answers = _alloc.TorchAnswers(torch)
        except Exception as e:  # noqa: BLE001
            self.route = _alloc.Route("segments", f"cannot find PyTorch's allocator: {e}")
            return
        self.use_answers(answers)

    def use_answers(self, answers) -> "_alloc.Route":
        """Attach the allocator route through ``answers`` (PyTorch's, or a
        stand-in's in the tests)."""
        owned_before = _core.allocator_state()["attached"]
        if not owned_before and _core.active() and not _core.cupti_held():
            # without CUPTI, PyTorch's segments come from its cudaMalloc: wrapped
            # before the probe, whose blocks may make one
            self.wrap_segments(answers)
        self.route = _alloc.attach(answers)
        if self.route.route != "allocator" and self._segments_wrapped:
            _core.segments_detach()  # its blocks unseen: segments alone would mislead no less
            self._segments_wrapped = False
            self.segments_route, self.segments_reason = None, "PyTorch's allocator route did not attach"
        # reduce-overhead's graphs recorded before tracking: said (memviz.torch.compiled)
        warn_if_trees_exist(self.route.route, stacklevel=3)
        if self.route.route == "allocator":
            self._answers = answers
            snap = _before.read_snapshot(answers)  # read once, for both below
            # e.g. the probe's: emptied before a report reads the peak
            self._remember_segments(snap)
            if not owned_before:  # this tracker attached it: what PyTorch holds joins the record
                _rules.apply(_rules.from_environment())  # how PyTorch sizes its blocks
                self.before_tracking = _before.seed(answers, snap)
        return self.route

    def wrap_segments(self, answers=None) -> bool:
        """Wrap the cudaMalloc/cudaFree of PyTorch's allocator library (the
        segments of its caching allocator), for capture without CUPTI
        (src/interpose.h, MVZ_WRAP_SEGMENTS). False, with segments_reason,
        where they cannot be: expandable segments map memory through the
        driver's entry points, not cudaMalloc."""
        if self._segments_wrapped:
            return True
        answers = answers if answers is not None else self._answers
        if answers is None:
            self.segments_reason = "PyTorch's allocator is not attached"
            return False
        if _rules.from_environment().expandable:
            self.segments_reason = ("PyTorch runs with expandable_segments, which maps memory through "
                                    "the driver's entry points, not cudaMalloc")
            return False
        n, why = _core.segments_attach(answers.library)
        if n <= 0:
            self.segments_reason = f"PyTorch's cudaMalloc cannot be wrapped: {why}"
            return False
        self._segments_wrapped = True
        self.segments_route, self.segments_reason = "allocator", None
        return True

    def _remember_segments(self, snap=None) -> None:
        """Note the segments PyTorch holds now (or held in ``snap``, its
        memory_snapshot()), so that a past snapshot (the peak) counts them as
        PyTorch's even if they are gone by the time it is read
        (torch.cuda.empty_cache())."""
        try:
            if snap is not None:
                self._pool_segments.update((int(s["device"]), int(s["address"])) for s in snap)
                return
            self._pool_segments.update((seg.device, seg.address) for seg in self._answers.view())
        except Exception:  # noqa: BLE001 - a figure for later reports, never the user's error
            pass

    @property
    def _serving(self) -> bool:
        """Its parts are on: its tracker runs, or trackers using them do."""
        return self._hooks_on[0]

    def on_stop(self, tracker) -> None:
        self._active = False
        _listen(self, False, to="torch")
        _listen(self, False, to="step")
        if any(u._active or u._teardown_pending for u in self._users):
            self._teardown_pending = True  # off when the last of them stops (_user_gone)
            return
        self._teardown()

    def _user_gone(self, user: "TorchIntegration") -> None:
        self._users.discard(user)
        if self._teardown_pending and not any(u._active or u._teardown_pending for u in self._users):
            self._teardown()

    def _teardown(self) -> None:
        """Take off what this integration installed, then let go of the
        parts it used."""
        self._teardown_pending = False
        self._hooks_on[0] = False
        if self._segments_wrapped:
            _core.segments_detach()
            self._segments_wrapped = False
        if self._answers is not None:
            self._remember_segments()
            _alloc.detach()
            self._answers = None
        self.graph.stop()
        if self._wrapped:
            _precise.detach_wrappers()
            self._wrapped = False
        if self._nodes_attached:
            _core.nodes_attach(None)
            self._nodes_attached = False
        if self._seq_attached:
            _core.seqmap_attach(0)
            self._seq_attached = False
        try:
            for module, name, original in reversed(self._patched):
                setattr(module, name, original)
            self._patched.clear()
        finally:
            borrowed, self._borrowed = self._borrowed, ()
            for owner in borrowed:
                owner._user_gone(self)

    def _patch_profiler(self) -> None:
        """memviz first, torch.profiler second: CUPTI takes one subscriber,
        so when a profiler that traces CUDA is about to start (PyTorch's
        _prepare_profiler/_enable_profiler, which every torch.profiler,
        Lightning and Hugging Face profiler goes through), memviz gives
        CUPTI up and goes on through PyTorch's allocator (the capture
        session's release_cupti), and the profiler works. Undone at stop."""
        try:
            import torch.autograd.profiler as prof
        except Exception:  # noqa: BLE001 - a torch without the profiler
            return
        ref = weakref.ref(self)
        for name in ("_prepare_profiler", "_enable_profiler"):
            original = getattr(prof, name, None)
            if original is None or getattr(original, "__memviz_wrapped__", False):
                continue

            def wrapper(*args, _original=original, **kwargs):
                me = ref()
                if me is not None and me._serving:
                    me._before_profiler(args[1] if len(args) > 1 else kwargs.get("activities"))
                return _original(*args, **kwargs)

            wrapper.__memviz_wrapped__ = True  # type: ignore[attr-defined]
            wrapper.__wrapped__ = original  # type: ignore[attr-defined]
            setattr(prof, name, wrapper)
            self._patched.append((prof, name, original))

    def _before_profiler(self, activities) -> None:
        """A profiler is about to start with ``activities``: if it traces
        CUDA and memviz holds CUPTI, give CUPTI up (see _patch_profiler)."""
        try:
            cuda = activities is None or any(str(a).rsplit(".", 1)[-1] == "CUDA" for a in activities)
        except Exception:  # noqa: BLE001 - unknown: assume it wants CUPTI
            cuda = True
        if not cuda or not _core.cupti_held():
            return
        owner = self.route_from or self  # the integration of the tracker that owns the capture
        self._session.release_cupti(f"torch.profiler started at {_user_line()} and needs CUPTI, which memviz held",
                                    before=owner.wrap_segments)

    def _patch_backward(self, torch) -> None:
        """Wrap PyTorch's entry to the autograd engine: count the backward
        passes running (memviz.torch.hooks.BACKWARD) and, where needed, put
        the pre-hooks on the graph first. The wrapper stays in this module:
        _install knows memviz's own by its ``__module__``."""
        import torch.autograd as autograd
        import torch.autograd.graph as agraph

        original = agraph._engine_run_backward
        integ = self

        def _engine_run_backward(t_outputs, *args, **kwargs):
            if integ._serving and integ.autograd and not integ._nodes_attached and integ._hooks_allowed:
                # else the callback names nodes itself (or, by default, nobody pays for hooks)
                try:
                    roots = [agraph._get_grad_fn_or_grad_acc(t) for t in t_outputs]
                    integ._hook_graph(roots)
                except Exception:  # noqa: BLE001 - attribution must never break backward
                    pass
            saved = _core.label_get()  # CPU backward runs nodes on this thread
            BACKWARD.enter()
            try:
                return original(t_outputs, *args, **kwargs)
            finally:
                BACKWARD.leave()
                _core.label_set(saved)

        for module in (agraph, autograd):
            if getattr(module, "_engine_run_backward", None) is original:
                self._patched.append((module, "_engine_run_backward", original))
                setattr(module, "_engine_run_backward", _engine_run_backward)

    # -- out of memory -----------------------------------------------------

    def _on_oom(self, device, alloc, device_total, device_free) -> None:
        from memviz.torch.oom import capture_oom

        tracker = self._tracker()
        if tracker is not None:
            try:
                self.oom_report = capture_oom(tracker, self, device, alloc, device_total, device_free)
            except Exception as e:  # noqa: BLE001 - never change the user's exception
                self.oom_report = None
                self.oom_error = repr(e)
            # The flight recorder writes its dump then, on the failing thread,
            # before PyTorch raises OutOfMemoryError to the program.
            self._session.failure(tracker, Trigger(OOM, f"PyTorch out of memory on cuda:{device}"))


def _user_line() -> str:
    """The first frame outside torch and memviz: where the profiler was started."""
    import os
    f = sys._getframe(1)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    while f is not None:
        name = f.f_code.co_filename
        if not (name.startswith(here) or f"{os.sep}torch{os.sep}" in name or
                f"{os.sep}lightning" in name or f"{os.sep}transformers{os.sep}" in name):
            return f"{name}:{f.f_lineno}"
        f = f.f_back
    return "?"
