"""Hardware profiles: what one device computes and moves per second, inside a node and across nodes.

The GPU profiles are datasheet peaks with the share of them that real kernels and collectives reach
written next to them (assumptions a reader can change, not measurements):

    H100 SXM   989 TFLOP/s dense bf16, 3.35 TB/s HBM3, 80 GiB; 8 per node on NVLink 4 (450 GB/s each
               way; nccl-tests' all-reduce bus bandwidth reaches about 360), one 400 Gb/s InfiniBand
               NDR port per GPU (50 GB/s; about 40 reached)
    A100 SXM   312 TFLOP/s dense bf16, 2.0 TB/s HBM2e, 80 GiB; NVLink 3 (300 GB/s each way, about 240
               reached), one 200 Gb/s HDR port per GPU (25 GB/s, about 20 reached)

Large GEMMs reach about 70% of the tensor-core peak on both; attention is fused (FlashAttention: its
probabilities never go to memory); communication overlaps compute where timing.py says it can; a
block's kernel launches cost about 20 us, the embeddings' and head's 50 us; the host (an offloaded
optimizer) has PCIe at 25 GB/s (A100) or 50 GB/s (H100), 100 GB/s of CPU memory bandwidth and NVMe
at 5 GB/s. ``local`` is measured where the planner runs (calibrate.py): NumPy's matmul speed on a
block's GEMMs at the model's shapes, its memory bandwidth, the fixed costs of minidist's autograd,
and the all-reduce of the collectives benchmark.
"""
from __future__ import annotations

from dataclasses import dataclass

GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    """One device and its links. ``flops``: dense peak in the compute dtype; ``matmul_efficiency``:
    the share of it GEMMs reach; ``memory_bandwidth``: device memory, bytes/s; ``layer_overhead``:
    seconds a block's forward and backward cost beyond FLOPs and bytes (kernel launches, the
    interpreter), ``microbatch_overhead`` the same for the embeddings, head and loss of a micro-batch,
    ``tensor_update_overhead`` an optimizer step's per parameter tensor; links are bytes/s of bus bandwidth per device, latencies seconds per message;
    ``host_bandwidth``: device to host (PCIe), ``host_memory_bandwidth``: the host's memory (where an
    offloaded optimizer updates), ``disk_bandwidth``: host to NVMe, all bytes/s;
    ``devices_per_node`` share the fast link; ``cores``: ranks that run at once (a CPU), None for a
    GPU (one rank each); ``overlap``: whether communication can run under compute (timing.py's
    overlap rules; a GPU's copy engines and NICs can); ``flash_attention``: whether attention is
    fused so that its probabilities never go to memory (on GPUs, FlashAttention); ``block_seconds``
    and ``head_seconds``: measured forward + backward of one rank's share of a block, and of the
    embeddings, head and loss, for one micro-batch (the local profile, at the run's shapes), which
    then replace the FLOP and byte counts of a block and of the head."""
    name: str
    flops: float
    matmul_efficiency: float
    memory_bandwidth: float
    memory_bytes: float
    devices_per_node: int
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float
    inter_latency: float
    layer_overhead: float = 0.0
    microbatch_overhead: float = 0.0
    tensor_update_overhead: float = 0.0
    host_bandwidth: float = 25e9
    host_memory_bandwidth: float = 100e9
    disk_bandwidth: float = 5e9
    cores: int | None = None
    overlap: bool = True
    flash_attention: bool = True
    block_seconds: float | None = None
    head_seconds: float | None = None
    note: str = ""

    def link(self, span: int) -> tuple[float, float]:
        """(bus bandwidth, latency) of a group whose ranks lie ``span`` consecutive devices apart
        end to end: inside a node when it fits in one."""
        if span <= self.devices_per_node:
            return self.intra_bandwidth, self.intra_latency
        return self.inter_bandwidth, self.inter_latency


PROFILES = {
    "h100": Hardware("H100 SXM", 989e12, 0.70, 3.35e12, 80 * GIB, 8, 360e9, 40e9, 5e-6, 15e-6, 20e-6, 50e-6, 0.0, 50e9),
    "a100": Hardware("A100 SXM", 312e12, 0.70, 2.0e12, 80 * GIB, 8, 240e9, 20e9, 5e-6, 15e-6, 20e-6, 50e-6, 0.0, 25e9),
}
