"""From a vLLM stream to SpecLens steps: what one streamed completion carried, and its steps rebuilt from it.

``Received`` gathers a stream chunk by chunk: the prompt and completion token ids, each chunk's arrival time and
size, the logprobs, the finish reason, the usage and, with the last chunk, vLLM's per-request speculative
metrics (``--per-request-spec-decode-metrics detailed``). vLLM reports how many drafts each drafting step
proposed and how many it accepted, but not where those steps fall in the token sequence; this module places them.

* ``per_step_accepted`` / ``per_step_drafted`` (``spec_counts``): one entry per verification step *that
  drafted*. Such a step emits ``accepted + 1`` tokens: the accepted drafts, then the *resampled* token (a draft
  was rejected) or the *bonus* token (every draft was accepted). The run's last step may be cut by EOS or
  max_tokens (``truncated``).
* The prefill pass emits the first token, and a decode step whose drafter found nothing (n-gram: no match)
  emits one bonus token; vLLM does not list those, so they are the tokens left over.
* The stream delivers each engine step's tokens in one chunk (several steps per chunk when the client falls
  behind). A step never straddles a chunk, which places the counted steps among the one-token ones
  (``align_steps``); where a one-token chunk could be a drafting step whose drafts were all rejected or a step
  that drafted nothing, the drafting step is placed first and the finish event's ``vllm.alignment`` says how
  many such choices were made.
* ``logprobs`` / ``top_logprobs``: the target's p of every emitted token and its top alternatives
  (``dists[*].p_top``), as vLLM reports them (``--logprobs-mode``, default the raw model distribution).
* Timing: each chunk's arrival time; a step's ``verify_ms`` is the time since the previous chunk (the whole
  engine step: drafting, the target pass, sampling and streaming), left null for steps that shared a chunk
  with an earlier one.

``build_steps`` writes the step events, ``finish`` the finish event of a complete stream and
``stopped_finish`` that of a stream the server broke off (its per-step counts never came, so it has no steps).
Nothing here speaks HTTP: the events follow from the stream's contents alone.
"""

from __future__ import annotations

import math

from engine.events import finish_event, rounded, step_record
from engine.metrics import summarize_steps
from engine.vllm.client import VllmError

__all__ = ["SERVER_STOPPED", "Received", "align_steps", "build_steps", "finish", "spec_counts", "stopped_finish"]

SERVER_STOPPED = "server_stopped"  # a finish event's stop_reason when the server stopped answering mid-run


class Received:
    """What one streamed response carried, chunk by chunk."""

    def __init__(self):
        self.prompt_ids: list[int] | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[tuple[float | None, list[tuple[int, float]]]] = []
        self.chunks: list[tuple[float, int]] = []  # (arrival, tokens) of every chunk that carried tokens
        self.text_parts: list[str] = []
        self.finish_reason = None
        self.spec_metrics = None
        self.usage = {}

    def add(self, arrived: float, chunk: dict) -> None:
        if self.prompt_ids is None and chunk.get("prompt_token_ids") is not None:
            self.prompt_ids = list(chunk["prompt_token_ids"])
        for choice in chunk.get("choices") or []:
            if self.prompt_ids is None and choice.get("prompt_token_ids") is not None:
                self.prompt_ids = list(choice["prompt_token_ids"])
            ids = list(choice.get("token_ids") or [])
            self.text_parts.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
            self.logprobs.extend(_logprobs(choice.get("logprobs")))
            if ids:
                self.token_ids.extend(ids)
                self.chunks.append((arrived, len(ids)))
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if chunk.get("usage"):
            self.usage = chunk["usage"]
            self.spec_metrics = (chunk.get("metrics") or {}).get("speculative_decoding")

    def check(self, payload: str) -> None:
        """One logprob entry per token (empty ones for payload "off", which asked for none) and as many tokens
        as the usage counts; VllmError otherwise."""
        if payload == "off":
            self.logprobs = [(None, [])] * len(self.token_ids)
        if len(self.logprobs) != len(self.token_ids):
            raise VllmError(f"vLLM streamed {len(self.token_ids)} tokens but {len(self.logprobs)} logprob entries")
        if self.usage and self.usage.get("completion_tokens") not in (None, len(self.token_ids)):
            raise VllmError(
                f"vLLM reported {self.usage['completion_tokens']} completion tokens but streamed {len(self.token_ids)}"
            )


