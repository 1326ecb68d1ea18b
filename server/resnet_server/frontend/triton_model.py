"""Triton's view of the served model: its metadata, statistics and ModelConfig, made from what the server
reports (protobuf messages; an HTTP front-end answers them in protobuf's JSON mapping)."""

from __future__ import annotations

from resnet_client.api import classifier_pb2 as pb
from resnet_client.api import grpc_predict_v2_pb2 as oip
from resnet_client.api import model_config_pb2 as mc
from resnet_server.common.statistics import BatchTotals, Duration, Totals
from resnet_server.frontend.oip_codec import DECLARED_INPUTS, INPUT_NAME, OUTPUT_TYPES, PROBABILITIES, TOP_K_OUTPUTS

# Triton's platform and backend names for what runs the forward pass (--runtime).
PLATFORMS = {"torch": ("pytorch_libtorch", "pytorch"), "onnxruntime": ("onnxruntime_onnx", "onnxruntime")}
# The declared input's type and layout in ModelConfig's terms, by its datatype.
_CONFIG_INPUTS = {"FP32": (mc.TYPE_FP32, mc.ModelInput.FORMAT_NCHW),
                  "UINT8": (mc.TYPE_UINT8, mc.ModelInput.FORMAT_NHWC)}


def model_metadata(name: str, version: int, runtime: str = "torch") -> oip.ModelMetadataResponse:
    """The model's metadata under ``name``: the input form that name declares, and every output."""
    tensor = oip.ModelMetadataResponse.TensorMetadata
    datatype, shape = DECLARED_INPUTS[name]
    return oip.ModelMetadataResponse(
        name=name, versions=[str(version)], platform=PLATFORMS[runtime][0],
        inputs=[tensor(name=INPUT_NAME, datatype=datatype, shape=shape)],
        outputs=[tensor(name=PROBABILITIES, datatype="FP32", shape=[-1, 1000]),
                 *(tensor(name=output, datatype=OUTPUT_TYPES[output], shape=[-1, -1]) for output in TOP_K_OUTPUTS)],
    )


def model_statistics(totals: Totals, name: str, version: int) -> oip.ModelStatistics:
    """Triton's statistics of the model under ``name``, from the server's totals."""
    def duration(value: Duration) -> oip.StatisticDuration:
        return oip.StatisticDuration(count=value.count, ns=value.ns)

    def compute(value: BatchTotals) -> dict[str, oip.StatisticDuration]:
        return {"compute_input": duration(value.compute_input), "compute_infer": duration(value.compute_infer),
                "compute_output": duration(value.compute_output)}

    return oip.ModelStatistics(
        name=name, version=str(version), last_inference=totals.last_inference_ms,
        inference_count=totals.inference_count, execution_count=totals.execution_count,
        inference_stats=oip.InferStatistics(success=duration(totals.success), fail=duration(totals.fail),
                                            queue=duration(totals.queue), **compute(totals.compute)),
        batch_stats=[oip.InferBatchStatistics(batch_size=size, **compute(totals.batches[size]))
                     for size in sorted(totals.batches)],
    )


def model_config(info: pb.ModelInfo, name: str, weights_sha256: str = "", runtime: str = "torch") -> mc.ModelConfig:
    """Triton's view of the served model under ``name``, from the ModelInfo our own API reports; settings
    Triton's config has no field for (the default temperature, the wait for closed-loop callers, the weights'
    SHA-256) go in its parameters."""
    gpus = sorted({int(device.split(":")[1].split("#")[0]) for device in info.devices if device.startswith("cuda")})
    group = (mc.ModelInstanceGroup(name="gpu", kind=mc.ModelInstanceGroup.KIND_GPU, count=1, gpus=gpus) if gpus
             else mc.ModelInstanceGroup(name="cpu", kind=mc.ModelInstanceGroup.KIND_CPU, count=len(info.devices)))
    batching = info.batching
    parameters = {"default_temperature": f"{info.default_temperature:g}",
                  "wait_for_callers_ms": f"{batching.wait_for_callers_ms:g}"}
    if weights_sha256:
        parameters["weights_sha256"] = weights_sha256
    datatype, shape = DECLARED_INPUTS[name]
    config_type, config_format = _CONFIG_INPUTS[datatype]
    return mc.ModelConfig(
        name=name, platform=PLATFORMS[runtime][0], backend=PLATFORMS[runtime][1],
        max_batch_size=info.input.max_images_per_request,
        input=[mc.ModelInput(name=INPUT_NAME, data_type=config_type, format=config_format, dims=shape[1:])],
        output=[mc.ModelOutput(name=PROBABILITIES, data_type=mc.TYPE_FP32, dims=[1000]),
                mc.ModelOutput(name="top_k_indices", data_type=mc.TYPE_INT64, dims=[-1]),
                mc.ModelOutput(name="top_k_probabilities", data_type=mc.TYPE_FP32, dims=[-1]),
                mc.ModelOutput(name="top_k_labels", data_type=mc.TYPE_STRING, dims=[-1])],
        instance_group=[group],
        dynamic_batching=mc.ModelDynamicBatching(
            preferred_batch_size=[batching.max_batch_size],
            max_queue_delay_microseconds=int(batching.max_batch_delay_ms * 1000)),
        parameters={name: mc.ModelParameter(string_value=value) for name, value in parameters.items()},
    )
