"""Every wheel agl needs, for a target Python and platform, in one folder: an install without a network.

    make wheelhouse PY=3.12 PLATFORM=manylinux_2_28_x86_64 DIR=.gpu/wheelhouse
    # on the node, from a checkout (docs/gpu.md):
    python3 -m pip install --no-index --find-links .gpu/wheelhouse -e '.[test,bench]'

What goes in: setup.cfg's install_requires and ``--extras`` (default ``test,bench``: the CUDA lane and the GPU
benchmarks' TRL), with all their dependencies, resolved by pip for the target (``pip install --dry-run --report``
with ``--platform``/``--python-version``, wheels only), plus setuptools and wheel (what ``pip install -e .``
builds agl with, offline). Left out: ``--exclude`` (default torch, transformers and peft, which a GPU node has
built for its CUDA) and the packages ``--have`` lists (what the target already has: a file of names, one a line,
``name==version`` where the version is known; known versions also constrain the resolution, so what is
downloaded works with them). A left-out package's own dependencies are left out too, unless something kept
needs them.

omegaconf's antlr4-python3-runtime 4.9.3 exists only as a source tarball: it is built here into a pure-Python
wheel (py3-none-any) in the folder, so the target installs it without building anything.
``--drop GLOB`` takes files out of the downloaded wheels (and their RECORD): a wheel's native libraries for
targets other than the node's (bitsandbytes ships one per CUDA and ROCm release, 43 MiB; the bundle must fit the
device tool's 64 MiB carry).
``wheelhouse.json`` in the folder lists what was resolved, kept and left out, with sizes.
"""

from __future__ import annotations

import argparse
import configparser
import copy
import fnmatch
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a bare Python: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
SDIST_ONLY = {"antlr4-python3-runtime": "4.9.3"}  # built into wheels here
BUILD_REQUIREMENTS = ["setuptools>=64", "wheel"]  # pyproject.toml's build-system: pip install -e . offline
DEFAULT_EXCLUDE = ("torch", "transformers", "peft")


def drop_members(wheel: Path, patterns: list[str]) -> list[str]:
    """Rewrite ``wheel`` without the members that match any of ``patterns`` (fnmatch globs on the member's path),
    and without their RECORD lines; returns the dropped members' names."""
    with zipfile.ZipFile(wheel) as source:
        names = source.namelist()
        dropped = [n for n in names if any(fnmatch.fnmatch(n, p) for p in patterns)]
        if not dropped:
            return []
        slim = wheel.with_suffix(".slim")
        with zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as out:
            for info in source.infolist():
                if info.filename in dropped:
                    continue
                data = source.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(line for line in lines if line.split(",")[0] not in dropped).encode()
                out.writestr(copy.copy(info), data, compress_type=zipfile.ZIP_DEFLATED)  # writestr edits its info
    slim.replace(wheel)
    return dropped


def requirements(setup_cfg: Path, extras: list[str]) -> list[str]:
    """setup.cfg's install_requires plus the named extras' requirements."""
    parser = configparser.ConfigParser()
    parser.read(setup_cfg)
    lines = parser["options"]["install_requires"].splitlines()
    for extra in extras:
        if extra not in parser["options.extras_require"]:
            raise SystemExit(f"setup.cfg has no extra '{extra}'")
        lines += parser["options.extras_require"][extra].splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def platform_tags(platform: str) -> list[str]:
    """``manylinux_2_28_x86_64`` -> itself and every older manylinux tag of that architecture (a wheel built for
    glibc 2.17 runs on 2.28; pip takes ``--platform`` literally)."""
    if not platform.startswith("manylinux_2_"):
        return [platform]
    minor, arch = platform[len("manylinux_2_") :].split("_", 1)
    tags = [f"manylinux_2_{m}_{arch}" for m in range(int(minor), 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for m, name in legacy.items() if m <= int(minor)]


def target_options(python: str, platform: str) -> list[str]:
    options = ["--only-binary=:all:", "--python-version", python, "--implementation", "cp"]
    options += ["--abi", f"cp{python.replace('.', '')}"]
    for tag in platform_tags(platform):
        options += ["--platform", tag]
    return options


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def marker_environment(python: str, platform: str) -> dict:
    machine = platform.rsplit("_", 1)[-1] if "x86_64" not in platform else "x86_64"
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "os_name": "posix",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": machine,
        "platform_release": "",
        "platform_version": "",
        "implementation_version": f"{python}.0",
    }


def applies(requirement: Requirement, environment: dict, extras: set[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**environment, "extra": extra}) for extra in extras | {""})


