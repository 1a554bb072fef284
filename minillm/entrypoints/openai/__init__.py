"""The OpenAI-compatible server (chapter 12): `minillm serve`, or api_server.run_server.

Importing this package needs nothing beyond minillm; its modules (api_server, serving_*, protocol,
metrics) need the `serve` extra: fastapi, uvicorn, prometheus-client.
"""
