"""Record what the analyzer's per-request reading (`analyze --requests`) reads: real responses of the real vLLM
CPU server, each with its own speculative metrics.

    .venv/bin/python scripts/record_per_request.py [--k 8] [--tokens 128] [--out assets/scrapes/vllm-ngram-requests.jsonl]

Starts vLLM (.venv-vllm) with its n-gram drafter at K and `--per-request-spec-decode-metrics detailed`
(engine/vllm/server.py), sends the chat, held-out chat, code-edit and summarize prompts of assets/workloads.json one after
another (greedy, chat template), and writes each whole JSON response as one line, with the workload it came
from added under "speclens_workload" (what a client's log of its responses would hold). The server is stopped
by its process group at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.vllm.server import VllmServer, ngram_config  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=str(ROOT / "assets" / "scrapes" / "vllm-ngram-requests.jsonl"))
    args = parser.parse_args()
    workloads = json.loads((ROOT / "assets" / "workloads.json").read_text())
    lines = []
    with VllmServer(speculative=ngram_config(args.k)) as server:
        import urllib.request

        for name in ("chat", "chat-heldout", "code-edit", "summarize"):
            for prompt in workloads[name]:
                body = {
                    "model": server.served_name,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": args.tokens,
                    "temperature": 0.0,
                }
                request = urllib.request.Request(
                    server.url + "/v1/chat/completions",
                    data=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(request, timeout=600) as answer:
                    response = json.load(answer)
                response["speclens_workload"] = name
                lines.append(json.dumps(response))
                spec = (response.get("metrics") or {}).get("speculative_decoding") or {}
                print(name, spec.get("mean_acceptance_length"), spec.get("acceptance_histogram"), flush=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} responses to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