def spec_counts(spec: bool | None, spec_metrics: dict | None, url: str) -> tuple[list[int], list[int]]:
    """(per_step_accepted, per_step_drafted) of a run, from the metrics its last chunk carried; empty lists
    when it drafted nothing. spec: whether the server speculates (None: cannot tell). VllmError when the
    server speculates (or may) but did not report per-step counts."""
    if spec_metrics is None:
        if spec is None:
            raise VllmError(
                f"cannot tell whether vLLM at {url} speculates: /metrics is unavailable and the response "
                "has no metrics.speculative_decoding (start it with --per-request-spec-decode-metrics detailed)"
            )
        if spec:
            raise VllmError(
                f"vLLM at {url} speculates but did not report per-step counts: start it with "
                "--per-request-spec-decode-metrics detailed"
            )
        return [], []
    accepted = spec_metrics.get("per_step_accepted")
    drafted = spec_metrics.get("per_step_drafted")
    if accepted is None or drafted is None:
        if spec_metrics.get("num_spec_steps", 0) == 0:
            return [], []  # detailed arrays are left out when no step drafted
        raise VllmError(
            f"vLLM at {url} reports speculative metrics without per-step counts: start it with "
            "--per-request-spec-decode-metrics detailed (not summary)"
        )
    if len(accepted) != len(drafted):
        raise VllmError("vLLM's per_step_accepted and per_step_drafted differ in length")
    return [int(a) for a in accepted], [int(d) for d in drafted]


def align_steps(chunk_sizes: list[int], accepted: list[int], total: int) -> tuple[list[tuple[int, int | None]], int]:
    """Place vLLM's drafting steps among the one-token ones.

    chunk_sizes: tokens per stream chunk, in order (a step never straddles chunks).
    accepted: per_step_accepted, one entry per drafting step, in order.
    total: tokens in the completion.
    The first step is the prefill (one token, nothing drafted); the last drafting step may
    be cut (fewer tokens than accepted + 1) when it is the run's last step. Of the
    placements that fit, the one with the fewest steps sharing a chunk with an earlier
    step is taken (vLLM streams one chunk per engine step unless the client falls
    behind); among equals a drafting step goes before a step that drafted nothing.
    Returns ([(tokens emitted, index into `accepted` or None), ...] per step, in order;
    choices), choices = the places where that rule had to pick between equally good
    placements (e.g. a one-token chunk that could be a drafting step whose drafts were
    all rejected, or a step that drafted nothing). Raises VllmError when nothing fits.
    """
    bounds = {0}
    at = 0
    for size in chunk_sizes:
        at += size
        bounds.add(at)
    if at != total:
        raise VllmError(f"the stream carried {at} tokens but the completion has {total}")
    if total == 0:
        return [], 0
    n_steps = len(accepted)

    def fits(start: int, end: int) -> bool:  # no chunk boundary strictly inside the step
        return not any(b in bounds for b in range(start + 1, end))

    def moves(t: int, j: int):
        """(t', j', emitted, drafting index, cost) from state (t, j), drafting first; cost 1
        when the step does not start a chunk."""
        cost = 0 if t in bounds else 1
        if j < n_steps:
            size = accepted[j] + 1
            if t + size <= total and fits(t, t + size):
                yield t + size, j + 1, size, j, cost
            elif t + size > total and j == n_steps - 1 and fits(t, total):
                yield total, j + 1, total - t, j, cost  # the last step, cut by EOS or the length limit
        if t < total:
            yield t + 1, j, 1, None, cost

    # States reachable after the prefill's token, then the least cost to the goal from each
    # (every move advances t, so decreasing t is a valid order).
    reachable = {(1, 0)}
    frontier = [(1, 0)]
    while frontier:
        nxt = []
        for t, j in frontier:
            for t2, j2, *_ in moves(t, j):
                if (t2, j2) not in reachable:
                    reachable.add((t2, j2))
                    nxt.append((t2, j2))
        frontier = nxt
    goal = (total, n_steps)
    inf = float("inf")
    best = {goal: 0} if goal in reachable else {}
    for t, j in sorted(reachable, reverse=True):
        if (t, j) != goal:
            best[(t, j)] = min((c + best.get((t2, j2), inf) for t2, j2, _, _, c in moves(t, j)), default=inf)
    if best.get((1, 0), inf) == inf:
        raise VllmError(
            f"vLLM's per-step counts (accepted {accepted}) do not fit the {total} streamed tokens "
            f"(chunks {chunk_sizes})"
        )
    steps: list[tuple[int, int | None]] = [(1, None)]
    choices = 0
    t, j = 1, 0
    while (t, j) != goal:
        options = [m for m in moves(t, j) if m[4] + best.get((m[0], m[1]), inf) == best[(t, j)]]
        if len(options) > 1:
            choices += 1
        t, j, size, index, _ = options[0]
        steps.append((size, index))
    return steps, choices


