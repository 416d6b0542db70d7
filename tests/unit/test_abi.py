"""src/cupti_abi.h against NVIDIA's own headers, where a CUDA toolkit is installed.

memviz builds without CUDA headers, so its hand-written constants and struct
layouts are checked here with C static asserts compiled against the real
cupti_callbacks.h, cupti_driver_cbid.h, cupti_activity.h and
generated_cuda_meta.h. Skipped (with the reason) where no toolkit exists.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _cuda_include():
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cupti_callbacks.h").exists():
            return Path(home) / "include"
    return None


INCLUDE = _cuda_include()
pytestmark = pytest.mark.skipif(
    INCLUDE is None or shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no CUDA toolkit headers (cupti_callbacks.h) or no C compiler on this machine",
)


def _cbid_names():
    text = (ROOT / "src" / "cupti_abi.h").read_text()
    return re.findall(r"MVZ_CBID_(\w+) = \d+", text)


def test_abi_matches_nvidia_headers(tmp_path):
    checks = [f"_Static_assert(MVZ_CBID_{n} == CUPTI_DRIVER_TRACE_CBID_{n}, \"{n}\");"
              for n in _cbid_names()]
    structs = {
        "cuMemAlloc_v2": ["dptr", "bytesize"],
        "cuMemAllocPitch_v2": ["dptr", "pPitch", "WidthInBytes", "Height", "ElementSizeBytes"],
        "cuMemFree_v2": ["dptr"],
        "cuMemAllocHost_v2": ["pp", "bytesize"],
        "cuMemFreeHost": ["p"],
        "cuMemHostAlloc": ["pp", "bytesize", "Flags"],
        "cuMemAllocManaged": ["dptr", "bytesize", "flags"],
        "cuMemAddressReserve": ["ptr", "size", "alignment", "addr", "flags"],
        "cuMemAddressFree": ["ptr", "size"],
        "cuMemCreate": ["handle", "size", "prop", "flags"],
        "cuMemRelease": ["handle"],
        "cuMemMap": ["ptr", "size", "offset", "handle", "flags"],
        "cuMemUnmap": ["ptr", "size"],
        "cuMemAllocAsync": ["dptr", "bytesize", "hStream"],
        "cuMemFreeAsync": ["dptr", "hStream"],
        "cuMemAllocFromPoolAsync": ["dptr", "bytesize", "pool", "hStream"],
        "cuMemPoolTrimTo": ["pool", "minBytesToKeep"],
    }
    for name, fields in structs.items():
        checks.append(f"_Static_assert(sizeof(mvz_{name}_params) == sizeof({name}_params), \"{name}\");")
        for f in fields:
            checks.append(f"_Static_assert(offsetof(mvz_{name}_params, {f}) == "
                          f"offsetof({name}_params, {f}), \"{name}.{f}\");")
    for ptsz in ("cuMemAllocAsync", "cuMemFreeAsync", "cuMemAllocFromPoolAsync"):
        checks.append(f"_Static_assert(sizeof(mvz_{ptsz}_params) == sizeof({ptsz}_ptsz_params), \"{ptsz}_ptsz\");")
    for f in ("callbackSite", "functionName", "functionParams", "functionReturnValue",
              "symbolName", "context", "contextUid", "correlationData", "correlationId"):
        checks.append(f"_Static_assert(offsetof(mvz_CUpti_CallbackData, {f}) == "
                      f"offsetof(CUpti_CallbackData, {f}), \"CallbackData.{f}\");")
    checks.append("_Static_assert(sizeof(mvz_CUpti_CallbackData) == sizeof(CUpti_CallbackData), \"cbdata\");")
    for f in ("structSize", "subscriberName", "oldSubscriberName", "oldSubscriberSize"):
        checks.append(f"_Static_assert(offsetof(mvz_CUpti_SubscriberParams, {f}) == "
                      f"offsetof(CUpti_SubscriberParams, {f}), \"SubscriberParams.{f}\");")
    for f in ("kind", "memoryOperationType", "memoryKind", "correlationId", "address", "bytes",
              "timestamp", "PC", "processId", "deviceId", "contextId", "streamId", "name",
              "isAsync", "memoryPoolConfig"):
        checks.append(f"_Static_assert(offsetof(mvz_CUpti_ActivityMemory3, {f}) == "
                      f"offsetof(CUpti_ActivityMemory3, {f}), \"Memory3.{f}\");")
        checks.append(f"_Static_assert(offsetof(mvz_CUpti_ActivityMemory4, base.{f}) == "
                      f"offsetof(CUpti_ActivityMemory4, {f}), \"Memory4.{f}\");")
    checks += [
        "_Static_assert(offsetof(mvz_CUpti_ActivityMemory4, source) == offsetof(CUpti_ActivityMemory4, source), \"source\");",
        "_Static_assert(sizeof(mvz_CUpti_ActivityMemory3) == sizeof(CUpti_ActivityMemory3), \"m3\");",
        "_Static_assert(sizeof(mvz_CUpti_ActivityMemory4) == sizeof(CUpti_ActivityMemory4), \"m4\");",
        "_Static_assert(MVZ_CUPTI_ACTIVITY_KIND_MEMORY2 == CUPTI_ACTIVITY_KIND_MEMORY2, \"kind\");",
        "_Static_assert(MVZ_CUPTI_ACTIVITY_MEMORY_KIND_DEVICE_STATIC == CUPTI_ACTIVITY_MEMORY_KIND_DEVICE_STATIC, \"static\");",
        "_Static_assert(MVZ_CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED == CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED, \"39\");",
        "_Static_assert(MVZ_CUPTI_ERROR_NOT_INITIALIZED == CUPTI_ERROR_NOT_INITIALIZED, \"15\");",
        "_Static_assert(MVZ_CUPTI_ERROR_INSUFFICIENT_PRIVILEGES == CUPTI_ERROR_INSUFFICIENT_PRIVILEGES, \"35\");",
        "_Static_assert(MVZ_CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN == CUPTI_OLD_SUBSCRIBER_NAME_MIN_LEN, \"name\");",
    ]
    src = tmp_path / "abi_check.c"
    src.write_text(
        "#include <stddef.h>\n#include <cuda.h>\n#include <cupti.h>\n"
        "#include <cupti_activity_deprecated.h>\n"
        f"#include \"{ROOT / 'src' / 'cupti_abi.h'}\"\n" + "\n".join(checks) + "\n")
    r = subprocess.run([os.environ.get("CC", "cc"), "-std=c11", "-fsyntax-only", f"-I{INCLUDE}", str(src)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
