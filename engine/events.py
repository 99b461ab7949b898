"""The events a run yields (schema: docs/events.md): start, one step per target pass, finish.

Each event is built once, from decisions already made (a ``verification.Verdict``)
and the loop's bookkeeping, and is not edited afterwards. Numbers are rounded to
``PROB_DIGITS`` decimals; full payloads add token texts and the top ``TOP_N``
entries of p, q and the residual (the verifier kept them, ``Verdict.tops``), which
is what the app draws.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.trace import EVENT_VERSION, TOP_N

if TYPE_CHECKING:  # read, never built, here: the schema needs neither the verifier nor its kernels
    from engine.drafters.base import DraftTree
    from engine.verification import Verdict

__all__ = [
    "PROB_DIGITS",
    "TOP_N",
    "finish_event",
    "rounded",
    "start_event",
    "step_event",
    "step_record",
    "top_list",
]

PROB_DIGITS = 6
PROMPT_TAIL = 8  # prompt tokens shown as "what the first pass continues from"

TokenText = Callable[[int], str]


def rounded(prob: float | None) -> float | None:
    """A probability as events record it (PROB_DIGITS decimals)."""
    return None if prob is None else round(float(prob), PROB_DIGITS)


def top_list(top: list[tuple[int, float]], token_text: TokenText) -> list[list]:
    """The TOP_N largest positive entries a Verdict kept, [(token_id, prob)] -> [[token_id, text, prob], ...]."""
    return [[int(i), token_text(int(i)), rounded(v)] for i, v in top]


def start_event(run: dict, prompt, prompt_ids: list[int], token_text: TokenText) -> dict:
    """run: what the engine resolved (mode, target, drafter, dtype, device, settings,
    sampling, greedy, tree, eos_ids, max_new_tokens)."""
    return {
        "type": "start",
        "version": EVENT_VERSION,
        **run,
        "prompt": prompt if isinstance(prompt, str) else None,
        "prompt_ids": list(prompt_ids),
        "prompt_tokens": len(prompt_ids),
        "prompt_tail": [token_text(t) for t in prompt_ids[-PROMPT_TAIL:]],
        "run_id": uuid.uuid4().hex,
        "started_at": time.time(),
    }


def _node(tree: DraftTree, verdict: Verdict, i: int, dropped: bool, token_text: TokenText | None) -> dict:
    p_token = verdict.p_token[i]
    item = {
        "id": i,
        "parent": tree.parents[i],
        "depth": tree.depths[i],
        "token_id": tree.tokens[i],
        "q": round(tree.q_token[i], PROB_DIGITS),
        "p": round(p_token, PROB_DIGITS) if p_token is not None else None,
        "decision": verdict.decisions[i],
    }
    rec = verdict.records[i]
    if rec is not None:
        item.update(
            accept_prob=round(rec["accept_prob"], PROB_DIGITS),
            u=None if rec["u"] is None else round(rec["u"], PROB_DIGITS),
            p_eff=round(rec["p_eff"], PROB_DIGITS),
            q_eff=round(rec["q_eff"], PROB_DIGITS),
            adjusted=rec["adjusted"],
        )
        if "joint" in rec:  # block verification: the running joint ratio after this node, and its prefix's test
            item["joint"] = round(rec["joint"], PROB_DIGITS)
            item["prefix_passed"] = rec["passed"]
    if dropped:
        item["dropped"] = True
    if token_text is not None:
        item["text"] = token_text(tree.tokens[i])
    return item


def _dists(tree: DraftTree, verdict: Verdict, token_text: TokenText) -> list[dict]:
    """p (and q) at every visited position: the root, then each accepted node."""
    tops = verdict.tops
    if tops is None:
        raise ValueError("a full payload needs the verifier's top entries: verify with tops=True")
    out = []
    for node in [-1, *verdict.path]:
        q = tops["q"].get(node)
        out.append(
            {
                "node": node,
                "p_top": top_list(tops["p"][node], token_text),
                "q_top": top_list(q, token_text) if q is not None else None,
            }
        )
    return out


def step_event(
    tree: DraftTree,
    verdict: Verdict,
    *,
    emitted: list[dict],
    kept: int,
    number: int,
    tokens_total: int,
    elapsed_s: float,
    draft_ms: float,
    verify_ms: float,
    draft: dict,
    payload: str,
    token_text: TokenText,
    kv: dict | None = None,
) -> dict:
    """One target pass. emitted: verdict.emitted(tree), which the loop already built; kept: how many of them
    the run keeps (fewer than all when EOS or max_new_tokens cut it); accepted nodes past the cut
    are marked ``dropped``. payload "off" leaves out the per-node records. draft: {"k": the K this pass
    drafted with, "stop": why drafting stopped} (``run_state.StepResult.draft_info``). kv: the target's KV cache
    in this pass, {"written", "kept", "rolled_back", "length"} (``run_state.StepResult.kv``)."""
    full = payload == "full"
    dropped = {item["node"] for item in emitted[kept:] if item["node"] is not None}
    texts = token_text if full else None
    nodes = [_node(tree, verdict, i, i in dropped, texts) for i in range(len(tree))] if payload != "off" else []
    kept_items = emitted[:kept]
    for item in kept_items:
        if "p" in item:
            item["p"] = round(item["p"], PROB_DIGITS)
        if full:
            item["text"] = token_text(item["token_id"])
    if full and kept == len(emitted) and verdict.extra["kind"] == "resampled" and not verdict.greedy:
        kept_items[-1]["residual_top"] = top_list(verdict.tops["residual"], token_text)
    return step_record(
        number=number,
        nodes=nodes,
        point_mass=tree.point_mass,
        dists=_dists(tree, verdict, token_text) if full else [],
        emitted=kept_items,
        drafted=len(tree),
        draft_depth=max(tree.depths, default=0),
        draft=dict(draft),
        accepted_len=len(verdict.path),
        extra_kind=verdict.extra["kind"],
        draft_ms=draft_ms,
        verify_ms=verify_ms,
        tokens_total=tokens_total,
        elapsed_s=elapsed_s,
        truncated=kept < len(emitted),
        kv=kv,
        verify=verdict.rule,
    )


def step_record(
    *,
    number: int,
    nodes: list[dict],
    point_mass: bool,
    dists: list[dict],
    emitted: list[dict],
    drafted: int,
    draft_depth: int,
    accepted_len: int,
    extra_kind: str,
    draft_ms: float | None,
    verify_ms: float | None,
    tokens_total: int,
    elapsed_s: float,
    truncated: bool = False,
    draft: dict | None = None,
    kv: dict | None = None,
    verify: str | None = None,
) -> dict:
    """The step event's one layout (docs/events.md), for our engine's passes (``step_event``) and for a
    production engine's reported steps (``engine.vllm.steps``, which knows counts and p but not q).
    Timings a backend could not measure are None."""
    event = {
        "type": "step",
        "step": number,
        "nodes": nodes,
        "point_mass": point_mass,
        "dists": dists,
        "emitted": emitted,
        "drafted": drafted,
        "draft_depth": draft_depth,
        **({"draft": draft} if draft is not None else {}),
        "accepted_len": accepted_len,
        "extra_kind": extra_kind,
        **({"verify": verify} if verify is not None else {}),
        "draft_ms": None if draft_ms is None else round(draft_ms, 3),
        "verify_ms": None if verify_ms is None else round(verify_ms, 3),
        "target_passes": number,
        "tokens_total": tokens_total,
        "elapsed_s": elapsed_s,
    }
    if truncated:
        event["truncated"] = True
    if kv is not None:  # a production engine manages its cache out of sight: no record
        event["kv"] = dict(kv)
    return event


def finish_event(stop_reason: str, text: str, token_ids: list[int], metrics: dict) -> dict:
    return {"type": "finish", "stop_reason": stop_reason, "text": text, "token_ids": token_ids, "metrics": metrics}
