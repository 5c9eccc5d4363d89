"""Agents written with the agent frameworks, as their users write them: a plain function
``(task, llm, **resources) -> float`` that builds the framework's client on ``llm.base_url`` and
``llm.model`` and returns a reward. tests/test_frameworks.py runs them through the real route.

Per framework: ``chat`` (one call), ``stream`` (one streamed call), ``multi_turn`` (a second
user turn on top of the first reply) and ``tools`` (the model calls ``add``, gets its result and
answers; streamed when ``stream=True``). Each appends what the framework handed back to
``transcript`` (one entry per model reply: ``{"text": ...}`` or ``{"calls": [(name, args)]}``,
with ``"chunks"`` for streamed replies), so the test can hold it against the recorded spans.

Each framework is imported inside its agents, so this module imports without any of them.
"""

import asyncio
import json
import os

import agl

INSTRUCTIONS = "You are a careful assistant. Use the add tool for arithmetic."
FOLLOW_UP = "Now say it again, shorter."


def _sampling(llm: agl.LLM) -> tuple[float | None, int | None]:
    return llm.sampling_parameters.get("temperature"), llm.sampling_parameters.get("max_tokens")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def _reward(text: str) -> float:
    return float("3" in text)


# ----------------------------------------------------------------------------- LangChain


def _langchain_model(llm: agl.LLM, responses: bool = False):
    from langchain_openai import ChatOpenAI

    temperature, max_tokens = _sampling(llm)
    return ChatOpenAI(
        model=llm.model,
        base_url=llm.base_url,
        api_key=llm.api_key,
        temperature=temperature,
        max_tokens=max_tokens,
        max_retries=0,
        timeout=120,
        use_responses_api=responses,
    )


def _langchain_text(message) -> str:
    return message.text if isinstance(message.text, str) else message.text()  # a property in langchain-core >= 1


def langchain_chat(task: dict, llm: agl.LLM, transcript: list, responses: bool = False, **_) -> float:
    from langchain_core.messages import HumanMessage, SystemMessage

    reply = _langchain_model(llm, responses).invoke([SystemMessage("Be brief."), HumanMessage(task["question"])])
    transcript.append({"text": _langchain_text(reply)})
    return _reward(_langchain_text(reply))


def langchain_stream(task: dict, llm: agl.LLM, transcript: list, responses: bool = False, **_) -> float:
    chunks = list(_langchain_model(llm, responses).stream(task["question"]))
    text = "".join(_langchain_text(c) for c in chunks)
    transcript.append({"text": text, "chunks": sum(bool(_langchain_text(c)) for c in chunks)})
    return _reward(text)


def langchain_multi_turn(task: dict, llm: agl.LLM, transcript: list, responses: bool = False, **_) -> float:
    from langchain_core.messages import HumanMessage

    model = _langchain_model(llm, responses)
    messages = [HumanMessage(task["question"])]
    for _turn in range(2):
        reply = model.invoke(messages)
        transcript.append({"text": _langchain_text(reply)})
        messages += [reply, HumanMessage(FOLLOW_UP)]
    return _reward(_langchain_text(reply))


def langchain_tools(
    task: dict, llm: agl.LLM, transcript: list, stream: bool = False, responses: bool = False, **_
) -> float:
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool

    add_tool = tool(add)
    model = _langchain_model(llm, responses).bind_tools([add_tool])
    messages = [SystemMessage(INSTRUCTIONS), HumanMessage(task["question"])]
    for _turn in range(4):
        if stream:
            chunks = list(model.stream(messages))
            reply = chunks[0]
            for chunk in chunks[1:]:
                reply += chunk
        else:
            reply = model.invoke(messages)
        entry = (
            {"calls": [(c["name"], c["args"]) for c in reply.tool_calls]}
            if reply.tool_calls
            else {"text": _langchain_text(reply)}
        )
        transcript.append(
            {**entry, "chunks": sum(bool(_langchain_text(c) or c.tool_call_chunks) for c in chunks)}
            if stream
            else entry
        )
        messages.append(reply)
        if not reply.tool_calls:
            return _reward(_langchain_text(reply))
        for call in reply.tool_calls:
            messages.append(ToolMessage(str(add_tool.invoke(call["args"])), tool_call_id=call["id"]))
    return 0.0


