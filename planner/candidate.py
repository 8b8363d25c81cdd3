"""A point of the search space (`Candidate`) and where its groups land on the cluster (`Links`): what
every cost term is asked about."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    """One point of the outer search space. `order` is the mesh placement, outermost dim first."""

    dp: int
    tp: int
    pp: int
    v: int
    schedule: str
    b: int
    m: int
    zero: int
    recompute: str  # none | selective | full (the mode; the ILP picks how many blocks per stage)
    recompute_pinned: bool = False  # True: every block uses `recompute` (the user pinned --recompute)
    order: tuple[str, ...] = ("pp", "dp", "tp")
    cp: int = 1  # context parallelism (planner/cost_cp.py): each rank holds s/cp tokens of every sequence
    cp_mode: str = "ring"  # ring | all-gather | all-to-all
    ep: int = 1  # expert parallelism (planner/cost_ep.py), carved out of dp x cp
    expert_tp: int = 1  # 1 or tp: the experts' tensor-parallel degree

    @property
    def num_stages(self) -> int:
        return self.pp * self.v


@dataclass(frozen=True)
class Links:
    """Link class of each parallel dimension's worst group under a placement (planner/placement.py), for its
    ring collectives (planner/topology.py: a ring leaves each scalable unit once)."""

    tp: str
    pp: str
    dp: str
    cp: str = "intra_node"
    ep: str = "intra_node"  # the worst EP group's class, members per domain too (planner/cost_ep.ep_link)
    edp: str = ""  # the worst expert-data-parallel group's, as dp_cp_group ("": no EP; planner/cost_ep.edp_link)
    dp_local: int = 1  # fewest members of a dp x cp group inside one NVLink domain
    cp_spread: str = ""  # the cp groups' class for all-to-all (topology.spread_class: "inter_node/8"; "": cp)

    def cp_link(self, mode: str) -> str:
        """The class context parallelism's collectives run on: its ring's, or for all-to-all (DeepSpeed-
        Ulysses) the groups' own."""
        return (self.cp_spread or self.cp) if mode == "all-to-all" else self.cp

    @property
    def dp_cp(self) -> str:
        """The flattened dp x cp group that averages gradients: the slower of the two groups' classes (the
        union of a dp group's cp groups stays inside whatever holds both)."""
        return next((c for c in ("inter_leaf", "inter_node") if c in (self.dp, self.cp)), "intra_node")

    @property
    def dp_cp_group(self) -> str:
        """`dp_cp`, with the members per NVLink domain when a spanning group has several ("inter_node/8"):
        NCCL then runs the collective hierarchically and all their NICs carry it (Profile.collective_time)."""
        link = self.dp_cp
        return f"{link}/{self.dp_local}" if link != "intra_node" and self.dp_local > 1 else link
