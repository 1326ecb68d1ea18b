"""The command line shared by the GPU check scripts (precision_check.py, decode_check.py)."""

from __future__ import annotations

import argparse
import json


def check_parser(doc: str, images: int) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--weights", default="random", help="imagenet, a state_dict PATH, or random")
    parser.add_argument("--images", type=int, default=images, help="how many fixed test images")
    parser.add_argument("--json", help="also write the results to this JSON file")
    return parser


def write_json(path: str | None, result: dict) -> None:
    if path:
        with open(path, "w") as handle:
            json.dump(result, handle, indent=2)
