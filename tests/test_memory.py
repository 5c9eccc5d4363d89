"""agl.memory reaches glibc's allocator where there is one, and yields to the user's own setting."""
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
