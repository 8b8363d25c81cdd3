"""Search entry point (filled in by the planner issue)."""

from __future__ import annotations

from planner.cluster_spec import ClusterSpec
from planner.constraints import Constraints
from planner.errors import InputError
from planner.model_spec import ModelSpec
from planner.plan import Plan


def find_plan(model: ModelSpec, cluster: ClusterSpec, constraints: Constraints, profile=None) -> Plan:
    raise InputError("planning is not implemented yet in this version of meshplan (see the Planner issue)")