def build_steps(plan, accepted, drafted, token_ids, logprobs, chunks, started, texts, payload, method) -> list[dict]:
    """The step events of a run placed by align_steps.

    plan: align_steps' [(tokens emitted, drafting index or None)]; accepted, drafted: spec_counts' lists;
    token_ids, logprobs, chunks: what the stream carried (Received); started: the request's perf_counter;
    texts: {id: text} of every token named (payload "full" only); method: the server's drafting method."""
    full = payload == "full"
    chunk_end = _chunk_ends(chunks)
    steps = []
    pos = 0
    prev_time = started
    ci = 0
    for number, (size, index) in enumerate(plan, start=1):
        n_drafted = drafted[index] if index is not None else 0
        n_accepted = accepted[index] if index is not None else 0
        emitted = _emitted(token_ids, logprobs, pos, size, n_accepted, n_drafted, texts if full else None)
        # Chunk bookkeeping: a step ends inside or at the end of chunk ci.
        while chunk_end[ci][0] < pos + size:
            ci += 1
        ends_chunk = chunk_end[ci][0] == pos + size
        first_in_chunk = (ci == 0 and pos == 0) or (ci > 0 and chunk_end[ci - 1][0] == pos)
        arrived = chunk_end[ci][1]
        step = step_record(
            number=number,
            nodes=[],  # vLLM reports how many drafts, not which tokens were rejected
            point_mass=method == "ngram" if index is not None else False,
            dists=_dists(logprobs, pos, size, texts) if full else [],
            emitted=emitted,
            drafted=n_drafted,
            draft_depth=n_drafted,
            accepted_len=n_accepted,
            # vLLM's counts tell how the pass ended even when EOS cut the extra token.
            extra_kind="bonus" if n_accepted == n_drafted else "resampled",
            draft_ms=None,
            # The whole engine step as the stream saw it; steps that shared a chunk have none.
            verify_ms=(arrived - prev_time) * 1000.0 if first_in_chunk else None,
            tokens_total=pos + size,
            elapsed_s=arrived - started,
            truncated=size < n_accepted + 1,
        )
        steps.append(step)
        pos += size
        if ends_chunk:
            prev_time = arrived
    return steps


def _chunk_ends(chunks: list[tuple[float, int]]) -> list[tuple[int, float]]:
    """(token index at which each chunk ends, its arrival time), in order."""
    ends = []
    at = 0
    for arrived, n in chunks:
        at += n
        ends.append((at, arrived))
    return ends


