"""``resnet-client calibrate``: fit the softmax temperature on labelled images (Guo et al., 2017).

Temperature scaling divides the logits by one scalar T fitted on held-out labelled data by
minimising the negative log-likelihood. It changes no prediction (argmax is unchanged), only how
confident the probabilities are. The server returns raw logits (``return_logits``), so the fit
needs no torch; it needs numpy (``pip install "resnet-grpc[tools]"``).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
from pathlib import Path

from .connection_flags import connect
from .flags import existing_path
from .progress import ProgressBar

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".gif", ".webp"}
ECE_BINS = 15
LOG_T_RANGE = (math.log(0.05), math.log(20.0))
CHUNK = 16


def _numpy():
    try:
        import numpy
    except ImportError:
        raise SystemExit('resnet-client calibrate needs numpy: pip install "resnet-grpc[tools]"') from None
    return numpy


def log_softmax(logits, temperature: float):
    np = _numpy()
    scaled = np.asarray(logits, dtype=np.float64) / temperature
    scaled = scaled - scaled.max(axis=1, keepdims=True)
    return scaled - np.log(np.exp(scaled).sum(axis=1, keepdims=True))


def nll(logits, labels, temperature: float) -> float:
    np = _numpy()
    log_p = log_softmax(logits, temperature)
    return float(-log_p[np.arange(len(labels)), labels].mean())


def fit_temperature(logits, labels, tolerance: float = 1e-6) -> float:
    """Golden-section search for the T minimising NLL, over log T (NLL is unimodal in it)."""
    low, high = LOG_T_RANGE
    ratio = (math.sqrt(5) - 1) / 2
    a, b = high - ratio * (high - low), low + ratio * (high - low)
    fa, fb = nll(logits, labels, math.exp(a)), nll(logits, labels, math.exp(b))
    while high - low > tolerance:
        if fa < fb:
            high, b, fb = b, a, fa
            a = high - ratio * (high - low)
            fa = nll(logits, labels, math.exp(a))
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (high - low)
            fb = nll(logits, labels, math.exp(b))
    return math.exp((low + high) / 2)


def expected_calibration_error(probabilities, labels, bins: int = ECE_BINS) -> float:
    """Sum over equal-width confidence bins of |accuracy - confidence|, weighted by the bin's share."""
    np = _numpy()
    probabilities = np.asarray(probabilities, dtype=np.float64)
    confidence = probabilities.max(axis=1)
    correct = probabilities.argmax(axis=1) == np.asarray(labels)
    edges = np.linspace(0.0, 1.0, bins + 1)
    ece = 0.0
    for lower, upper in zip(edges[:-1], edges[1:], strict=True):
        in_bin = (confidence > lower) & (confidence <= upper)
        if in_bin.any():
            ece += in_bin.mean() * abs(correct[in_bin].mean() - confidence[in_bin].mean())
    return float(ece)


def brier(probabilities, labels) -> float:
    np = _numpy()
    one_hot = np.zeros_like(probabilities)
    one_hot[np.arange(len(labels)), labels] = 1.0
    return float(((probabilities - one_hot) ** 2).sum(axis=1).mean())


def report(logits, labels, temperature: float) -> dict[str, float]:
    np = _numpy()
    probabilities = np.exp(log_softmax(logits, temperature))
    return {"nll": nll(logits, labels, temperature), "ece": expected_calibration_error(probabilities, labels),
            "brier": brier(probabilities, labels),
            "accuracy": float((probabilities.argmax(axis=1) == np.asarray(labels)).mean())}


def class_index(name: str, labels: list[str], wnids: list[str] | None) -> int:
    """A folder or CSV label: a class index, a WordNet id (with --wnids), or a label (case-insensitive)."""
    if name.isdigit() and int(name) < len(labels):
        return int(name)
    if wnids and name in wnids:
        return wnids.index(name)
    lowered = [label.lower() for label in labels]
    if name.lower() in lowered:
        return lowered.index(name.lower())
    if name.startswith("n") and name[1:].isdigit():
        raise SystemExit(f"resnet-client: error: {name!r} looks like a WordNet id: pass --wnids FILE "
                         "(the 1000 ids, one per line, in class-index order)")
    raise SystemExit(f"resnet-client: error: {name!r} is not a class index, WordNet id or label")