# ----------------------------------------------------------------------------- LiteLLM


def _litellm():
    # LiteLLM fetches its model price list from the internet at import unless told not to.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    return litellm


def _litellm_call(llm: agl.LLM, messages: list, **kwargs):
    temperature, max_tokens = _sampling(llm)
    return _litellm().completion(
        model=f"openai/{llm.model}",
        api_base=llm.base_url,
        api_key=llm.api_key,
        messages=messages,
        temperature=temperature,
        max_tokens=max_tokens,
        num_retries=0,
        timeout=120,
        **kwargs,
    )


ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def litellm_chat(task: dict, llm: agl.LLM, transcript: list, **_) -> float:
    reply = _litellm_call(
        llm, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": task["question"]}]
    )
    text = reply.choices[0].message.content or ""
    transcript.append({"text": text})
    return _reward(text)


def _litellm_streamed(llm: agl.LLM, messages: list, **kwargs):
    chunks = list(_litellm_call(llm, messages, stream=True, **kwargs))
    message = _litellm().stream_chunk_builder(chunks, messages=messages).choices[0].message
    return message, sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) + sum(
        bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks
    )


def litellm_stream(task: dict, llm: agl.LLM, transcript: list, **_) -> float:
    message, chunks = _litellm_streamed(llm, [{"role": "user", "content": task["question"]}])
    transcript.append({"text": message.content or "", "chunks": chunks})
    return _reward(message.content or "")


def litellm_multi_turn(task: dict, llm: agl.LLM, transcript: list, **_) -> float:
    messages = [{"role": "user", "content": task["question"]}]
    for _turn in range(2):
        text = _litellm_call(llm, messages).choices[0].message.content or ""
        transcript.append({"text": text})
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UP}]
    return _reward(text)


def litellm_tools(task: dict, llm: agl.LLM, transcript: list, stream: bool = False, **_) -> float:
    # litellm 1.106.2 imports `mcp` for any call with tools: install `litellm[mcp]`
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": task["question"]}]
    for _turn in range(4):
        if stream:
            message, chunks = _litellm_streamed(llm, messages, tools=[ADD_TOOL])
        else:
            message = _litellm_call(llm, messages, tools=[ADD_TOOL]).choices[0].message
        calls = message.tool_calls or []
        entry = (
            {"calls": [(c.function.name, json.loads(c.function.arguments)) for c in calls]}
            if calls
            else {"text": message.content or ""}
        )
        transcript.append({**entry, "chunks": chunks} if stream else entry)
        messages.append(message.model_dump(exclude_none=True))  # what LiteLLM's docs do: the message goes back as is
        if not calls:
            return _reward(message.content or "")
        for call in calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": str(add(**json.loads(call.function.arguments)))}
            )
    return 0.0


# ----------------------------------------------------------------------------- pydantic-ai


def _pydantic_agent(llm: agl.LLM, tools: bool = False, responses: bool = False, instructions: str | None = None):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    temperature, max_tokens = _sampling(llm)
    provider = OpenAIProvider(base_url=llm.base_url, api_key=llm.api_key)
    model = (OpenAIResponsesModel if responses else OpenAIChatModel)(llm.model, provider=provider)
    settings = {"temperature": temperature, "max_tokens": max_tokens}
    return Agent(
        model,
        instructions=instructions,
        model_settings={k: v for k, v in settings.items() if v is not None},
        tools=[add] if tools else [],
    )


def pydantic_ai_chat(task: dict, llm: agl.LLM, transcript: list, responses: bool = False, **_) -> float:
    result = _pydantic_agent(llm, responses=responses, instructions="Be brief.").run_sync(task["question"])
    transcript.append({"text": result.output})
    return _reward(result.output)


def pydantic_ai_stream(task: dict, llm: agl.LLM, transcript: list, responses: bool = False, **_) -> float:
    async def run() -> tuple[str, int]:
        async with _pydantic_agent(llm, responses=responses).run_stream(task["question"]) as result:
            deltas = [d async for d in result.stream_text(delta=True, debounce_by=None)]
        return "".join(deltas), sum(bool(d) for d in deltas)

    text, chunks = asyncio.run(run())
    transcript.append({"text": text, "chunks": chunks})
    return _reward(text)


