"""The HTTP transport: the only place that knows uvicorn, Starlette and FastAPI."""
