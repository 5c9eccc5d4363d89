"""Agents for the research-workflow tests (tiny random model), written as a user would write them."""

import openai

import agl

MARKER = "[BEST]"


def marker_agent(task: dict, llm: agl.LLM, prompt_template: str, **_: object) -> float:
    """Calls the LLM through the route like any agent; the template decides most of the reward:
    one with MARKER in it is clearly better, whatever the (random) model says."""
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
    reply = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": prompt_template.format(question=task["question"])}],
        **llm.sampling_parameters,
    )
    text = reply.choices[0].message.content or ""
    vowels = sum(c in "aeiou" for c in text.lower()) / max(len(text), 1)
    agl.emit_metric("marked", float(MARKER in prompt_template))
    return 0.7 * float(MARKER in prompt_template) + 0.3 * vowels


def broken_load(split: str) -> list[dict]:
    raise RuntimeError("this data loader always fails")
