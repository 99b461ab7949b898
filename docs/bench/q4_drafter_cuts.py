"""Fewer bytes per q4 draft pass, at what cost in drafts kept? Three cuts measured offline (greedy).

    .venv/bin/python docs/bench/q4_drafter_cuts.py      (from the repository's root; ~5 minutes on 2 cores)

The q4 drafter reads ~84 MB per pass (66 MB of Q4_1 layers, 18 MB of Q4_1 head), 0.31 of the bf16 target's
269 MB: at equal bandwidth its cost c could not go below ~0.31. Each cut below would read less, and each is
judged by the drafter's greedy hit rate: how often its argmax is the target's next token, over the target's own
greedy answers (128 new tokens) to the prompts of every workload (the q4 drafter as shipped: 0.974; a drop of
one point costs ~4% of the tokens per pass at K = 6):

1. a reduced vocabulary (the head's first N rows: byte-level BPE numbers its tokens roughly by merge order; or
   the EAGLE head's 8192 most frequent tokens of its training answers): the share of answer tokens inside it
   bounds the hit rate from above;
2. a low-rank preview of the head (SVD-softmax, Shim et al. 2017): logits from the first W of the 576
   directions of E = U S V^T (int8 per row), the N best previewed re-scored in int8;
3. layers skipped (the residual passes them by): each single layer, then the least harmful few together.

Prints one JSON object.
"""

import dataclasses
import json
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, ".")
from engine import SpeculativeEngine  # noqa: E402
from engine.host import cpu_name  # noqa: E402

torch.manual_seed(0)
engine = SpeculativeEngine.load()
target, model = engine.target.model, engine.drafter("q4").model
workloads = json.load(open("assets/workloads.json"))
report: dict = {"host": cpu_name()}

# The target's greedy answers: (workload, prompt + answer ids, prompt length).
seqs = []
for name in ("chat", "chat-heldout", "code-edit", "summarize"):
    for prompt in workloads[name]:
        ids = engine.prompts.ids(prompt, True)
        seqs.append((name, ids + engine.run(prompt, "none", max_new_tokens=128)["token_ids"], len(ids)))
answers = torch.tensor([t for _, ids, n0 in seqs for t in ids[n0:]])  # [P] every answer token
report["answer_tokens"] = len(answers)


def rate(hits: torch.Tensor) -> float:
    return round(float(hits.float().mean()), 4)


@torch.inference_mode()
def drafter_rows(layers=None):
    """The q4 drafter's (with `layers` only, if given) logits [P, V] and final normed rows [P, E] at every answer
    position (the row before each answer token)."""
    all_layers, cfg = model.layers, model.cfg
    if layers is not None:
        model.layers = [all_layers[i] for i in layers]
        model.cfg = dataclasses.replace(cfg, num_layers=len(layers))
        model._stack = None
    logits, normed = [], []
    try:
        for _, ids, n0 in seqs:
            cache = model.new_cache(len(ids) + 4)
            rows = torch.arange(n0 - 1, len(ids) - 1)
            out = model.run_pass(torch.tensor(ids), torch.arange(len(ids)), cache, logits_rows=rows, features=True)
            logits.append(out.logits.float())
            normed.append(model._rms_norm(out.hidden[rows].float(), model.norm).float())
    finally:
        model.layers, model.cfg, model._stack = all_layers, cfg, None
    return torch.cat(logits), torch.cat(normed)


logits, x = drafter_rows()
report["q4 drafter as shipped: greedy hit rate"] = rate(logits.argmax(-1) == answers)

# 1. A reduced vocabulary.
eagle_vocab = set(load_file("assets/heads/SmolLM2-135M-Instruct/eagle-head.safetensors")["vocab_ids"].tolist())
report["reduced vocabulary: answer tokens inside it"] = {
    **{f"first {n} ids": rate(answers < n) for n in (8192, 16384, 24576, 32768)},
    "EAGLE head's 8192": rate(torch.tensor([int(t) in eagle_vocab for t in answers])),
}

# 2. A low-rank preview of the head, its best N re-scored in int8.
E = target.lm_head.weight.float()  # [V, E]
scale8 = E.abs().amax(1, keepdim=True) / 127
full8 = x @ ((E / scale8).round().clamp(-127, 127) * scale8).T  # [P, V] the int8 head's logits
U, S, Vh = torch.linalg.svd(E, full_matrices=False)
B, xr = U * S, x @ Vh.T  # [V, 576] rotated rows, [P, 576] rotated inputs
energy = (S**2).cumsum(0) / (S**2).sum()
preview = {}
for w in (64, 128):
    bw = B[:, :w]
    sw = bw.abs().amax(1, keepdim=True) / 127
    approx = xr[:, :w] @ ((bw / sw).round().clamp(-127, 127) * sw).T  # [P, V]
    for n in (32, 256):
        top = approx.topk(n, -1).indices
        rescored = approx.scatter(1, top, full8.gather(1, top))
        preview[f"W {w} ({49152 * w / 1e6:.1f} MB int8), N {n}"] = rate(rescored.argmax(-1) == answers)
report["low-rank head preview: greedy hit rate"] = preview
report["low-rank head: energy in the first 64 / 128 directions"] = [
    round(float(energy[63]), 3),
    round(float(energy[127]), 3),
]

# 3. Layers skipped.
n_layers = len(model.layers)
single = {}
for skip in range(n_layers):
    single[skip] = rate(drafter_rows([i for i in range(n_layers) if i != skip])[0].argmax(-1) == answers)
report["one layer skipped: greedy hit rate"] = single
order = sorted(single, key=lambda i: -single[i])
report["the least harmful layers skipped together"] = {
    str(sorted(order[:n])): rate(
        drafter_rows([i for i in range(n_layers) if i not in order[:n]])[0].argmax(-1) == answers
    )
    for n in (1, 2, 4)
}
print(json.dumps(report, indent=1))
