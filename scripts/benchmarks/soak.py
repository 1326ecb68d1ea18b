"""Soak test (not in CI): mixed traffic over the server's capacity against one server on 127.0.0.1.

A quarter of the requests are bad input of 16 kinds, some good ones carry tiny deadlines, and the rate is
past what the server computes (RESOURCE_EXHAUSTED must answer some: the run says whether it overloaded).
Good images go four ways, as many each: our Classify, and the Open Inference Protocol's ModelInfer with the
image inline, read from a region of /dev/shm the soak registered (Triton's system shared memory), and read
from it with the top-k probabilities written back into it. Every ``--reload-every`` seconds the weights are
reloaded while this goes on (RepositoryModelLoad, as ``tritonclient``'s ``load_model`` sends it; the seeded
random weights again, so every answer stays comparable). Reports requests sent and answered by status code,
wrong answers among good requests (must be 0), the reloads by outcome (all OK), the RSS of every server process
(supervisor, engines, front-ends: its ``worker`` label on the one /metrics) and of all of them together at 1
minute and at the end (the total's growth must stay under 5%), the largest p99 latency of accepted requests
over 10-second windows, and what the run left in /dev/shm (nothing). With ``--hostile``, a hostile client sends
every field's worst value (scripts/benchmarks/hostile_cases.py) in a loop meanwhile, each of which must be
refused, and no normal call may fail for it. Starts its own server and stops it (by PID) at the end.

Usage: python scripts/benchmarks/soak.py [--duration 600] [--rate 200] [--reload-every 30] [--hostile] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import math
import mmap
import os
import random
import struct
import subprocess
import sys
import threading
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
from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_client.api import grpc_predict_v2_pb2_grpc as oip_grpc

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


SHM_FOLDER = "/dev/shm"
SLOT, OUTPUT_SLOTS = 4096, 256  # an answer's top-k probabilities written into the region: one slot a call in flight
TOP_K = ("top_k_indices", "top_k_probabilities")
GOOD_PATHS = ("classify", "oip", "oip_shm", "oip_shm_out")  # as many good images each way


class SharedImages:
    """The soak's region of /dev/shm: every good image as a BYTES tensor from its start, then OUTPUT_SLOTS slots
    of SLOT bytes for answers (a call takes one while it is in flight)."""

    def __init__(self) -> None:
        self.name = f"soak-{os.getpid()}"
        self.tensors = [struct.pack("<I", len(image)) + image for image in GOOD]
        self.offsets = list(itertools.accumulate((len(tensor) for tensor in self.tensors[:-1]), initial=0))
        self.slots_at = -(-sum(map(len, self.tensors)) // SLOT) * SLOT
        self.byte_size = self.slots_at + OUTPUT_SLOTS * SLOT
        fd = os.open(os.path.join(SHM_FOLDER, self.name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.byte_size)
            self.map = mmap.mmap(fd, self.byte_size)
        finally:
            os.close(fd)
        for offset, tensor in zip(self.offsets, self.tensors, strict=True):
            self.map[offset:offset + len(tensor)] = tensor
        self.free_slots = list(range(OUTPUT_SLOTS))

    def refer(self, parameters, offset: int, byte_size: int) -> None:
        """A tensor's ``parameters`` made to name ``byte_size`` bytes at ``offset`` in this region."""
        parameters["shared_memory_region"].string_param = self.name
        parameters["shared_memory_offset"].int64_param = offset
        parameters["shared_memory_byte_size"].int64_param = byte_size

    def remove(self) -> None:
        self.map.close()
        os.unlink(os.path.join(SHM_FOLDER, self.name))


def infer_request(shared: SharedImages, good: int, by_reference: bool, slot: int | None = None,
                  offset: int | None = None) -> oip.ModelInferRequest:
    """ModelInfer for good image ``good``: inline, or at its place in the region (or at ``offset``); its top 5
    probabilities answered inline, or into ``slot``."""
    tensor = oip.ModelInferRequest.InferInputTensor(name="input", datatype="BYTES", shape=[1])
    if by_reference:
        at = shared.offsets[good] if offset is None else offset
        shared.refer(tensor.parameters, at, len(shared.tensors[good]))
    request = oip.ModelInferRequest(model_name="resnet18", inputs=[tensor], outputs=[
        oip.ModelInferRequest.InferRequestedOutputTensor(name=name) for name in TOP_K])
    request.parameters["top_k"].int64_param = 5
    if not by_reference:
        request.raw_input_contents.append(shared.tensors[good])
    if slot is not None:
        shared.refer(request.outputs[1].parameters, shared.slots_at + slot * SLOT, SLOT)
    return request


def bad_infer_requests(shared: SharedImages) -> dict[str, oip.ModelInferRequest]:
    """ModelInfer requests that name what is not there: INVALID_ARGUMENT each."""
    unknown = infer_request(shared, 0, True)
    unknown.inputs[0].parameters["shared_memory_region"].string_param = "no-such-region"
    return {"oip_unknown_region": unknown,
            "oip_out_of_bounds": infer_request(shared, 0, True, offset=shared.byte_size - 8)}


