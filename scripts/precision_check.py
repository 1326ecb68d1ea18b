"""fp16/bf16 against fp32 on a fixed set of images: top-1 agreement and the largest probability difference.

Usage: python scripts/precision_check.py --device cuda:0 [--weights imagenet|PATH|random] [--images 512]
"""

from __future__ import annotations

import argparse
import json

import torch

from server.model import build_model, load_weights
from server.runner import ModelRunner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--weights", default="random")
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device(args.device)
    # Fixed inputs: smooth random images (normalised), so classes differ between images.
    generator = torch.Generator().manual_seed(0)
    images = torch.nn.functional.interpolate(torch.randn(args.images, 3, 28, 28, generator=generator), size=224,
                                             mode="bilinear")
    temperatures = torch.ones(args.images)
    results, reference = {}, None
    for precision in ("fp32", "fp16", "bf16"):
        runner = ModelRunner(build_model(load_weights(args.weights, device), device), device, precision, True)
        probabilities = torch.cat([runner(images[i:i + 64], temperatures[i:i + 64])[0]
                                   for i in range(0, args.images, 64)])
        if reference is None:
            reference = probabilities
            continue
        agreement = (probabilities.argmax(1) == reference.argmax(1)).float().mean().item()
        results[precision] = {"top1_agreement": agreement,
                              "max_probability_difference": (probabilities - reference).abs().max().item()}
        print(f"{precision}: top-1 agrees with fp32 on {100 * agreement:.2f}% of {args.images} images; "
              f"max |p - p_fp32| = {results[precision]['max_probability_difference']:.2e}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"weights": args.weights, "images": args.images, **results}, handle, indent=2)


if __name__ == "__main__":
    main()
