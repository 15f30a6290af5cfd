"""Projected per-GPU scaling efficiency of DDP at 8, 64 and 512 GPUs, on paper.

    python benchmarks/projection.py                     # the table in docs/performance.md
    python benchmarks/projection.py --link mine --inter-gbit 100 --inter-latency-us 10 \\
        --gpus-per-node 4 --gpus 8,32,128 --arch resnet50 --compute-ms 60

Efficiency is one GPU's throughput in an N-GPU run over its throughput alone, with the
same per-GPU batch: compute / (compute + exposed communication + compression compute).
Only the gradient all-reduce is modelled; data loading, stragglers and the optimizer cost
the same at any N here (they do not in real runs: see docs/performance.md, "Scaling").

The all-reduce, as NCCL runs it across nodes (stated in docs/performance.md):
  bandwidth: 2 (N - 1) / N x bytes / bus_bw, bus_bw = the NVLink bandwidth of a GPU inside
             one node, else min(NVLink, the node's network bandwidth): in a ring (and in
             NCCL's trees) each node sends and receives about 2 x bytes through its NICs,
             however many GPUs share them;
  latency:   per collective, the smaller of a ring's 2 (N - 1) network hops and a tree's
             2 (log2 nodes network hops + (GPUs per node - 1) NVLink hops): NCCL's tuner
             picks trees at scale because the ring's latency grows with N.
DDP all-reduces gradient buckets during backward (`--bucket-cap-mb` 25), so only what does
not fit in the backward pass is exposed: max(last bucket's share x comm, comm - backward
share x compute); the last bucket is filled when backward ends and always shows.
ddpcli's PowerSGD hook waits for its two all-reduces per bucket inside the hook, which on a
GPU puts them (and its matmuls) on the compute stream: nothing of it overlaps backward.

Stdlib only; the models' figures below come from ddpcli's own `bytes_per_step` and DDP's
bucket assignment on torchvision's models (tests/test_projection.py checks them).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

GBIT = 1e9 / 8  # bytes/s
US = 1e-6
MS = 1e-3

NVLINK4_BW = 450e9  # H100 SXM NVLink 4: 900 GB/s per GPU both ways, 450 GB/s each way
NVLINK_LATENCY = 1 * US  # assumed, per hop
BACKWARD_SHARE = 2 / 3  # assumed: backward is about twice the forward's work
# PowerSGD's compute, estimated: each of its small eager ops costs about this much to
# issue (assumed), and it reads and writes the gradient matrices about 10 times in fp32
# over H100 HBM3's 3.35 TB/s (its matmuls are rank-2: negligible arithmetic).
OP_COST = 5 * US
MATRIX_PASSES = 10
HBM_BW = 3.35e12


@dataclass(frozen=True)
class Link:
    name: str
    label: str  # its columns' heading
    gpus_per_node: int
    intra_bw: float  # bytes/s per GPU inside a node
    inter_bw: float  # bytes/s per node between nodes, all its NICs together
    inter_latency: float  # s per network hop
    intra_latency: float = NVLINK_LATENCY


LINKS = {
    # One 400 Gbit/s NIC per GPU (8 per node), as DGX H100 and most H100 clusters.
    "ib": Link(
        "NVLink 4 + 8 x 400 Gbit/s InfiniBand per node", "IB", 8, NVLINK4_BW, 8 * 400 * GBIT, 5 * US
    ),
    # One 25 Gbit/s port per node, TCP sockets (NCCL_NET=Socket): tens of microseconds.
    "eth": Link(
        "NVLink 4 + 25 Gbit/s Ethernet per node", "25GbE", 8, NVLINK4_BW, 25 * GBIT, 25 * US
    ),
}


@dataclass(frozen=True)
class Workload:
    """One model's step: its compute and what DDP all-reduces."""

    name: str
    setting: str  # image size, batch, classes
    compute_s: float  # forward + backward of one GPU's batch
    source: str  # where compute_s comes from
    bytes_per_step: dict[str, int]  # by --grad-compression, from ddpcli's bytes_per_step
    buckets: int  # DDP's buckets at --bucket-cap-mb 25
    last_bucket_share: float  # of the gradient bytes: the bucket backward fills last
    matrices: int  # gradients PowerSGD compresses (rank 2)
    other_tensors: int  # biases and norms, all-reduced as they are
    matrix_elements: int


