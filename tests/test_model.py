"""Weights loading: every accepted checkpoint layout, clear errors, and the ImageNet path offline."""

from __future__ import annotations

import collections
import subprocess
import sys

import pytest
import torch
from torchvision.models import resnet18

from resnet_server.common.errors import StartupError
from resnet_server.common.model import (
    WeightsError,
    build_model,
    check_weights_file,
    load_state_dict_file,
    load_weights,
    random_state_dict,
)

CPU = torch.device("cpu")


def assert_same_weights(loaded, reference) -> None:
    assert loaded.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(loaded[key], tensor), key


@pytest.mark.parametrize("layout", ["plain", "state_dict", "model", "module_prefix", "checkpoint_of_dataparallel"])
def test_checkpoint_layouts_load(tmp_path, weights_file, layout):
    state = weights_file[1]
    prefixed = collections.OrderedDict((f"module.{key}", value) for key, value in state.items())
    saved = {
        "plain": state,
        "state_dict": {"state_dict": state, "epoch": 3},
        "model": {"model": state, "optimizer": {"lr": 0.1}},
        "module_prefix": prefixed,
        "checkpoint_of_dataparallel": {"state_dict": prefixed},
    }[layout]
    path = tmp_path / "weights.pth"
    torch.save(saved, path)
    assert_same_weights(load_state_dict_file(path, CPU), state)


def test_loaded_model_is_in_eval_mode_on_the_device(weights_file):
    model = build_model(load_weights(str(weights_file[0]), CPU), CPU)
    assert not model.training
    assert next(model.parameters()).device == CPU


def test_random_weights_are_reproducible_and_flagged():
    assert_same_weights(random_state_dict(), random_state_dict())
    weights = load_weights("random", CPU)
    assert "RANDOM" in weights.warning and weights.source == "random(seed=0)"


def test_missing_key_is_named(tmp_path, weights_file):
    state = dict(weights_file[1])
    del state["layer3.0.conv1.weight"]
    torch.save(state, tmp_path / "w.pth")
    with pytest.raises(WeightsError, match="missing key 'layer3.0.conv1.weight'"):
        build_model(load_weights(str(tmp_path / "w.pth"), CPU), CPU)


def test_wrong_shape_is_named(tmp_path, weights_file):
    state = dict(weights_file[1])
    state["fc.weight"] = torch.zeros(10, 512)
    torch.save(state, tmp_path / "w.pth")
    with pytest.raises(WeightsError, match=r"'fc.weight' has shape \(10, 512\), ResNet18 needs \(1000, 512\)"):
        build_model(load_weights(str(tmp_path / "w.pth"), CPU), CPU)


def test_unexpected_key_is_named(tmp_path, weights_file):
    state = {**weights_file[1], "head.extra": torch.zeros(1)}
    torch.save(state, tmp_path / "w.pth")
    with pytest.raises(WeightsError, match="unexpected key 'head.extra'"):
        build_model(load_weights(str(tmp_path / "w.pth"), CPU), CPU)


class NeedsPickle:
    """Anything but tensors and plain containers needs pickle code to load: refused."""


def test_file_needing_pickle_code_is_refused(tmp_path):
    torch.save({"state_dict": {"w": torch.zeros(1)}, "extra": NeedsPickle()}, tmp_path / "evil.pth")
    with pytest.raises(WeightsError, match="weights_only=True"):
        load_state_dict_file(tmp_path / "evil.pth", CPU)


def test_not_a_state_dict_and_missing_file(tmp_path):
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(WeightsError, match="holds no state_dict"):
        load_state_dict_file(tmp_path / "list.pth", CPU)
    with pytest.raises(WeightsError, match="does not exist"):
        load_weights(str(tmp_path / "nope.pth"), CPU)
    assert issubclass(WeightsError, StartupError)


def test_imagenet_weights_load_from_the_torch_home_cache(tmp_path, weights_file, monkeypatch):
    cache = tmp_path / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(weights_file[1], cache / "resnet18-f37072fd.pth")
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    weights = load_weights("imagenet", CPU)
    assert weights.source == "imagenet:IMAGENET1K_V1" and weights.warning == ""
    assert_same_weights(weights.state_dict, weights_file[1])


@pytest.mark.slow
def test_server_exits_with_one_clear_line_when_imagenet_is_unavailable(tmp_path):
    env = {"TORCH_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "RESNET_SERVER_METRICS_PORT": "0",
           # An unroutable proxy makes the download fail fast, with or without a network.
           "https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}
    done = subprocess.run([sys.executable, "-m", "resnet_server", "--port", "0", "--device", "cpu"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    error_lines = [line for line in done.stderr.splitlines() if line.startswith("resnet-server: error:")]
    assert len(error_lines) == 1
    assert "--weights PATH" in error_lines[0] and "hub/checkpoints/resnet18-f37072fd.pth" in error_lines[0]


def test_integer_weights_are_refused_by_the_check_naming_the_key(tmp_path):
    from safetensors.torch import save_file

    state = {key: value.long() for key, value in resnet18().state_dict().items()}
    torch.save(state, tmp_path / "integers.pt")
    save_file({key: value.contiguous() for key, value in state.items()}, tmp_path / "integers.safetensors")
    for name in ("integers.pt", "integers.safetensors"):
        with pytest.raises(WeightsError, match="'conv1.weight' holds torch.int64, ResNet18 needs floating-point"):
            check_weights_file(tmp_path / name)


def test_weights_holding_nan_are_refused_when_the_model_is_built(tmp_path):
    state = resnet18().state_dict()
    state["fc.bias"][3] = float("nan")
    torch.save(state, tmp_path / "nan.pt")
    check_weights_file(tmp_path / "nan.pt")  # shapes and kinds only: the values are the engines' to read
    with pytest.raises(WeightsError, match="'fc.bias' holds NaN or infinite values"):
        build_model(load_weights(str(tmp_path / "nan.pt"), torch.device("cpu")), torch.device("cpu"))
