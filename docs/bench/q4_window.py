"""Would a q4 drafter that attends to fewer positions keep its drafts? Measured offline (greedy, teacher-forced).

    .venv/bin/python docs/bench/q4_window.py > report.json      (from the repository's root; ~4 minutes on 2 cores)

Attention is ~12% of a q4 draft pass at ~120 cached positions (docs/kernels.md: a build attending to 8 keys made
the pass 1.14x quicker), and it is the one part of the pass a drafter could shrink without reading fewer weight
bytes: a drafter may attend to anything (verification keeps the output exact whatever it drafts), for example to
the first few positions (attention sinks, StreamingLLM) and the last W. Judged, as q4_drafter_cuts.py judges its
cuts, by the greedy hit rate: how often the drafter's argmax is the target's next token over the target's own greedy
answers (128 new tokens) to every workload prompt, per workload (a point lost costs ~4% of the tokens per pass at
K = 6). Each row attends causally and, where a window is given, only to positions within W of it or among the
first `sinks`. Prints one JSON object.
"""

import json
import sys

import torch

sys.path.insert(0, ".")
from engine import SpeculativeEngine  # noqa: E402
from engine.host import cpu_name  # noqa: E402

WINDOWS = ((None, 0), (128, 4), (96, 4), (64, 4), (32, 4), (64, 0))  # (W, sinks); None: the drafter as shipped

engine = SpeculativeEngine.load()
model = engine.drafter("q4").model
workloads = json.load(open("assets/workloads.json"))
seqs = []  # (workload, prompt + answer ids, prompt length)
for name in ("chat", "chat-heldout", "code-edit", "summarize"):
    for prompt in workloads[name]:
        ids = engine.prompts.ids(prompt, True)
        seqs.append((name, ids + engine.run(prompt, "none", max_new_tokens=128)["token_ids"], len(ids)))


@torch.inference_mode()
def hit_rates(window: int | None, sinks: int) -> dict[str, float]:
    hits: dict[str, list[bool]] = {}
    for name, ids, n0 in seqs:
        n = len(ids)
        i = torch.arange(n)
        allow = i[None, :] <= i[:, None]  # [n, n] causal
        if window is not None:
            allow &= (i[:, None] - i[None, :] < window) | (i[None, :] < sinks)
        rows = torch.arange(n0 - 1, n - 1)  # the row before each answer token
        logits = model.run_pass(torch.tensor(ids), i, model.new_cache(n + 4), mask=allow, logits_rows=rows).logits
        hits.setdefault(name, []).extend((logits.float().argmax(-1) == torch.tensor(ids[n0:])).tolist())
    return {name: round(sum(h) / len(h), 4) for name, h in hits.items()}


report = {
    "host": cpu_name(),
    "sequence lengths (prompt + answer)": sorted(len(ids) for _, ids, _ in seqs),
    "greedy hit rate": {("as shipped" if w is None else f"W {w}, {s} sinks"): hit_rates(w, s) for w, s in WINDOWS},
}
print(json.dumps(report, indent=1))
