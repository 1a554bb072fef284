"""Ways into minillm from outside Python: the OpenAI-compatible HTTP server (chapter 12)."""
