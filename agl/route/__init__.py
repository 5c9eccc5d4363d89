"""The OpenAI-compatible route agents call: HTTP transport, requests and errors, response objects, chat
rendering with exact prefix reuse, tool calls on any model, the Responses API, and the spans it records."""
