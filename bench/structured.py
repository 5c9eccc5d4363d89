"""Structured outputs on the embedded model: are replies valid, how many are cut, what does the grammar cost?

Validity: ``--requests`` sampled requests (temperature 1, a seed each) spread over 10 schemas, sent
through the HTTP route by 32 concurrent ``AsyncOpenAI`` clients: 7 ``response_format`` json_schema
(strict) and 3 forced tool calls (``tool_choice`` "required" or named, one with
``parallel_tool_calls: false``). Each prompt shows the schema in words, as an agent's would. Per
schema and overall: the share of replies that ended by the grammar's own end (finish_reason
"stop" / "tool_calls"), the share of those that are valid (``json.loads`` + ``jsonschema``; a
tool call's name must be a tool's, its arguments valid against that tool's parameters; must be
100%), and the share cut by ``max_tokens`` (finish_reason "length", counted apart).

Speed: decode tokens/s at ``--clients`` concurrent clients with and without a grammar, side by
side: rounds alternate on the same engine, each client sending ``--speed-requests`` requests of
exactly ``--new-tokens`` tokens (free: ``ignore_eos``; with a grammar: a schema no reply can end
within that many tokens, an array of at least 64 objects), so both sides decode the same shapes and
only the mask differs. tokens/s is completion tokens over the round's wall time; the ratio is
grammar / free per pair of rounds, and its median is reported.

Writes bench/results/structured.json and bench/results/structured.md.

    PYTHONPATH=. /work/main/.venv/bin/python bench/structured.py                        # ~10 min, shared 2-core CPU
    PYTHONPATH=. /work/main/.venv/bin/python bench/structured.py --requests 20 --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import platform
import statistics
import time

import jsonschema
import openai

from agl.policy import compute_thread
from agl.policy.engine import Engine
from agl.policy.load import load_policy
from agl.route.server import ModelServer
from bench.common import RESULTS, gsm8k_prompts, model_config


def _object(properties: dict, required: list | None = None) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _tool(name: str, description: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


STRING = {"type": "string"}
SCHEMAS = {
    "person": _object({"name": STRING, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "email": STRING}),
    "gsm8k_answer": _object({"reasoning": STRING, "answer": {"type": "integer"}}),
    "sentiment": _object(
        {
            "label": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        }
    ),
    "todo_list": _object(
        {"items": {"type": "array", "items": _object({"title": STRING, "done": {"type": "boolean"}}), "maxItems": 5}}
    ),
    "address": _object({"street": STRING, "city": STRING, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "event": _object(
        {
            "title": STRING,
            "day": {"type": "integer", "minimum": 1, "maximum": 31},
            "month": {"enum": ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]},
            "online": {"type": "boolean"},
        }
    ),
    "user_profile": _object(
        {
            "user": _object({"id": {"type": "integer", "minimum": 1}, "tags": {"type": "array", "items": STRING}}),
            "active": {"type": "boolean"},
            "note": {"anyOf": [STRING, {"type": "null"}]},
        }
    ),
}
PROMPTS = {
    "person": "Make up a person and describe them.",
    "gsm8k_answer": None,  # a GSM8K question
    "sentiment": "Classify the sentiment of: 'The food was cold and the waiter was rude.'",
    "todo_list": "Write a short to-do list for moving house.",
    "address": "Give the address of a made-up bakery in Springfield.",
    "event": "Describe a birthday party happening next month.",
    "user_profile": "Describe a user of a music app.",
}
WEATHER = _tool(
    "get_weather",
    "Current weather in a city.",
    _object({"city": STRING, "unit": {"enum": ["celsius", "fahrenheit"]}}),
)
ADD = _tool("add", "Add two integers.", _object({"a": {"type": "integer"}, "b": {"type": "integer"}}))
SEARCH = _tool(
    "search",
    "Search the web.",
    _object({"query": STRING, "limit": {"type": "integer", "minimum": 1, "maximum": 10}}),
)
CALCULATOR = _tool("calculator", "Evaluate an arithmetic expression.", _object({"expression": STRING}))
TOOL_CASES = {  # name -> (tools, tool_choice, parallel_tool_calls, prompt)
    "tool_weather_required": ([WEATHER], "required", None, "What is the weather in Paris?"),
    "tool_add_named": ([ADD], {"type": "function", "function": {"name": "add"}}, None, "What is 17 + 25?"),
    "tool_search_or_calc_single": (
        [SEARCH, CALCULATOR],
        "required",
        False,
        "How tall is the Eiffel tower in feet, times 2?",
    ),
}
SPEED_SCHEMA = _object(
    {"rows": {"type": "array", "items": _object({"name": STRING, "value": {"type": "integer"}}), "minItems": 64}}
)


def cases(count: int, gsm8k: list[dict]) -> list[dict]:
    """``count`` requests, round-robin over the 10 schemas, each with its own seed."""
    names = list(SCHEMAS) + list(TOOL_CASES)
    out = []
    for i in range(count):
        name = names[i % len(names)]
        request: dict = {"temperature": 1.0, "seed": 1000 + i}
        if name in SCHEMAS:
            prompt = PROMPTS[name] or gsm8k[i % len(gsm8k)]["question"]
            schema = SCHEMAS[name]
            request["messages"] = [
                {"role": "system", "content": f"Reply with JSON only, matching this JSON schema: {json.dumps(schema)}"},
                {"role": "user", "content": prompt},
            ]
            request["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": name, "schema": schema, "strict": True},
            }
        else:
            tools, choice, parallel, prompt = TOOL_CASES[name]
            request |= {"messages": [{"role": "user", "content": prompt}], "tools": tools, "tool_choice": choice}
            if parallel is not None:
                request["parallel_tool_calls"] = parallel
        out.append({"name": name, "request": request})
    return out


def judge(case: dict, choice) -> dict:
    """Whether the reply ended by its grammar's end, was cut, and (if it ended) is valid."""
    name, finish = case["name"], choice.finish_reason
    if name in SCHEMAS:
        ended = finish == "stop"
        try:
            jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
            valid = True
        except (ValueError, jsonschema.ValidationError):
            valid = False
    else:
        ended = finish == "tool_calls"
        tools = {t["function"]["name"]: t["function"]["parameters"] for t in case["request"]["tools"]}
        calls = choice.message.tool_calls or []
        try:
            valid = bool(calls) and all(
                jsonschema.validate(json.loads(c.function.arguments), tools[c.function.name]) is None for c in calls
            )
            if case["request"].get("parallel_tool_calls") is False:
                valid = valid and len(calls) == 1
        except (ValueError, KeyError, jsonschema.ValidationError):
            valid = False
    return {"name": name, "finish_reason": finish, "ended": ended, "cut": finish == "length", "valid": valid}


