"""The schedule walk: a pipeline rank's real program executed on the traced chunks' bytes, holding what the runner
holds, to the rank's peak."""
from __future__ import annotations

from typing import Any

from k3train.planning.memory.results import ChunkTrace


def walk_schedule(program: list[Any], traces: dict[int, ChunkTrace], grad_full: dict[int, int],
                  grad_owned: dict[int, int], zero: int, per_mb_extra: dict[int, int],
                  b_extra: dict[int, int], msg_bytes: Any, cached_grad: dict[int, int],
                  mb_segs: list[int | None], timeline: list | None = None,
                  pairs: Any = None, pair_done: float = 0.5) -> tuple[int, int, int, str]:
    """Walk this rank's real program (``parallel.pipeline.p2p.build_programs``: receives posted ahead, computes,
    sends) holding what the runner holds: a received payload from its post to the B that consumes it, a
    micro-batch's saved bytes from its F to its B, the gradients sent back until the next compute, the block-cache
    gradients of earlier local chunks until their B. Returns ``(peak above params+optimizer+persistent buffers,
    activations at the peak, gradients at the peak, action at the peak)``.

    ``pairs`` (F/B pairing, ``parallel.overlap_ep``; ``program`` is then the paired one, :func:`k3train.planning.programs.paired_programs`):
    the first compute of every pair -> its trailing-post count (``pair_programs``' firsts); it and the next
    compute run at the same time on two threads. The F's saved
    bytes grow while the B frees its micro-batch's, so the pair's peak is where the F ends (its own peak: the
    head and loss come last) with the B ``pair_done`` of the way through, having freed that share of its saved
    bytes (the two threads share the cores: with a backward k times the forward, the F ends when the B has done
    1/k of its work) -- unless the B consumes a received gradient (not the last stage): the next stage sends it
    from a pair of its own, so when the F ends the B may still wait for it, having freed nothing (measured so at
    pp 2 x vpp 2); at least the B's own peak. What actually meets depends on the threads' timing: measured
    peaks vary run to run by a few percent (tools/memory.py --measure)."""
    computes = [ins.action for ins in program if ins.op == "compute"]
    last_b = {a.chunk: i for i, a in enumerate(computes) if a.kind == "B"}
    grads = {c: 0 for c in traces}
    held, pending_send, cache_g = 0, 0, {}
    best = (-1, 0, 0, "")
    i = -1
    with_next: Any = None  # the first compute of the running pair (its effects apply with the second's)
    # a pair's first compute posts its trailing receives (the instructions after the second) as soon as it ends
    # (PipelineRunner.run_pair): a paired F's are held at the F's end already
    x_recv = {ins.action: sum(msg_bytes(p.msg) for p in program[k + 2:k + 2 + pairs[ins.action]] if p.op == "recv")
              for k, ins in enumerate(program) if ins.op == "compute" and pairs and ins.action in pairs}
    for ins in program:
        if ins.op == "recv":
            held += msg_bytes(ins.msg)
            continue
        if ins.op == "send":
            continue
        i += 1
        a = ins.action
        if pairs and a in pairs and with_next is None:
            with_next = a
            continue
        acts = [(with_next, i - 1), (a, i)] if with_next is not None else [(a, i)]
        with_next = None
        # gradients of the chunk's first B are created inside it (autograd keeps the fresh tensor as .grad): the
        # trace's b_peak (run with .grad pre-set) already holds their size, so they count from the next action on
        g = sum(grads.values())
        live = held + pending_send + sum(cache_g.values())
        peaks = _action_peaks(acts, traces, grads, grad_full, per_mb_extra, b_extra, mb_segs, pair_done)
        if len(acts) == 1:
            cand = live + peaks.get("F", peaks.get("B"))
        else:  # a pair: the F's peak at its end, the B partly through (docstring); at least the B's own peak
            cand = live + max(peaks["F"] - peaks["B freed"] + x_recv.get(acts[0][0], 0), peaks["B"])
        what = "+".join(repr(x) for x, _ in acts)
        if cand + g > best[0]:
            best = (cand + g, cand, g, what)
        if timeline is not None:
            timeline.append((what, live + g, cand + g))
        pending_send = 0  # sends get one compute of slack (PipelineRunner.run_instr)
        for x, k in acts:
            tr = traces[x.chunk]
            saved = tr.at(mb_segs[x.mb])[0]
            if x.kind == "F":
                held += saved + per_mb_extra[x.chunk]
                continue
            held -= saved + per_mb_extra[x.chunk] + tr.recv + tr.grad_msg
            pending_send = tr.recv
            cache_g.pop((x.chunk, x.mb), None)
            if cached_grad.get(x.chunk):
                cache_g[(x.chunk - 1, x.mb)] = cached_grad[x.chunk]
            if zero == 2 and last_b[x.chunk] == k:
                grads[x.chunk] = grad_owned[x.chunk]
    return best[0], best[1], best[2], best[3]


def _action_peaks(acts: list[tuple[Any, int]], traces: dict[int, ChunkTrace], grads: dict[int, int],
                  grad_full: dict[int, int], per_mb_extra: dict[int, int], b_extra: dict[int, int],
                  mb_segs: list[int | None], pair_done: float) -> dict[str, int]:
    """The transient peaks of the computes ``acts`` (one, or a pair) above what is held before them: ``"F"``,
    ``"B"`` and what the B has freed when a paired F ends (``"B freed"``); a chunk's first B makes its gradients
    (``grads``)."""
    peaks = {}
    for x, _ in acts:
        saved, f_peak, b_peak = traces[x.chunk].at(mb_segs[x.mb])
        if x.kind == "B" and grads[x.chunk] == 0:
            grads[x.chunk] = grad_full[x.chunk]
        if x.kind == "F":
            peaks["F"] = f_peak + per_mb_extra[x.chunk]
        else:
            # b_peak is measured from before this micro-batch's forward: it includes its own saved bytes
            peaks["B"] = b_peak - saved + b_extra[x.chunk]
            # a B that consumes a received gradient may still wait for it when the F ends: nothing freed
            done = 0.0 if traces[x.chunk].grad_msg else pair_done
            peaks["B freed"] = int(done * (saved + per_mb_extra[x.chunk]))
    return peaks
