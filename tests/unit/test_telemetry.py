"""GPU telemetry: which NVML device is this process's GPU (CUDA_VISIBLE_DEVICES as numbers, GPU UUIDs or MIG
slices, read as torch reads it), and nothing, quietly, where no NVIDIA driver answers."""

import logging
import warnings

import pytest
import torch

from train.report.hardware import GpuTelemetry, NvmlDevice, nvml_device

# Three GPUs in NVML's order; 'GPU-8f2' is a prefix of the first two, 'GPU-8f2c' of the first alone.
UUIDS = ["GPU-8f2c1a7e-4b1d-9c3e-2f5a-6d7e8f9a0b1c", "GPU-8f2d0b6a-1c2e-4f3a-8b9c-0d1e2f3a4b5c",
         "GPU-12ab34cd-56ef-7890-abcd-ef1234567890"]
MIG = "MIG-5c9f2e1d-7a3b-5c8e-9d0f-1a2b3c4d5e6f"

MAPPINGS = [
    (None, 1, NvmlDevice(1)),  # unset: every GPU, in NVML's order
    (None, 3, None),
    ("2,0", 0, NvmlDevice(2)),
    ("2,0", 1, NvmlDevice(0)),
    (" 1 , 2", 1, NvmlDevice(2)),
    ("1gpu,0", 0, NvmlDevice(1)),  # strtoul: the leading digits
    ("0,-1,1", 1, None),  # a negative number ends the list
    ("0,x,1", 1, None),  # so does one that is no number
    ("0,7,1", 1, None),  # and one past the last GPU
    ("1,1", 0, None),  # a repeat leaves no device
    ("", 0, None),
    (UUIDS[2], 0, NvmlDevice(2)),
    ("GPU-12ab34cd-56ef-7890-abcd-ef1234567890,GPU-8f2d", 1, NvmlDevice(1)),
    ("GPU-8f2c,GPU-12", 1, NvmlDevice(2)),  # unique prefixes
    ("GPU-12,GPU-8f2", 1, None),  # an ambiguous prefix ends the list
    ("GPU-12,GPU-ffff", 1, None),  # so does one that matches no GPU
    ("GPU-12,1", 1, None),  # and an entry without the prefix
    ("GPU-12,GPU-12ab", 0, None),  # one GPU twice leaves no device
    ("GPU-12,GPU-12", 0, None),
    (MIG, 0, NvmlDevice(mig_uuid=MIG)),
    (f"{MIG},MIG-0a1b2c3d-0000-1111-2222-333344445555", 1,
     NvmlDevice(mig_uuid="MIG-0a1b2c3d-0000-1111-2222-333344445555")),
    (f"MIG-{UUIDS[0]}/3/0", 0, NvmlDevice(0, instance=(3, 0))),  # CUDA's older form: a slice of GPU 0
    ("MIG-GPU-12ab34cd/1/2", 0, NvmlDevice(2, instance=(1, 2))),
    ("MIG-GPU-ffff/1/0", 0, None),  # no such GPU
    (f"{MIG},0", 1, None),  # an entry without the prefix ends the list
    (f"{MIG},{MIG}", 0, None),
]


@pytest.mark.parametrize("visible, ordinal, device", MAPPINGS)
def test_cuda_visible_devices_names_the_nvml_device(visible, ordinal, device):
    assert nvml_device(visible, ordinal, UUIDS) == device


@pytest.mark.parametrize("visible, ordinal, device", [m for m in MAPPINGS if not (m[0] or "").startswith("MIG-")])
def test_the_mapping_is_torchs_own(visible, ordinal, device, monkeypatch):
    """The GPU torch itself would ask NVML about (torch.cuda._get_nvml_device_index, torch 2.13.0), from its own
    parsing and UUID matching, which need no driver."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    parsed = torch.cuda._parse_visible_devices()
    if parsed and isinstance(parsed[0], str):
        ordinals = torch.cuda._transform_uuid_to_ordinals(parsed, UUIDS)
    else:  # _device_count_nvml: the list ends at the first number past the last GPU
        ordinals = parsed[:next((i for i, n in enumerate(parsed) if n >= len(UUIDS)), len(parsed))]
    assert (NvmlDevice(ordinals[ordinal]) if ordinal < len(ordinals) else None) == device


@pytest.mark.parametrize("visible", [None, "1", UUIDS[0], MIG, f"MIG-{UUIDS[0]}/3/0"])
def test_without_a_driver_telemetry_reads_nothing_quietly(visible, monkeypatch, capfd, caplog):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        readings = [GpuTelemetry(torch.device("cuda", 0)).read(), GpuTelemetry(torch.device("cpu")).read()]
    assert readings == [{}, {}]
    assert capfd.readouterr() == ("", "") and not caplog.records


@pytest.mark.gpu
def test_a_gpu_named_by_its_uuid_is_read(monkeypatch):
    """On a real driver: CUDA_VISIBLE_DEVICES as a prefix of NVML index 0's UUID reads that GPU."""
    import pynvml

    pynvml.nvmlInit()
    uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(0))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", uuid[:12])
    telemetry = GpuTelemetry(torch.device("cuda", 0))
    assert pynvml.nvmlDeviceGetUUID(telemetry.board) == uuid
    reading = telemetry.read()
    assert reading.keys() >= {"util", "mem_mib"} and reading["mem_mib"] > 0
