"""A guarded route: no public bind without a key, bounded request bodies and token counts, clear path errors.

The route itself runs on loopback only (tests send traffic nowhere else): a public host is refused
before anything binds, which is what is tested for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from agl.config import ServerConfig, check_server_exposure
from agl.errors import ConfigError
from agl.policy.engine import Engine
from agl.policy.load import load_policy
from agl.policy.lora import find_adapter_dir
from agl.report.run_report import report
from agl.route.server import ModelServer
from agl.store import SqliteStore

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 2048  # server.max_request_bytes of the route under test


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "192.168.0.7", "no-such-host.invalid"])
def test_a_public_host_without_a_key_is_refused_naming_the_way_out(host):
    with pytest.raises(ConfigError) as error:
        check_server_exposure(ServerConfig(host=host))
    [line] = str(error.value).splitlines()
    assert f"server.host={host} is not a loopback address" in line
    assert "server.api_key=<secret>" in line and "server.allow_public=true" in line
    check_server_exposure(ServerConfig(host=host, api_key="sekret"))
    check_server_exposure(ServerConfig(host=host, allow_public=True))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost"])
def test_loopback_hosts_need_no_key(host):
    check_server_exposure(ServerConfig(host=host))


def test_the_harness_refuses_a_public_serve_before_loading_anything(tmp_path):
    result = subprocess.run(
        [sys.executable, "harness.py", "model=tiny", "algo=serve", "server.host=0.0.0.0", f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: server.host=0.0.0.0 is not a loopback address and server.api_key is not set, so anyone who can "
        "reach this machine could call the route: set server.api_key=<secret> (clients send it as the Bearer "
        "token), or server.allow_public=true to serve it without a key"
    ]
    assert not (tmp_path / "store.sqlite").exists()  # refused before the job opened anything


@pytest.fixture(scope="module")
def route(tiny_model_cfg):
    """The tiny policy's route with a small body limit, on a loop of its own: (base_url, loop)."""
    loop = asyncio.new_event_loop()

    async def start():
        policy = load_policy(tiny_model_cfg, "cpu")
        engine = Engine(policy)
        await engine.start()
        with pytest.raises(ConfigError, match="server.host=0.0.0.0 is not a loopback address"):
            ModelServer(engine, policy, config={"host": "0.0.0.0"})  # library users are guarded too
        server = ModelServer(engine, policy, config={"max_request_bytes": LIMIT})
        await server.start()
        return engine, server

    engine, server = loop.run_until_complete(start())
    yield server.base_url, loop
    loop.run_until_complete(server.stop())
    loop.run_until_complete(engine.stop())
    loop.close()


def post(route, path: str, **kwargs) -> httpx.Response:
    """POST on the route's loop (it serves while this waits)."""
    base_url, loop = route

    async def send():
        async with httpx.AsyncClient(timeout=60) as client:
            return await client.post(base_url + path, **kwargs)

    return loop.run_until_complete(send())


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    return error


def chat(content: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 1, **fields}


def test_a_body_over_the_limit_is_a_413_declared_or_chunked(route):
    fits = json.dumps(chat("x" * (LIMIT - 200))).encode()
    assert len(fits) <= LIMIT and post(route, "/chat/completions", content=fits).status_code == 200
    big = json.dumps(chat("x" * LIMIT)).encode()
    error = assert_openai_error(post(route, "/chat/completions", content=big), 413, "request_too_large")
    assert f"{len(big)} bytes" in error["message"] and "server.max_request_bytes" in error["message"]

    async def chunked():  # no Content-Length: refused once it has sent more than the limit
        for i in range(0, len(big), 256):
            yield big[i : i + 256]

    error = assert_openai_error(post(route, "/chat/completions", content=chunked()), 413, "request_too_large")
    assert f"over {LIMIT} bytes" in error["message"]
    assert_openai_error(post(route, "/responses", content=big), 413, "request_too_large")
    assert_openai_error(post(route, "/completions", content=big), 413, "request_too_large")


def test_a_call_once_the_stores_disk_is_full_is_a_503_not_a_server_error(tiny_model_cfg, tmp_path, caplog):
    """The job that owns the store stops on the full disk (tests/test_full_disk.py); a call that arrives meanwhile
    reads the store before it runs (its rollout and attempt) and gets OpenAI's 503, with nothing logged as a
    server error."""

    async def call_on_a_full_store() -> httpx.Response:
        policy = load_policy(tiny_model_cfg, "cpu")
        engine, store = Engine(policy), SqliteStore(tmp_path / "store.sqlite", watchdog_interval=None)
        await engine.start()
        server = ModelServer(engine, policy, store)
        await server.start()
        try:
            rollout = await store.start_rollout(input={"question": "hi"})
            store._db.full = True  # what a write that met ENOSPC leaves (agl/store/db.py): every later use says so
            async with httpx.AsyncClient(timeout=60) as client:
                url = server.rollout_base_url(rollout.rollout_id, rollout.attempt.attempt_id)
                return await client.post(f"{url}/chat/completions", json=chat("hi"))
        finally:
            store._db.full = False
            await server.stop()
            await engine.stop()
            await store.close()

    with caplog.at_level(logging.ERROR):
        response = asyncio.run(call_on_a_full_store())
    error = assert_openai_error(response, 503, "disk_full")
    assert "no space left on the device holding" in error["message"], error
    assert not caplog.records, [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_context_is_a_400_not_an_allocation(route, field):
    for huge in (2049, 10**12, 2**63):
        body = {"messages": [{"role": "user", "content": "hi"}], field: huge}
        error = assert_openai_error(post(route, "/chat/completions", json=body), 400, "context_length_exceeded")
        assert "maximum context length is 2048 tokens" in error["message"] and error["param"] == "max_tokens"
    error = assert_openai_error(
        post(route, "/responses", json={"input": "hi", "max_output_tokens": 10**12}), 400, "context_length_exceeded"
    )
    assert error["param"] == "max_output_tokens"


# ----------------------------------------------------------------------------- paths that are not agl's


def one_line_error(call, *args) -> str:
    with pytest.raises(ConfigError) as error:
        call(*args)
    [line] = str(error.value).splitlines()  # the harness prints it as "error: <line>" (tests/test_harness.py)
    return line


def test_adapter_and_report_paths_that_are_not_agl_dirs_are_one_line(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a run")
    no_weights = tmp_path / "half-adapter"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    unfinished = tmp_path / "unfinished-run"
    unfinished.mkdir()
    (unfinished / "store.sqlite").write_bytes(b"")
    assert one_line_error(find_adapter_dir, str(a_file)) == (
        f"model.adapter '{a_file}' is a file, not an adapter dir or a run dir"
    )
    assert one_line_error(find_adapter_dir, str(no_weights)) == (
        f"model.adapter '{no_weights}' has adapter_config.json but no adapter_model.safetensors "
        "(an adapter being written, or copied in part)"
    )
    assert one_line_error(find_adapter_dir, str(unfinished)) == (
        f"model.adapter '{unfinished}' is a run dir without an adapter yet (its job has not finished: "
        f"python harness.py resume={unfinished})"
    )
    assert one_line_error(report, a_file) == f"report='{a_file}' is not a directory"
    assert one_line_error(report, tmp_path / "missing") == f"report='{tmp_path / 'missing'}' does not exist"
    assert one_line_error(report, tmp_path) == (
        f"report='{tmp_path}' is neither a run dir (no store.sqlite) nor a sweep dir (no job dirs)"
    )
