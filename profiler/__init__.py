"""meshplan profiler: measures per-layer compute and memory and the links between devices.

    plan profile MODEL --cluster CLUSTER [-o profile.json] [--force] [--dtype bf16] [--seq-len S]
                 [--micro-batch-sizes B ...] [--tp-degrees T ...] [--preset]

- compute (profiler.compute): forward/backward (and backward with full / selective recompute) of the
  embedding, a block with the shard shapes of TP degree t, and head + loss, per (b, s, t); medians and
  spreads. On `Nxcpu` all N ranks measure at once, as they will train.
- memory (profiler.memory): activation bytes saved for backward (saved_tensors_hooks, storages counted
  once), parameter / gradient / AdamW-state bytes.
- links (profiler.links): all-reduce, all-gather, reduce-scatter, send/recv from 4 KiB to 256 MiB over
  the ranks that exist (torch.multiprocessing or torchrun; gloo / NCCL), α-β fit per link class.
- cache (profiler.cache): by (model, device, dtype, concurrent ranks, versions) in $MESHPLAN_CACHE or
  ~/.cache/meshplan; profiler.source.profile_for gives `plan` the cached measurement for this machine's
  hardware, else presets. With nothing cached for this host's CPUs (Nxcpu, local), `plan` measures a small
  model itself once (profiler.source.small_enough; MESHPLAN_AUTO_PROFILE=0 turns that off) and otherwise
  says on stderr that the prediction comes from presets, with the `plan profile` command to run.
"""
