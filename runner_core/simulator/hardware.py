"""The devices a what-if can plan for: datasheet peaks, memory, links and efficiency bands, one table with sources.

A `HardwareSpec` holds what a datasheet says (dense peaks per compute format, memory, bandwidths); `Coefficients`
say how much of it a serving engine gets (the cost model's efficiencies and fixed costs). A calibrated CPU carries
its fitted coefficients in `efficiency`; a named GPU carries a `band` of three ("low" / "typical" / "high":
pessimistic .. optimistic), so a prediction is a range, not a point.

The bands (GPU_BANDS below), from published measurements:

* compute_efficiency, the share of the dense tensor peak the linear layers reach when compute-bound: large bf16
  GEMMs reach ~70-80% of peak with cuBLAS on A100 and H100 (H100 ~700-750 of 989 TFLOP/s), a model's mix of shapes
  (skinny QKV and down projections, TP shards) less; hipBLASLt on MI300X reached ~45-55% of its 1307 TFLOP/s in
  SemiAnalysis's GEMM sweep (Dec 2024); the 72 W L4 lowers its clocks under sustained tensor load.
* memory_efficiency, the share of HBM bandwidth weight and KV reads reach when memory-bound: a STREAM-like copy
  reaches ~90% of the datasheet figure on H100 (3.0-3.1 of 3.35 TB/s), GEMV-shaped decode kernels 70-85%.
* attention_efficiency, the share of the peak prefill (chunk) attention's query-key FLOPs reach:
  FlashAttention-2 forward runs at 50-73% of A100's peak, FlashAttention-3 at ~75% of H100's (bf16).
* decode_attention_efficiency, the share of the bandwidth the paged decode kernel's KV reads reach (one query
  per sequence: memory-bound, a different kernel): it reads its scattered KV blocks at 40-70% of the bandwidth.
* fixed costs: the CPU side of a vLLM-style step (scheduling, input preparation, sampling, output processing)
  takes ~1-5 ms per step plus some microseconds per sequence; kernel gaps and small ops a few to tens of
  microseconds per layer (less under CUDA graphs). BLIS found that a model with zero per-step overhead
  under-predicts TTFT by 17-56%, so the band's lowest fixed costs stay well above zero.

The band is as wide as these measurements disagree: "high" is what a tuned stack (CUDA graphs, FlashAttention-3,
well-tuned GEMMs) reaches, "low" an untuned or eager one; published serving figures should fall inside it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

_GiB = 2**30
_MiB = 2**20
BANDS = ("low", "typical", "high")


@dataclass(frozen=True)
class Coefficients:
    """What the fit finds (a CPU) or a band gives (a GPU): efficiencies (fractions of the peaks) and fixed seconds."""

    compute_efficiency: float  # fraction of peak_flops the linear layers reach when compute-bound
    memory_efficiency: float  # fraction of mem_bandwidth when memory-bound (weights + activations)
    attention_efficiency: float  # fraction of peak for prefill / chunk attention (query-key pair FLOPs)
    decode_attention_efficiency: float  # fraction of mem_bandwidth for the decode rows' KV reads
    step_s: float  # fixed seconds per step (scheduler, input prep, sampling, launch)
    layer_s: float  # fixed seconds per decoder layer per step (kernel launches, small ops)
    seq_s: float  # fixed seconds per scheduled sequence per step (bookkeeping, sampling, detokenize)
    token_s: float = 0.0  # per scheduled token (elementwise work the roofline misses)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class HardwareSpec:
    """One device as its datasheet describes it (per device figures) and how to reach it (links, devices per node)."""

    name: str  # "h100-sxm", "h200", "a100-sxm-80g", "l4", "mi300x", or "cpu:<model> (<tier>)"
    kind: str  # "gpu" | "cpu"
    memory_bytes: int  # per device, as the driver reports it
    peak_flops: dict[str, float]  # dense FLOP/s per device by compute format
    mem_bandwidth: float  # bytes/s per device
    link_bandwidth: float  # bytes/s per device, one direction (NVLink / Infinity Fabric / PCIe)
    link_latency_s: float  # per collective or send
    devices_per_node: int
    reserved_bytes: int  # held outside the model on each device (CUDA context, workspaces)
    efficiency: Coefficients | None = None  # calibrated coefficients (a CPU)
    band: dict[str, Coefficients] = field(default_factory=dict)  # "low" / "typical" / "high" (GPUs)
    sources: dict[str, str] = field(default_factory=dict)  # field -> datasheet / paper URL or title

    def coefficients(self, band: str = "typical") -> Coefficients:
        """The coefficients of `band`: a GPU's band entry, or a calibrated CPU's own (its only, "typical")."""
        if band not in BANDS:
            raise ValueError(f"band={band!r} is not an efficiency band; use one of {', '.join(BANDS)}")
        if band in self.band:
            return self.band[band]
        if self.efficiency is not None and band == "typical":
            return self.efficiency
        if self.efficiency is not None:
            raise ValueError(f"{self.name} has one set of calibrated coefficients, no {band!r} band; use "
                             "band='typical'")
        raise ValueError(f"{self.name} has neither calibrated coefficients nor an efficiency band; give it "
                         "efficiency=Coefficients(...) (a CPU: runner_core.simulator.calibrate)")

    def as_dict(self) -> dict:
        """Plain values (the coefficients as dicts): JSON-ready."""
        return asdict(self)


def _band(compute: tuple, memory: tuple, attention: tuple, decode_attention: tuple = (0.40, 0.55, 0.70), *,
          layer_s: tuple = (30e-6, 15e-6, 5e-6)) -> dict:
    """Low / typical / high coefficients from (low, typical, high) efficiencies (decode attention: the paged
    decode kernel's 40-70% of the bandwidth unless given); the fixed costs are the host's (vLLM-style engine,
    CUDA graphs at "high", eager at "low"): shared by every GPU but the layer cost."""
    step_s, seq_s = (5e-3, 2.5e-3, 1e-3), (30e-6, 12e-6, 4e-6)
    return {name: Coefficients(compute[i], memory[i], attention[i], decode_attention[i], step_s[i], layer_s[i],
                               seq_s[i]) for i, name in enumerate(BANDS)}


# efficiencies as (low, typical, high); the reasoning is in the module docstring (MI300X's decode attention: the
# same kernel measurements, lowered as its other bands are for a less tuned ROCm stack)
GPU_BANDS = {
    "a100-sxm-80g": _band((0.55, 0.70, 0.82), (0.65, 0.78, 0.88), (0.35, 0.50, 0.65)),
    "h100-sxm": _band((0.45, 0.60, 0.75), (0.65, 0.78, 0.90), (0.35, 0.50, 0.70)),
    "h200": _band((0.45, 0.60, 0.75), (0.65, 0.78, 0.90), (0.35, 0.50, 0.70)),
    "l4": _band((0.40, 0.55, 0.70), (0.65, 0.78, 0.88), (0.30, 0.45, 0.60)),
    "mi300x": _band((0.30, 0.42, 0.55), (0.55, 0.70, 0.82), (0.25, 0.40, 0.55), (0.35, 0.50, 0.62),
                    layer_s=(40e-6, 20e-6, 8e-6)),
}

_BAND_SOURCES = {
    "band.compute_efficiency": "cuBLAS / hipBLASLt GEMM sweeps: SemiAnalysis, 'MI300X vs H100 vs H200 Benchmark "
                               "Part 1: Training' (2024-12-22); NVIDIA H100 datasheet peaks",
    "band.memory_efficiency": "sustained HBM bandwidth (D2D copy / STREAM triad ~3.0-3.1 of 3.35 TB/s on H100)",
    "band.attention_efficiency": "Dao, 'FlashAttention-2' (arXiv 2307.08691: 50-73% of A100 peak); Shah et al., "
                                 "'FlashAttention-3' (arXiv 2407.08608: ~75% of H100 bf16 peak)",
    "band.decode_attention_efficiency": "paged decode attention (vLLM PagedAttention, FlashInfer / FlashDecoding "
                                        "kernels) reads scattered KV blocks at ~40-70% of HBM bandwidth",
    "band.step_s": "BLIS (inference-sim): zero per-step overhead under-predicts TTFT by 17-56%; "
                   "Srivatsa et al., 'Can scheduling overhead dominate LLM inference?' (mlsys.wuklab.io)",
    "reserved_bytes": "CUDA context (~0.3-0.5 GiB) + cuBLASLt workspace (32 MiB on Hopper, pytorch#120925) + "
                      "NCCL buffers and allocator slack: ~1 GiB, as vLLM's profiled non-torch memory",
}
_NVLINK_LATENCY = "docs/parallel.md: ~8 us per NVLink all-reduce (NCCL, small messages)"


def _nvidia(name: str, *, memory_mib: int, peaks: dict[str, float], bandwidth: float, link: float,
            latency: float, sources: dict[str, str]) -> HardwareSpec:
    return HardwareSpec(name=name, kind="gpu", memory_bytes=memory_mib * _MiB, peak_flops=peaks,
                        mem_bandwidth=bandwidth, link_bandwidth=link, link_latency_s=latency, devices_per_node=8,
                        reserved_bytes=_GiB, band=GPU_BANDS[name], sources={**sources, **_BAND_SOURCES})


_H100_DATASHEET = "NVIDIA H100 Tensor Core GPU datasheet (SXM: dense = half the 'with sparsity' figures), " \
                  "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"
_HOPPER_PEAKS = {"float32": 66.9e12, "bfloat16": 989.4e12, "float16": 989.4e12, "fp8": 1978.9e12, "int8": 1978.9e12}

HARDWARE: dict[str, HardwareSpec] = {spec.name: spec for spec in (
    _nvidia("a100-sxm-80g", memory_mib=81920, bandwidth=2.039e12, link=300e9, latency=8e-6,
            peaks={"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12, "int8": 624e12},
            sources={"peak_flops": "NVIDIA A100 Tensor Core GPU datasheet (dense; no fp8 on Ampere), "
                                   "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
                                   "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf",
                     "mem_bandwidth": "A100 datasheet: 80GB HBM2e SXM, 2,039 GB/s",
                     "memory_bytes": "A100 80GB: 81,920 MiB as nvidia-smi reports it",
                     "link_bandwidth": "A100 datasheet: NVLink 600 GB/s (both directions) -> 300 GB/s each way",
                     "link_latency_s": _NVLINK_LATENCY, "devices_per_node": "DGX/HGX A100: 8 GPUs"}),
    _nvidia("h100-sxm", memory_mib=81559, bandwidth=3.35e12, link=450e9, latency=8e-6, peaks=_HOPPER_PEAKS,
            sources={"peak_flops": _H100_DATASHEET + "; float32 = non-tensor FP32 (torch's default matmul)",
                     "mem_bandwidth": "H100 datasheet: SXM 80GB HBM3, 3.35 TB/s",
                     "memory_bytes": "H100 80GB HBM3: 81,559 MiB as nvidia-smi reports it",
                     "link_bandwidth": "H100 datasheet: NVLink 900 GB/s (both directions) -> 450 GB/s each way",
                     "link_latency_s": _NVLINK_LATENCY, "devices_per_node": "DGX/HGX H100: 8 GPUs"}),
    _nvidia("h200", memory_mib=143771, bandwidth=4.8e12, link=450e9, latency=8e-6, peaks=_HOPPER_PEAKS,
            sources={"peak_flops": "NVIDIA H200 Tensor Core GPU datasheet (SXM; same GH100 compute as H100), "
                                   "https://www.nvidia.com/en-us/data-center/h200/",
                     "mem_bandwidth": "H200 datasheet: 141 GB HBM3e, 4.8 TB/s",
                     "memory_bytes": "H200 141GB: 143,771 MiB as nvidia-smi reports it",
                     "link_bandwidth": "H200 datasheet: NVLink 900 GB/s (both directions) -> 450 GB/s each way",
                     "link_latency_s": _NVLINK_LATENCY, "devices_per_node": "HGX H200: 8 GPUs"}),
    _nvidia("l4", memory_mib=23034, bandwidth=300e9, link=32e9, latency=20e-6,
            peaks={"float32": 30.3e12, "bfloat16": 121e12, "float16": 121e12, "fp8": 242.5e12, "int8": 242.5e12},
            sources={"peak_flops": "NVIDIA L4 Tensor Core GPU datasheet (dense = half the sparsity figures: "
                                   "FP8 485 -> 242.5, BF16 242 -> 121 TFLOPS; FP32 30.3), "
                                   "https://resources.nvidia.com/en-us-data-center-overview/l4-gpu-datasheet",
                     "mem_bandwidth": "L4 datasheet: 24GB GDDR6, 300 GB/s",
                     "memory_bytes": "L4 24GB: 23,034 MiB as nvidia-smi reports it (ECC on)",
                     "link_bandwidth": "L4 datasheet: PCIe Gen4 x16, 64 GB/s (both directions) -> 32 GB/s each way; "
                                       "no NVLink",
                     "link_latency_s": "PCIe peer-to-peer all-reduce through the host: ~20 us (estimate)",
                     "devices_per_node": "GCP g2-standard-96 / AWS g6.48xlarge: 8 L4"}),
    HardwareSpec(
        name="mi300x", kind="gpu", memory_bytes=196288 * _MiB,
        peak_flops={"float32": 163.4e12, "bfloat16": 1307.4e12, "float16": 1307.4e12, "fp8": 2614.9e12,
                    "int8": 2614.9e12},
        mem_bandwidth=5.3e12, link_bandwidth=448e9, link_latency_s=10e-6, devices_per_node=8, reserved_bytes=_GiB,
        band=GPU_BANDS["mi300x"],
        sources={"peak_flops": "AMD Instinct MI300X data sheet (dense; float32 = FP32 matrix), https://www.amd.com/"
                               "content/dam/amd/en/documents/instinct-tech-docs/data-sheets/"
                               "amd-instinct-mi300x-data-sheet.pdf",
                 "mem_bandwidth": "MI300X data sheet: 192 GB HBM3, 5.3 TB/s",
                 "memory_bytes": "MI300X: 196,288 MiB as rocm-smi / hipGetDeviceProperties report it",
                 "link_bandwidth": "MI300X data sheet: 7 Infinity Fabric links x 128 GB/s (both directions) = "
                                   "896 GB/s -> 448 GB/s each way in the 8-GPU mesh",
                 "link_latency_s": "RCCL small-message all-reduce over xGMI: ~10 us (estimate)",
                 "devices_per_node": "AMD Instinct MI300X platform: 8 OAM GPUs", **_BAND_SOURCES}),
)}


def get_hardware(name_or_spec: str | HardwareSpec) -> HardwareSpec:
    """A spec as given, or the named device of HARDWARE (ValueError listing the names for an unknown one)."""
    if isinstance(name_or_spec, HardwareSpec):
        return name_or_spec
    spec = HARDWARE.get(str(name_or_spec).lower()) if isinstance(name_or_spec, str) else None
    if spec is None:
        raise ValueError(f"unknown hardware {name_or_spec!r}; use one of {', '.join(HARDWARE)}, or a HardwareSpec "
                         "(this CPU: Simulation(hardware='cpu') after `make bench-whatif`)")
    return spec
