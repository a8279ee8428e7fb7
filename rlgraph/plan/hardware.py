"""Hardware profiles as data: what one device computes, holds and moves, with the sources.

    profile("h100").peak_flops            # 9.89e14 dense bf16 FLOP/s
    register_profile(HardwareProfile("b200", ...))   # then Mesh.parse("b200:8") works

The cost model (`rlgraph.plan.cost`) turns plan steps into seconds with these numbers; the memory
model reads `memory_gib` (through `DEVICE_MEMORY_GIB`, which `rlgraph.plan.mesh` re-exports). Link
bandwidths are per direction, per device, in bytes/s: the datasheets quote NVLink and PCIe as the
sum of both directions, so the table halves them. Efficiencies are the fraction of a peak that a
well-tuned run reaches; they are assumptions, stated where they come from, and what calibration
(docs/benchmarks.md) adjusts.
"""

from __future__ import annotations

import attrs

GB = 1e9
TFLOPS = 1e12


@attrs.frozen
class HardwareProfile:
    """One device kind. `peak_flops`: dense bf16 (fp32 for the CPU, which trains in fp32);
    `memory_bandwidth`, `intra_node_bandwidth` (NVLink, or PCIe where there is none),
    `inter_node_bandwidth` (the network share of one device), `host_bandwidth` (device <-> host
    memory): bytes/s, one direction. `latency_s`: fixed cost of one collective or copy.
    `train_efficiency` (MFU of an FSDP step), `prefill_efficiency` (of peak FLOP/s),
    `decode_efficiency` (of peak memory bandwidth), `link_efficiency` (of link bandwidth).
    `host_memory_gib`: host (CPU) memory per device, a typical node's divided by its devices (None:
    unknown, or the device is the host); the memory model checks offloaded state against it."""

    name: str
    peak_flops: float
    memory_bandwidth: float
    memory_gib: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    host_bandwidth: float
    source: str
    latency_s: float = 20e-6
    train_efficiency: float = 0.4
    prefill_efficiency: float = 0.5
    decode_efficiency: float = 0.6
    link_efficiency: float = 0.8
    stage_overhead_s: float = 0.0  # fixed cost of launching one stage (dispatch, Python), per stage
    host_memory_gib: float | None = None


# Efficiencies on GPUs: FSDP training of 7-70B dense models reports 38-45% MFU on H100 (PyTorch's
# "Maximizing training throughput using PyTorch FSDP", 2024; Llama 3 paper, 38-43% BF16 MFU);
# vLLM decode reaches ~60% of HBM bandwidth at small batch. Inter-node: one 400 Gb/s NIC per GPU
# (DGX H100/H200 reference architecture), 200 Gb/s HDR on DGX A100.
PROFILES: dict[str, HardwareProfile] = {}


def register_profile(profile: HardwareProfile) -> HardwareProfile:
    """Add (or replace) a device kind; `Mesh` then accepts its name and its memory."""
    PROFILES[profile.name] = profile
    DEVICE_MEMORY_GIB[profile.name] = profile.memory_gib
    if profile.host_memory_gib is not None:
        HOST_MEMORY_GIB[profile.name] = profile.host_memory_gib
    else:
        HOST_MEMORY_GIB.pop(profile.name, None)
    return profile


def profile(device: str) -> HardwareProfile:
    """The profile of `device` ("h100", "cpu", ...)."""
    if device not in PROFILES:
        raise ValueError(f"no hardware profile for device {device!r}; known: {', '.join(sorted(PROFILES))}; "
                         "add one with rlgraph.plan.hardware.register_profile(HardwareProfile(...))")
    return PROFILES[device]


DEVICE_MEMORY_GIB: dict[str, float] = {}
HOST_MEMORY_GIB: dict[str, float] = {}

# Host memory per device: 2 TiB per 8-GPU H100/H200 node (MLPerf Inference v4.1 system descriptions:
# HPE Cray XD670 8x H100-SXM-80GB "2048GB", Dell XE9680 8x H100 "2 TB", NVIDIA 8x H200-SXM-141GB "2 TB"),
# DGX A100 640GB: 2 TB; L40S: Lenovo ThinkSystem SR650 V3, 512 GB for 3 GPUs. H20: not known here.
NODE_HOST_GIB_PER_GPU = 2048 / 8

