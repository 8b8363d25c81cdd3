"""What the user pinned on the command line, checked against the model and cluster before any search."""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.planner.cluster_spec import ClusterSpec
from meshplan.planner.errors import InputError
from meshplan.planner.model_spec import ModelSpec


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
    dtype: str = "bf16"
    memory_margin: float = 0.1  # fraction of device memory kept free for fragmentation and workspace
    top_k: int = 3

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
        for flag, value in (("--dp", self.dp), ("--tp", self.tp), ("--pp", self.pp)):
            if value is not None and world % value:
                raise InputError(f"{flag}: {value} does not divide the cluster's {world} devices")
        pinned = [v for v in (self.dp, self.tp, self.pp) if v is not None]
        product = 1
        for v in pinned:
            product *= v
        if world % product:
            raise InputError(f"--dp/--tp/--pp: their product {product} does not divide the cluster's {world} devices")
        if len(pinned) == 3 and product != world:
            raise InputError(f"--dp/--tp/--pp: dp x tp x pp = {product}, expected the cluster's {world} devices")
        stages = (self.pp or 1) * (self.virtual_stages or 1)
        if stages > len(model.layers):
            raise InputError(f"--pp/--virtual-stages: {stages} pipeline stages for a model of "
                             f"{len(model.layers)} layers (embedding, {model.num_layers} blocks, head)")
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
        seq = self.effective_seq_len(model)
        if model.position == "learned" and seq > model.max_seq_len:
            raise InputError(f"--seq-len: {seq} exceeds the model's {model.max_seq_len} learned positions")
        if not 0 <= self.memory_margin < 1:
            raise InputError(f"--memory-margin: expected a fraction in [0, 1), got {self.memory_margin}")
