"""An app that only receives a body and answers a fixed one: the HTTP floor for a workload.

    ECHO_RESPONSE=/path/to/response.json uvicorn bench.echo_app:app
"""

import os

from fastapi import FastAPI, Request
from fastapi.responses import Response

app = FastAPI()
RESPONSE = open(os.environ["ECHO_RESPONSE"], "rb").read()  # noqa: SIM115


@app.post("/attend")
async def attend(request: Request) -> Response:
    chunks = [chunk async for chunk in request.stream()]
    del chunks
    return Response(RESPONSE, media_type="application/json")
