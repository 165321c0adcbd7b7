"""Predicted step time of one layout: per-action costs, the real per-rank pipeline programs simulated, then the
data-parallel reductions and the optimizer.

Per virtual stage and micro-batch (``B = micro_batch_size`` rows of ``T = seq_len / cp`` tokens):

* compute: GPUs -- forward FLOPs of each layer from the project's partitioner cost model
  (``parallel.pipeline.partition.layer_cost / embed_cost / head_cost``: KDA, MLA, dense FFN, LatentMoE, AttnRes,
  LM head + MTP) x ``B*T`` at the device's achievable FLOP/s, backward = 2 x forward; the MLA attention term is taken
  at the slowest context-parallel rank's mean context: ``T_full / 2`` on every rank under ``parallel.mla_cp_balance``
  (kcp/mla_cp.py), else the LAST rank's ``T_full - T/2``. ``--device cpu`` --
  measured per-layer times (:mod:`k3train.planning.calibration.layer_bench`). Full recomputation adds the forward to the
  backward. Plain EP (no MoonEP) multiplies the routed-expert share of a MoE layer by the routing skew (the most
  loaded EP rank's load over the mean; ``--ep-skew``, default 1.5 -- about what QB leaves early in training, see
  ``moe_maxvio`` in metrics.jsonl); MoonEP computes exactly ``N*k`` rows on every rank (skew 1).
* in-action communication: EP -- per MoE layer two all-to-alls forward (dispatch, combine) and two backward of
  ``N*k`` latent rows, the ``(ep-1)/ep`` that leave the rank (x skew on the busiest receiver without MoonEP); MoonEP
  adds the redundant experts' weight prefetch and their fp32 gradient reduce-back: on ``cpu`` the point-to-point
  calls and bytes its dispatcher issued while the layers were timed (each call a ``Device.call_cost('p2p')``), on
  GPUs ``min(E/ep, ceil((skew-1) E/ep))`` experts of ``3 l f`` each. What of it is exposed is what the layer's
  thread blocks on when the dispatcher's own order runs (:func:`layer_ops`, :func:`side_timeline`): the prefetch
  travels beside the token all-to-all and behind the own experts' compute, the reduce-back and the next backward's
  prefetch behind the own experts' backward, and under ``parallel.expert_wgrad_split`` the input gradients'
  all-to-all behind the own experts' weight-gradient matmuls; transfers in flight share the link. KCP -- per KDA layer one all-gather of the ``B x H x dk x (dk+dv)`` fp32 pairs forward and one backward;
  MLA-CP -- per MLA layer an all-gather of the ``B x T x (kv_lora_rank + rope)`` latents forward and a
  reduce-scatter backward, and under the causal balance two half-segment swaps each way (the layer's input and
  output, ``B x T/2 x d`` with the partner rank ``cp-1-r``, the CP group's link); KCP's short-convolution halo
  and per-micro-batch layout exchange; the MTP layer's on the last stage. Ring formulas (``(n-1)`` latency
  steps, ``(n-1)/n x bytes`` per rank) on the link the group spans; the all-to-all as NCCL runs it, ``bytes / n`` to
  every peer at once, those in the rank's NVLink domain over NVLink while the rest go over its NIC
  (:func:`~k3train.planning.step_time.links.ring_time`); plus ``Device.call_cost(kind)`` per call
  (cpu: what a small all-reduce costs while every rank of the host computes, ``calibration.cpu_bench.bench_loaded_collective``:
  with more ranks than cores a collective waits for descheduled peers; GPUs: 0).
* p2p: the cached AttnRes plan's payload per boundary (``memory.buffers.plan_bytes``) over the link between the two ranks.

The schedule: :func:`parallel.pipeline.p2p.build_programs` gives every pipeline rank's real program (receives
posted, computes, sends); :func:`simulate_programs` executes those programs event by event -- a compute starts
when its inputs have arrived, a send occupies its link -- so the bubble is the real schedule's. On a CPU the ranks
of the host share its cores: while ``n`` ranks compute (every busy pipeline rank times its dp x cp replicas), each
runs at ``Device.rank_speed(n)`` -- measured on this host (``calibration.cpu_bench.bench_concurrency``; ``tools/plan.py`` takes
the curve of n copies of this config's real one-process trainer stepping at once, ``calibration.anchor_run.concurrency_curve``),
which is below plain processor sharing ``min(1, cores / n)``: ranks also compete for caches and memory bandwidth,
and past the core count the scheduler's switching costs more. An action's in-action communication follows its
compute at wall speed (its per-call costs were measured while every rank computes) and the rank waiting in it does
not count among those computing.

Gradients (parameter dtype) over ``dp_cp`` (dense) and ``edp`` (routed experts), per chunk as soon as the chunk's
last backward ends (overlapping the rest of the pipeline): all-reduced at ZeRO 0/1, reduced to owners at ZeRO-2;
after the pipeline, the optimizer (Muon Newton-Schulz FLOPs + elementwise bytes; on cpu measured per parameter),
balanced over owners at ZeRO >= 1 (not below the largest parameter); ZeRO >= 1 then broadcasts the updated
parameters (all-gather bytes). ``--device cpu``: the trainer anchor (:class:`~k3train.planning.calibration.layer_times.
TrainerAnchor`, one real one-process run of the config on this host) scales the measured layer and optimizer
times to what the trainer takes, and adds the gradient norm's own work (the rank's share of the parameters) and the
step's host work outside the timed phases (``Prediction.host``). Ranks are placed in ``ParallelDims``' order,
``gpus_per_node`` a node and ``Device.nvlink_domain`` (a node, or an NVL72 rack) an NVLink domain; a group whose
ranks share a domain uses NVLink, else the inter-node link.
"""