def same_top_k(indices: bytes, probabilities: bytes, want: pb.ImageResult) -> bool:
    got = zip(struct.unpack("<5q", indices), struct.unpack("<5f", probabilities[:20]), strict=True)
    return all(index == score.index and abs(probability - score.probability) <= 1e-5
               for (index, probability), score in zip(got, want.top_k, strict=True))


async def infer_good(stub, shared: SharedImages, path: str, good: int, timeout: float,
                     want: pb.ImageResult) -> bool:
    """Good image ``good`` through ModelInfer by ``path``; whether its top 5 are Classify's. A call with a tiny
    deadline writes into no slot: the server may still be writing after its caller has given up."""
    slot = shared.free_slots.pop() if path == "oip_shm_out" and timeout > 1 and shared.free_slots else None
    try:
        response = await stub.ModelInfer(infer_request(shared, good, path != "oip", slot), timeout=timeout)
        probabilities = response.raw_output_contents[1]
        if slot is not None:
            at = shared.slots_at + slot * SLOT
            probabilities = shared.map[at:at + 20]  # the five float32s, not the rest of the region
        return same_top_k(response.raw_output_contents[0], probabilities, want)
    finally:
        if slot is not None:
            shared.free_slots.append(slot)


async def reload_every(stub, seconds: float, until: float, outcomes: Counter) -> None:
    """The weights reloaded every ``seconds`` while the soak runs, as tritonclient's load_model asks."""
    while time.monotonic() + seconds < until:
        await asyncio.sleep(seconds)
        try:
            await stub.RepositoryModelLoad(oip.RepositoryModelLoadRequest(model_name="resnet18"), timeout=300)
            outcomes["OK"] += 1
        except grpc.aio.AioRpcError as error:
            outcomes[f"{error.code().name}: {error.details()}"] += 1


async def right(stub, infer, shared: SharedImages, path: str, request, timeout: float, good_index: int | None,
                expected: list[pb.ImageResult]) -> bool:
    """The request sent by ``path``; whether a good image's answer is its reference in ``expected``."""
    if good_index is None:
        await (stub.Classify if path == "classify" else infer.ModelInfer)(request, timeout=timeout)
        return True
    if path == "classify":
        return same_answer((await stub.Classify(request, timeout=timeout)).results[0], expected[good_index])
    return await infer_good(infer, shared, path, good_index, timeout, expected[good_index])


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


def next_request(rng: random.Random, bad_infer: dict[str, oip.ModelInferRequest]
                 ) -> tuple[str, str, object, float, int | None]:
    """The mix: a quarter bad requests, the rest good images (each of GOOD_PATHS as often), a twentieth of all
    with a 5 ms deadline. Returns its kind, its path, the request (a good ModelInfer's is made as it is sent),
    its timeout and the good image's index (None for a bad one)."""
    draw = rng.random()
    if draw < 0.25:
        name = rng.choice(sorted(BAD) + sorted(bad_infer))
        return f"bad:{name}", "classify" if name in BAD else "oip", BAD.get(name) or bad_infer[name], 30.0, None
    good, path = rng.randrange(len(GOOD)), rng.choice(GOOD_PATHS)
    kind = "good_tiny_deadline" if draw > 0.95 else "good"
    request = pb.ClassifyRequest(images=[pb.Image(encoded=GOOD[good])], top_k=5) if path == "classify" else None
    named = kind if path == "classify" else f"{kind}_{path}"  # good, good_oip, good_oip_shm, ... as reported
    return named, path, request, 0.005 if kind == "good_tiny_deadline" else 30.0, good


def same_answer(got: pb.ImageResult, want: pb.ImageResult) -> bool:
    return [s.index for s in got.top_k] == [s.index for s in want.top_k] and all(
        abs(a.probability - b.probability) <= 1e-5 for a, b in zip(got.top_k, want.top_k, strict=True))


def code_of(error: grpc.aio.AioRpcError) -> str:
    """The call's status code's name; REFUSED_STREAM for an UNAVAILABLE that is HTTP/2's refusal."""
    code = error.code().name
    return "REFUSED_STREAM" if code == "UNAVAILABLE" and REFUSED_STREAM in (error.details() or "") else code


