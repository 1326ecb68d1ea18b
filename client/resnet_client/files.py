"""Classify many image files: a few files a request, a few requests in flight, a bad file failing alone.

The service answers a request all or nothing (one undecodable image fails it with INVALID_ARGUMENT, naming
every invalid image) and refuses a request of more images than its ``--max-images-per-request``. So a folder
of files goes in requests of ``images_per_request`` files, ``concurrency`` of them at a time, answered in the
order of the paths. A request refused for some of its images has those files get their errors and the others
sent again in one request; one refused otherwise for what its images hold (RESOURCE_EXHAUSTED: a message over
the size limit, or a full queue) is sent again one image a request, so only the files at fault get an error. A file
that cannot be read gets its error without a call. Any other failure (server unreachable, credentials
refused, deadline) raises ClassifierError and ends the run: it would fail every file after it too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from .client import Client
from .errors import ClassifierError
from .messages import Classification

IMAGES_PER_REQUEST = 8
CONCURRENCY = 2
# Codes that can come from one image of the request: worth retrying its images one by one.
PER_IMAGE_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True)
class FileError:
    """Why one file has no result: a gRPC status code and the server's message, or code None when the
    file could not be read."""

    code: grpc.StatusCode | None
    message: str


FileResult = Classification | FileError


def classify_files(client: Client, paths: Sequence[str], *, images_per_request: int = IMAGES_PER_REQUEST,
                   concurrency: int = CONCURRENCY, **options) -> Iterator[tuple[str, FileResult]]:
    """(path, Classification or FileError) for each path, in order; ``options`` go to Client.classify."""
    if images_per_request < 1 or concurrency < 1:
        raise ValueError("images_per_request and concurrency must be at least 1")
    chunks = [paths[start:start + images_per_request] for start in range(0, len(paths), images_per_request)]
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="classify-files")
    try:
        for chunk, results in zip(chunks, pool.map(lambda chunk: _classify_chunk(client, chunk, options), chunks),
                                  strict=True):
            yield from zip(chunk, results, strict=True)
    finally:  # on an error, or a caller that stops early: send nothing more
        pool.shutdown(wait=True, cancel_futures=True)


def _classify_chunk(client: Client, paths: Sequence[str], options: dict) -> list[FileResult]:
    """One request for the chunk's readable files; unreadable ones get their FileError in place."""
    results: dict[int, FileResult] = {}
    readable: dict[int, bytes] = {}
    for index, path in enumerate(paths):
        try:
            readable[index] = Path(path).read_bytes()
        except OSError as exc:
            results[index] = FileError(None, str(exc))
    if readable:
        results.update(zip(readable, _classify(client, list(readable.values()), options), strict=True))
    return [results[index] for index in range(len(paths))]


def _classify(client: Client, images: list[bytes], options: dict) -> list[FileResult]:
    try:
        classified: list[FileResult] = list(client.classify(images, **options))
        return classified
    except ClassifierError as exc:
        if exc.code not in PER_IMAGE_CODES:
            raise
        if len(images) == 1:
            return [FileError(exc.code, exc.message)]
        if exc.invalid_images:  # the server named the invalid images: the others go again in one request
            return _without_invalid(client, images, exc, options)
        return [result for image in images for result in _classify(client, [image], options)]


def _without_invalid(client: Client, images: list[bytes], exc: ClassifierError, options: dict) -> list[FileResult]:
    results: dict[int, FileResult] = {index: FileError(exc.code, reason)
                                      for index, reason in exc.invalid_images.items() if index < len(images)}
    valid = [index for index in range(len(images)) if index not in results]
    if valid:
        results.update(zip(valid, _classify(client, [images[i] for i in valid], options), strict=True))
    return [results[index] for index in range(len(images))]