WORKLOADS = {
    "resnet18": Workload(
        "resnet18",
        "96 px, batch 128, 10 classes",
        128 / 10_797,  # measured: bf16, 10,797 img/s on one H100 80GB HBM3, 2026-11-26
        "measured, H100, bf16",
        {"none": 44_726_568, "fp16": 22_363_284, "bf16": 22_363_284, "powersgd:2": 330_000},
        buckets=3,
        last_bucket_share=8_769_792 / 44_726_568,
        matrices=21,
        other_tensors=41,
        matrix_elements=11_172_032,
    ),
    "resnet50": Workload(
        "resnet50",
        "224 px, batch 256, 1000 classes",
        256 / 2_470,  # published: NVIDIA DeepLearningExamples, 1 x A100 80GB, AMP
        "published, A100 80GB, AMP",
        {"none": 102_228_128, "fp16": 51_114_064, "bf16": 51_114_064, "powersgd:2": 876_408},
        buckets=5,
        last_bucket_share=9_724_160 / 102_228_128,
        matrices=54,
        other_tensors=107,
        matrix_elements=25_502_912,
    ),
}
COMPRESSIONS = ("none", "fp16", "powersgd:2")


def allreduce_seconds(
    nbytes: float,
    gpus: int,
    gpus_per_node: int,
    intra_bw: float,
    inter_bw: float,
    latency: float,
    intra_latency: float = NVLINK_LATENCY,
) -> float:
    """One all-reduce of NBYTES over GPUS (module docstring: bandwidth plus latency)."""
    if gpus <= 1:
        return 0.0
    nodes = math.ceil(gpus / gpus_per_node)
    if nodes == 1:
        return 2 * (gpus - 1) / gpus * nbytes / intra_bw + 2 * (gpus - 1) * intra_latency
    bus_bw = min(intra_bw, inter_bw)
    ring = 2 * (gpus - 1) * latency
    tree = 2 * (math.ceil(math.log2(nodes)) * latency + (gpus_per_node - 1) * intra_latency)
    return 2 * (gpus - 1) / gpus * nbytes / bus_bw + min(ring, tree)


def efficiency(
    compute_s: float,
    backward_share: float,
    bytes_per_step: float,
    gpus: int,
    gpus_per_node: int,
    intra_bw: float,
    inter_bw: float,
    latency: float,
    *,
    collectives: int = 1,
    last_share: float = 0.0,
    overlaps: bool = True,
    extra_s: float = 0.0,
    intra_latency: float = NVLINK_LATENCY,
) -> float:
    """compute / (compute + exposed communication + EXTRA_S) for one GPU of GPUS.

    BYTES_PER_STEP goes in COLLECTIVES all-reduces of equal size (DDP's buckets); those
    that OVERLAP backward hide behind BACKWARD_SHARE x COMPUTE_S, except the LAST_SHARE
    that backward fills last. EXTRA_S: compression's own compute per step."""
    if gpus <= 1:
        return 1.0  # nothing all-reduced, no hook runs
    each = allreduce_seconds(
        bytes_per_step / collectives,
        gpus,
        gpus_per_node,
        intra_bw,
        inter_bw,
        latency,
        intra_latency,
    )
    comm = collectives * each
    exposed = max(last_share * comm, comm - backward_share * compute_s) if overlaps else comm
    return compute_s / (compute_s + exposed + extra_s)


def powersgd_seconds(workload: Workload, op_cost: float = OP_COST, rank: int = 2) -> float:
    """PowerSGD's compute per step, estimated from ddpcli's hook: per matrix, the copy and
    error add, M Q, Gram-Schmidt (3 ops a column, 4 more between columns), M^T P, the
    mean P Q^T, the new error and the copy back; two ops per other tensor; two cats and two
    all-reduce calls a bucket. Issue cost plus memory traffic."""
    per_matrix = 8 + 3 * rank + 4 * (rank - 1)
    ops = workload.matrices * per_matrix + 2 * workload.other_tensors + 4 * workload.buckets
    traffic = workload.matrix_elements * 4 * MATRIX_PASSES / HBM_BW
    return ops * op_cost + traffic


def step_efficiency(
    workload: Workload,
    compression: str,
    gpus: int,
    link: Link,
    backward_share: float = BACKWARD_SHARE,
    op_cost: float = OP_COST,
) -> float:
    """One table cell: WORKLOAD with COMPRESSION on GPUS over LINK."""
    powersgd = compression.startswith("powersgd")
    return efficiency(
        workload.compute_s,
        backward_share,
        workload.bytes_per_step[compression],
        gpus,
        link.gpus_per_node,
        link.intra_bw,
        link.inter_bw,
        link.inter_latency,
        # PowerSGD: two all-reduces a bucket (P, then Q), waited for inside the hook.
        collectives=workload.buckets * (2 if powersgd else 1),
        last_share=workload.last_bucket_share,
        overlaps=not powersgd,
        extra_s=powersgd_seconds(workload, op_cost) if powersgd else 0.0,
        intra_latency=link.intra_latency,
    )


