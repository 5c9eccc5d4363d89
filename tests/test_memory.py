"""agl.memory reaches glibc's allocator where there is one, and yields to the user's own setting."""
import ctypes
import ctypes.util
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


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


@glibc
def test_an_update_maps_its_mid_sized_blocks_and_the_threshold_comes_back(monkeypatch):
    """Inside ``update_memory`` blocks of 512 KiB are mappings of their own (unmapped when freed) once
    the heaps' free space is used up; before and after it, with the threshold pinned at 1 MiB, they
    all come from a heap. glibc maps only what its heaps cannot serve, so the test asks for more
    blocks than the heaps' free space holds, plus 64 (a long test session leaves much free)."""
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc < 2.33: no mallinfo2")
    libc.mallinfo2.restype = _Mallinfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]

    def mapped_of(count: int, size: int) -> int:
        before = libc.mallinfo2().hblks
        blocks = [libc.malloc(size) for _ in range(count)]
        mapped = libc.mallinfo2().hblks - before
        for block in blocks:
            libc.free(block)
        return mapped

    size = 512 << 10
    count = libc.mallinfo2().fordblks // size + 64
    assert memory.release_freed_memory()
    assert mapped_of(count, size) == 0
    with memory.update_memory():
        assert mapped_of(count, size) >= 64
        assert mapped_of(64, 128 << 10) == 0  # below the update's threshold: still a heap's
    assert mapped_of(count, size) == 0