for _profile in (
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5), https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet:
    # 989 TFLOPS BF16 dense (1,979 with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s.
    HardwareProfile("h100", 989 * TFLOPS, 3.35e12, 80, 450 * GB, 50 * GB, 64 * GB,
                    "NVIDIA H100 Tensor Core GPU datasheet (SXM5); DGX H100: 400 Gb/s ConnectX-7 per GPU",
                    host_memory_gib=NODE_HOST_GIB_PER_GPU),
    # NVIDIA H200 Tensor Core GPU datasheet (SXM), https://www.nvidia.com/en-us/data-center/h200/:
    # 989 TFLOPS BF16 dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, PCIe Gen5 128 GB/s.
    HardwareProfile("h200", 989 * TFLOPS, 4.8e12, 141, 450 * GB, 50 * GB, 64 * GB,
                    "NVIDIA H200 Tensor Core GPU datasheet (SXM); DGX H200: 400 Gb/s per GPU",
                    host_memory_gib=NODE_HOST_GIB_PER_GPU),
    # NVIDIA A100 Tensor Core GPU datasheet (80GB SXM), https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf:
    # 312 TFLOPS BF16 dense, 80 GB HBM2e at 2,039 GB/s, NVLink 600 GB/s, PCIe Gen4 64 GB/s.
    HardwareProfile("a100", 312 * TFLOPS, 2.039e12, 80, 300 * GB, 25 * GB, 32 * GB,
                    "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM); DGX A100: 200 Gb/s HDR per GPU",
                    host_memory_gib=NODE_HOST_GIB_PER_GPU),
    # NVIDIA H20 (HGX H20) product brief, https://www.nvidia.com/en-us/data-center/h20/ (as published
    # by NVIDIA partners): 148 TFLOPS BF16 dense, 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s, PCIe Gen5.
    HardwareProfile("h20", 148 * TFLOPS, 4.0e12, 96, 450 * GB, 50 * GB, 64 * GB,
                    "NVIDIA HGX H20 product brief; 400 Gb/s per GPU assumed"),
    # NVIDIA L40S datasheet, https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413:
    # 362.05 TFLOPS BF16 dense (733 with sparsity), 48 GB GDDR6 at 864 GB/s, no NVLink, PCIe Gen4 x16 64 GB/s.
    HardwareProfile("l40s", 362.05 * TFLOPS, 864 * GB, 48, 32 * GB, 25 * GB, 32 * GB,
                    "NVIDIA L40S datasheet; no NVLink (PCIe Gen4 between GPUs); 200 Gb/s per GPU assumed",
                    host_memory_gib=512 / 3),
    # The project's development machine as one device (the local runtime: one process, 2 threads):
    # 2 cores of an AMD EPYC at 2.6 GHz (/proc/cpuinfo) with AVX2/AVX-512 (Zen 4 runs 512-bit FMAs on
    # two 256-bit pipes: 2 x 8 fp32 lanes x 2 FLOP = 32 FLOP/cycle, 83 GFLOP/s per core); DDR at
    # ~20 GB/s for two cores; links are memory copies. Efficiencies fitted on the per-step breakdown
    # of the spmd benchmark (docs/benchmarks.md: per worker, 1 thread, half the demo batch, update
    # 55.4 ms for 1.30e9 FLOP = 23.4 GFLOP/s, generate 21.7 ms for 4.32e8 FLOP = 19.9 GFLOP/s): the
    # tiny model's 64-wide matrices keep a core at a quarter of its peak. A cpu:2 mesh on this
    # machine splits these two cores; the profile does not know that.
    HardwareProfile("cpu", 166e9, 20 * GB, 24, 10 * GB, 1 * GB, 10 * GB,
                    "AMD EPYC (Zen 4), 2 cores at 2.6 GHz, fp32 FMA peak; 24 GiB",
                    latency_s=100e-6, train_efficiency=0.28, prefill_efficiency=0.24, decode_efficiency=0.5,
                    link_efficiency=0.5, stage_overhead_s=0.5e-3),
):
    register_profile(_profile)


# Name fragments of `torch.cuda.get_device_name()` -> profile, most specific first ("H200" before
# "H100"; "H20" only as a whole word, or "H200" would match it).
_GPU_NAMES: tuple[tuple[str, str], ...] = (("H200", "h200"), ("H100", "h100"), ("A100", "a100"),
                                           ("L40S", "l40s"), ("H20", "h20"))


def profile_for_gpu(name: str, memory_bytes: int) -> str:
    """The profile of a GPU that reports `name` and `memory_bytes` (torch's device properties).

    A known kind whose memory differs from its table entry by more than 3% (an A100 40GB, an H100
    NVL 94GB, an L40S, whose 48 GB are 44.4 GiB) gets a derived profile `<kind>_<GiB>g` with the
    memory it really has. A GPU of no known kind (a T4, an RTX card) gets the generic entry
    `generic_gpu_<GiB>g`: its own memory, so fits are checked against what it has, and the L40S's
    compute and bandwidth standing in (its `source` says so): its costs are estimates, not a profile."""
    import re

    gib = memory_bytes / 2**30
    for fragment, kind in _GPU_NAMES:
        if re.search(rf"\b{fragment}\b", name.upper()):
            base = PROFILES[kind]
            if abs(gib - base.memory_gib) <= 0.03 * base.memory_gib:
                return kind
            return _with_memory(base, f"{kind}_{round(gib)}g", gib, f"{base.source}; memory as the device reports it")
    return _with_memory(PROFILES["l40s"], f"{GENERIC_GPU}_{round(gib)}g", gib,
                        f"{name!r} has no profile: the L40S's compute and bandwidth stand in, so its costs are "
                        "estimates; register its own with rlgraph.plan.hardware.register_profile(HardwareProfile(...)) "
                        "and name it in the mesh; memory as the device reports it")


GENERIC_GPU = "generic_gpu"  # the kind of a GPU no profile names (with its memory: generic_gpu_15g)


def _with_memory(base: HardwareProfile, kind: str, gib: float, source: str) -> str:
    """`kind`: `base` with `gib` of device memory (registered once), for a GPU whose memory differs."""
    if kind not in PROFILES:
        register_profile(attrs.evolve(base, name=kind, memory_gib=round(gib, 1), source=f"{source} ({gib:.1f} GiB)"))
    return kind


def detect_device_kind(device: str) -> str:
    """The mesh's device kind for a runtime device ("cpu", "cuda", "cuda:1"): "cpu", or the profile of
    the GPU torch finds (`profile_for_gpu`), so a plan's costs and fits are for the hardware in hand."""
    if device == "cpu":
        return "cpu"
    import torch

    index = torch.device(device).index or 0
    properties = torch.cuda.get_device_properties(index)
    return profile_for_gpu(properties.name, properties.total_memory)
