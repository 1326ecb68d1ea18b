"""The KServe SDK's REST client against a server, run by tests/test_http.py in an environment of its own (the SDK
pins protobuf < 7, which this project's generated code cannot use): prints what it read, as one JSON object.

Usage: python tests/kserve_rest_client.py http://HOST:PORT IMAGES.npy
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig


async def main(base_url: str, images_path: str) -> dict:
    images = np.load(images_path)
    client = InferenceRESTClient(RESTConfig(protocol="v2", retries=0, timeout=60))
    try:
        tensor = InferInput("input", list(images.shape), "UINT8")
        tensor.set_data_from_numpy(images, binary_data=False)
        request = InferRequest("resnet18_uint8", [tensor], request_id="kserve-1", parameters={"top_k": 3})
        response = await client.infer(base_url, request, model_name="resnet18_uint8")
        outputs = {output.name: output.as_numpy().tolist() for output in response.outputs}
        return {"live": await client.is_server_live(base_url), "ready": await client.is_server_ready(base_url),
                "model_ready": await client.is_model_ready(base_url, "resnet18_uint8"), "id": response.id,
                "model_name": response.model_name, "outputs": outputs}
    finally:
        await client.close()


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1], sys.argv[2]))))
