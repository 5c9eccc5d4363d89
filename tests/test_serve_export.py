"""``algo=serve`` (the trained policy on the route, calls recorded) and ``algo=export`` (merged HF dir + GGUF).

Serve runs as users run it, ``python harness.py ...`` in a process of its own (forked: tests/runs.py),
called with the stock ``openai`` client and stopped with SIGTERM; its refusals (a port in use, an
adapter that is not there) are ``ConfigError``s of the same job run in this process (``agl.run``;
tests/test_harness.py runs the command line's one-line error). Export runs in this process too, on
the tiny model with a random adapter, and what it wrote is loaded by plain transformers (HF dir, and
the GGUF through ``gguf_file=``) and compared with the agl policy on a few chat prompts:

  - against the same adapter on an unquantized policy (``model.quantization=none``): the export
    must match to 1e-4 in every logit (measured <1e-6: the merge itself);
  - against the NF4 policy it trained as: within 0.25 (measured 0.12 on logits up to ~2: the
    base's NF4 rounding, which the full-precision export does not have; agl.jobs.export says more);
  - the GGUF against the HF dir: 1e-5 (measured 0: the same float32 weights, q/k rows permuted and back);
  - bfloat16: GGUF and HF dir equal (1e-5), within 0.05 of the unquantized policy (measured ~0.008);
  - the exported tokenizers (HF dir and GGUF) render every prompt to the policy's exact ids.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from pathlib import Path

import openai
import pytest
import torch
from omegaconf import OmegaConf
from runs import harness

import agl
from agl.errors import ConfigError
from agl.jobs.gguf import check_gguf_support
from agl.policy.load import load_policy
from agl.policy.weights import gguf_read_once
from agl.store import SqliteStore

PROMPTS = [
    [{"role": "user", "content": "What is 17 * 23?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour, then 1234 and 56."}],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! I'm Lightning."},
        {"role": "user", "content": "Who?"},
    ],
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------- serve


def test_serve_answers_the_openai_client_records_each_call_and_stops_on_sigterm(tmp_path):
    port = free_port()
    run_dir = tmp_path / "run"
    serve = ("model=tiny", "algo=serve", f"server.port={port}", f"hydra.run.dir={run_dir}")
    proc = harness(*serve, device="auto", env={"OMP_NUM_THREADS": "1"})  # on a GPU, the GPU (then not forked)

    def banner() -> str | None:
        return next((line for line in proc.output().splitlines() if line.startswith("serving ")), None)

    try:
        deadline = time.monotonic() + 120
        while (line := banner()) is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert line and proc.poll() is None, proc.output()[-3000:]
        base_url = line.split()[1]
        assert base_url == f"http://127.0.0.1:{port}/v1" and "model 'tiny'" in line, line

        client = openai.OpenAI(base_url=base_url, api_key="agl")
        reply = client.chat.completions.create(
            model="tiny", messages=PROMPTS[0], max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
        )
        stream = client.chat.completions.create(model="tiny", messages=PROMPTS[1], max_tokens=8, stream=True)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.output()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = proc.output()
    assert "Traceback" not in output and "stopped; 2 calls recorded" in output, output
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "succeeded" and status["result"]["recorded_calls"] == 2

    async def recorded() -> list:
        store = SqliteStore.open_readonly(run_dir / "store.sqlite")
        try:
            rollouts = await store.query_rollouts()
            return [(r, await store.query_spans(r.rollout_id)) for r in rollouts]
        finally:
            await store.close()

    (first, first_spans), (second, second_spans) = asyncio.run(recorded())
    assert first.status == second.status == "succeeded" and first.metadata == {"served": "chat"}
    [span] = first_spans
    assert span.name == "llm.chat" and span.prompt_token_ids == reply.model_extra["prompt_token_ids"]
    assert span.response_token_ids == reply.choices[0].model_extra["token_ids"]
    assert (
        len(span.response_logprobs) == len(span.response_token_ids)
        and span.attributes["request"]["messages"] == PROMPTS[0]
    )
    [span] = second_spans
    assert span.attributes["response_text"] == streamed and span.response_token_ids


def test_serve_on_a_port_in_use_is_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as error:
            agl.run("model=tiny", "algo=serve", f"server.port={port}", run_dir=tmp_path / "run")
    message = str(error.value)
    assert message.startswith(f"cannot listen on 127.0.0.1:{port}: Address already in use") and "\n" not in message


@pytest.mark.parametrize("algo", ["serve", "export"])
def test_an_adapter_that_does_not_exist_is_one_line_naming_it(tmp_path, algo):
    missing = tmp_path / "no-such-run"
    with pytest.raises(ConfigError) as error:
        agl.run("model=tiny", f"algo={algo}", f"model.adapter={missing}", run_dir=tmp_path / "run")
    assert str(error.value) == (
        f"model.adapter '{missing}' holds no adapter_config.json (neither it nor '{missing / 'adapter'}')"
    )


# ----------------------------------------------------------------------------- export


def random_adapter(tiny_model_cfg, directory: Path, **lora) -> Path:
    """A saved LoRA with random B (peft starts it at zero), so the merge changes the logits."""
    cfg = OmegaConf.merge(tiny_model_cfg, {"lora": lora})
    policy = load_policy(cfg, "cpu")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in policy.trainable_parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    policy.save_adapter(directory)
    return directory


ADAPTERS = {"linear-layers": {}, "tied-embeddings-too": {"train_embeddings": True}}


@pytest.fixture(scope="module")
def adapters(tiny_model_cfg, tmp_path_factory) -> dict[str, Path]:
    """The tests' random adapters, saved once; the tests only read them."""
    root = tmp_path_factory.mktemp("adapters")
    return {name: random_adapter(tiny_model_cfg, root / name, **lora) for name, lora in ADAPTERS.items()}


