"""A small closed-loop HTTP/1.1 load generator, run in its own process by the REST workload.

``python -m bench.loadgen SPEC.json`` reads ``{"port", "concurrency", "seconds",
"max_requests", "requests": [{"method", "path", "headers", "body"}]}`` and prints JSON:
the latency of each request, the wall time, and the count of each status. ``{n}`` in a
path or body becomes the request's sequence number (unique ids for POSTs).

Why not locust or wrk: on this 2-core machine the generator competes with gunicorn and
PostgreSQL for the CPU, so it must cost little per request and add no dependency. locust
brings gevent, Flask and its own HTTP client stack for features this does not need, and
wrk is not on PyPI (``make bench`` must work on a fresh machine with pip alone).
A caller reuses its connection while the server keeps it open; gunicorn's sync workers
close it after each response, so each request then opens a new one (in its latency, for
the API and the bare endpoint alike). It only connects to 127.0.0.1, and stops after
``seconds`` or ``max_requests``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

HOST = "127.0.0.1"


def _encode(req: dict[str, Any], n: int, port: int) -> bytes:
    body = req.get("body", "").replace("{n}", str(n)).encode()
    lines = [f"{req['method']} {req['path'].replace('{n}', str(n))} HTTP/1.1", f"Host: {HOST}:{port}"]
    lines += [f"{k}: {v}" for k, v in req.get("headers", {}).items()]
    if body or req["method"] in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """Read one response; return its status and whether the server keeps the connection."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
    else:
        await reader.read()
        return status, False
    return status, headers.get("connection", "").lower() != "close"


async def main(spec: dict[str, Any]) -> dict[str, Any]:
    port, requests = int(spec["port"]), spec["requests"]
    deadline = time.perf_counter() + float(spec["seconds"])
    budget = iter(range(int(spec["max_requests"])))
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    errors = 0

    async def caller() -> None:
        nonlocal errors
        reader = writer = None
        for n in budget:
            if time.perf_counter() >= deadline:
                break
            payload = _encode(requests[n % len(requests)], n, port)
            t0 = time.perf_counter()
            try:
                if writer is None:
                    reader, writer = await asyncio.open_connection(HOST, port)
                writer.write(payload)
                status, keep = await _read_response(reader)
            except (OSError, asyncio.IncompleteReadError, ValueError):
                errors += 1
                if writer is not None:
                    writer.close()
                reader = writer = None
                continue
            latencies.append(time.perf_counter() - t0)
            statuses[status] = statuses.get(status, 0) + 1
            if not keep:
                writer.close()
                reader = writer = None
        if writer is not None:
            writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(int(spec["concurrency"]))))
    return {"seconds": time.perf_counter() - t0, "latencies": latencies, "statuses": statuses, "errors": errors}


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        print(json.dumps(asyncio.run(main(json.load(fh)))))