async def run_clients(base_url: str, model: str, requests: list[dict], clients: int, max_tokens: int) -> list:
    """Each of ``clients`` clients sends its share of ``requests`` one after another; all at once."""
    sdk = [openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=3600) for _ in range(clients)]
    replies: list = [None] * len(requests)

    async def loop(client: openai.AsyncOpenAI, indices: list[int]) -> None:
        for i in indices:
            replies[i] = await client.chat.completions.create(model=model, max_tokens=max_tokens, **requests[i])

    try:
        await asyncio.gather(*(loop(c, list(range(k, len(requests), clients))) for k, c in enumerate(sdk)))
    finally:
        await asyncio.gather(*(c.close() for c in sdk))
    return replies


async def speed_round(base_url: str, model: str, args: argparse.Namespace, grammar: bool, gsm8k: list) -> dict:
    requests = []
    for i in range(args.clients * args.speed_requests):
        messages = [{"role": "user", "content": gsm8k[i % len(gsm8k)]["question"]}]
        request: dict = {"messages": messages, "temperature": 1.0, "seed": i}
        if grammar:
            request["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "rows", "schema": SPEED_SCHEMA, "strict": True},
            }
        else:
            request["extra_body"] = {"ignore_eos": True}
        requests.append(request)
    start = time.perf_counter()
    replies = await run_clients(base_url, model, requests, args.clients, args.new_tokens)
    wall = time.perf_counter() - start
    tokens = sum(r.usage.completion_tokens for r in replies)
    assert tokens == len(requests) * args.new_tokens, "a reply ended early: the shapes would differ"
    return {"grammar": grammar, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}


def summary(judged: list[dict]) -> dict:
    ended = [j for j in judged if j["ended"]]
    return {
        "requests": len(judged),
        "ended": len(ended),
        "valid_of_ended": sum(j["valid"] for j in ended),
        "valid_share_of_ended": sum(j["valid"] for j in ended) / len(ended) if ended else None,
        "cut_by_length": sum(j["cut"] for j in judged),
        "cut_share": sum(j["cut"] for j in judged) / len(judged),
    }