def _emitted(token_ids, logprobs, pos, size, n_accepted, n_drafted, texts) -> list[dict]:
    """A step's emitted items: its accepted drafts, then the bonus or resampled token (texts None: no text)."""
    emitted = []
    for offset in range(size):
        tid = token_ids[pos + offset]
        lp, _ = logprobs[pos + offset]
        if offset < n_accepted:
            item = {"token_id": tid, "kind": "accepted", "node": offset}
        else:
            kind = "bonus" if n_accepted == n_drafted else "resampled"
            item = {"token_id": tid, "kind": kind, "from_node": n_accepted - 1 if n_accepted else -1}
        item["p"] = _prob(lp)
        if texts is not None:
            item["text"] = texts[tid]
        emitted.append(item)
    return emitted


def _dists(logprobs, pos, size, texts) -> list[dict]:
    """A step's target distributions as vLLM's top logprobs give them, one per emitted position."""
    dists = []
    for offset in range(size):
        _, top = logprobs[pos + offset]
        dists.append(
            {
                "node": offset - 1,  # -1 = the root, then the accepted drafts (chain ids)
                "p_top": [[i, texts[i], _prob(v)] for i, v in top],
                "q_top": None,
            }
        )
    return dists


def finish(got: Received, plan: list, choices: int, steps: list[dict], k: int, wall_s: float, started: float):
    """The finish event of a streamed run: the metrics of its steps, and what vLLM said (``vllm``)."""
    prefill_s = got.chunks[0][0] - started if got.chunks else 0.0
    metrics = summarize_steps(steps, k, wall_s, prefill_s)
    reason = got.finish_reason
    stop = {"stop": "eos", "length": "max_new_tokens"}.get(reason or "", reason or "unknown")
    event = finish_event(stop, "".join(got.text_parts), got.token_ids, metrics)
    event["vllm"] = {
        "finish_reason": reason,
        "usage": got.usage,
        "speculative_decoding": got.spec_metrics,
        "alignment": {
            "chunks": len(got.chunks),
            "steps": len(plan),
            "one_token_choices": choices,
            "rule": "fewest steps sharing a chunk, then drafting steps first (see align_steps)",
        },
    }
    return event


def stopped_finish(got: Received, k: int, wall_s: float, started: float, why: str) -> dict:
    """The finish event of a run whose server stopped answering mid-run: stop_reason SERVER_STOPPED, the tokens
    and text streamed before it stopped, metrics over no steps (vLLM sends its per-step counts at the end, which
    never came), ``incomplete`` and the ``error`` in words."""
    prefill_s = got.chunks[0][0] - started if got.chunks else 0.0
    event = finish_event(
        SERVER_STOPPED, "".join(got.text_parts), got.token_ids, summarize_steps([], k, wall_s, prefill_s)
    )
    event["incomplete"] = True
    event["error"] = why
    event["vllm"] = {
        "finish_reason": None,
        "usage": got.usage,
        "speculative_decoding": None,
        "streamed_chunks": len(got.chunks),
    }
    return event


def _prob(logprob: float | None) -> float | None:
    """p of a logprob, rounded as our events round; None when vLLM sent none, 0 for -inf (or nan)."""
    if logprob is None or not math.isfinite(logprob):
        return None if logprob is None else 0.0
    return rounded(math.exp(logprob))


def _token_id(token: str) -> int:
    """The id of a "token_id:N" string (return_tokens_as_token_ids); VllmError for a token given as text."""
    if not token.startswith("token_id:"):
        raise VllmError(
            f"vLLM returned a token as text ({token!r}), not as an id; is return_tokens_as_token_ids supported?"
        )
    return int(token.split(":", 1)[1])


def _logprobs(block) -> list[tuple[float | None, list[tuple[int, float]]]]:
    """[(logprob of the emitted token, [(id, logprob) of the top alternatives])] of one chunk,
    for both response shapes (chat: content entries; completions: parallel lists)."""
    if not block:
        return []
    out = []
    if "content" in block:  # chat completions
        for entry in block["content"] or []:
            top = [(_token_id(t["token"]), t["logprob"]) for t in entry.get("top_logprobs") or []]
            out.append((entry.get("logprob"), top))
    else:  # completions
        for lp, top in zip(block.get("token_logprobs") or [], block.get("top_logprobs") or []):
            out.append((lp, [(_token_id(t), v) for t, v in (top or {}).items()]))
    return out
