"""fp16/bf16 against fp32 on a fixed set of images: top-1 agreement and the largest probability difference.

Usage: python scripts/benchmarks/precision_check.py --device cuda:0 [--weights imagenet|PATH|random] [--images 512]
"""

from __future__ import annotations

import torch
from check_args import check_parser, write_json

from resnet_server.common.model import build_model, load_weights
from resnet_server.engine.runner import ModelRunner


def main() -> None:
    args = check_parser(__doc__, images=512).parse_args()
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
    write_json(args.json, {"weights": args.weights, "images": args.images, **results})


if __name__ == "__main__":
    main()
