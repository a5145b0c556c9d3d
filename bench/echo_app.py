"""An app that only receives a body and answers a fixed one: the HTTP floor for a workload.

    ECHO_RESPONSE=/path/to/response.json uvicorn bench.echo_app:app
"""

import os

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

app = FastAPI()
# Importable without it (bench/guard_cost.py uses `drain`); uvicorn serving this module needs it.
RESPONSE = open(os.environ["ECHO_RESPONSE"], "rb").read() if "ECHO_RESPONSE" in os.environ else b""  # noqa: SIM115


@app.post("/attend")
async def attend(request: Request) -> Response:
    chunks = [chunk async for chunk in request.stream()]
    del chunks
    return Response(RESPONSE, media_type="application/json")


async def drain(receive: Receive) -> None:
    """Every message of a request's body, read and dropped."""
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)


async def raw_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The same without a framework: uvicorn's own floor (httptools, uvloop, one ASGI cycle)."""
    if scope["type"] != "http":
        return
    await drain(receive)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(RESPONSE)).encode())]})
    await send({"type": "http.response.body", "body": RESPONSE})
