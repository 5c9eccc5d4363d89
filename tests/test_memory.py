"""agl.memory reaches glibc's allocator where there is one, and yields to the user's own setting."""

import ctypes
import ctypes.util
import os
import subprocess
import sys

import pytest

from agl import memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None, reason="glibc only"
)


@glibc
def test_the_threshold_is_pinned_and_the_heaps_trimmed(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert memory.release_freed_memory()
    assert memory.trim()


def test_the_users_own_glibc_setting_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")
    assert memory.release_freed_memory() is False


def test_a_missing_libc_function_is_none_not_an_error():
    assert memory._libc_function("no_such_function_in_libc") is None


@glibc
def test_an_update_maps_its_mid_sized_blocks_and_the_threshold_comes_back(monkeypatch):
    """Inside ``update_memory`` blocks of 512 KiB are mappings of their own (unmapped when freed) once
    the heaps' free space is used up; before and after it, with the threshold pinned at 1 MiB, they
    all come from a heap. glibc maps only what its heaps cannot serve, so the test asks for more
    blocks than the heaps' free space holds, plus 64 (a long test session leaves much free)."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if memory.mallinfo() is None:
        pytest.skip("glibc < 2.33: no mallinfo2")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def mapped_of(count: int, size: int) -> int:
        before = memory.mallinfo().hblks
        blocks = [libc.malloc(size) for _ in range(count)]
        mapped = memory.mallinfo().hblks - before
        for block in blocks:
            libc.free(block)
        return mapped

    size = 512 << 10
    count = memory.mallinfo().fordblks // size + 64
    assert memory.release_freed_memory()
    assert mapped_of(count, size) == 0
    with memory.update_memory():
        assert mapped_of(count, size) >= 64
        assert mapped_of(64, 128 << 10) == 0  # below the update's threshold: still a heap's
    assert mapped_of(count, size) == 0


def test_the_users_own_kernel_cache_capacity_wins(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)  # monkeypatch puts back what the session had
    memory.cap_kernel_caches(16)
    assert (os.environ["LRU_CACHE_CAPACITY"], os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]) == ("7", "16")


KERNEL_GROWTH = """
import sys
import torch
from agl import memory

if sys.argv[1] == "capped":
    memory.cap_kernel_caches(16)
weight = torch.randn(1536, 576, dtype=torch.bfloat16)
torch.nn.functional.linear(torch.randn(8, 576, dtype=torch.bfloat16), weight)
before = memory.mallinfo().uordblks
for rows in range(100, 260):  # 160 shapes, each new
    torch.nn.functional.linear(torch.randn(rows, 576, dtype=torch.bfloat16), weight)
print((memory.mallinfo().uordblks - before) / 2**20)
"""


@glibc
def test_capped_kernel_caches_stop_the_heap_growing_with_every_new_matmul_shape():
    """160 bf16 matmuls of new shapes: uncapped, each keeps a compiled kernel in the heap (where
    torch's CPU matmuls go through oneDNN); capped at 16, the heap stops growing after 16."""
    env = {k: v for k, v in os.environ.items() if k not in memory.KERNEL_CACHES}

    def growth_mib(mode: str) -> float:
        out = subprocess.run(
            [sys.executable, "-c", KERNEL_GROWTH, mode], env=env, capture_output=True, text=True, check=True
        )
        return float(out.stdout.strip().splitlines()[-1])

    uncapped = growth_mib("uncapped")
    if uncapped < 32:
        pytest.skip(f"this CPU's bf16 matmuls keep no kernel per shape (heap grew {uncapped:.1f} MiB)")
    assert growth_mib("capped") < uncapped / 4


def test_allocator_names_resolve_and_bad_ones_say_what_is_wrong(tmp_path):
    assert memory.allocator_library("glibc") is None
    library = tmp_path / "libsomething.so"
    library.write_bytes(b"")
    assert memory.allocator_library(str(library)) == str(library)
    for choice, words in (("tcmalloc2", "expected auto, glibc"), (str(tmp_path / "missing.so"), "no such file")):
        with pytest.raises(memory.ConfigError, match=words):
            memory.allocator_library(choice)
    for name in memory.ALLOCATORS:  # asked for by name: the library, or an error naming the package to install
        try:
            assert memory.allocator_library(name)
        except memory.ConfigError as error:
            assert "install it: apt-get install lib" in str(error)
    found = [memory.allocator_library(name) for name in memory.ALLOCATORS if memory.find_allocator(name)]
    assert memory.allocator_library("auto") == (found[0] if found else None)  # in ALLOCATORS' order
    # mimalloc ships as a wheel agl depends on (setup.cfg): found inside it, whatever ldconfig knows
    shipped = memory.find_allocator("mimalloc")
    assert shipped and "cmeel.prefix" in shipped and os.path.isfile(shipped)


PRELOAD_CHILD = """
import os, sys
from agl import memory
print("start", flush=True)
memory.preload_allocator()
with open("/proc/self/maps") as maps:
    print("loaded", sys.argv[1] in maps.read(), memory.active_allocator(), memory.release_freed_memory(), flush=True)
"""


def _mapped_path(soname: str) -> str | None:
    """Where the dynamic loader finds ``soname``: load it here and read the mapping's path."""
    ctypes.CDLL(soname)
    stem = "/" + soname.split(".so")[0] + ".so"  # the mapped file is the soname's target: libz.so.1 -> libz.so.1.2.13
    with open("/proc/self/maps") as maps:
        return next((line.split()[-1] for line in maps if stem in line), None)


@glibc
@pytest.mark.parametrize("choice", ["zlib", "tcmalloc", "mimalloc", "jemalloc"])
def test_preload_runs_the_command_again_once_under_the_library(choice, tmp_path):
    """The real mechanism (exec with LD_PRELOAD), checked from inside the child: the library is mapped,
    and the command ran twice (the first run exec'd) and no more. zlib, given by its path, stands in
    where neither malloc is installed: any shared library shows the exec; a malloc also takes glibc's
    place, so glibc's threshold is not pinned under it."""
    if choice == "zlib":
        soname = ctypes.util.find_library("z")
        setting = _mapped_path(soname) if soname else None
    else:
        setting = choice if memory.find_allocator(choice) else None
    if setting is None:
        pytest.skip(f"no {choice} library on this machine")
    script = tmp_path / "child.py"
    script.write_text(PRELOAD_CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_MMAP_THRESHOLD_")}
    env["AGL_ALLOCATOR"] = setting
    env["PYTHONPATH"] = ROOT  # this checkout's agl
    out = subprocess.run(
        [sys.executable, str(script), "libz" if choice == "zlib" else f"lib{choice}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.split()
    assert lines[:2] == ["start", "start"] and lines[2] == "loaded"  # the first run exec'd; the second did not
    mapped, active, pinned = lines[3:]
    assert mapped == "True"
    expected = "glibc" if choice == "zlib" else choice
    assert (active, pinned) == (expected, str(expected == "glibc"))


def test_the_harness_names_a_malloc_it_cannot_find_before_anything_else(tmp_path):
    env = {**os.environ, "AGL_ALLOCATOR": "tcmalloc2"}
    out = subprocess.run(
        [sys.executable, "harness.py", "algo=info", f"hydra.run.dir={tmp_path}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        == "error: AGL_ALLOCATOR=tcmalloc2: expected auto, glibc, tcmalloc, mimalloc, jemalloc or a library's path"
    )


@glibc
def test_active_allocator_reads_another_process_by_its_pid():
    """What bench/route_ab.py records for each server: the malloc mapped into that process, not this one."""
    children = {"glibc": {}}
    children.update(
        {name: {"LD_PRELOAD": memory.find_allocator(name)} for name in memory.ALLOCATORS if memory.find_allocator(name)}
    )
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    for name, preload in children.items():
        code = (
            "import sys; print('ready', flush=True); sys.stdin.read()"  # up (its libraries mapped) until stdin closes
        )
        child = subprocess.Popen(
            [sys.executable, "-c", code], env={**env, **preload}, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        try:
            assert child.stdout.readline() == b"ready\n"
            assert memory.active_allocator(child.pid) == name
        finally:
            child.communicate(b"")
