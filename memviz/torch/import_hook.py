"""Running code right after a module is imported: how the PyTorch
integration hooks in when tracking starts before the script imports torch
(``python -m memviz run``).

May import: the standard library only (floors: docs/architecture.md).
"""

from __future__ import annotations

__all__ = ["PostImport"]


class PostImport:
    """A meta-path finder that runs ``callback`` right after module ``name``
    finished importing. It stays in ``sys.meta_path``: removing it while
    another thread's import loops over that list makes the loop skip the
    finder after it (PathFinder, last: ModuleNotFoundError)."""

    def __init__(self, name, callback):
        self.name, self.callback, self._busy = name, callback, False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._busy:
            return None
        import importlib.util

        self._busy = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        original = spec.loader.exec_module
        finder = self

        def exec_module(module):
            original(module)
            finder.callback()

        spec.loader.exec_module = exec_module
        return spec
