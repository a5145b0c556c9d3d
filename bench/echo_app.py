"""An app that only receives a body and answers a fixed one: the HTTP floor for a workload.

    ECHO_RESPONSE=/path/to/response.json uvicorn bench.echo_app:app
"""

import os

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

app = FastAPI()
RESPONSE = open(os.environ["ECHO_RESPONSE"], "rb").read()  # noqa: SIM115


@app.post("/attend")
async def attend(request: Request) -> Response:
    chunks = [chunk async for chunk in request.stream()]
    del chunks
    return Response(RESPONSE, media_type="application/json")


async def raw_app(scope: Scope, receive: Receive, send: Send) -> None:
    """The same without a framework: uvicorn's own floor (httptools, uvloop, one ASGI cycle)."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(RESPONSE)).encode())]})
    await send({"type": "http.response.body", "body": RESPONSE})
