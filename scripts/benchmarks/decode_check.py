"""JPEG decoding on the GPU (nvjpeg, --decode-on-device) against the CPU path: do the answers agree?

nvjpeg's IDCT and the GPU resize round differently from libjpeg-turbo and the CPU resize, so the
model inputs differ slightly; this reports by how much, and how often top-1 changes.
Usage: python scripts/benchmarks/decode_check.py --device cuda:0 [--weights imagenet|PATH|random] [--images 256]
"""

from __future__ import annotations

import io

import numpy as np
import torch
from check_args import check_parser, write_json
from PIL import Image

from resnet_server.common.device_decode import DeferredJpeg, decode_batch
from resnet_server.common.model import build_model, load_weights
from resnet_server.common.preprocess import decode, transform
from resnet_server.engine.runner import ModelRunner


def sample_jpegs(count: int, seed: int = 0) -> list[bytes]:
    """Smooth random pictures of assorted sizes, JPEG-encoded at quality 90."""
    rng = np.random.default_rng(seed)
    jpegs = []
    for _ in range(count):
        height, width = rng.integers(200, 700, size=2)
        small = rng.integers(0, 256, size=(height // 16 + 1, width // 16 + 1, 3), dtype=np.uint8)
        picture = Image.fromarray(small).resize((int(width), int(height)), Image.BILINEAR)
        buffer = io.BytesIO()
        picture.save(buffer, format="JPEG", quality=90)
        jpegs.append(buffer.getvalue())
    return jpegs


def main() -> None:
    args = check_parser(__doc__, images=256).parse_args()
    device = torch.device(args.device)
    jpegs = sample_jpegs(args.images)
    on_cpu = torch.stack([transform(decode(data, 10**8)) for data in jpegs])
    deferred = [DeferredJpeg.of(data, 40_000_000) for data in jpegs]
    on_device = torch.cat([torch.stack(decode_batch(deferred[i:i + 64], device)).cpu()
                           for i in range(0, len(deferred), 64)])
    runner = ModelRunner(build_model(load_weights(args.weights, device), device), device)
    ones = torch.ones(args.images)
    reference, probabilities = runner(on_cpu, ones)[0], runner(on_device, ones)[0]
    result = {"weights": args.weights, "images": args.images,
              "max_input_difference": (on_device - on_cpu).abs().max().item(),
              "top1_agreement": (probabilities.argmax(1) == reference.argmax(1)).float().mean().item(),
              "max_probability_difference": (probabilities - reference).abs().max().item()}
    print(f"GPU decode vs CPU decode: top-1 agrees on {100 * result['top1_agreement']:.2f}% of {args.images} "
          f"images; max |p - p_cpu| = {result['max_probability_difference']:.2e}; largest input difference "
          f"{result['max_input_difference']:.3f} (normalised units)")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
