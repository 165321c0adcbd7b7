"""Memory per pipeline stage and rank, estimated by running the project's own code on fake tensors.

What is TRACED (the real code, under ``FakeTensorMode`` + :class:`~k3train.planning.fakerun.known_data.KnownData`,
bytes booked by :class:`~k3train.planning.fakerun.live_bytes.LiveBytes`; nothing the size of the model is allocated):

* each pipeline rank's real stage model: ``K3Model(cfg.model)`` built on fake tensors, pruned by
  ``parallel.pipeline.stage.prune_to_stage``, routed experts sharded by ``moonep.shard.shard_experts``, cast by
  ``k3train.parallelize.cast_params_to_bf16`` -> parameter bytes;
* per local chunk, one micro-batch (``micro_batch_size x seq_len / cp`` tokens) through the runner's own
  forward (``embed`` / ``forward_layers`` / ``loss_sums`` under ``run_maybe_recomputed``, so ``parallel.recompute``
  and ``model.attn_res_recompute`` act as in training) and its backward: bytes saved for backward per chunk and
  micro-batch, and the transient peak inside the forward and the backward. When the run's dataset can be read,
  on its real micro-batches (the ones with the fewest and the most padded KDA chunks of steps 2-3; every other
  micro-batch interpolated by its chunk count), else on one document per row. Under CP, per CP rank, with the
  real KCP context (halo, pair gather and fold, MLA latent prefix) whose collectives are simulated locally
  (:mod:`k3train.planning.fakerun.sim_collectives`: same shapes and in-place writes, no peers). Long sequences (the CP group's
  tokens x layers over ``TRACE_BUDGET``, :func:`whole_traces`: K3) trace each distinct layer alone at 1K/2K/4K tokens, fit a + bT + cT^2
  exactly and compose the chunk (:func:`trace_chunk`; under CP at ranks 0 and 1, extended affinely in the rank);
* a vision model's first stage: ``embed_batch`` -- the MoonViT-V2 encoder + projector on the micro-batch's media
  and the placeholder scatter, inside the chunk's forward and backward as the runner runs it -- on the media
  :class:`MediaCase` names: on multimodal data by default the WORST CASE (every position of every row a
  placeholder of the largest images ``data.max_media_pixels`` allows that fit a row; ``frames`` per media), or
  the data's own media, or none (the default on text data); the step's pixels are in ``buffers``. The tower's parameters, gradients and optimizer state are the first
  chunk's like any other (the stage model holds them);
* the optimizer update: ``muon_step_`` / ``adamw_step_`` on the largest owned parameters (Newton-Schulz
  temporaries);
* ownership: ``k3train.optim.param_groups.build_param_infos`` + ``k3train.optim.zero.assign_owners`` over the
  layout's real group ranks (``parallel.dims.ParallelDims``, no process group) -> ZeRO-1/2 shares per rank.

What is COMPUTED (distributed pieces cannot run without process groups; sizes from the code's own formulas):

* the schedule walk: each pipeline rank's real program (``build_schedule`` + ``p2p.build_programs``: the order
  of computes and receive posts); a micro-batch's saved bytes are held from its F to its B; gradients appear at
  a chunk's first B and (ZeRO-2) shrink to the owned share after its last B; the optimizer step's peak
  (gradients + the largest update's temporaries + the reduction bucket) is compared with the schedule's;
* p2p: the AttnRes plan's payload per boundary (``AttnResCommPlan.payload``): received inputs kept until B,
  incoming gradients during B;
* EP (ep > 1): the expert layer runs locally on the rank's shard with ``N*k`` rows (what MoonEP computes; plain
  EP's expectation under balanced routing); the persistent send/recv buffers from ``moonep.comm.token_buffer_rows``;
  MoonEP's replica pool (two banks of ``[E/ep, l, f] x 3`` shared by all MoE layers, persistent), and during a
  MoE layer's B its replicas' gradients plus at most two reduce-back receive rounds (3 x one layer's replicas);

Assumptions: balanced routing (``KnownData``: what Quantile Balancing converges to); a scalar read from fake
data is 0 (statistics only). Not modelled: allocator
rounding/fragmentation (add ~5-10% on GPU), NCCL workspaces, the data loader's few KiB.

The modules, in the order a step is estimated: :mod:`.estimate` (the entry, :func:`~.estimate.estimate`) lays out
the step and cuts each pipeline rank's stage from the fake model (:mod:`.fake_model`), picks the traced micro-batches
(:mod:`.run_data`, :mod:`.media`), traces each local chunk (:mod:`.chunk`: whole, :mod:`.trace`, or composed from
its pieces, :mod:`.pieces` fitted by :mod:`.fit` and put together by :mod:`.compose`), adds what is computed
(:mod:`.buffers`, :mod:`.optimizer`) and walks each rank's program (:mod:`.walk`) to its peak (:mod:`.results`,
printed by :mod:`.report`). :mod:`.cache` is what the planner shares across estimates, :mod:`.piece_bytes` what its
static bound reads, :mod:`.limits` how a trace stops early, :mod:`.compose_check` ``tools/memory.py
--check-compose``.
"""
