"""bench/wheelhouse.py's ``--drop``: a wheel rewritten without some members (bitsandbytes' libraries for other CUDA
releases, so the GPU bundle fits the device tool's carry) still installs, without them, and lists none of them."""

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "bench" / "wheelhouse.py")
wheelhouse = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wheelhouse)

MEMBERS = {
    "pkg/__init__.py": b"",
    "pkg/libpkg_cuda118.so": b"\0" * 64,
    "pkg/libpkg_cuda130.so": b"\1" * 64,
    "pkg/libpkg_rocm64.so": b"\2" * 64,
}


def make_wheel(folder: Path) -> Path:
    """A minimal valid wheel of a package ``pkg`` with three native libraries."""
    dist = "pkg-1.0.dist-info"
    files = {
        **MEMBERS,
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n",
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + f"{dist}/RECORD,,\n"
    wheel = folder / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as out:
        for name, data in files.items():
            out.writestr(name, data)
        out.writestr(f"{dist}/RECORD", record)
    return wheel


def test_dropped_members_leave_the_wheel_and_its_record_and_it_still_installs(tmp_path):
    wheel = make_wheel(tmp_path)
    dropped = wheelhouse.drop_members(wheel, ["pkg/libpkg_cuda1[12]*.so", "pkg/libpkg_rocm*.so"])
    assert sorted(dropped) == ["pkg/libpkg_cuda118.so", "pkg/libpkg_rocm64.so"]
    with zipfile.ZipFile(wheel) as kept:
        names = set(kept.namelist())
        record = kept.read("pkg-1.0.dist-info/RECORD").decode()
        assert kept.read("pkg/libpkg_cuda130.so") == MEMBERS["pkg/libpkg_cuda130.so"]
    assert "pkg/libpkg_cuda130.so" in names and not names & set(dropped)
    assert "libpkg_cuda130" in record and not any(name in record for name in dropped)
    assert wheelhouse.drop_members(wheel, ["pkg/libpkg_rocm*.so"]) == []  # nothing left to drop: untouched

    target = tmp_path / "site"
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--target",
        str(target),
    ]
    subprocess.run([*pip, str(wheel)], check=True, capture_output=True)
    assert sorted(p.name for p in (target / "pkg").iterdir()) == ["__init__.py", "libpkg_cuda130.so"]
