"""How an engine splits the layers into pipeline stages, when it does not let the planner choose.

- "free": any boundaries (the executor, torchtitan's module_fqns_per_model_part, Megatron-Core since
  --decoder-first/last-pipeline-num-layers, 2024-09, and --pipeline-model-parallel-layout).
- "even": the blocks spread evenly over the stages, the embedding with the first and the head with the
  last. Megatron-LM of 2021-22 gives each pipeline rank num_layers // pp blocks and asserts that pp (and
  pp·v when interleaved) divides num_layers (megatron/mpu/initialize.py get_num_layers, 2021;
  megatron/model/transformer.py _get_num_layers, 2022). Megatron-DeepSpeed's GPTModelPipe partitions with
  partition_method='type:transformer': DeepSpeed's PipelineModule balances the count of transformer layers
  per stage, the others weighing nothing (runtime/pipe/module.py _partition_layers, utils.partition_balanced).
- "even-ends": the embedding and the head each counted as one more block, then spread evenly (Megatron-
  DeepSpeed's 'type:transformer|embedding', which BLOOM ran: its tied 250K-row embedding weighs about a
  block; Megatron-Core's account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split).
Where the counts do not divide, the first stages take one more.
"""

from __future__ import annotations

SPLITS = ("free", "even", "even-ends")
# How `plan` says a fixed split in its summary
SPLIT_WORDS = {"even": "blocks spread evenly", "even-ends": "blocks, embedding and head spread evenly"}


def split_bounds(kinds: list[str], stages: int, mode: str) -> list[int] | None:
    """Stage bounds (len stages + 1, over layer indices) of a fixed split; None for "free", for a model
    that is not embedding, blocks..., head, or where a stage would hold nothing but its boundary."""
    if mode == "free" or stages < 2 or len(kinds) < 3 or kinds[0] != "embedding" or kinds[-1] != "head" or \
            any(k != "block" for k in kinds[1:-1]):
        return None
    blocks = len(kinds) - 2
    ends = mode == "even-ends"
    items = blocks + (2 if ends else 0)
    if items < stages:
        return None
    counts = [items // stages + (1 if k < items % stages else 0) for k in range(stages)]
    if ends:  # the embedding and the head take a block's place in the first and the last stage
        counts[0] -= 1
        counts[-1] -= 1
        if any(c < 1 for c in counts[1:-1]) or min(counts[0], counts[-1]) < 0:
            return None
    bounds = [0]
    for k, c in enumerate(counts):
        bounds.append(bounds[-1] + c + (1 if k == 0 else 0) + (1 if k == stages - 1 else 0))
    return bounds


def split_cuts(cuts: list[bool], bounds: list[int]) -> list[bool]:
    """`cuts` (cuts[l]: a stage may start at layer l) narrowed to the fixed split's boundaries, so the
    partition solver has only that partition to choose."""
    inner = set(bounds[1:-1])
    return [True] + [ok and layer in inner for layer, ok in enumerate(cuts) if layer > 0]
