"""The profile as tables: compute and activations per (kind, b, s, t), model state, links."""

from __future__ import annotations

from meshplan.profiler.profile import Profile
from rich.console import Console
from rich.table import Table


def _act(profile: Profile, kind: str, b: int, s: int, tp: int, mode: str) -> str:
    for m in profile.memory:
        if (m.kind, m.micro_batch_size, m.seq_len, m.tp, m.recompute) == (kind, b, s, tp, mode):
            return f"{m.activation_bytes / 1024:.1f}"
    return "-"


def print_profile(profile: Profile, console: Console | None = None) -> None:
    if console is None:
        console = Console()
        if not console.is_terminal:
            console = Console(width=140)  # a log or a pipe: do not squeeze the tables to 80 columns
    threads = f", {profile.threads_per_rank} threads/rank" if profile.threads_per_rank else ""
    console.print(f"[bold]{profile.model.name}[/] {profile.dtype} on {profile.device_name} ({profile.source}, "
                  f"{profile.concurrent_ranks} rank(s) at once{threads}, torch {profile.torch_version})")
    t = Table(title="compute per layer (median; spread = (p90 - p10) / median of fwd+bwd)")
    for col in ("kind", "b", "s", "t", "fwd ms", "bwd ms", "bwd+full ms", "bwd+sel ms", "spread",
                "act KiB", "act sel KiB", "act full KiB"):
        t.add_column(col, justify="left" if col == "kind" else "right")
    for c in profile.compute:
        key = (c.kind, c.micro_batch_size, c.seq_len, c.tp)
        t.add_row(c.kind, str(c.micro_batch_size), str(c.seq_len), str(c.tp), f"{c.forward_s * 1e3:.3f}",
                  f"{c.backward_s * 1e3:.3f}",
                  f"{c.backward_full_s * 1e3:.3f}" if c.backward_full_s else "-",
                  f"{c.backward_selective_s * 1e3:.3f}" if c.backward_selective_s else "-",
                  f"{c.spread:.0%}", _act(profile, *key, "none"), _act(profile, *key, "selective"),
                  _act(profile, *key, "full"))
    console.print(t)
    fits = []
    for kind in ("embedding", "block", "head"):
        for tp in sorted({c.tp for c in profile.compute if c.kind == kind}):
            parts = []
            for attr in ("forward_s", "backward_s"):
                overhead, rate = profile._fit(kind, tp, attr)
                speed = f"{1 / rate / 1e9:.2f} GFLOP/s" if rate > 0 else "no FLOP term"
                parts.append(f"{attr[:-2]} {overhead * 1e3:.3f} ms + FLOPs at {speed}")
            fits.append(f"  {kind} t={tp}: " + "; ".join(parts))
    if fits:
        console.print("fitted time = overhead + FLOPs / rate (what the planner uses):\n" + "\n".join(fits))
    if profile.state:
        st = Table(title="model state per layer and TP rank (bytes)")
        for col in ("kind", "t", "params", "param B", "grad B", "optimizer B"):
            st.add_column(col, justify="left" if col == "kind" else "right")
        for s in profile.state:
            st.add_row(s.kind, str(s.tp), f"{s.parameters:,}", f"{s.parameter_bytes:,}", f"{s.gradient_bytes:,}",
                       f"{s.optimizer_bytes:,}")
        console.print(st)
    lt = Table(title="links: time = alpha x steps + beta x factor x bytes (ring)")
    for col in ("link", "op", "ranks", "alpha us", "1/beta GB/s", "fit err", "spread"):
        lt.add_column(col, justify="left" if col in ("link", "op") else "right")
    for name, fits in profile.links.items():
        for op, f in fits.items():
            bw = f"{1.0 / f.beta_s_per_byte / 1e9:.2f}" if f.beta_s_per_byte > 0 else "- (latency only)"
            lt.add_row(name, op, str(f.measured_group_size or "preset"), f"{f.alpha_s * 1e6:.1f}", bw,
                       f"{f.fit_error:.0%}" if f.measured_group_size else "-",
                       f"{f.spread:.0%}" if f.measured_group_size else "-")
    console.print(lt)
    if profile.optimizer_s_per_param:
        console.print(f"optimizer (clip + AdamW, fp32 master): {profile.optimizer_s_per_param * 1e9:.2f} ns/parameter")
    if profile.step_sync_s:
        console.print(f"all-reduce of a scalar over all ranks (the step's gradient norm and loss): "
                      f"{profile.step_sync_s * 1e3:.3f} ms")
    if profile.wrappers:
        from meshplan.planner.cost_collectives import in_situ_factor
        from meshplan.profiler.wrappers import ENGINE_ZERO

        et = Table(title=f"data-parallel engines in situ ({profile.wrappers[0].ranks} ranks)")
        for col in ("engine", "ZeRO", "hooks ms / unit / micro-batch", "reduction ms", "x link fit", "AdamW x"):
            et.add_column(col, justify="left" if col == "engine" else "right")
        for w in profile.wrappers:
            zero = ENGINE_ZERO[w.engine]
            k = in_situ_factor(profile, zero)
            et.add_row(w.engine, {0: "0", 1: "1-2", 3: "3"}[zero], f"{w.hook_s * 1e3:.2f}", f"{w.sync_s * 1e3:.2f}",
                       f"{k:.1f}" if k is not None else "-", f"{w.optimizer_ratio:.1f}")
        console.print(et)
    # older profiles hold one figure per schedule, at a size they did not record
    samples = [(f" at b={p.micro_batch_size}", p.overheads) for p in profile.pipeline_samples] or \
        ([("", profile.pipeline_overheads)] if profile.pipeline_overheads else [])
    for at, overheads in samples:
        per = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in overheads.items())
        console.print(f"pipeline schedules in situ{at}, ms per crossing stage boundary and micro-batch "
                      f"(torch.distributed.pipelining, P2P included): {per}")
    if profile.chains:
        for tp in sorted({c.tp for c in profile.chains}):
            factors = ", ".join(f"b={c.micro_batch_size}: x{profile.chain_factor(c.micro_batch_size, tp):.2f}"
                                for c in sorted(profile.chains, key=lambda c: c.micro_batch_size) if c.tp == tp)
            console.print(f"layers run as one model vs alone (applied to the t={tp} fit): {factors}")
        if any(c.split_extra_s for c in profile.chains):
            split = ", ".join(f"b={c.micro_batch_size}: x{profile.split_backward_factor(c.micro_batch_size):.2f}"
                              for c in sorted(profile.chains, key=lambda c: c.micro_batch_size) if c.tp == 1)
            console.print(f"backward split into input- and weight-grad (zero-bubble) vs whole: {split}")
