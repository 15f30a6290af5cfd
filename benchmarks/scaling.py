"""Scaling over ordinary links: the same training on one host and on 2 (and 3) hosts joined
by a rate-limited link, for each --grad-compression.

    sudo python benchmarks/scaling.py                    # everything below (hours)
    sudo python benchmarks/scaling.py --quick            # 2 hosts, unshaped and 1 Gbit/s,
                                                         # resnet18, none and fp16, 8 steps
    sudo python benchmarks/scaling.py --hosts 2 --links 1gbit,100mbit --archs resnet18 \\
        --compressions none,fp16,powersgd:2 --steps 40 --json scaling.json

The hosts are network namespaces made by the script (tests/netns.py's `bridged_hosts`:
one veth per host, its other end on a bridge inside a namespace of its own, addresses from
192.0.2.0/24); no real interface is touched, and everything is removed at the end, on an
error and on SIGINT/SIGTERM/SIGHUP. A link of RATE is a `tc ... tbf` qdisc of that rate on
both ends of every host's veth (this kernel has tbf, not netem), so each host sends and
receives at RATE, as through a switch port of that speed. Needs root, iproute2 and taskset.

Each namespaced host runs one rank (`ddpcli train --nproc 1 --nnodes N`) pinned to its own
CORES cores (`taskset`), as a real host has its own: without the pinning, hosts on one
machine share its cores and measure that instead of the link. The one-host figure is the
same N ranks of the same work in one namespace over its loopback, pinned to the same N x
CORES cores; the scaling efficiency is the N-host images/s over it.

For every link it first measures the all-reduce bus bandwidth `ddpcli bench-barrier` gets
between the namespaced hosts (nccl-tests' busbw; Gloo on the CPU): a link must give at
least 80 % of its tbf rate (LINK_CHECK), or the emulation, not ddpcli, is what the table
would measure (the table marks it). Training images/s come from `metrics.jsonl`
(`images_per_sec`: the epoch's steps after the first 3, summed over ranks); the exposed
communication share is rank 0's from summary.json's `step_breakdown`. PowerSGD runs with
--powersgd-start-step 0, so that the timed steps are compressed ones.

Prints two tables (the links, then throughput and efficiency per model and compression);
--json FILE keeps every figure and the settings. Figures belong in docs/performance.md
("Scaling") only from a machine with at least N x CORES otherwise idle cores.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # netns.py: the namespaces the tests use

from _bounded import end_session  # noqa: E402

# tbf rates by name; None: the veth as it is (no qdisc).
LINKS = {"none": None, "10gbit": 10e9, "1gbit": 1e9, "100mbit": 100e6}
LINK_CHECK = 0.8  # of the tbf rate the all-reduce bus bandwidth must reach
QUICK = {
    "hosts": "2",
    "links": "none,1gbit",
    "archs": "resnet18",
    "compressions": "none,fp16",
    "steps": 8,
}
FIRST_PORT = 29700
PORTS = itertools.count(FIRST_PORT, 2)  # the agents take the port after the workers'
IFNAME = "veth0"  # tests/netns.py's name for every host's end
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                      "MASTER_PORT", "GROUP_RANK", "TORCHELASTIC_RUN_ID")  # fmt: skip


@dataclass
class LinkRow:
    hosts: int
    link: str
    rate_gbps: float | None
    busbw_gbps: float | None
    message_bytes: int
    ok: bool | None  # busbw >= LINK_CHECK x rate; None: unshaped, or not measured


@dataclass
class RunRow:
    arch: str
    compression: str
    hosts: int
    link: str  # "loopback": the one-host run
    images_per_sec: float | None
    exposed_comm: float | None  # rank 0's share of the step
    error: str = ""


# --- the machine and its namespaces -------------------------------------------------------


def check_machine(hosts: list[int], cores_per_host: int) -> list[int]:
    """Exit with the reason when the script cannot run here; the host counts that fit."""
    if os.geteuid() != 0:
        sys.exit("scaling.py makes network namespaces: run it as root")
    for tool in ("ip", "tc", "taskset"):
        if shutil.which(tool) is None:
            sys.exit(f"scaling.py needs `{tool}` (iproute2, util-linux)")
    cores = len(os.sched_getaffinity(0))
    fitting = [count for count in hosts if count * cores_per_host <= cores]
    for count in sorted(set(hosts) - set(fitting)):
        say(f"skipping {count} hosts: {count} x {cores_per_host} pinned cores, this machine "
            f"lets us use {cores}")  # fmt: skip
    if not fitting:
        sys.exit("no host count fits this machine's cores; lower --cores-per-host")
    return fitting


def core_groups(count: int, cores_per_host: int) -> list[str]:
    """taskset's lists, one per host, from the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0))
    return [
        ",".join(map(str, cores[index * cores_per_host : (index + 1) * cores_per_host]))
        for index in range(count)
    ]


