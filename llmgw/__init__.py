"""llmgw: one OpenAI-compatible endpoint in front of the LLMs on your own servers."""

__version__ = "0.1.0"