def table(
    workloads: list[Workload],
    links: list[Link],
    gpu_counts: list[int],
    backward_share: float = BACKWARD_SHARE,
    op_cost: float = OP_COST,
) -> str:
    """The projection as a Markdown table: one row per model and compression, one column
    per link and GPU count."""
    header = ["model (compute per step)", "compression", "MB/step"]
    header += [f"{link.label} {gpus}" for link in links for gpus in gpu_counts]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (len(header) - 3)]
    for workload in workloads:
        for compression in COMPRESSIONS:
            cells = [
                f"{workload.name} ({workload.compute_s / MS:.1f} ms)",
                compression
                + (
                    f" (+{powersgd_seconds(workload, op_cost) / MS:.1f} ms)"
                    if "powersgd" in compression
                    else ""
                ),
                f"{workload.bytes_per_step[compression] / 1e6:.2f}",
            ]
            cells += [
                f"{step_efficiency(workload, compression, gpus, link, backward_share, op_cost):.0%}"
                for link in links
                for gpus in gpu_counts
            ]
            rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch",
        choices=sorted(WORKLOADS),
        action="append",
        help="a model (repeatable; default both)",
    )
    parser.add_argument(
        "--gpus", default="8,64,512", help="GPU counts, comma-separated (default 8,64,512)"
    )
    parser.add_argument(
        "--compute-ms",
        type=float,
        help="forward + backward per step of one GPU (default: the model's)",
    )
    parser.add_argument(
        "--backward-share", type=float, default=BACKWARD_SHARE, help="of the compute (default 2/3)"
    )
    parser.add_argument(
        "--powersgd-op-us",
        type=float,
        default=OP_COST / US,
        help="issue cost of one of its ops (default 5)",
    )
    own = parser.add_argument_group(
        "your own link (any of these replaces the two default links with one)"
    )
    own.add_argument("--link", help="its name in the table")
    own.add_argument("--gpus-per-node", type=int, help="default 8")
    own.add_argument(
        "--nvlink-gbyte", type=float, help="GB/s per GPU inside a node, each way (default 450)"
    )
    own.add_argument(
        "--inter-gbit", type=float, help="Gbit/s per node between nodes, all NICs (default 25)"
    )
    own.add_argument(
        "--inter-latency-us", type=float, help="microseconds per network hop (default 25)"
    )
    args = parser.parse_args(argv)
    try:
        args.gpu_counts = [int(count) for count in args.gpus.split(",")]
    except ValueError:
        parser.error(
            f"--gpus takes whole numbers separated by commas, e.g. 8,64,512; got {args.gpus!r}"
        )
    numbers = [
        args.compute_ms,
        args.gpus_per_node,
        args.nvlink_gbyte,
        args.inter_gbit,
        args.inter_latency_us,
    ]
    if min(args.gpu_counts) < 1 or any(value is not None and value <= 0 for value in numbers):
        parser.error(
            "GPU counts, --compute-ms, --gpus-per-node and the link's figures must be positive"
        )
    if args.powersgd_op_us < 0:
        parser.error(f"--powersgd-op-us is a time, 0 or more; got {args.powersgd_op_us}")
    if not 0 <= args.backward_share <= 1:
        parser.error(
            f"--backward-share is a share of the compute, 0 to 1; got {args.backward_share}"
        )
    return args


def chosen_links(args: argparse.Namespace) -> list[Link]:
    figures = (
        args.link,
        args.gpus_per_node,
        args.nvlink_gbyte,
        args.inter_gbit,
        args.inter_latency_us,
    )
    if all(value is None for value in figures):
        return list(LINKS.values())
    base = LINKS["eth"]
    return [
        replace(
            base,
            name="NVLink + " + (args.link or "your link"),
            label=args.link or "yours",
            gpus_per_node=args.gpus_per_node or base.gpus_per_node,
            intra_bw=args.nvlink_gbyte * 1e9 if args.nvlink_gbyte else base.intra_bw,
            inter_bw=args.inter_gbit * GBIT if args.inter_gbit else base.inter_bw,
            inter_latency=args.inter_latency_us * US
            if args.inter_latency_us
            else base.inter_latency,
        )
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    workloads = [WORKLOADS[name] for name in (args.arch or sorted(WORKLOADS))]
    if args.compute_ms:
        workloads = [replace(w, compute_s=args.compute_ms * MS, source="given") for w in workloads]
    links = chosen_links(args)
    for w in workloads:
        print(
            f"{w.name}, {w.setting}: {w.compute_s / MS:.1f} ms a step ({w.source}), "
            f"{w.buckets} DDP buckets, PowerSGD rank 2 computes "
            f"{powersgd_seconds(w, args.powersgd_op_us * US) / MS:.1f} ms a step (estimated)"
        )
    for link in links:
        print(
            f"{link.name}: {link.gpus_per_node} GPUs a node, "
            f"NVLink {link.intra_bw / 1e9:.0f} GB/s a GPU, "
            f"network {link.inter_bw / 1e9:.3g} GB/s a node, {link.inter_latency / US:g} us a hop"
        )
    print(f"backward share of the compute: {args.backward_share:.2f}\n")
    print(table(workloads, links, args.gpu_counts, args.backward_share, args.powersgd_op_us * US))


if __name__ == "__main__":
    main()
