"""Sustained GEMM throughput of this machine's accelerator: one matmul shape run back to back for a while,
reported per window, against the GEMM ceiling the device's preset uses.

    python benchmarks/gemm_sustained.py [--seconds 120] [--shape 8192 8192 8192] [--dtype bf16]
                                        [--preset h200-141gb]

Why: the GPU presets' GEMM ceiling (planner/cluster_spec.py, `efficiency`) is ml-engineering's mamf-finder
figure: per shape 50 warm-up and 100 timed calls with the L2 cache flushed between calls, a short burst
after a 30 s warm-up (stas00/ml-engineering compute/accelerator/benchmarks/mamf-finder.py). Training keeps
the tensor cores busy for hours, and a GPU at its power limit lowers its clock. This keeps them busy for
`--seconds` and prints each window's rate and, on CUDA, the SM clock, power draw and throttle reasons
nvidia-smi reports, so the preset can be checked against the hardware.
Runs on CPU too (fp32, small shapes), which is how the tests check it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import torch
from rich.console import Console
from rich.table import Table

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SMI_FIELDS = "clocks.sm,power.draw,clocks_throttle_reasons.active"


def smi(device: torch.device) -> tuple[str, str, str]:
    """(SM clock MHz, power W, active throttle reasons) from nvidia-smi; blanks where it cannot say."""
    if device.type != "cuda":
        return "", "", ""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits",
                              "-i", str(device.index or 0)], capture_output=True, text=True, timeout=10)
        clock, power, reasons = (x.strip() for x in out.stdout.strip().split(",")[:3])
        return clock, power, reasons
    except (OSError, subprocess.SubprocessError, ValueError):
        return "", "", ""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_window(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, seconds: float, chunk: int) -> tuple[int, float]:
    """Matmuls issued back to back in chunks until `seconds` pass: (calls, elapsed seconds)."""
    calls, start = 0, time.perf_counter()
    while True:
        for _ in range(chunk):
            torch.mm(a, b, out=c)
        sync(a.device)
        calls += chunk
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return calls, elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=120.0, help="time under load, after a warm-up window")
    ap.add_argument("--window", type=float, default=10.0, help="seconds per reported window")
    ap.add_argument("--shape", type=int, nargs=3, default=[8192, 8192, 8192], metavar=("M", "N", "K"))
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--preset", default=None, help="device preset to compare with (e.g. h200-141gb)")
    args = ap.parse_args()
    from meshplan.planner.cluster_spec import DEVICE_PRESETS

    if args.preset is not None and args.preset not in DEVICE_PRESETS:
        ap.error(f"--preset: unknown device preset {args.preset!r}; expected one of {', '.join(DEVICE_PRESETS)}")
    if args.seconds <= 0 or args.window <= 0 or min(args.shape) < 1:
        ap.error("--seconds and --window: expected > 0; --shape: expected three positive sizes")
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    m, n, k = args.shape
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, dtype=DTYPES[dtype], generator=gen)
    b = torch.randn(k, n, device=device, dtype=DTYPES[dtype], generator=gen)
    c = torch.empty(m, n, device=device, dtype=DTYPES[dtype])
    flops = 2.0 * m * n * k
    # size the chunk so one takes ~50 ms: few host syncs, and the queue never runs dry
    calls, elapsed = run_window(a, b, c, 0.2, 1)
    chunk = max(1, int(0.05 / (elapsed / calls)))
    run_window(a, b, c, min(args.window, 5.0), chunk)  # warm-up
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    table = Table(title=f"{m}x{n}x{k} {dtype} matmul on {name}, back to back")
    for col in ("window", "end s", "TFLOP/s", "vs first", "SM MHz", "power W", "throttle"):
        table.add_column(col, justify="right")
    rates, t0, w = [], time.perf_counter(), 0
    while time.perf_counter() - t0 < args.seconds:
        calls, elapsed = run_window(a, b, c, args.window, chunk)
        clock, power, reasons = smi(device)
        rates.append(calls * flops / elapsed)
        w += 1
        table.add_row(str(w), f"{time.perf_counter() - t0:.0f}", f"{rates[-1] / 1e12:.2f}",
                      f"x{rates[-1] / rates[0]:.3f}", clock, power, reasons)
    console = Console(width=120)
    console.print(table)
    steady = statistics.median(rates[len(rates) * 2 // 3:])
    line = (f"first window {rates[0] / 1e12:.2f} TFLOP/s, last third (median) {steady / 1e12:.2f}: "
            f"x{steady / rates[0]:.3f}")
    if args.preset and dtype in ("bf16", "fp16"):  # the MAMF share was measured in 16-bit
        dev = DEVICE_PRESETS[args.preset]
        ceiling = dev.peak_flops[dtype] * dev.efficiency
        line += f"; the {args.preset} preset's ceiling {ceiling / 1e12:.1f}: steady x{steady / ceiling:.3f}"
    console.print(line)


if __name__ == "__main__":
    main()
