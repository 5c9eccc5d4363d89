"""Let freed tensor memory go back to the OS, so a long run's resident size follows what it uses.

On a run whose model computes on the CPU (``harness.py`` leaves all of this alone on CUDA: ``runs_on_cuda``):

  - ``release_freed_memory`` pins glibc's mmap threshold. glibc otherwise raises it to the size of every mmapped
    block freed, so tensors of a few MiB come from heaps, which tensors of ever-changing sizes fragment and which
    give pages back only from their top. Pinned, large tensors are mapped and unmapped on free: far less resident,
    at the price of page faults (the kernel zeroes every fresh page). The default is this memory-safe setting;
    ``MALLOC_MMAP_THRESHOLD_`` (glibc's own variable, in bytes) overrides it, e.g. 33554432 for speed.
  - ``update_memory`` lowers the threshold further for an update, whose many small blocks would fragment the heaps,
    and ``trim`` (glibc's malloc_trim) gives back the free pages left inside heaps after it.
  - ``preload_allocator`` runs the process again, once, with a malloc that reuses blocks by size class in glibc's
    place (``AGL_ALLOCATOR``): tcmalloc where the system has it, else mimalloc from its wheel (an agl dependency on
    Linux, so ``make`` alone gives a fast malloc), else jemalloc; the pinning then does not apply.
  - ``cap_kernel_caches`` bounds the compiled kernels torch's CPU matmuls keep per shape.

Non-glibc platforms (macOS, musl) keep their own behaviour: the glibc measures are no-ops there.
Why, measured: docs/benchmarks-history.md#glibc-malloc
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import os
import resource
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from agl.errors import ConfigError

ALLOCATORS = {  # AGL_ALLOCATOR's names -> the libraries ldconfig may know each by, and where to get one
    "tcmalloc": (("tcmalloc_minimal", "tcmalloc"), "apt-get install libtcmalloc-minimal4"),
    "mimalloc": (("mimalloc",), "pip install cmeel-mimalloc"),
    "jemalloc": (("jemalloc",), "apt-get install libjemalloc2"),
}
# A malloc shipped as a wheel, so that `pip install` (make setup) alone gives one: the distribution, and the glob of
# its library inside it. cmeel-mimalloc is a dependency of agl on Linux (setup.cfg).
WHEELS = {"mimalloc": ("cmeel-mimalloc", "cmeel.prefix/lib/libmimalloc.so*")}
M_MMAP_THRESHOLD = -3  # mallopt parameters, from glibc's malloc.h
KERNEL_CACHES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")  # oneDNN's primitives; ideep's, around them
KERNEL_CACHE_CAPACITY = 64  # entries in each (both libraries default to 1024)
MMAP_THRESHOLD_BYTES = 1 << 20
UPDATE_MMAP_THRESHOLD_BYTES = 256 << 10  # during an update (update_memory)
_pinned: int | None = None  # the threshold release_freed_memory set, if it did


def runs_on_cuda(argv: Sequence[str], environ: dict | None = None, dev: Path = Path("/dev")) -> bool:
    """Whether the job on this command line will compute on a CUDA device, told before torch loads (it
    decides whether the CPU-only measures above apply): ``device=cuda...`` yes, ``device=cpu`` no, else
    (``auto``, the default, or a ``resume=`` run) whether the machine shows an NVIDIA device that
    ``CUDA_VISIBLE_DEVICES`` does not hide.

    >>> runs_on_cuda(["model=tiny", "device=cpu"]), runs_on_cuda(["device=cuda:1"])
    (False, True)
    """
    environ = os.environ if environ is None else environ
    device = "auto"
    for arg in argv:
        key, sep, value = arg.partition("=")
        if sep and key.lstrip("+~") == "device":
            device = value.strip().strip("'\"")
    if device.startswith("cuda"):
        return True
    if device != "auto":
        return False
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    return any(path.name[len("nvidia") :].isdigit() for path in dev.glob("nvidia[0-9]*"))


def allocator_library(choice: str) -> str | None:
    """The malloc library ``choice`` names: ``tcmalloc``, ``mimalloc`` or ``jemalloc`` (``find_allocator``), a
    path to one, ``auto`` (the first of ``ALLOCATORS`` found, else None) or ``glibc`` (None)."""
    if choice == "glibc":
        return None
    if os.sep in choice:
        if not os.path.isfile(choice):
            raise ConfigError(f"AGL_ALLOCATOR={choice}: no such file")
        return choice
    if choice != "auto" and choice not in ALLOCATORS:
        raise ConfigError(f"AGL_ALLOCATOR={choice}: expected auto, glibc, {', '.join(ALLOCATORS)} or a library's path")
    for name, (_, package) in ALLOCATORS.items():
        if choice in ("auto", name):
            if found := find_allocator(name):
                return found
            if choice == name:
                raise ConfigError(f"AGL_ALLOCATOR={name}: no {name} library found (install it: {package})")
    return None


def find_allocator(name: str) -> str | None:
    """The library ``name`` (a key of ``ALLOCATORS``) is: the one its wheel installed (``WHEELS``), else the one
    ldconfig knows it by, else None."""
    if name in WHEELS and (shipped := wheel_library(*WHEELS[name])):
        return shipped
    return next(filter(None, map(ctypes.util.find_library, ALLOCATORS[name][0])), None)


def wheel_library(distribution: str, pattern: str) -> str | None:
    """The file matching ``pattern`` among the installed ``distribution``'s files (the shortest name: the
    library's soname link, not a versioned copy), or None where it is not installed."""
    import importlib.metadata

    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    found = sorted((f for f in files if f.match(pattern)), key=lambda f: len(str(f)))
    for file in found:
        path = os.path.realpath(file.locate())
        if os.path.isfile(path):
            return path
    return None


