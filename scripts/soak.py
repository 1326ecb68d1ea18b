"""Soak test (not in CI): mixed traffic over the server's capacity against one server on 127.0.0.1.

A quarter of the requests are bad input of 14 kinds, some good ones carry tiny deadlines, and the rate is
past what the server computes (RESOURCE_EXHAUSTED must answer some: the run says whether it overloaded).
Reports requests sent and answered by status code, wrong answers among good requests (must be 0), the RSS
of every server process (supervisor, engines, front-ends: its ``worker`` label on the one /metrics) and of
all of them together at 1 minute and at the end (the total's growth must stay under 5%), and the largest
p99 latency of accepted requests over 10-second windows. Starts its own server and stops it (by PID) at the
end.

Usage: python scripts/soak.py [--duration 600] [--rate 200] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import random
import subprocess
import sys
import time
import urllib.request
import zlib
from collections import Counter, defaultdict

import grpc
import numpy as np
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import classifier_pb2_grpc as pb_grpc

PORT, METRICS_PORT = 50177, 8177


def jpeg(seed: int, size=(320, 240)) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()


def png_claiming(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, "PNG")
    tiny = buffer.getvalue()
    ihdr = b"IHDR" + width.to_bytes(4, "big") + height.to_bytes(4, "big") + tiny[24:29]
    return tiny[:12] + ihdr + zlib.crc32(ihdr).to_bytes(4, "big") + tiny[33:]


def raw(dtype, shape, data) -> pb.Image:
    return pb.Image(raw=pb.RawTensor(dtype=dtype, shape=shape, data=data))


GOOD = [jpeg(seed) for seed in range(4)]
BAD = {
    "empty_request": pb.ClassifyRequest(),
    "empty_bytes": pb.ClassifyRequest(images=[pb.Image(encoded=b"")]),
    "junk_bytes": pb.ClassifyRequest(images=[pb.Image(encoded=b"\xff\xd8 not really a jpeg")]),
    "truncated_jpeg": pb.ClassifyRequest(images=[pb.Image(encoded=GOOD[0][:500])]),
    "bomb_png": pb.ClassifyRequest(images=[pb.Image(encoded=png_claiming(30000, 30000))]),
    "raw_bad_shape": pb.ClassifyRequest(images=[raw(pb.RawTensor.UINT8, [10, 10], b"\0" * 100)]),
    "raw_bad_length": pb.ClassifyRequest(images=[raw(pb.RawTensor.UINT8, [10, 10, 3], b"\0" * 299)]),
    "raw_no_dtype": pb.ClassifyRequest(images=[raw(pb.RawTensor.DTYPE_UNSPECIFIED, [10, 10, 3], b"\0" * 300)]),
    "raw_nan": pb.ClassifyRequest(images=[raw(pb.RawTensor.FLOAT32, [3, 224, 224],
                                              np.full(3 * 224 * 224, np.nan, np.float32).tobytes())]),
    "temperature_zero": pb.ClassifyRequest(images=[pb.Image(encoded=GOOD[1])], temperature=0.0),
    "temperature_nan": pb.ClassifyRequest(images=[pb.Image(encoded=GOOD[1])], temperature=math.nan),
    "top_k_zero": pb.ClassifyRequest(images=[pb.Image(encoded=GOOD[2])], top_k=0),
    "top_k_huge": pb.ClassifyRequest(images=[pb.Image(encoded=GOOD[2])], top_k=5000),
    "too_many_images": pb.ClassifyRequest(images=[pb.Image(encoded=GOOD[3])] * 65),
}


def rss_by_process(exposition: str) -> dict[str, float]:
    """Each server process's resident memory in bytes, by its ``worker`` label, from the supervisor's /metrics."""
    return {sample.labels["worker"]: sample.value for family in text_string_to_metric_families(exposition)
            if family.name == "process_resident_memory_bytes" for sample in family.samples}


def rss(metrics_port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        return rss_by_process(response.read().decode())


def rss_report(at_1min: dict[str, float], at_end: dict[str, float]) -> dict:
    """MB per process and in total, at 1 minute and at the end, and the total's growth (a process replaced
    meanwhile counts at its new size)."""
    def mb(values: dict[str, float]) -> dict[str, float]:
        return {worker: round(value / 2**20, 1) for worker, value in sorted(values.items())}

    first, last = sum(at_1min.values()), sum(at_end.values())
    return {"rss_1min_mb": mb(at_1min), "rss_end_mb": mb(at_end), "rss_total_1min_mb": round(first / 2**20, 1),
            "rss_total_end_mb": round(last / 2**20, 1), "rss_growth_pct": 100 * (last - first) / first}


# HTTP/2's REFUSED_STREAM, which gRPC reports as UNAVAILABLE: the connection had --max-concurrent-streams calls
# open, and the server refused this one before reading it (a refusal, as RESOURCE_EXHAUSTED is, not a failure).
REFUSED_STREAM = "RST_STREAM with error code 7"
# What a good request may meet without being a failure: the server over its capacity, or its deadline passed.
REFUSALS = ("RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "REFUSED_STREAM")


def next_request(rng: random.Random) -> tuple[str, pb.ClassifyRequest, float, int | None]:
    """The mix: a quarter bad requests, the rest good images, a twentieth of all with a 5 ms deadline. Returns
    its kind, the request, its timeout and the good image's index (None for a bad one)."""
    draw = rng.random()
    if draw < 0.25:
        name = rng.choice(sorted(BAD))
        return f"bad:{name}", BAD[name], 30.0, None
    good = rng.randrange(len(GOOD))
    tiny = draw > 0.95
    request = pb.ClassifyRequest(images=[pb.Image(encoded=GOOD[good])], top_k=5)
    return ("good_tiny_deadline", request, 0.005, good) if tiny else ("good", request, 30.0, good)


