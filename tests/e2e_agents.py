"""Agents for end-to-end tests on the tiny random model, written as a user would write them.

The tiny model's text is noise, so these rewards measure something noise varies in (how
many vowels a reply has), which gives every GRPO group a spread of rewards to learn from.
"""

import time
import weakref

import openai

import agl


def vowel_rate(text: str) -> float:
    return sum(c in "aeiou" for c in text.lower()) / max(len(text), 1)


def multi_turn_agent(task: dict, llm: agl.LLM, prompt_template: str, max_turns: int = 3, **_: object) -> float:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
    messages = [{"role": "user", "content": prompt_template.format(question=task["question"])}]
    replies = []
    for turn in range(max_turns):
        reply = client.chat.completions.create(model=llm.model, messages=messages, **llm.sampling_parameters)
        text = reply.choices[0].message.content or ""
        replies.append(text)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"Turn {turn + 2}: say more."}]
    agl.emit_metric("turns", float(len(replies)))
    agl.emit_metric("said_a", float("a" in "".join(replies).lower()))  # a 0/1 score: gets intervals and a paired test
    return vowel_rate("".join(replies))


async def blocking_async_agent(task: dict, llm: agl.LLM, prompt_template: str, **_: object) -> float:
    """Two mistakes people make in async agents: a sync client and time.sleep. Each blocks the loop."""
    time.sleep(1.2)
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key, timeout=60, max_retries=0)
    reply = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": prompt_template.format(question=task["question"])}],
        **llm.sampling_parameters,
    )
    return vowel_rate(reply.choices[0].message.content or "")


CLIENTS: list[weakref.ref] = []  # every client_per_rollout_agent's client, to see when it is freed


def client_per_rollout_agent(task: dict, llm: agl.LLM, prompt_template: str, **_: object) -> float:
    """A client made per rollout, as deployed code does: it is left in a reference cycle."""
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
    CLIENTS.append(weakref.ref(client))
    reply = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": prompt_template.format(question=task["question"])}],
        **llm.sampling_parameters,
    )
    return vowel_rate(reply.choices[0].message.content or "")


def load(split: str) -> list[dict]:
    return [{"id": f"{split}-{i}", "question": f"Question number {i}?"} for i in range(16)]


_PACED = {"calls": 0}


def paced_hello_agent(task: dict, llm: agl.LLM, prompt_template: str, **kwargs: object) -> float:
    """The hello agent, slowed down after ``AGL_TEST_FAST_ROLLOUTS`` rollouts in this process by
    ``AGL_TEST_SLOW_S`` seconds each (unset: never): a job that stays busy in a chosen step, for as long
    as a test needs another process to act beside it."""
    import os

    from tasks.hello.agent import hello_agent

    _PACED["calls"] += 1
    if _PACED["calls"] > int(os.environ.get("AGL_TEST_FAST_ROLLOUTS", "1000000000")):
        time.sleep(float(os.environ.get("AGL_TEST_SLOW_S", "0")))
    return hello_agent(task, llm, prompt_template, **kwargs)