def preload_allocator() -> None:
    """Run this process's command again, once, with ``AGL_ALLOCATOR``'s malloc preloaded (default
    ``auto``: the first of ``ALLOCATORS`` found, else glibc as it is). Call it first thing: nothing
    from before survives the exec."""
    library = allocator_library(os.environ.get("AGL_ALLOCATOR", "auto"))
    preloaded = os.environ.get("LD_PRELOAD", "")
    if library is None or library in preloaded:  # already preloaded (or the loader refused it: then no loop either)
        return
    os.environ["LD_PRELOAD"] = f"{library} {preloaded}".strip()
    os.execv(sys.executable, sys.orig_argv)


def active_allocator(pid: int | str = "self") -> str:
    """``tcmalloc``, ``jemalloc`` or ``glibc``: which malloc process ``pid`` (default: this one) runs on."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/maps") as maps:
            loaded = maps.read()
        for name in ALLOCATORS:
            if f"lib{name}" in loaded:
                return name
    return "glibc"


def release_freed_memory(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold at ``threshold`` bytes; False where there is no glibc mallopt,
    or another malloc serves this process (``preload_allocator``).

    Call it early: blocks already taken from a heap stay there. ``MALLOC_MMAP_THRESHOLD_`` in the
    environment (glibc's own setting) wins, so a user can still choose.
    """
    global _pinned
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or active_allocator() != "glibc" or not _set_threshold(threshold):
        return False
    _pinned = threshold
    return True


def cap_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> None:
    """Keep at most ``capacity`` compiled kernels in each of the caches torch's CPU matmuls use.

    On a CPU where torch runs matmuls through oneDNN (bf16 on AVX-512/AMX), every new shape
    compiles a kernel, and two LRU caches keep it: oneDNN's primitives and ideep's wrappers
    around them, 1,024 entries each, every entry heap memory (more for a long prefill's). A job's
    shapes never stop being new (every micro-batch and prefill has its own length), so both caches
    fill, and the heaps' memory in use grows from a job's first eval to its last. The decode step's
    working set is a few shapes (five weights at the batch's current rows) and a micro-batch's a
    dozen, so 64 entries lose neither (measured: docs/benchmarks-history.md#kernel-cache-capacity).
    Both libraries read the variables once, at their first kernel: call this before torch
    computes anything. Values already in the environment win.
    """
    for name in KERNEL_CACHES:
        os.environ.setdefault(name, str(capacity))


