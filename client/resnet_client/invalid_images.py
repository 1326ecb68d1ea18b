"""How a request refused for some of its images says which and why: the server writes it, the client reads it.
No transport here (the server's engine-side code imports it, and no grpc)."""

from __future__ import annotations

# Trailing metadata of a request refused for some of its images: their positions, comma-separated. The status
# message says why, a line ``images[i]: reason`` each (or just the reason, for a request of one image).
INVALID_IMAGES_KEY = "resnet-invalid-images"
REASONS_LISTED = 8  # a status message travels in a trailer too, whose size gRPC limits (8 KiB by default)


def invalid_images_message(reasons: dict[int, str], total: int) -> str:
    """The status message of a request refused for some of its ``total`` images (the server writes it, and
    ``reasons_given`` reads it back): a lone image's reason as it is; otherwise a line per invalid image,
    ``images[i]: reason``, under a count when there are several."""
    if total == 1:
        return next(iter(reasons.values()))
    lines = [f"images[{index}]: {reason}" for index, reason in list(reasons.items())[:REASONS_LISTED]]
    if len(reasons) > REASONS_LISTED:
        lines.append(f"... and {len(reasons) - REASONS_LISTED} more")
    head = [] if len(reasons) == 1 else [f"{len(reasons)} of {total} images are invalid"]
    return "\n".join(head + lines)


def reasons_given(listed: str, message: str) -> dict[int, str]:
    """Each invalid image's reason by its position, from the positions ``listed`` (INVALID_IMAGES_KEY's value)
    and the status ``message``."""
    positions = [int(text) for text in listed.split(",") if text.strip().isdigit()]
    if len(positions) == 1 and not message.startswith("images["):  # a lone image: the message is its reason
        return {positions[0]: message}
    reasons = {}
    for line in message.splitlines():
        head, _, reason = line.partition("]: ")
        if head.startswith("images[") and head[7:].isdigit():
            reasons[int(head[7:])] = reason
    return {position: reasons.get(position, message) for position in positions}