@pytest.fixture(scope="module")
def gguf_parsed_once():
    """Each exported GGUF file parsed once (agl.policy.weights.gguf_read_once): transformers parses one file three
    times for a model and its tokenizer, most of an export test's time."""
    with gguf_read_once():
        yield


def chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


@torch.no_grad()
def logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits.float()


@pytest.mark.parametrize("lora", sorted(ADAPTERS))
def test_export_loads_in_plain_transformers_and_matches_the_policy(
    tmp_path, tiny_model_cfg, adapters, gguf_parsed_once, lora
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = adapters[lora]
    result = agl.run("model=tiny", "algo=export", f"model.adapter={adapter}", run_dir=tmp_path / "run")
    out = tmp_path / "run" / "export"
    assert result["hf"] == str(out / "hf") and result["gguf"] == str(out / "model-float32.gguf")
    assert sorted(p.name for p in out.iterdir()) == ["hf", "model-float32.gguf"]  # no temporary dir left
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (out / "hf" / name).is_file(), name

    hf = AutoModelForCausalLM.from_pretrained(out / "hf")
    gguf = AutoModelForCausalLM.from_pretrained(out, gguf_file="model-float32.gguf", dtype=torch.float32)
    hf_tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    gguf_tokenizer = AutoTokenizer.from_pretrained(out, gguf_file="model-float32.gguf")
    exact = load_policy(OmegaConf.merge(tiny_model_cfg, {"quantization": "none", "adapter": str(adapter)}), "cpu")
    trained = load_policy(OmegaConf.merge(tiny_model_cfg, {"adapter": str(adapter)}), "cpu")  # NF4, as trained
    for messages in PROMPTS:
        ids = exact.render_chat(messages)
        assert chat_ids(hf_tokenizer, messages) == ids == chat_ids(gguf_tokenizer, messages)
        exported = logits(hf, ids)
        assert (exported - logits(exact.model, ids)).abs().max() < 1e-4
        assert (exported - logits(gguf, ids)).abs().max() < 1e-5
        assert (exported - logits(trained.model, ids)).abs().max() < 0.25
        with exact.reference():  # the merge matters: without the adapter the logits are far off
            assert (exported - logits(exact.model, ids)).abs().max() > 0.01


def test_bfloat16_export_writes_bf16_gguf_matrices(tmp_path, tiny_model_cfg, adapters, gguf_parsed_once):
    import gguf
    from transformers import AutoModelForCausalLM

    adapter = adapters["linear-layers"]
    agl.run("model=tiny", "algo=export", f"model.adapter={adapter}", "algo.dtype=bfloat16", run_dir=tmp_path / "run")
    out = tmp_path / "run" / "export"
    reader = gguf.GGUFReader(out / "model-bfloat16.gguf")
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert (
        types["blk.0.attn_q.weight"] == "BF16"
        and types["blk.0.attn_norm.weight"] == "F32"
        and "output.weight" not in types
    )
    hf = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)  # the same bf16 values, computed in fp32
    from_gguf = AutoModelForCausalLM.from_pretrained(out, gguf_file="model-bfloat16.gguf", dtype=torch.float32)
    exact = load_policy(OmegaConf.merge(tiny_model_cfg, {"quantization": "none", "adapter": str(adapter)}), "cpu")
    ids = exact.render_chat(PROMPTS[0])
    assert (logits(hf, ids) - logits(from_gguf, ids)).abs().max() < 1e-5
    assert (logits(hf, ids) - logits(exact.model, ids)).abs().max() < 0.05  # bf16 rounding of the weights


def test_export_refuses_an_out_dir_that_holds_files(tmp_path, adapters):
    adapter = adapters["linear-layers"]
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="already holds files"):
        agl.run(
            "model=tiny",
            "algo=export",
            f"model.adapter={adapter}",
            f"algo.out={tmp_path / 'mine'}",
            run_dir=tmp_path / "run",
        )
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    "config, pre_tokenizer, message",
    [
        ({"model_type": "qwen2"}, {"type": "ByteLevel"}, "only the llama architecture is mapped, not 'qwen2'"),
        ({"model_type": "llama", "rope_parameters": {"rope_type": "llama3"}}, {"type": "ByteLevel"}, "RoPE scaling"),
        ({"model_type": "llama"}, {"type": "Sequence", "pretokenizers": []}, "split text as GPT-2 does"),
    ],
)
def test_gguf_export_names_what_it_does_not_map(tmp_path, config, pre_tokenizer, message):
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}, "pre_tokenizer": pre_tokenizer}))
    with pytest.raises(ConfigError, match=message):
        check_gguf_support(tmp_path)