async def soak(args, shared: SharedImages) -> dict:
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{PORT}")
    stub, infer = pb_grpc.ClassifierStub(channel), oip_grpc.GRPCInferenceServiceStub(channel)
    expected = [(await stub.Classify(pb.ClassifyRequest(images=[pb.Image(encoded=image)], top_k=5),
                                     timeout=60)).results[0] for image in GOOD]
    await infer.SystemSharedMemoryRegister(oip.SystemSharedMemoryRegisterRequest(
        name=shared.name, key=f"/{shared.name}", byte_size=shared.byte_size), timeout=30)
    bad_infer = bad_infer_requests(shared)
    sent, answered, wrong, reloads = Counter(), Counter(), Counter(), Counter()
    messages: dict[str, Counter] = {}  # the other codes' messages: what refused or failed them
    windows: dict[int, list[float]] = defaultdict(list)
    rng = random.Random(1)
    started = time.monotonic()
    rss_at_1min = None
    tasks = []

    async def one(kind: str, path: str, request, timeout: float, good_index: int | None) -> None:
        begin = time.monotonic()
        try:
            code = "OK"
            if not await right(stub, infer, shared, path, request, timeout, good_index, expected):
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
    reloading = asyncio.ensure_future(reload_every(infer, args.reload_every, started + args.duration, reloads))
    while next_at < started + args.duration:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        kind, path, request, timeout, good = next_request(rng, bad_infer)
        sent[kind.split(":")[0]] += 1
        tasks.append(asyncio.ensure_future(one(kind, path, request, timeout, good)))
        if rss_at_1min is None and time.monotonic() - started >= 60:
            rss_at_1min = rss(METRICS_PORT)
        next_at += rng.expovariate(args.rate)
    await asyncio.gather(*tasks, reloading)
    rss_end = rss(METRICS_PORT)
    await infer.SystemSharedMemoryUnregister(oip.SystemSharedMemoryUnregisterRequest(name=shared.name), timeout=30)
    await channel.close()
    p99s = [float(np.percentile(values, 99)) for values in windows.values() if len(values) >= 20]
    return {
        "duration_s": args.duration, "rate": args.rate, "sent": dict(sent),
        "answered": {f"{kind}/{code}": count for (kind, code), count in sorted(answered.items())},
        "overloaded": any(code == "RESOURCE_EXHAUSTED" for _, code in answered),
        "other_failures": {code: dict(counted.most_common(3)) for code, counted in messages.items()},
        "wrong_answers_among_good": sum(wrong.values()), "wrong_by_kind": dict(wrong), "reloads": dict(reloads),
        **rss_report(rss_at_1min or rss_end, rss_end),
        "max_window_p99_ms": 1000 * max(p99s) if p99s else None,
    }


class HostileLoop:
    """scripts/benchmarks/hostile_cases.py's requests, one after another on a thread of their own, until stopped."""

    def __init__(self, target: str) -> None:
        import hostile_cases  # beside this script

        self._hostile = hostile_cases
        self._cases = hostile_cases.cases()
        self._target = target
        self.answered: Counter = Counter()
        self.refused_wrongly: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        with grpc.insecure_channel(self._target, options=options) as channel:
            for case in itertools.cycle(self._cases):
                if self._stop.is_set():
                    return
                code = self._hostile.outcome(channel, case)
                self.answered[code] += 1
                if code not in self._hostile.ALLOWED:
                    self.refused_wrongly[f"{case.name}: {code}"] += 1

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(120)
        return {"hostile_sent": sum(self.answered.values()), "hostile_answered": dict(self.answered),
                "hostile_not_refused": dict(self.refused_wrongly)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--rate", type=float, default=200.0,
                        help="requests/s, past the server's capacity (a 2-core CPU computes about 60 of these)")
    parser.add_argument("--reload-every", type=float, default=30.0, help="seconds between reloads of the weights")
    parser.add_argument("--hostile", action="store_true",
                        help="send every field's worst value in a loop meanwhile (scripts/benchmarks/hostile_cases.py)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    if not args.reload_every > 0:
        parser.error(f"argument --reload-every: must be > 0, got {args.reload_every}")
    shm_before = set(os.listdir(SHM_FOLDER))
    shared = SharedImages()
    server = subprocess.Popen([sys.executable, "-m", "resnet_server", "--host", "127.0.0.1", "--port", str(PORT),
                               "--metrics-port", str(METRICS_PORT), "--device", "cpu", "--weights", "random",
                               "--max-queue", "16", "--max-images-per-request", "16", "--log-level", "ERROR",
                               "--model-control", "explicit", "--allow-client-shm"])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{PORT}") as channel:
            grpc.channel_ready_future(channel).result(timeout=120)
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with grpc.insecure_channel(f"127.0.0.1:{PORT}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while health.Check(health_pb2.HealthCheckRequest(), timeout=10).status != 1:
                time.sleep(0.2)
        hostile = HostileLoop(f"127.0.0.1:{PORT}") if args.hostile else None
        report = asyncio.run(soak(args, shared))
        if hostile is not None:
            report.update(hostile.stop())
    finally:
        server.terminate()
        server.wait(60)
        shared.remove()
    report["server_exit_code"] = server.returncode
    report["dev_shm_left"] = sorted(set(os.listdir(SHM_FOLDER)) - shm_before)
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    ok = (report["wrong_answers_among_good"] == 0 and report["rss_growth_pct"] < 5 and server.returncode == 0
          and report["overloaded"] and set(report["reloads"]) <= {"OK"} and not report["dev_shm_left"]
          and not report.get("hostile_not_refused"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