def labelled_images(data: Path, labels: list[str], wnids: list[str] | None) -> list[tuple[Path, int]]:
    """ImageFolder (one sub-folder per class) or a CSV of path,label (paths relative to the CSV)."""
    if data.is_dir():
        return [(path, class_index(folder.name, labels, wnids))
                for folder in sorted(p for p in data.iterdir() if p.is_dir())
                for path in sorted(folder.iterdir()) if path.suffix.lower() in IMAGE_SUFFIXES]
    with data.open(newline="") as handle:
        rows = [row for row in csv.reader(handle) if row and row[0].strip() and row[0] != "path"]
    return [(data.parent / row[0].strip(), class_index(row[1].strip(), labels, wnids)) for row in rows]


def collect_logits(client, items: list[tuple[Path, int]], quiet: bool) -> list[list[float]]:
    logits: list[list[float]] = []
    bar = ProgressBar("collecting logits", quiet)
    for start in range(0, len(items), CHUNK):
        chunk = [path for path, _ in items[start:start + CHUNK]]
        logits.extend(result.logits for result in client.classify(chunk, top_k=1, logits=True))
        bar.update(len(logits) / len(items), f"{len(logits)}/{len(items)}")
    bar.close()
    return logits


def plot_reliability(logits, labels, temperature: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    np = _numpy()
    figure, axes = plt.subplots(1, 2, figsize=(10, 4.5), sharey=True)
    for axis, (title, t) in zip(axes, (("before (T = 1)", 1.0), (f"after (T = {temperature:.3f})", temperature)),
                                strict=True):
        probabilities = np.exp(log_softmax(logits, t))
        confidence, correct = probabilities.max(axis=1), probabilities.argmax(axis=1) == np.asarray(labels)
        edges = np.linspace(0, 1, ECE_BINS + 1)
        which = np.clip(np.digitize(confidence, edges[1:-1], right=True), 0, ECE_BINS - 1)
        accuracy = [correct[which == b].mean() if (which == b).any() else 0.0 for b in range(ECE_BINS)]
        axis.bar(edges[:-1], accuracy, width=1 / ECE_BINS, align="edge", edgecolor="black", label="accuracy")
        axis.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
        axis.set(title=f"{title}, ECE {expected_calibration_error(probabilities, labels):.3f}",
                 xlabel="confidence", ylabel="accuracy")
        axis.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(path)


def add_parser(commands) -> argparse.ArgumentParser:
    calibrate = commands.add_parser("calibrate", help="fit the softmax temperature on labelled images")
    calibrate.add_argument("data", type=existing_path, help="ImageFolder-style directory, or a CSV of path,label")
    calibrate.add_argument("--output", help="write the fitted temperature as JSON (for --temperature-file)")
    calibrate.add_argument("--wnids", type=existing_path, help="file of the 1000 WordNet ids in class-index order")
    calibrate.add_argument("--json", action="store_true")
    calibrate.add_argument("--plot", help="write reliability diagrams before and after to this PNG")
    calibrate.add_argument("--quiet", action="store_true", help="no progress bar (drawn only on a terminal)")
    calibrate.set_defaults(run=run_calibrate)
    return calibrate


def run_calibrate(args: argparse.Namespace) -> int:

    np = _numpy()
    wnids = Path(args.wnids).read_text().split() if args.wnids else None
    with connect(args) as client:
        labels = list(client.model_info().labels)
        items = labelled_images(Path(args.data), labels, wnids)
        if not items:
            raise SystemExit(f"resnet-client: error: no labelled images found in {args.data}")
        logits = np.asarray(collect_logits(client, items, args.quiet), dtype=np.float64)
    targets = np.asarray([label for _, label in items])
    temperature = fit_temperature(logits, targets)
    result = {"temperature": temperature, "samples": len(items), "before": report(logits, targets, 1.0),
              "after": report(logits, targets, temperature), "server": args.server,
              "fitted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot_reliability(logits, targets, temperature, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"fitted temperature T = {temperature:.4f} on {len(items)} images")
        print(f"{'':>10} {'NLL':>8} {'ECE':>8} {'Brier':>8} {'accuracy':>9}")
        for name in ("before", "after"):
            row = result[name]
            print(f"{name:>10} {row['nll']:8.4f} {row['ece']:8.4f} {row['brier']:8.4f} {row['accuracy']:9.4f}")
    return 0

