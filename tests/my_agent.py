# my_agent.py: python harness.py task=custom task.agent=my_agent:my_agent task.data=capitals.jsonl algo=grpo
import openai

import agl


def my_agent(task: dict, llm: agl.LLM, prompt_template: str, **resources) -> float:
    client = openai.OpenAI(base_url=llm.base_url, api_key=llm.api_key)
    reply = client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": prompt_template.format(**task)}],
        **llm.sampling_parameters,  # temperature / max_tokens, chosen by the algorithm
    )
    text = reply.choices[0].message.content or ""
    agl.emit_metric("short", float(len(text) < 80))  # any number: averaged in eval tables
    return 1.0 if task["answer"].lower() in text.lower() else 0.0  # the reward
