"""The OpenAI-compatible HTTP server (`engine serve`)."""
