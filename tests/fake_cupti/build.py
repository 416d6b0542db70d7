"""Compile the libcupti test double (fake_cupti.c) into libcupti_fake.so.

The library is cached under ``<build dir>/<key>/libcupti_fake.so`` where the
key hashes everything that affects the output (the C source, the ABI header
it includes, the compiler and the flags), so a sanitizer build and a plain one
live side by side and an edited source is rebuilt. Each build writes to a
unique temporary name and is renamed into place with os.replace, so any number
of processes (pytest-xdist workers, subprocess tests) may call build() at the
same time: the losers of the race simply replace the file with an identical
one, and a process that already loaded the old inode is unaffected.

Environment:
  CC            C compiler to use (default: cc)
  CFLAGS_EXTRA  extra flags for compile and link, e.g.
                "-fsanitize=address,undefined" (shell-style quoting allowed)
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "fake_cupti.c"
ABI_HEADER = HERE.parent.parent / "src" / "cupti_abi.h"
DEFAULT_BUILD_DIR = HERE / "_build"
LIB_NAME = "libcupti_fake.so"
CFLAGS = ["-std=c11", "-O1", "-g", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", "-pthread"]


def _command(cc: list[str], extra: list[str], out: Path) -> list[str]:
    return [*cc, *CFLAGS, *extra, "-o", str(out), str(SOURCE)]


def _key(cc: list[str], extra: list[str]) -> str:
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), ABI_HEADER.read_bytes(), "\0".join(cc + CFLAGS + extra)):
        data = part if isinstance(part, bytes) else part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:16]


def build(outdir: str | os.PathLike[str] | None = None) -> str:
    """Build (or reuse) the double and return the absolute path of the .so.

    ``outdir`` is the build directory root (default: tests/fake_cupti/_build);
    the library is placed in a subdirectory named after the cache key.
    Raises RuntimeError with the compiler output if compilation fails.
    """
    cc = shlex.split(os.environ.get("CC") or "cc")
    extra = shlex.split(os.environ.get("CFLAGS_EXTRA", ""))
    root = Path(outdir) if outdir is not None else DEFAULT_BUILD_DIR
    target_dir = (root / _key(cc, extra)).resolve()
    target = target_dir / LIB_NAME
    if target.is_file():
        return str(target)

    target_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{LIB_NAME}.", suffix=".tmp", dir=target_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        proc = subprocess.run(_command(cc, extra, tmp), capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"building {SOURCE.name} failed ({shlex.join(_command(cc, extra, target))}):\n"
                f"{proc.stdout}{proc.stderr}"
            )
        tmp.chmod(0o755)  # mkstemp made it 0600
        os.replace(tmp, target)  # atomic: readers see the old file or the new one
    finally:
        tmp.unlink(missing_ok=True)
    return str(target)


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else None))
