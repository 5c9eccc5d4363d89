"""agl.memory reaches glibc's allocator where there is one, and yields to the user's own setting."""
import ctypes
import ctypes.util
import os
import subprocess
import sys

import pytest

from agl import memory

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None, reason="glibc only")


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
        out = subprocess.run([sys.executable, "-c", KERNEL_GROWTH, mode], env=env, capture_output=True, text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])

    uncapped = growth_mib("uncapped")
    if uncapped < 32:
        pytest.skip(f"this CPU's bf16 matmuls keep no kernel per shape (heap grew {uncapped:.1f} MiB)")
    assert growth_mib("capped") < uncapped / 4
