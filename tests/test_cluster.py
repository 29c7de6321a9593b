"""Cluster spec, catalog, emulation helpers (CPU ranks imitating declared GPUs) and the analytic cost model
(ring all-reduce 2(n-1)/n x S, bubble (p-1)/(m+p-1); issue 4)."""

from __future__ import annotations

import math

import pytest

from whale.cluster import (
    CATALOG,
    ClusterError,
    ClusterSpec,
    DeviceType,
    NodeSpec,
    emulation_delays,
    from_device_types,
    get_device_type,
    homogeneous_cpu,
    memory_capacity,
)
from whale.detect import detect_cluster
from whale.plan import schedule
from whale.planner.steptime import cost

MIXED_YAML = """
emulate: true
memory_scale: 1.0e-3
inter_node_bandwidth: 6.25e9
nodes:
  - devices: [V100-32GB, V100-32GB]
  - devices:
      - P100-16GB
      - {name: MyGPU, fp32_flops: 5e12, bf16_flops: 2e13, memory_bytes: 8e9, mem_bandwidth: 3e11}
"""


def test_catalog_has_the_issue_devices_with_datasheet_numbers():
    for name in ("V100-16GB", "V100-32GB", "P100-16GB", "P100-PCIE-16GB", "T4", "A100-40GB", "A100-80GB",
                 "H100-80GB", "H200", "CPU"):
        assert name in CATALOG
    v100, p100 = CATALOG["V100-32GB"], CATALOG["P100-16GB"]
    assert (v100.fp32_flops, v100.bf16_flops, v100.memory_bytes) == (15.7e12, 125e12, 32e9)
    assert v100.mem_bandwidth == 900e9 and v100.nvlink_bandwidth == 300e9
    assert (p100.fp32_flops, CATALOG["P100-PCIE-16GB"].fp32_flops) == (10.6e12, 9.3e12)
    assert CATALOG["H200"].memory_bytes == 141e9 and CATALOG["H200"].bf16_flops == 989e12
    assert CATALOG["T4"].flops("bf16") == 65e12
    # The issue's ideal speedups over equal shares: sum X_i / (N min X_i), V100 vs P100 (SXM2 / PCIe).
    assert (15.7 + 10.6) / (2 * 10.6) == pytest.approx(1.24, abs=0.005)
    assert (15.7 + 9.3) / (2 * 9.3) == pytest.approx(1.34, abs=0.005)


def test_yaml_parses_catalog_custom_and_shorthand_and_round_trips(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(MIXED_YAML)
    spec = ClusterSpec.from_yaml(path)
    assert spec.world_size == 4 and spec.emulate and spec.memory_scale == 1e-3
    assert [d.name for d in spec.devices()] == ["V100-32GB", "V100-32GB", "P100-16GB", "MyGPU"]
    assert spec.devices()[3].fp32_flops == 5e12  # "5e12" is a string to PyYAML; it is coerced
    assert [spec.node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert spec.link_bandwidth(0, 1) == 300e9 and spec.link_bandwidth(1, 2) == 6.25e9
    assert spec.link_bandwidth(2, 3) == 16e9  # MyGPU has no NVLink: PCIe
    assert ClusterSpec.from_dict(spec.to_dict()) == spec
    (tmp_path / "d.yaml").write_text(spec.to_yaml())
    assert ClusterSpec.from_yaml(tmp_path / "d.yaml") == spec
    short = ClusterSpec.from_dict({"nodes": [{"devices": {"V100-32GB": 2, "P100-16GB": 2}}]})
    assert [d.name for d in short.devices()] == ["V100-32GB"] * 2 + ["P100-16GB"] * 2
    assert short.inter_node_bandwidth == 6.25e9 and not short.emulate
    override = ClusterSpec.from_dict({"nodes": [{"devices": [{"name": "t4", "memory_bytes": 8e9}]}]})
    assert override.devices()[0].memory_bytes == 8e9 and override.devices()[0].fp32_flops == 8.1e12


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"nodes": [{"devices": ["V100-32G"]}]}, ["unknown device type 'V100-32G'", "did you mean 'V100-32GB'",
                                                   "P100-16GB"]),
        ({"nodes": [{"devices": [{"name": "X", "fp32_flops": 1e12}]}]}, ["lacks field(s) bf16_flops, memory_bytes"]),
        ({"nodes": [{"devices": [{"name": "X", "fp32_flops": -1, "bf16_flops": 1, "memory_bytes": 1,
                                  "mem_bandwidth": 1}]}]}, ["fp32_flops must be a finite number > 0"]),
        ({"nodes": []}, ["cluster spec is empty"]),
        ({}, ["cluster spec is empty"]),
        ({"nodes": [{"devices": []}]}, ["non-empty list"]),
        ({"nodes": [{"devices": ["T4"]}], "inter_node_bandwidth": 0}, ["inter_node_bandwidth must be"]),
        ({"nodes": [{"devices": ["T4"]}], "memory_scal": 1}, ["unknown cluster spec key(s) ['memory_scal']"]),
        ({"nodes": [{"devices": {"T4": 0}}]}, ["device count for 'T4' must be an int >= 1"]),
        ({"nodes": [{"devices": [{"name": "T4", "flops": 3}]}]}, ["unknown device field(s) ['flops']"]),
    ],
)
def test_validation_errors_name_the_problem(data, words):
    with pytest.raises(ClusterError) as e:
        ClusterSpec.from_dict(data)
    for w in words:
        assert w in str(e.value)


