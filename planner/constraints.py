"""What the user pinned on the command line, checked against the model and cluster before any search."""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.cluster_spec import ClusterSpec
from meshplan.planner.errors import InputError
from meshplan.planner.model_spec import ModelSpec
from meshplan.planner.plan import ep_fits
from meshplan.planner.stage_split import split_bounds


def check_seq_len(model: ModelSpec, seq: int) -> None:
    """Only learned positions bound the sequence (a table of max_seq_len rows); rotary positions extend to
    any length. `plan` and `plan profile` share this check."""
    if model.position == "learned" and seq > model.max_seq_len:
        raise InputError(f"--seq-len: {seq} exceeds the model's {model.max_seq_len} learned positions")


@dataclass
class Constraints:
    """Search inputs and pins. None means "the planner chooses"."""

    global_batch_size: int = 8  # the CLI defaults it to 2 x world size (at least 8)
    seq_len: int | None = None  # None: the model's max_seq_len
    micro_batch_size: int | None = None
    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    virtual_stages: int | None = None
    schedule: str | None = None
    recompute: str | None = None
    zero: int | None = None
    cp: int | None = None  # context parallelism degree (planner/cost_cp.py)
    cp_mode: str | None = None  # "ring" | "all-gather" | "all-to-all"
    ep: int | None = None  # expert parallelism degree, carved out of dp x cp (planner/cost_ep.py)
    expert_tp: int | None = None  # the experts' tensor-parallel degree: 1 or tp
    moe_imbalance: float = 1.25  # busiest EP rank's routed rows over the mean (cost_ep.DEFAULT_IMBALANCE)
    dtype: str = "bf16"
    stage_split: str | None = None  # planner/stage_split.py; None: the engine's (free for the executor)
    memory_margin: float = 0.05  # share kept free for fragmentation, after the reserve (planner/memory_reserve.py)
    top_k: int = 3
    # The training software the plan is for (--software, profiler/software.py) and what it can run; None:
    # everything the executor runs, () for CP modes: no context parallelism.
    engine: str = "meshplan"
    engine_schedules: tuple[str, ...] | None = None
    engine_zero: tuple[int, ...] | None = None
    engine_cp_modes: tuple[str, ...] | None = None
    engine_recompute: tuple[str, ...] | None = None
    engine_stage_splits: tuple[str, ...] | None = None  # the first is its default
    engine_even_divides: bool = False  # the engine asserts that pp·v divides the blocks (Megatron-LM 2021-22)
    engine_recompute_all: bool = False  # full recompute checkpoints every block of every stage (no counts)

    @property
    def split(self) -> str:
        """How the layers are split into pipeline stages: the pin, else the engine's way, else free."""
        return self.stage_split or (self.engine_stage_splits[0] if self.engine_stage_splits else "free")

    def _validate_engine(self) -> None:
        """Pins that the --software engine cannot run."""
        def refuse(flag: str, value, allowed) -> None:
            runs = ", ".join(str(a) for a in allowed) if allowed else "none"
            raise InputError(f"{flag}: {self.engine} does not run {value} (it runs: {runs})")
        if self.engine_schedules is not None and self.schedule is not None and \
                self.schedule not in self.engine_schedules:
            refuse("--schedule", self.schedule, self.engine_schedules)
        if self.engine_zero is not None and self.zero is not None and self.zero not in self.engine_zero:
            refuse("--zero", self.zero, self.engine_zero)
        if self.engine_recompute is not None and self.recompute is not None and \
                self.recompute not in self.engine_recompute:
            refuse("--recompute", self.recompute, self.engine_recompute)
        if self.engine_stage_splits is not None and self.stage_split is not None and \
                self.stage_split not in self.engine_stage_splits:
            refuse("--stage-split", self.stage_split, self.engine_stage_splits)
        if self.engine_cp_modes is not None:
            if self.cp is not None and self.cp > 1 and not self.engine_cp_modes:
                refuse("--cp", f"context parallelism (cp={self.cp})", ())
            if self.cp_mode is not None and self.cp_mode not in self.engine_cp_modes:
                refuse("--cp-mode", self.cp_mode, self.engine_cp_modes)

    def _validate_cp(self, model: ModelSpec) -> None:
        """--cp / --cp-mode: what the pinned context parallelism needs of the sequence and the heads."""
        seq = self.effective_seq_len(model)
        if self.cp is None or self.cp == 1:
            return
        if obstacle := model.cp_obstacle(seq):
            raise InputError(f"--cp: {model.name} {obstacle}, which context parallelism does not run; use --cp 1")
        if self.cp_mode != "all-to-all" and seq % (2 * self.cp):
            if self.cp_mode is not None or seq % self.cp:
                raise InputError(f"--cp: {self.cp_mode or 'ring'} context parallelism splits the sequence into 2 x cp "
                                 f"= {2 * self.cp} load-balanced chunks; {seq} is not a multiple")
        if self.cp_mode == "all-to-all":
            tp = self.tp or 1
            if seq % self.cp or model.num_heads % (tp * self.cp) or model.num_kv_heads % (tp * self.cp):
                raise InputError(f"--cp: all-to-all context parallelism scatters heads: tp x cp = {tp * self.cp} must "
                                 f"divide the model's {model.num_heads} attention and {model.num_kv_heads} key/value "
                                 f"heads, and cp the sequence length {seq}")

    def _validate_ep(self, model: ModelSpec) -> None:
        """--ep / --expert-tp / --moe-imbalance against the model's experts."""
        if self.moe_imbalance < 1:
            raise InputError(f"--moe-imbalance: expected a factor >= 1, got {self.moe_imbalance}")
        if model.moe is None:
            if (self.ep or 1) > 1 or (self.expert_tp or 1) > 1:
                raise InputError(f"--ep/--expert-tp: {model.name} is dense (no experts to shard)")
            return
        e = model.moe.num_experts
        if self.ep is not None and e % self.ep:
            raise InputError(f"--ep: {self.ep} must divide the model's {e} experts")
        if self.ep is not None and self.dp is not None:
            cp, tp = self.cp or 1, self.tp
            folded = tp is None or (tp > 1 and self.expert_tp in (None, 1) and ep_fits(self.ep, self.dp, cp, tp, True))
            if not ep_fits(self.ep, self.dp, cp, 1, False) and not folded:
                raise InputError(f"--ep: {self.ep} must divide dp x cp = {self.dp * cp} (EP is carved out of the "
                                 "data-parallel ranks), or with --expert-tp 1 be tp times a divisor of it (EP "
                                 "groups spanning the tensor-parallel ranks)")
        if self.expert_tp is not None and self.expert_tp != 1 and self.tp is not None and self.expert_tp != self.tp:
            raise InputError(f"--expert-tp: expected 1 or --tp ({self.tp}), got {self.expert_tp}")
        if self.expert_tp is not None and model.moe.expert_ffn_hidden_size % self.expert_tp:
            raise InputError(f"--expert-tp: {self.expert_tp} must divide the experts' width "
                             f"{model.moe.expert_ffn_hidden_size}")

    def split_runs(self, model: ModelSpec, stages: int) -> bool:
        """Whether the stage split can cut the model into `stages` pipeline stages (planner/stage_split.py)."""
        if stages == 1 or self.split == "free":
            return True
        if self.engine_even_divides and model.num_layers % stages:
            return False
        return split_bounds([layer.kind for layer in model.layers], stages, self.split) is not None

    def _validate_split(self, model: ModelSpec) -> None:
        """A pinned pipeline that the stage split cannot cut."""
        if self.pp is None:
            return
        stages = self.pp * (self.virtual_stages or 1)
        if self.engine_even_divides and model.num_layers % stages:
            raise InputError(f"--pp/--virtual-stages: {self.engine} gives every stage the same number of blocks; "
                             f"{stages} stages do not divide the model's {model.num_layers}")
        if not self.split_runs(model, stages):
            raise InputError(f"--stage-split: {self.split} cannot cut {model.name}'s layers into {stages} stages "
                             "(it needs embedding, blocks, head and a block in every middle stage)")

    def effective_seq_len(self, model: ModelSpec) -> int:
        return self.seq_len if self.seq_len is not None else model.max_seq_len

    def validate(self, model: ModelSpec, cluster: ClusterSpec) -> None:
        """Reject pins that no plan can satisfy, naming the flag (exit 2)."""
        world = cluster.world_size
        if self.tp is not None:
            if model.num_heads % self.tp or model.num_kv_heads % self.tp:
                raise InputError(f"--tp: {self.tp} must divide the model's {model.num_heads} attention heads "
                                 f"and {model.num_kv_heads} key/value heads")
            if model.ffn_hidden_size % self.tp:
                raise InputError(f"--tp: {self.tp} must divide the model's MLP width {model.ffn_hidden_size}")
            if self.effective_seq_len(model) % self.tp:
                raise InputError(f"--tp: {self.tp} must divide the sequence length {self.effective_seq_len(model)} "
                                 "(sequence parallelism splits it)")
            if self.tp > cluster.devices_per_node:
                raise InputError(f"--tp: {self.tp} exceeds the {cluster.devices_per_node} devices of a node "
                                 "(tensor parallelism stays inside a node)")
        for flag, value in (("--dp", self.dp), ("--tp", self.tp), ("--pp", self.pp), ("--cp", self.cp)):
            if value is not None and world % value:
                raise InputError(f"{flag}: {value} does not divide the cluster's {world} devices")
        pinned = [v for v in (self.dp, self.tp, self.pp, self.cp) if v is not None]
        product = 1
        for v in pinned:
            product *= v
        if world % product:
            raise InputError(f"--dp/--tp/--pp/--cp: their product {product} does not divide the cluster's {world} "
                             "devices")
        if len(pinned) == 4 and product != world:
            raise InputError(f"--dp/--tp/--pp/--cp: dp x tp x pp x cp = {product}, expected the cluster's {world} "
                             "devices")
        self._validate_engine()
        self._validate_cp(model)
        self._validate_ep(model)
        stages = (self.pp or 1) * (self.virtual_stages or 1)
        if stages > len(model.layers):
            raise InputError(f"--pp/--virtual-stages: {stages} pipeline stages for a model of "
                             f"{len(model.layers)} layers (embedding, {model.num_layers} blocks, head)")
        self._validate_split(model)
        if self.virtual_stages is not None and self.virtual_stages > 1 and self.schedule not in (
                None, "interleaved-1f1b", "zero-bubble"):
            raise InputError(f"--virtual-stages: {self.virtual_stages} needs --schedule interleaved-1f1b or "
                             f"zero-bubble, got {self.schedule}")
        if self.dp is not None and self.global_batch_size % self.dp:
            raise InputError(f"--global-batch-size: {self.global_batch_size} is not divisible by --dp {self.dp}")
        if self.micro_batch_size is not None:
            per_replica = self.global_batch_size // self.dp if self.dp else self.global_batch_size
            if self.micro_batch_size > per_replica or per_replica % self.micro_batch_size:
                raise InputError(f"--micro-batch-size: {self.micro_batch_size} does not divide the "
                                 f"{per_replica} sequences each data-parallel replica gets per step")
        check_seq_len(model, self.effective_seq_len(model))
        if not 0 <= self.memory_margin < 1:
            raise InputError(f"--memory-margin: expected a fraction in [0, 1), got {self.memory_margin}")