@contextlib.contextmanager
def namespaced_hosts(count: int) -> Iterator[tuple]:
    """COUNT hosts on a bridge (tests/netns.py); every process in them killed before they
    are deleted (deleting a namespace stops nothing that runs in it)."""
    import pytest
    from netns import bridged_hosts

    try:
        with bridged_hosts(count) as hosts:
            try:
                yield hosts
            finally:
                for host in hosts:
                    kill_namespace_processes(host.namespace)
    except pytest.skip.Exception as skipped:
        sys.exit(f"cannot make the namespaces: {skipped.msg}")


def kill_namespace_processes(namespace: str) -> None:
    listed = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10
    )
    for pid in listed.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def shape(hosts: tuple, link: str) -> None:
    """tbf of LINK's rate on both ends of every host's veth; unshaped: none."""
    rate = LINKS[link]
    for host in hosts:
        for namespace, ifname in ((host.namespace, host.ifname), host.peer):
            tc(namespace, "qdisc", "del", "dev", ifname, "root", check=False)
            if rate is not None:
                tc(namespace, "qdisc", "add", "dev", ifname, "root", *tbf_settings(rate))


def tbf_settings(rate: float) -> list[str]:
    """A bucket of at least 2 ms at RATE and 256 KiB: veth hands tbf GSO packets of up to
    64 KiB, and a bucket smaller than a packet drops it. 50 ms of queue, as a switch's."""
    burst = max(256 * 1024, int(rate / 8 * 0.002))
    return ["tbf", "rate", f"{int(rate)}bit", "burst", str(burst), "latency", "50ms"]


def tc(namespace: str, *argv: str, check: bool = True) -> None:
    done = subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", *argv], capture_output=True, text=True, timeout=10
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(argv)} in {namespace}: {done.stderr.strip()}")


# --- runs ---------------------------------------------------------------------------------


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def in_host(namespace: str, cores: str, *argv: str) -> list[str]:
    """ARGV inside NAMESPACE, on CORES only (the affinity passes to every child)."""
    return ["taskset", "-c", cores, "ip", "netns", "exec", namespace, *argv]


