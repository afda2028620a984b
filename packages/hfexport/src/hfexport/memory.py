"""Process memory: the resident set size now, its peak so far, and the memory the machine has.

The export report records both readings at the end of every stage, so the stage in which the
process's peak rose is the one whose ``peak_rss_bytes`` grew. The peak is never reset (resetting
``VmHWM`` through ``/proc/self/clear_refs`` would also lower what ``/usr/bin/time -v`` and
``getrusage`` report for the whole process, which is what the benchmarks compare).

All sizes are bytes. Linux readings come from ``/proc``; elsewhere :func:`current_rss_bytes` and
:func:`available_bytes` return ``None`` and the peak comes from ``getrusage``.
"""

from __future__ import annotations

__all__ = [
    "available_bytes",
    "current_rss_bytes",
    "format_bytes",
    "peak_rss_bytes",
    "release_freed_memory",
]

_STATUS = "/proc/self/status"


def _status_kib(key: str) -> int | None:
    try:
        with open(_STATUS, encoding="ascii") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def current_rss_bytes() -> int | None:
    """Resident set size of this process now (``VmRSS``: anonymous and file-backed pages), or
    ``None`` where ``/proc`` is not available."""
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int | None:
    """Peak resident set size of this process since it started (``ru_maxrss``), what
    ``/usr/bin/time -v`` reports as "Maximum resident set size"; ``None`` where the platform has
    no ``resource`` module (Windows)."""
    import sys

    try:
        import resource
    except ImportError:  # Windows
        return None

    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(value) if sys.platform == "darwin" else int(value) * 1024  # macOS: bytes, Linux: KiB


def available_bytes() -> int | None:
    """Memory the machine can give a new allocation without swapping: ``MemAvailable`` of
    ``/proc/meminfo``, capped by the cgroup limit of this process when one is set (containers), or
    ``None`` when neither can be read."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    for path, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            with open(path, encoding="ascii") as fh:
                raw = fh.read().strip()
            if raw == "max":
                continue
            limit = int(raw)
            with open(usage, encoding="ascii") as fh:
                used = int(fh.read().strip())
        except (OSError, ValueError):
            continue
        if limit < 2**60:  # "no limit" is written as a huge number in cgroup v1
            free = max(limit - used, 0)
            available = free if available is None else min(available, free)
    return available


def format_bytes(n: int | None) -> str:
    """``2_380_000_000`` -> ``"2.38 GB"`` (decimal units, as ``ls -h --si`` and the docs use)."""
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def release_freed_memory() -> bool:
    """Collect garbage and hand the C heap's free pages back to the operating system.

    glibc's ``malloc`` keeps freed memory for reuse: after a stage frees hundreds of MB in
    allocations below its (dynamic, up to 32 MiB) ``mmap`` threshold, such as numpy weight arrays
    and protobuf buffers, the resident set does not shrink and the next stage's allocations add on
    top of it. ``malloc_trim(0)`` returns every whole free page of every arena (``MADV_DONTNEED``);
    it changes no live data. Called after the stages that free whole copies of the weights.

    Returns:
        ``True`` when ``malloc_trim`` ran (glibc), ``False`` elsewhere (musl, macOS, Windows), where
        only the garbage collection happened.
    """
    import ctypes
    import ctypes.util
    import gc
    import sys

    gc.collect()
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True
