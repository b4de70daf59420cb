"""The HTTP frontend role: OpenAI's completions, chat and Responses APIs and Anthropic's Messages
API over the client SDK, one process per ``worker`` (docs/architecture.md names every module)."""