def same_answer(got: pb.ImageResult, want: pb.ImageResult) -> bool:
    return [s.index for s in got.top_k] == [s.index for s in want.top_k] and all(
        abs(a.probability - b.probability) <= 1e-5 for a, b in zip(got.top_k, want.top_k, strict=True))


def code_of(error: grpc.aio.AioRpcError) -> str:
    """The call's status code's name; REFUSED_STREAM for an UNAVAILABLE that is HTTP/2's refusal."""
    code = error.code().name
    return "REFUSED_STREAM" if code == "UNAVAILABLE" and REFUSED_STREAM in (error.details() or "") else code


async def soak(args) -> dict:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{PORT}")
    stub = pb_grpc.ClassifierStub(channel)
    expected = [(await stub.Classify(pb.ClassifyRequest(images=[pb.Image(encoded=image)], top_k=5),
                                     timeout=60)).results[0] for image in GOOD]
    sent, answered, wrong = Counter(), Counter(), Counter()
    messages: dict[str, Counter] = {}  # the other codes' messages: what refused or failed them
    windows: dict[int, list[float]] = defaultdict(list)
    rng = random.Random(1)
    started = time.monotonic()
    rss_at_1min = None
    tasks = []

    async def one(kind: str, request: pb.ClassifyRequest, timeout: float, good_index: int | None) -> None:
        begin = time.monotonic()
        try:
            response = await stub.Classify(request, timeout=timeout)
            code = "OK"
            if good_index is not None and not same_answer(response.results[0], expected[good_index]):
                wrong[kind] += 1
            windows[int((begin - started) // 10)].append(time.monotonic() - begin)
        except grpc.aio.AioRpcError as error:
            code = code_of(error)
            if code not in ("OK", "INVALID_ARGUMENT", *REFUSALS):
                messages.setdefault(code, Counter())[error.details()] += 1
            if good_index is not None and code not in REFUSALS:
                wrong[kind] += 1
        answered[(kind.split(":")[0], code)] += 1

    next_at = started
    while next_at < started + args.duration:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        kind, request, timeout, good = next_request(rng)
        sent[kind.split(":")[0]] += 1
        tasks.append(asyncio.ensure_future(one(kind, request, timeout, good)))
        if rss_at_1min is None and time.monotonic() - started >= 60:
            rss_at_1min = rss(METRICS_PORT)
        next_at += rng.expovariate(args.rate)
    await asyncio.gather(*tasks)
    rss_end = rss(METRICS_PORT)
    await channel.close()
    p99s = [float(np.percentile(values, 99)) for values in windows.values() if len(values) >= 20]
    return {
        "duration_s": args.duration, "rate": args.rate, "sent": dict(sent),
        "answered": {f"{kind}/{code}": count for (kind, code), count in sorted(answered.items())},
        "overloaded": any(code == "RESOURCE_EXHAUSTED" for _, code in answered),
        "other_failures": {code: dict(counted.most_common(3)) for code, counted in messages.items()},
        "wrong_answers_among_good": sum(wrong.values()),
        **rss_report(rss_at_1min or rss_end, rss_end),
        "max_window_p99_ms": 1000 * max(p99s) if p99s else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--rate", type=float, default=200.0,
                        help="requests/s, past the server's capacity (a 2-core CPU computes about 60 of these)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    server = subprocess.Popen([sys.executable, "-m", "resnet_server", "--host", "127.0.0.1", "--port", str(PORT),
                               "--metrics-port", str(METRICS_PORT), "--device", "cpu", "--weights", "random",
                               "--max-queue", "16", "--max-images-per-request", "16", "--log-level", "ERROR"])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{PORT}") as channel:
            grpc.channel_ready_future(channel).result(timeout=120)
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with grpc.insecure_channel(f"127.0.0.1:{PORT}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while health.Check(health_pb2.HealthCheckRequest(), timeout=10).status != 1:
                time.sleep(0.2)
        report = asyncio.run(soak(args))
    finally:
        server.terminate()
        server.wait(60)
    report["server_exit_code"] = server.returncode
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    ok = (report["wrong_answers_among_good"] == 0 and report["rss_growth_pct"] < 5 and server.returncode == 0
          and report["overloaded"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
