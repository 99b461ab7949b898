"""Does the EAGLE head draft better reading a low / middle / high mix of the target's layers (EAGLE-3)?

    .venv/bin/python docs/bench/eagle_feature_layers.py [--steps 250] [--layers 1,14,29] [--json OUT]

A short, controlled comparison before paying for a full recipe run: the same answers (the
train-head work folder's, from ``python -m engine train-head``), the same held-out sequences
(100, never trained on), the same batches, learning-rate schedule and seed; only what the head
reads differs:

* ``last``: the last layer's rows (the shipped head's input, EAGLE-1);
* ``mix``:  the outputs of ``--layers`` (the last one last), each RMS-normalised and mixed down
  to one feature by a trained fc (EAGLE-3's fused features).

Reported per variant: the held-out teacher-forced top-1 agreement with the target at each
training-time-test step (step s drafts s tokens ahead from real features s - 1 positions back,
as drafting at depth s does), and the training minutes. Both variants train for the same
number of steps, so this compares what each input gives for equal compute, not where a full
run ends.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from engine.paths import cache_dir
from engine.training.train_head import (
    TrainConfig,
    _batches,
    _collate,
    _features,
    _losses,
    _target_checkpoint,
    _Trainable,
    _vocabulary,
)


@torch.no_grad()
def held_out_top1(model, sequences, features, prompt_lengths, cfg, idx) -> list[float]:
    """Top-1 agreement per step over the held-out pairs that drafting predicts (answer tokens)."""
    hits = [0.0] * cfg.unroll
    count = [0.0] * cfg.unroll
    for start in range(0, len(idx), 8):
        batch = idx[start : start + 8]
        feats, tokens, valid, weight = _collate(batch, sequences, features, prompt_lengths, 0.0)
        _, stats = _losses(model, feats, tokens, valid, cfg.unroll, cfg.reg_weight, weight)
        n = float((weight >= 1).sum())
        for s, st in enumerate(stats):
            hits[s] += st["top1"] * n
            count[s] += n
    return [round(h / max(c, 1.0), 4) for h, c in zip(hits, count)]


def train(model, cfg, sequences, features, prompt_lengths, train_idx, steps: int, seed: int) -> float:
    params = list(model.params.values())
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(seed)
    lengths = [len(sequences[i]) for i in train_idx]
    plan = []
    while len(plan) < steps:
        plan += [[train_idx[j] for j in b] for b in _batches(lengths, cfg.batch_tokens, rng)]
    plan = plan[:steps]
    warmup = max(1, min(100, steps // 20))
    t0 = time.perf_counter()
    for step, idx in enumerate(plan, start=1):
        lr = cfg.lr * min(1.0, step / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        feats, tokens, valid, weight = _collate(idx, sequences, features, prompt_lengths, cfg.prompt_weight)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast):
            loss, stats = _losses(model, feats, tokens, valid, cfg.unroll, cfg.reg_weight, weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0:
            print(
                f"  step {step}/{steps} loss {float(loss):.3f} top1@1 {stats[0]['top1']:.2f}",
                file=sys.stderr,
                flush=True,
            )
    return (time.perf_counter() - t0) / 60


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--layers", default="1,14,29", help="target layers of the mix, the last layer last")
    ap.add_argument("--held-out", type=int, default=100)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    layers = tuple(int(x) for x in args.layers.split(","))
    cfg = TrainConfig()
    work = cache_dir() / "train-head" / "default"
    rows = sorted((json.loads(line) for line in (work / "answers.jsonl").open()), key=lambda r: r["index"])
    if not rows:
        raise SystemExit(f"no answers in {work}: run `python -m engine train-head` first")
    hf, engine, _ = _target_checkpoint(cfg, work)
    if layers[-1] != hf.config.num_hidden_layers - 1:
        raise SystemExit("--layers must end with the last layer")
    sequences = [r["prompt_ids"] + r["answer_ids"] for r in rows]
    prompt_lengths = [len(r["prompt_ids"]) for r in rows]
    order = list(range(len(sequences)))
    random.Random(1).shuffle(order)
    held, train_idx = order[: args.held_out], order[args.held_out :]
    t0 = time.perf_counter()
    features = _features(hf, sequences, cfg.batch_tokens, layers)  # [n, layers E] per sequence
    feature_minutes = (time.perf_counter() - t0) / 60
    E = hf.config.hidden_size
    last_only = [f[:, -E:] for f in features]
    vocab_ids = _vocabulary([sequences[i] for i in train_idx], cfg.vocab, set(engine.eos_ids), hf.config.vocab_size)
    rms = float(torch.cat([f[:64].float() for f in last_only[:64]]).pow(2).mean().sqrt())
    report = {"layers": list(layers), "steps": args.steps, "feature_minutes": round(feature_minutes, 2), "variants": {}}
    for name, feats, n_layers in (("last", last_only, 1), ("mix", features, len(layers))):
        model = _Trainable(hf, vocab_ids, rms, cfg.seed, n_layers)
        minutes = train(model, cfg, sequences, feats, prompt_lengths, train_idx, args.steps, cfg.seed)
        top1 = held_out_top1(model, sequences, feats, prompt_lengths, cfg, held)
        report["variants"][name] = {"held_out_top1": top1, "train_minutes": round(minutes, 2)}
        print(f"{name}: held-out top-1 by step {top1}, {minutes:.1f} min of training", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