def pydantic_ai_multi_turn(task: dict, llm: agl.LLM, transcript: list, responses: bool = False, **_) -> float:
    agent = _pydantic_agent(llm, responses=responses)
    first = agent.run_sync(task["question"])
    second = agent.run_sync(FOLLOW_UP, message_history=first.all_messages())
    transcript += [{"text": first.output}, {"text": second.output}]
    return _reward(second.output)


def _pydantic_replies(messages) -> list[dict]:
    """The model's replies in a run's messages, as the transcript holds them."""
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart

    replies = []
    for message in messages:
        if isinstance(message, ModelResponse):
            calls = [(p.tool_name, p.args_as_dict()) for p in message.parts if isinstance(p, ToolCallPart)]
            replies.append(
                {"calls": calls}
                if calls
                else {"text": "".join(p.content for p in message.parts if isinstance(p, TextPart))}
            )
    return replies


def pydantic_ai_tools(
    task: dict, llm: agl.LLM, transcript: list, stream: bool = False, responses: bool = False, **_
) -> float:
    agent = _pydantic_agent(llm, tools=True, responses=responses, instructions=INSTRUCTIONS)
    if not stream:
        result = agent.run_sync(task["question"])
        transcript += _pydantic_replies(result.all_messages())
        return _reward(result.output)

    from pydantic_ai import AgentRunResultEvent
    from pydantic_ai.messages import FunctionToolResultEvent, PartDeltaEvent, PartStartEvent

    async def run() -> list:
        # run_stream_events streams every model reply (run_stream stops at the first text)
        async with agent.run_stream_events(task["question"]) as stream:
            return [event async for event in stream]

    events = asyncio.run(run())
    [final] = [e for e in events if isinstance(e, AgentRunResultEvent)]
    deltas, after_tools = [0], False  # streamed pieces per model reply: a reply starts after tool results
    for event in events:
        if isinstance(event, FunctionToolResultEvent):
            after_tools = True
        elif isinstance(event, PartStartEvent) and after_tools:
            deltas.append(0)
            after_tools = False
        deltas[-1] += isinstance(event, (PartStartEvent, PartDeltaEvent))
    replies = _pydantic_replies(final.result.all_messages())
    transcript += (
        [{**reply, "chunks": n} for reply, n in zip(replies, deltas)] if len(deltas) == len(replies) else replies
    )
    return _reward(final.result.output)


# ----------------------------------------------------------------------------- the OpenAI Agents SDK


def _agents_config(llm: agl.LLM, responses: bool):
    """(model, run config): the SDK's default Responses model, or OpenAIChatCompletionsModel."""
    import agents
    import openai

    client = openai.AsyncOpenAI(base_url=llm.base_url, api_key=llm.api_key, max_retries=0, timeout=120)
    provider = agents.OpenAIProvider(openai_client=client, use_responses=responses)
    model = (
        provider.get_model(llm.model)
        if responses
        else agents.OpenAIChatCompletionsModel(model=llm.model, openai_client=client)
    )
    return client, model, agents.RunConfig(model_provider=provider, tracing_disabled=True)


def _agents_agent(llm: agl.LLM, model, tools: bool = False, instructions: str | None = None):
    import agents

    temperature, max_tokens = _sampling(llm)
    return agents.Agent(
        name="assistant",
        instructions=instructions,
        model=model,
        tools=[agents.function_tool(add)] if tools else [],
        model_settings=agents.ModelSettings(temperature=temperature, max_tokens=max_tokens),
    )


def _agents_replies(result) -> list[dict]:
    replies = []
    for response in result.raw_responses:
        calls = [(item.name, json.loads(item.arguments)) for item in response.output if item.type == "function_call"]
        text = "".join(
            part.text
            for item in response.output
            if item.type == "message"
            for part in item.content
            if part.type == "output_text"
        )
        replies.append({"calls": calls} if calls else {"text": text})
    return replies


async def openai_agents_chat(task: dict, llm: agl.LLM, transcript: list, responses: bool = True, **_) -> float:
    import agents

    client, model, config = _agents_config(llm, responses)
    async with client:
        result = await agents.Runner.run(
            _agents_agent(llm, model, instructions="Be brief."), task["question"], run_config=config
        )
    transcript.append({"text": result.final_output})
    return _reward(result.final_output)