def kept_packages(report: dict, roots: list[str], leave_out: set[str], environment: dict) -> dict[str, dict]:
    """The resolved packages reachable from ``roots`` without passing through one in ``leave_out``."""
    resolved = {canonicalize_name(item["metadata"]["name"]): item for item in report["install"]}
    wanted: dict[str, set[str]] = {}
    queue = [Requirement(r) for r in roots]
    while queue:
        requirement = queue.pop()
        name = canonicalize_name(requirement.name)
        if name in leave_out or name not in resolved:
            continue
        extras = set(requirement.extras)
        if name in wanted and extras <= wanted[name]:
            continue
        wanted[name] = wanted.get(name, set()) | extras
        for line in resolved[name]["metadata"].get("requires_dist") or []:
            dependency = Requirement(line)
            if applies(dependency, environment, wanted[name]):
                queue.append(dependency)
    return {name: resolved[name] for name in sorted(wanted)}


def read_have(path: Path | None) -> tuple[set[str], list[str]]:
    """(names, pins) of a ``--have`` file: every name, and the ``name==version`` lines as constraints."""
    if path is None:
        return set(), []
    names, pins = set(), []
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            names.add(canonicalize_name(Requirement(line).name))
            if "==" in line:
                pins.append(line)
    return names, pins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", default=f"{sys.version_info.major}.{sys.version_info.minor}")
    parser.add_argument("--platform", default="manylinux_2_28_x86_64")
    parser.add_argument("--dir", type=Path, default=ROOT / ".gpu" / "wheelhouse")
    parser.add_argument("--extras", default="test,bench", help="setup.cfg extras to include, comma-separated")
    parser.add_argument("--exclude", default=" ".join(DEFAULT_EXCLUDE), help="packages the target has (spaces)")
    parser.add_argument("--have", type=Path, help="a file of packages the target has: name or name==version a line")
    parser.add_argument("--drop", default="", help="globs of wheel members to leave out (spaces), e.g. native libs")
    args = parser.parse_args()

    extras = [e for e in args.extras.replace(",", " ").split() if e]
    roots = requirements(ROOT / "setup.cfg", extras)
    have, pins = read_have(args.have)
    leave_out = {canonicalize_name(n) for n in args.exclude.split()} | have
    args.dir.mkdir(parents=True, exist_ok=True)
    target = target_options(args.python, args.platform)

    for name, version in SDIST_ONLY.items():  # pure Python: a py3-none-any wheel built here serves every target
        pip("wheel", "--quiet", "--no-deps", "--no-binary", name, f"{name}=={version}", "-w", str(args.dir))
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("\n".join(pins) + "\n")
        report_path = Path(tmp) / "report.json"
        pip(
            "install",
            "--quiet",
            "--dry-run",
            "--ignore-installed",
            "--report",
            str(report_path),
            "--target",
            str(Path(tmp) / "target"),
            "--find-links",
            str(args.dir),
            "-c",
            str(constraints),
            *target,
            *roots,
            *BUILD_REQUIREMENTS,
        )
        report = json.loads(report_path.read_text())
    environment = marker_environment(args.python, args.platform)
    build = {canonicalize_name(Requirement(r).name) for r in BUILD_REQUIREMENTS}
    kept = kept_packages(report, roots, leave_out - build, environment)
    kept |= kept_packages(report, BUILD_REQUIREMENTS, set(), environment)
    downloads = [
        f"{item['metadata']['name']}=={item['metadata']['version']}"
        for name, item in kept.items()
        if name not in SDIST_ONLY
    ]
    pip("download", "--quiet", "--no-deps", "-d", str(args.dir), *target, *downloads)
    dropped = {}
    for wheel in sorted(args.dir.glob("*.whl")):
        if names := drop_members(wheel, args.drop.split()):
            dropped[wheel.name] = names

    wheels = {p.name: p.stat().st_size for p in sorted(args.dir.glob("*.whl"))}
    stale = [n for n in wheels if canonicalize_name(n.split("-")[0]) not in kept]
    manifest = {
        "python": args.python,
        "platform": args.platform,
        "extras": extras,
        "excluded": sorted(canonicalize_name(n) for n in args.exclude.split()),
        "have": sorted(have),
        "pins": pins,
        "kept": {name: item["metadata"]["version"] for name, item in kept.items()},
        "left_out": sorted(
            canonicalize_name(i["metadata"]["name"])
            for i in report["install"]
            if canonicalize_name(i["metadata"]["name"]) not in kept
        ),
        "wheels": wheels,
        "dropped": dropped,  # members taken out (--drop)
        "stale_wheels": stale,  # in the folder from an earlier build, not needed by this one
        "total_mib": round(sum(wheels.values()) / 2**20, 2),
    }
    (args.dir / "wheelhouse.json").write_text(json.dumps(manifest, indent=1))
    for name, size in sorted(wheels.items(), key=lambda kv: -kv[1]):
        print(f"{size / 2**20:8.2f} MiB  {name}")
    print(f"{manifest['total_mib']:8.2f} MiB  in {len(wheels)} wheels, {args.dir}")
    if stale:
        print(f"note: {len(stale)} wheels in the folder are not needed by this build: {', '.join(stale)}")


if __name__ == "__main__":
    main()