async def main(args: argparse.Namespace) -> dict:
    policy = await compute_thread.run(load_policy, model_config("smollm2"), "cpu")  # the engine's thread: one pool
    engine = Engine(policy)
    await engine.start()
    server = ModelServer(engine, policy)
    await server.start()
    gsm8k = gsm8k_prompts("test", 64)
    try:
        start = time.perf_counter()
        all_cases = cases(args.requests, gsm8k)
        replies = await run_clients(
            server.base_url, policy.name, [c["request"] for c in all_cases], args.clients, args.max_tokens
        )
        judged = [judge(case, reply.choices[0]) for case, reply in zip(all_cases, replies)]
        validity_s = time.perf_counter() - start
        examples = {}
        for case, reply in zip(all_cases, replies):
            message = reply.choices[0].message
            examples.setdefault(
                case["name"],
                message.content
                if message.content is not None
                else [(c.function.name, c.function.arguments) for c in message.tool_calls or []],
            )
        await speed_round(server.base_url, policy.name, args, True, gsm8k)  # warm-up, not counted
        rounds = []
        for pair in range(args.rounds):  # the order alternates, so a drift in the machine's load favours neither
            for grammar in (False, True) if pair % 2 == 0 else (True, False):
                rounds.append(await speed_round(server.base_url, policy.name, args, grammar, gsm8k))
    finally:
        await server.stop()
        await engine.stop()
    pairs = [sorted(rounds[i : i + 2], key=lambda r: r["grammar"]) for i in range(0, len(rounds), 2)]
    ratios = [grammar["tokens_per_s"] / free["tokens_per_s"] for free, grammar in pairs]
    return {
        "date": datetime.date.today().isoformat(),
        "machine": platform.processor() or platform.machine(),
        "args": vars(args),
        "validity": {
            "overall": summary(judged),
            "per_schema": {
                name: summary([j for j in judged if j["name"] == name])
                for name in dict.fromkeys(j["name"] for j in judged)
            },
            "wall_s": validity_s,
            "examples": examples,
        },
        "speed": {
            "rounds": rounds,
            "free_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rounds if not r["grammar"]),
            "grammar_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rounds if r["grammar"]),
            "ratio_median": statistics.median(ratios),
            "ratios": ratios,
        },
    }


def command_line(args: dict) -> str:
    return " ".join(f"--{key.replace('_', '-')} {value}" for key, value in args.items())


def markdown(result: dict) -> str:
    v, s, a = result["validity"], result["speed"], result["args"]
    lines = [
        f"# Structured outputs on the embedded model ({result['date']})",
        "",
        f"`PYTHONPATH=. python bench/structured.py {command_line(a)}`",
        "",
        f"## Validity: {v['overall']['requests']} sampled requests (temperature 1) over 10 schemas, "
        f"{a['clients']} clients, max_tokens {a['max_tokens']}",
        "",
        "| schema | requests | ended by the grammar | valid of those | cut by max_tokens |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, row in [*v["per_schema"].items(), ("**all**", v["overall"])]:
        share = "n/a" if row["valid_share_of_ended"] is None else f"{row['valid_share_of_ended']:.0%}"
        lines.append(
            f"| {name} | {row['requests']} | {row['ended']} | {row['valid_of_ended']} ({share}) | "
            f"{row['cut_by_length']} ({row['cut_share']:.0%}) |"
        )
    lines += [
        "",
        f"## Decode speed at {a['clients']} clients, {a['new_tokens']} tokens a reply, "
        f"{a['rounds']} pairs of rounds (free and grammar, their order alternating)",
        "",
        "| round | grammar | tokens | wall s | tokens/s |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    for i, r in enumerate(s["rounds"]):
        lines.append(
            f"| {i} | {'yes' if r['grammar'] else 'no'} | {r['tokens']} | {r['wall_s']:.1f} | {r['tokens_per_s']:.1f} |"
        )
    lines += [
        "",
        f"Median tokens/s: free {s['free_tokens_per_s']:.1f}, with a grammar {s['grammar_tokens_per_s']:.1f}; "
        f"grammar / free per pair: {', '.join(f'{x:.2f}' for x in s['ratios'])} (median {s['ratio_median']:.2f}).",
        "",
        "## A reply per schema",
        "",
    ]
    lines += [f"- {name}: `{json.dumps(example, ensure_ascii=False)[:300]}`" for name, example in v["examples"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--speed-requests", type=int, default=1, help="requests per client per speed round")
    parser.add_argument("--rounds", type=int, default=4, help="pairs of speed rounds (free, grammar)")
    args = parser.parse_args()
    result = asyncio.run(main(args))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "structured.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    (RESULTS / "structured.md").write_text(markdown(result))
    print(markdown(result))