async def _agents_streamed(agent, run_input, config):
    """(result, streamed pieces per model reply)."""
    import agents
    from openai.types.responses import (
        ResponseCompletedEvent,
        ResponseFunctionCallArgumentsDeltaEvent,
        ResponseTextDeltaEvent,
    )

    result = agents.Runner.run_streamed(agent, run_input, run_config=config)
    deltas = [0]
    async for event in result.stream_events():
        if event.type == "raw_response_event":
            if isinstance(event.data, (ResponseTextDeltaEvent, ResponseFunctionCallArgumentsDeltaEvent)):
                deltas[-1] += 1
            elif isinstance(event.data, ResponseCompletedEvent):
                deltas.append(0)
    return result, deltas[:-1]


async def openai_agents_stream(task: dict, llm: agl.LLM, transcript: list, responses: bool = True, **_) -> float:
    client, model, config = _agents_config(llm, responses)
    async with client:
        result, [deltas] = await _agents_streamed(_agents_agent(llm, model), task["question"], config)
    transcript.append({"text": result.final_output, "chunks": deltas})
    return _reward(result.final_output)


async def openai_agents_multi_turn(task: dict, llm: agl.LLM, transcript: list, responses: bool = True, **_) -> float:
    import agents

    client, model, config = _agents_config(llm, responses)
    agent = _agents_agent(llm, model)
    async with client:
        first = await agents.Runner.run(agent, task["question"], run_config=config)
        second = await agents.Runner.run(
            agent, first.to_input_list() + [{"role": "user", "content": FOLLOW_UP}], run_config=config
        )
    transcript += [{"text": first.final_output}, {"text": second.final_output}]
    return _reward(second.final_output)


async def openai_agents_tools(
    task: dict, llm: agl.LLM, transcript: list, stream: bool = False, responses: bool = True, **_
) -> float:
    import agents

    client, model, config = _agents_config(llm, responses)
    agent = _agents_agent(llm, model, tools=True, instructions=INSTRUCTIONS)
    async with client:
        if stream:
            result, deltas = await _agents_streamed(agent, task["question"], config)
        else:
            result = await agents.Runner.run(agent, task["question"], run_config=config)
    replies = _agents_replies(result)
    transcript += (
        [{**reply, "chunks": n} for reply, n in zip(replies, deltas)]
        if stream and len(deltas) == len(replies)
        else replies
    )
    return _reward(result.final_output)


# ----------------------------------------------------------------------------- structured outputs
# Each framework's own way of asking for a reply shaped as a pydantic model; the route enforces the
# schema (docs/structured-outputs.md). The agents append {"parsed": the model's fields} to transcript.


def structured_output_type():
    """The reply's shape: small enough that even the tiny random model ends it within a few tokens."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Sum(BaseModel):
        answer: int = Field(ge=0, le=9)
        sure: bool
        unit: Literal["apples", "pears"]

    return Sum


def _structured_reward(output, transcript: list) -> float:
    transcript.append({"parsed": output.model_dump()})
    return float(output.answer == 3)


def langchain_structured(task: dict, llm: agl.LLM, transcript: list, responses: bool = False, **_) -> float:
    model = _langchain_model(llm, responses).with_structured_output(structured_output_type())  # method="json_schema"
    return _structured_reward(model.invoke(task["question"]), transcript)


def pydantic_ai_structured(task: dict, llm: agl.LLM, transcript: list, responses: bool = False, **_) -> float:
    from pydantic_ai import Agent, NativeOutput

    agent = _pydantic_agent(llm, responses=responses)
    native = Agent(agent.model, output_type=NativeOutput(structured_output_type()), model_settings=agent.model_settings)
    return _structured_reward(native.run_sync(task["question"]).output, transcript)


async def openai_agents_structured(task: dict, llm: agl.LLM, transcript: list, responses: bool = True, **_) -> float:
    import agents

    client, model, config = _agents_config(llm, responses)
    agent = _agents_agent(llm, model).clone(output_type=structured_output_type())
    async with client:
        result = await agents.Runner.run(agent, task["question"], run_config=config)
    return _structured_reward(result.final_output, transcript)