@contextlib.contextmanager
def update_memory():
    """Around a policy update: the mmap threshold at ``UPDATE_MMAP_THRESHOLD_BYTES``, then back, then ``trim``.

    An update allocates many blocks between 256 KiB and 1 MiB whose sizes change with every
    micro-batch (a micro-batch of a few rows has activations that size: [2, 150, 576] fp32 is
    675 KiB). From a heap they fragment it: at an update's peak the heaps hold more free than in
    use. Mapped, each is unmapped when freed (glibc maps only what its heaps cannot serve, so part
    of them still comes from the heaps' free space). That lowers the update's and the SFT step's
    peak RSS at some of their time (the kernel zeroes every fresh page: system time; measured:
    docs/benchmarks-history.md#update-blocks-mapped). Only where ``release_freed_memory`` pinned the
    threshold (not under the user's ``MALLOC_MMAP_THRESHOLD_``); the engine is paused meanwhile, so
    nothing else allocates much.
    """
    lowered = _pinned is not None and _set_threshold(UPDATE_MMAP_THRESHOLD_BYTES)
    try:
        yield
    finally:
        if lowered:
            _set_threshold(_pinned)
        trim()  # the update's graph was many small blocks: give their pages back before sampling resumes


def _set_threshold(threshold: int) -> bool:
    mallopt = _libc_function("mallopt")
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, threshold) == 1)


def trim() -> bool:
    """Give the free pages of malloc's heaps back to the OS (glibc's ``malloc_trim(0)``); False without glibc.

    With the pinned threshold only blocks under 1 MiB live in heaps, but a phase that makes many
    of them (an update's autograd graph, a decode's small tensors) leaves free pages between the
    live ones, which a heap keeps until its top is free. The trainers call it after each update
    (its cost: docs/benchmarks-history.md#trim-and-collect).
    """
    malloc_trim = _libc_function("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


@contextlib.contextmanager
def long_lived_frozen() -> Iterator[None]:
    """Inside the block, Python's collector skips every object that exists as it starts (``gc.freeze``):
    the imports' and the loaded model's, over half a million with torch and transformers, which a job keeps
    to its end. A full collection then traverses only what came after (docs/benchmarks-history.md#trim-and-collect).
    What is frozen is still freed when its count drops to zero; a cycle among it waits for the block's end. Inside
    a block another froze first, nothing changes (``gc.unfreeze`` unfreezes all)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def collect() -> None:
    """A full garbage collection, then ``trim`` (``long_lived_frozen`` takes the model's objects out of it;
    its cost: docs/benchmarks-history.md#trim-and-collect).

    Agents leave reference cycles (an ``openai.OpenAI`` client made per rollout sits in one with
    its SSL context and its OpenSSL heap), and with a loaded model's many long-lived objects
    Python's own full collections are rare. The runtime calls this
    every ``runner.collect_every`` finished rollouts.
    """
    gc.collect()
    trim()


class Mallinfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (malloc.h): totals over every arena, in bytes."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def mallinfo() -> Mallinfo2 | None:
    """glibc's ``mallinfo2()`` (``uordblks``: bytes in use; ``fordblks``: free in heaps; ``hblks``,
    ``hblkhd``: blocks mapped on their own), or None (no glibc, or one older than 2.33)."""
    mallinfo2 = _libc_function("mallinfo2")
    if mallinfo2 is None:
        return None
    mallinfo2.restype = Mallinfo2
    return mallinfo2()


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@functools.cache
def _libc_function(name: str):
    """libc's ``name``, or None (no libc found, or a libc without it: macOS, musl)."""
    path = ctypes.util.find_library("c")  # runs ldconfig: once
    try:
        return getattr(ctypes.CDLL(path), name) if path else None
    except (OSError, AttributeError):
        return None