def test_world_size_check_and_file_errors(tmp_path):
    spec = from_device_types([CATALOG["V100-32GB"]] * 2 + [CATALOG["P100-16GB"]] * 2)
    spec.check_world_size(4)
    with pytest.raises(ClusterError, match="cluster spec declares 4 devices but world size is 2; "):
        spec.check_world_size(2)
    with pytest.raises(ClusterError, match="cannot read cluster spec"):
        ClusterSpec.from_yaml(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("nodes: [\n")
    with pytest.raises(ClusterError, match="not valid YAML"):
        ClusterSpec.from_yaml(tmp_path / "bad.yaml")
    with pytest.raises(ClusterError, match="out of range"):
        spec.node_of(4)
    with pytest.raises(ClusterError, match="unknown device type"):
        get_device_type("Z9000")
    assert get_device_type("h200") is CATALOG["H200"]


def test_emulation_delays_and_memory_capacity():
    spec = ClusterSpec((NodeSpec((CATALOG["V100-32GB"], CATALOG["P100-16GB"], CATALOG["T4"])),),
                       emulate=True, memory_scale=1e-3)
    delays = emulation_delays(spec)
    assert delays[0] == 0.0
    assert delays[1] == pytest.approx(15.7 / 10.6 - 1)
    assert delays[2] == pytest.approx(15.7 / 8.1 - 1)
    assert memory_capacity(spec, 1) == pytest.approx(16e6)
    plain = ClusterSpec(spec.nodes)
    assert memory_capacity(plain, 1) == 16e9
    assert any("EMULATED" in line for line in spec.describe())
    assert not any("EMULATED" in line for line in plain.describe())


@pytest.mark.parametrize(
    ("name", "memory", "expected"),
    [
        ("Tesla V100-SXM2-32GB", 34089730048, "V100-32GB"),
        ("Tesla V100-SXM2-16GB", 16945512448, "V100-16GB"),
        ("Tesla P100-PCIE-16GB", 17071734784, "P100-PCIE-16GB"),
        ("Tesla P100-SXM2-16GB", 17071734784, "P100-16GB"),
        ("Tesla T4", 15843721216, "T4"),
        ("NVIDIA A100-SXM4-40GB", 42505273344, "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", 85100068864, "A100-80GB"),
        ("NVIDIA H100 80GB HBM3", 85032697856, "H100-80GB"),
        ("NVIDIA H200", 150109454336, "H200"),
    ],
)
def test_detect_local_device_maps_cuda_names_to_the_catalog(monkeypatch, name, memory, expected):
    import types

    import torch

    from whale.detect import detect_local_device

    props = types.SimpleNamespace(name=name, total_memory=memory, multi_processor_count=80, major=8, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    assert detect_local_device(0) is CATALOG[expected]


def test_detect_local_device_estimates_an_unknown_gpu(monkeypatch):
    import types

    import torch

    from whale.detect import detect_local_device

    props = types.SimpleNamespace(name="NVIDIA GeForce RTX 4090", total_memory=25e9, multi_processor_count=128,
                                  major=8, minor=9)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    dev = detect_local_device(0)
    assert dev.name == "NVIDIA GeForce RTX 4090" and dev.memory_bytes == 25e9
    assert dev.fp32_flops == pytest.approx(128 * 128 * 2 * 1.5e9) and dev.bf16_flops == 8 * dev.fp32_flops


def test_detection_without_cuda_is_cpu_and_homogeneous_cpu():
    import torch

    spec = detect_cluster(3)
    if not torch.cuda.is_available():
        assert spec == homogeneous_cpu(3)
    assert spec.world_size == 3
    assert emulation_delays(homogeneous_cpu(2)) == [0.0, 0.0]
    with pytest.raises(ClusterError):
        homogeneous_cpu(0)
    with pytest.raises(ClusterError, match="must be a finite number > 0"):
        DeviceType("X", 1e12, 1e12, 0, 1e9)


def test_cost_model_formulas():
    v100 = CATALOG["V100-32GB"]
    assert cost.compute_time(15.7e12, v100) == pytest.approx(1.0)
    assert cost.compute_time(125e12, v100, efficiency=0.5, dtype="bf16") == pytest.approx(2.0)
    assert cost.compute_time(1e12, 2e12) == 0.5
    assert cost.ring_allreduce_bytes(100.0, 4) == 150.0
    assert cost.ring_allreduce_bytes(100.0, 1) == 0.0
    assert cost.ring_allreduce_time(1e9, 4, 1e9, latency=1e-3) == pytest.approx(1.5 + 6e-3)
    assert cost.ring_allgather_time(1e9, 4, 1e9) == pytest.approx(0.75)
    assert cost.p2p_time(1e6, 1e9, latency=1e-5) == pytest.approx(1e-3 + 1e-5)
    assert [schedule.in_flight_micro_batches(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [schedule.in_flight_micro_batches(s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert schedule.in_flight_micro_batches(3, 4, 8, "GPipe") == 8
    assert schedule.bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert cost.memory_per_device(100, 100, 200, activation_bytes=10, in_flight=3, buffer_bytes=5) == 435
    assert cost.memory_per_device(100, 100, 200, zero_degree=4) == 250
    assert cost.memory_per_device(100, 100, 200, zero_degree=4, zero_stage=3) == 100
    assert cost.utilization([1.0, 2.0, 0.5]) == [0.5, 1.0, 0.25]
    for bad in (lambda: cost.compute_time(-1, v100), lambda: cost.ring_allreduce_time(1, 0, 1),
                lambda: cost.p2p_time(1, 0), lambda: schedule.in_flight_micro_batches(4, 4, 1),
                lambda: cost.memory_per_device(1, 1, 1, zero_stage=4), lambda: cost.compute_time(1, v100, 0.0)):
        with pytest.raises(ValueError):
            bad()
    assert math.isclose(cost.compute_time(0, v100), 0.0)
