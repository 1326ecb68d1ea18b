"""resnet-client: classify images, show model info, check health (and bench, calibrate).

Any failure exits non-zero with one stderr line naming the gRPC status code and the message. `classify`
sends its files in requests of a few (files.py): a file that fails gets its own line and the rest are
still classified; it exits 1 if any file failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from . import bench, calibrate
from .channel import DEFAULT_ATTEMPTS, parse_targets
from .connection_flags import (
    BENCH_ATTEMPTS,
    add_connection_flags,
    connect,
    fill_connection_defaults,
)
from .errors import ClassifierError
from .files import CONCURRENCY, IMAGES_PER_REQUEST, FileError, classify_files
from .flags import int_between, positive_float, top_k
from .messages import Classification


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resnet-client", description="Client of the ResNet18 gRPC service")
    add_connection_flags(parser, attempts_default_text=f"{DEFAULT_ATTEMPTS}, bench {BENCH_ATTEMPTS}")
    commands = parser.add_subparsers(dest="command", required=True)

    classify = commands.add_parser("classify", help="classify image files")
    classify.add_argument("paths", nargs="+", metavar="PATH")
    classify.add_argument("--top-k", type=top_k, default=None, help="classes to show per image, 1 to 1000 (default 5)")
    classify.add_argument("--temperature", type=positive_float, default=None,
                          help="softmax temperature, finite and > 0 (default: the server's)")
    classify.add_argument("--full", action="store_true", help="also return the 1000 probabilities")
    classify.add_argument("--json", action="store_true", help="one JSON object per image per line")
    classify.add_argument("--trace", action="store_true",
                          help="start a sampled trace for each call and print its trace id (the server's, when it "
                               "runs with --otlp-endpoint: find the call in your tracing backend)")
    classify.add_argument("--images-per-request", type=int_between(1, 1000), default=IMAGES_PER_REQUEST,
                          metavar="N", help="files per request (default %(default)s; at most the server's "
                                            "max_images_per_request, see `info`)")
    classify.add_argument("--concurrency", type=int_between(1, 64), default=CONCURRENCY, metavar="C",
                          help="requests in flight (default %(default)s)")
    classify.set_defaults(run=run_classify)

    info = commands.add_parser("info", help="show the served model")
    info.add_argument("--json", action="store_true")
    info.set_defaults(run=run_info)

    health = commands.add_parser("health", help="check the gRPC health service (exit 0 only when SERVING)")
    health.add_argument("--service", default="", help="service name to check (default: the whole server)")
    health.set_defaults(run=run_health)

    reload = commands.add_parser("reload", help="load new weights while serving (the server runs with "
                                                "--model-control explicit); returns once every device serves them")
    reload.add_argument("--weights", metavar="FILE", default=None,
                        help="a ResNet18 state_dict saved by torch.save, or a safetensors file, sent to the server "
                             "(default: the server reads its own --weights again)")
    reload.set_defaults(run=run_reload)

    for sub in (classify, info, health, reload):
        add_connection_flags(sub)
    _add_optional_commands(commands)
    return parser


def _add_optional_commands(commands) -> None:
    """Commands with their own modules register themselves here."""
    for module, attempts in ((bench, BENCH_ATTEMPTS), (calibrate, DEFAULT_ATTEMPTS)):
        sub = module.add_parser(commands)
        add_connection_flags(sub, attempts)


def result_json(path: str, result: Classification) -> dict:
    record = {
        "image": path,
        "top_k": [{"index": s.index, "label": s.label, "probability": s.probability} for s in result.top_k],
        "device": result.device,
        "temperature": result.temperature,
        "queue_ms": result.queue_ms,
        "compute_ms": result.compute_ms,
    }
    if result.trace_id:
        record["trace_id"] = result.trace_id
    if result.probabilities is not None:
        record["probabilities"] = result.probabilities
    return record


def error_json(path: str, error: FileError) -> dict:
    return {"image": path, "error": {"code": error.code.name if error.code else None, "message": error.message}}


def run_classify(args: argparse.Namespace) -> int:
    failed = 0
    with connect(args, trace=args.trace) as client:
        for path, result in classify_files(client, args.paths, images_per_request=args.images_per_request,
                                           concurrency=args.concurrency, top_k=args.top_k,
                                           temperature=args.temperature, full=args.full):
            failed += isinstance(result, FileError)
            print_classified(path, result, args.json)
    return 1 if failed else 0


def print_classified(path: str, result: Classification | FileError, as_json: bool) -> None:
    """A result on stdout; an error on stderr, or on stdout as a JSON record in --json mode."""
    if as_json:
        print(json.dumps(error_json(path, result) if isinstance(result, FileError) else result_json(path, result)),
              flush=True)
    elif isinstance(result, FileError):
        cause = f"{result.code.name}: {result.message}" if result.code else result.message
        print(f"resnet-client: error: {path}: {cause}", file=sys.stderr, flush=True)
    else:
        traced = f", trace {result.trace_id}" if result.trace_id else ""
        print(f"{path}  (device {result.device}, queue {result.queue_ms:.1f} ms, compute {result.compute_ms:.1f} ms"
              f"{traced})")
        for rank, score in enumerate(result.top_k, 1):
            print(f"  {rank:>2}. {score.probability:8.4f}  {score.index:>4}  {score.label}")


def run_info(args: argparse.Namespace) -> int:
    with connect(args) as client:
        info = client.model_info()
    summary = {
        "name": info.name, "version": info.version, "devices": list(info.devices), "weights": info.weights,
        "warning": info.warning, "precision": info.precision, "runtime": info.runtime, "runs": list(info.runs),
        "default_temperature": info.default_temperature,
        "temperature_source": info.temperature_source, "max_batch_size": info.batching.max_batch_size,
        "max_batch_delay_ms": info.batching.max_batch_delay_ms,
        "wait_for_callers_ms": info.batching.wait_for_callers_ms, "max_queue": info.batching.max_queue,
        "max_pixels": info.input.max_pixels, "max_images_per_request": info.input.max_images_per_request,
        "encodings": list(info.input.encodings), "raw_formats": list(info.input.raw_formats),
        "labels": len(info.labels), "weights_version": info.weights_version, "weights_sha256": info.weights_sha256,
    }
    if args.json:
        print(json.dumps({**summary, "labels": list(info.labels)}))
    else:
        width = max(map(len, summary))
        for key, value in summary.items():
            if key == "warning" and not value:  # only weights that need one (random) have a warning
                continue
            print(f"{key:<{width}}  {value}")
    return 0


def run_reload(args: argparse.Namespace) -> int:
    try:
        weights = Path(args.weights).read_bytes() if args.weights else None
    except OSError as exc:
        print(f"resnet-client: error: {exc}", file=sys.stderr)
        return 1
    with connect(args) as client:
        client.reload(weights)
        info = client.model_info()
    print(f"serving weights version {info.weights_version} (sha256 {info.weights_sha256})")
    return 0


def run_health(args: argparse.Namespace) -> int:
    with connect(args) as client:
        status = client.health(args.service)
    print(status)
    return 0 if status == "SERVING" else 1


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line parsed, each connection flag given nowhere at its default; a server address that names
    an impossible port (from --server or RESNET_CLIENT_SERVER) is a usage error."""
    parser = build_parser()
    args = fill_connection_defaults(parser.parse_args(argv))
    try:
        parse_targets(args.server)
    except ValueError as exc:
        parser.error(f"argument --server: {exc}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return args.run(args)
    except ClassifierError as exc:
        print(f"resnet-client: error: {exc.code.name}: {exc.message}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # its reader has gone (`| head`): stop quietly, as other command-line tools do
        _discard_stdout()
        return 0
    except OSError as exc:
        print(f"resnet-client: error: {exc}", file=sys.stderr)
        return 1


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what is still buffered does not fail on
    the closed pipe too (Python's documented way out of a SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