def run_together(
    commands: list[list[str]], envs: list[dict[str, str]], logs: list[Path], timeout_s: float
) -> list[int]:
    """Start every command at once (the nodes of one job), each in its own session; wait
    for all within TIMEOUT_S; end each whole process tree after. Exit codes (124: timeout).
    Each one's stdout goes to its LOG, its stderr beside it (LOG.err)."""
    processes: list[subprocess.Popen] = []
    handles = []
    try:
        for command, env, log in zip(commands, envs, logs, strict=True):
            # closed below, after the process ends
            output, errors = open(log, "wb"), open(f"{log}.err", "wb")  # noqa: SIM115
            handles += [output, errors]
            processes.append(
                subprocess.Popen(
                    command,
                    cwd=ROOT,
                    env=env,
                    stdout=output,
                    stderr=errors,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )  # fmt: skip
            )
        deadline = time.monotonic() + timeout_s
        codes = []
        for process in processes:
            try:
                codes.append(process.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(124)
        return codes
    finally:
        for process in processes:
            end_session(process)
        for handle in handles:
            handle.close()


def train_args(args: argparse.Namespace, arch: str, compression: str, world: int) -> list[str]:
    """The work, the same on one host and on several: STEPS steps of the global batch."""
    batch = args.per_gpu_batch
    # Compressed from the first step; the flag is PowerSGD's alone (refused with the others).
    start = ["--powersgd-start-step", "0"] if compression.startswith("powersgd") else []
    return [
        sys.executable, "-m", "ddpcli", "train", "--cpu", "--arch", arch,
        "--image-size", str(args.image_size), "--per-gpu-batch", str(batch),
        "--synthetic-size", str(batch * world * args.steps), "--epochs", "1",
        "--log-every", str(args.steps), "--precision", args.precision,
        "--grad-compression", compression, *start,
        "--timeout", str(args.run_timeout), "--json", *args.train_flags.split(),
    ]  # fmt: skip


def one_host_run(args, hosts, cores: list[str], arch, compression, work: Path) -> RunRow:
    """N ranks in the first namespace, over its loopback, on all N hosts' cores."""
    world = len(hosts)
    out = work / f"{arch}-{compression}-1x{world}"
    command = in_host(
        hosts[0].namespace, ",".join(cores),
        *train_args(args, arch, compression, world), "--nproc", str(world),
        "--master-port", str(next(PORTS)), "--out", str(out),
    )  # fmt: skip
    (code,) = run_together([command], [clean_env()], [out.with_suffix(".log")], args.run_timeout)
    return run_row(arch, compression, world, "loopback", code, out)


def hosts_run(args, hosts, cores: list[str], link, arch, compression, work: Path) -> RunRow:
    """One rank per namespaced host, each on its own cores, through the shaped link."""
    world, port = len(hosts), next(PORTS)
    outs = [work / f"{arch}-{compression}-{world}x1-{link}-node{rank}" for rank in range(world)]
    commands = [
        in_host(
            host.namespace,
            cores[rank],
            *train_args(args, arch, compression, world),
            "--nproc",
            "1",
            "--nnodes",
            str(world),
            "--node-rank",
            str(rank),
            "--master-addr",
            hosts[0].address,
            "--master-port",
            str(port),
            "--ifname",
            host.ifname,
            "--out",
            str(outs[rank]),
        )  # fmt: skip
        for rank, host in enumerate(hosts)
    ]
    logs = [out.with_suffix(".log") for out in outs]
    codes = run_together(commands, [clean_env()] * world, logs, args.run_timeout)
    code = next((code for code in codes if code != 0), 0)
    return run_row(arch, compression, world, link, code, outs[0])


def run_row(arch: str, compression: str, world: int, link: str, code: int, out: Path) -> RunRow:
    row = RunRow(arch, compression, world, link, None, None)
    if code != 0:
        log = Path(f"{out.with_suffix('.log')}.err")
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
        row.error = f"exit {code}" + (f": {tail[0][:200]}" if tail else "")
        return row
    summary = json.loads((out / "summary.json").read_text())
    row.images_per_sec = summary["images_per_sec"]
    breakdown = summary.get("step_breakdown")
    if breakdown:
        row.exposed_comm = breakdown["per_rank"][0]["exposed_comm"]
    return row


def message_bytes(rate: float | None) -> int:
    """About a second of the link per all-reduce: long enough that tbf's bucket is a small
    part of it, short enough for a few iterations. Unshaped: 64 MiB."""
    if rate is None:
        return 64 << 20
    return max(1 << 20, min(256 << 20, int(rate / 8) >> 20 << 20))


def link_row(args, hosts, cores: list[str], link: str, work: Path) -> LinkRow:
    """`ddpcli bench-barrier`'s all-reduce between the hosts, one rank each, as torchrun
    would start it (RANK, WORLD_SIZE, MASTER_*), over the shaped veth."""
    world, rate, port = len(hosts), LINKS[link], next(PORTS)
    size = message_bytes(rate)
    command = [
        sys.executable, "-m", "ddpcli", "bench-barrier", "--nproc", str(world), "--demo", "none",
        "--iters", str(args.bench_iters), "--warmup", "1", "--collective", "all_reduce",
        "--sizes", str(size), "--timeout", str(args.run_timeout), "--json",
    ]  # fmt: skip
    envs = [
        clean_env(
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            GROUP_RANK=str(rank),
            MASTER_ADDR=hosts[0].address,
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME=host.ifname,
        )  # fmt: skip
        for rank, host in enumerate(hosts)
    ]
    logs = [work / f"busbw-{world}x1-{link}-rank{rank}.log" for rank in range(world)]
    commands = [in_host(host.namespace, cores[rank], *command) for rank, host in enumerate(hosts)]
    codes = run_together(commands, envs, logs, args.run_timeout)
    busbw = None
    if codes[0] == 0:
        report = json.loads(logs[0].read_text())
        busbw = report["collectives"][0]["busbw_GBps"] * 8  # GB/s -> Gbit/s
    else:
        say(f"bench-barrier on {world} hosts, {link}: exit {codes}; see {logs[0]}.err")
    rate_gbps = rate / 1e9 if rate else None
    ok = None if rate_gbps is None or busbw is None else busbw >= LINK_CHECK * rate_gbps
    return LinkRow(world, link, rate_gbps, busbw, size, ok)


# --- the tables ---------------------------------------------------------------------------


def link_table(rows: list[LinkRow]) -> str:
    lines = [
        "all-reduce bus bandwidth between the namespaced hosts (ddpcli bench-barrier, Gloo)",
        f"{'hosts':>5}  {'link':<8} {'tbf rate':>10} {'busbw':>12} {'of rate':>8}  message",
    ]
    for row in rows:
        rate = f"{row.rate_gbps:g} Gbit/s" if row.rate_gbps else "none"
        busbw = f"{row.busbw_gbps:.3f} Gbit/s" if row.busbw_gbps is not None else "failed"
        share = "-"
        if row.rate_gbps and row.busbw_gbps is not None:
            share = f"{100 * row.busbw_gbps / row.rate_gbps:.0f}%" + ("" if row.ok else " (!)")
        lines.append(
            f"{row.hosts:>5}  {row.link:<8} {rate:>10} {busbw:>12} {share:>8}  "
            f"{row.message_bytes >> 20} MiB"
        )
    if any(row.ok is False for row in rows):
        lines.append(
            f"(!) below {100 * LINK_CHECK:.0f}% of the tbf rate: the emulation (or the cores "
            "driving it) is the limit; those rows do not measure the link"
        )
    return "\n".join(lines)


def throughput_table(rows: list[RunRow], links: list[LinkRow]) -> str:
    base = {(r.arch, r.compression, r.hosts): r for r in rows if r.link == "loopback"}
    suspect = {(row.hosts, row.link) for row in links if row.ok is False}
    header = (
        f"{'model':<9} {'compression':<11} {'hosts':>5} {'link':<8} {'img/s':>8} "
        f"{'one host':>9} {'efficiency':>10} {'exposed comm':>12}"
    )
    lines = ["training throughput: N hosts x 1 rank against 1 host x N ranks", header]
    for row in rows:
        if row.link == "loopback":
            continue
        one = base.get((row.arch, row.compression, row.hosts))
        rate = f"{row.images_per_sec:.1f}" if row.images_per_sec is not None else "failed"
        one_rate = f"{one.images_per_sec:.1f}" if one and one.images_per_sec else "failed"
        efficiency = "-"
        if row.images_per_sec is not None and one and one.images_per_sec:
            efficiency = f"{100 * row.images_per_sec / one.images_per_sec:.0f}%"
        exposed = f"{100 * row.exposed_comm:.0f}%" if row.exposed_comm is not None else "-"
        mark = " (!)" if (row.hosts, row.link) in suspect else ""
        lines.append(
            f"{row.arch:<9} {row.compression:<11} {row.hosts:>5} {row.link:<8} {rate:>8} "
            f"{one_rate:>9} {efficiency:>10} {exposed:>12}{mark}"
        )
    errors = [row for row in rows if row.error]
    for row in errors:
        lines.append(f"failed: {row.arch} {row.compression} {row.hosts} hosts {row.link}: "
                     f"{row.error}")  # fmt: skip
    return "\n".join(lines)


# --- the whole ----------------------------------------------------------------------------


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def end_on_signals() -> None:
    """SIGTERM and SIGHUP end the script as Ctrl-C does: through every `finally`, so the
    namespaces and the ranks in them go."""

    def stop(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop)


def measure(args: argparse.Namespace, work: Path) -> tuple[list[LinkRow], list[RunRow]]:
    host_counts = check_machine(args.hosts, args.cores_per_host)
    link_rows: list[LinkRow] = []
    run_rows: list[RunRow] = []
    for count in host_counts:
        cores = core_groups(count, args.cores_per_host)
        with namespaced_hosts(count) as hosts:
            for arch, compression in itertools.product(args.archs, args.compressions):
                row = one_host_run(args, hosts, cores, arch, compression, work)
                run_rows.append(row)
                say(f"1 host x {count} ranks, {arch}, {compression}: {describe(row)}")
            for link in args.links:
                shape(hosts, link)
                link_rows.append(link_row(args, hosts, cores, link, work))
                say(f"{count} hosts, link {link}: busbw {link_rows[-1].busbw_gbps} Gbit/s")
                for arch, compression in itertools.product(args.archs, args.compressions):
                    row = hosts_run(args, hosts, cores, link, arch, compression, work)
                    run_rows.append(row)
                    say(f"{count} hosts x 1 rank, {link}, {arch}, {compression}: {describe(row)}")
    return link_rows, run_rows


def describe(row: RunRow) -> str:
    return f"{row.images_per_sec:.1f} img/s" if row.images_per_sec is not None else row.error


def comma_list(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 hosts, unshaped and 1gbit, resnet18, none and fp16, 8 steps",
    )
    parser.add_argument("--hosts", default="2,3", help="host counts (default 2,3)")
    parser.add_argument(
        "--links",
        default="none,10gbit,1gbit,100mbit",
        help=f"from {', '.join(LINKS)} (default all)",
    )
    parser.add_argument("--archs", default="resnet18,resnet50")
    parser.add_argument("--compressions", default="none,fp16,bf16,powersgd:2")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--per-gpu-batch", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--precision", default="fp32", help="ddpcli train's --precision")
    parser.add_argument("--cores-per-host", type=int, default=1)
    parser.add_argument(
        "--train-flags",
        default="",
        help="more `ddpcli train` flags for every run, e.g. '--bucket-cap-mb 100 --static-graph'",
    )
    parser.add_argument("--bench-iters", type=int, default=5, help="all-reduces timed per link")
    parser.add_argument("--run-timeout", type=float, default=1800, help="seconds per run")
    parser.add_argument("--json", type=Path, help="also write every figure to this file")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders and logs")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        args.bench_iters, args.run_timeout = 3, min(args.run_timeout, 600)
    args.hosts = [int(count) for count in comma_list(str(args.hosts))]
    args.links, args.archs = comma_list(args.links), comma_list(args.archs)
    args.compressions = comma_list(args.compressions)
    unknown = [link for link in args.links if link not in LINKS]
    if unknown or any(count < 2 for count in args.hosts) or args.steps < 5:
        parser.error(f"--links from {', '.join(LINKS)}; --hosts of 2 or more; --steps >= 5 "
                     "(images/s leaves out the first 3)")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    end_on_signals()
    work = Path(tempfile.mkdtemp(prefix="ddpcli-scaling-"))
    try:
        link_rows, run_rows = measure(args, work)
    finally:
        if args.keep:
            say(f"runs and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print(link_table(link_rows))
    print()
    print(throughput_table(run_rows, link_rows))
    if args.json:
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        document = {
            "settings": settings,
            "machine": {"cpus": len(os.sched_getaffinity(0)), "platform": platform.platform()},
            "links": [asdict(row) for row in link_rows],
            "runs": [asdict(row) for row in run_rows],
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")


if __name__ == "__main__":
    main()
