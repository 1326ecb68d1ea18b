"""Temperature calibration: the fit recovers a known T, ECE on a hand-checked case, and end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from resnet_client import Client
from resnet_client.calibrate import brier, expected_calibration_error, fit_temperature, nll
from resnet_client.cli import main
from tests.helpers import encode, random_rgb


@pytest.mark.parametrize("true_temperature", [0.5, 2.0, 3.5])
def test_fit_recovers_a_known_temperature(true_temperature):
    rng = np.random.default_rng(7)
    logits = rng.normal(0.0, 3.0, size=(4000, 10))
    scaled = logits / true_temperature
    probabilities = np.exp(scaled - scaled.max(1, keepdims=True))
    probabilities /= probabilities.sum(1, keepdims=True)
    labels = np.array([rng.choice(10, p=row) for row in probabilities])
    fitted = fit_temperature(logits, labels)
    assert fitted == pytest.approx(true_temperature, rel=0.05)
    assert nll(logits, labels, fitted) <= nll(logits, labels, 1.0)


def test_ece_and_brier_on_a_hand_checked_example():
    # Confidences 0.9, 0.9 (bin 14: one right, one wrong), 0.6 (bin 9: right), 0.3 (bin 4: wrong).
    probabilities = np.array([[0.9, 0.1, 0.0], [0.9, 0.05, 0.05], [0.6, 0.4, 0.0], [0.3, 0.3, 0.4]])
    labels = np.array([0, 1, 0, 0])
    # |0.5 - 0.9| * 2/4 + |1 - 0.6| * 1/4 + |0 - 0.4| * 1/4 = 0.2 + 0.1 + 0.1
    assert expected_calibration_error(probabilities, labels) == pytest.approx(0.4)
    expected_brier = np.mean([0.01 + 0.01, 0.81 + 0.9025 + 0.0025, 0.16 + 0.16, 0.49 + 0.09 + 0.16])
    assert brier(probabilities, labels) == pytest.approx(expected_brier)


def test_calibrate_end_to_end_and_serve_the_fitted_temperature(server, make_server, tmp_path, capsys):
    data = tmp_path / "data"
    for folder, seeds in (("0", (1, 2, 3)), ("goldfish", (4, 5)), ("2", (6,))):
        (data / folder).mkdir(parents=True)
        for seed in seeds:
            (data / folder / f"{seed}.png").write_bytes(encode(random_rgb(seed, 64, 64), "PNG"))
    output = tmp_path / "temperature.json"
    plot = tmp_path / "reliability.png"
    code = main(["calibrate", str(data), "--server", server.target, "--output", str(output), "--json",
                 "--quiet", "--plot", str(plot)])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    saved = json.loads(output.read_text())
    assert saved["temperature"] == pytest.approx(printed["temperature"]) and saved["samples"] == 6
    assert saved["before"]["accuracy"] == saved["after"]["accuracy"]  # T never changes the argmax
    assert saved["after"]["nll"] <= saved["before"]["nll"] + 1e-9
    assert plot.stat().st_size > 0

    served = make_server(temperature_file=str(output))
    with Client(served.target) as client:
        info = client.model_info()
        assert info.default_temperature == pytest.approx(saved["temperature"])
        assert info.temperature_source == f"file:{output}"
        (result,) = client.classify([encode(random_rgb(1))])
        assert result.temperature == pytest.approx(saved["temperature"])


def test_csv_data_and_unknown_label(server, tmp_path, capsys):
    (tmp_path / "a.png").write_bytes(encode(random_rgb(1, 64, 64), "PNG"))
    (tmp_path / "labels.csv").write_text("path,label\na.png,tench\n")
    assert main(["calibrate", str(tmp_path / "labels.csv"), "--server", server.target, "--quiet"]) == 0
    assert "fitted temperature" in capsys.readouterr().out
    (tmp_path / "bad.csv").write_text("a.png,n01440764\n")
    with pytest.raises(SystemExit, match="WordNet id"):
        main(["calibrate", str(tmp_path / "bad.csv"), "--server", server.target, "--quiet"])


@pytest.mark.parametrize("flags", [["/no/such/folder"], ["DATA", "--wnids", "/no/such/wnids.txt"]])
def test_a_missing_path_is_a_usage_error_before_anything_connects(tmp_path, capsys, flags):
    """127.0.0.1:1 answers nothing: a check made after connecting would fail UNAVAILABLE (exit 1) instead."""
    argv = ["calibrate", *(str(tmp_path) if flag == "DATA" else flag for flag in flags), "--server", "127.0.0.1:1"]
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"no such file or folder: '{flags[-1]}'")
