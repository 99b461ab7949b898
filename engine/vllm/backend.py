"""SpecLens on a production engine: a vLLM server's speculative decoding as SpecLens events.

``VllmBackend(url).generate(prompt)`` runs one prompt through vLLM's OpenAI-compatible API (streaming, logprobs,
and the per-request speculative metrics of ``--per-request-spec-decode-metrics detailed``) and yields the same
events as ``SpeculativeEngine.generate``: ``start``, one ``step`` per target pass, ``finish`` (docs/events.md),
so the trace validator, ``run_summary``, the visuals and downloads work on it unchanged.

What vLLM reports, and how it becomes steps:

* ``metrics.speculative_decoding.per_step_accepted`` / ``per_step_drafted``: one entry per verification step
  *that drafted* (vLLM's scheduler only counts steps with scheduled draft tokens). Such a step emits
  ``accepted + 1`` tokens: the accepted drafts, then the *resampled* token (a draft was rejected) or the *bonus*
  token (every draft was accepted). The run's last step may be cut by EOS or max_tokens (``truncated``).
* The prefill pass emits the first token, and a decode step whose drafter found nothing (n-gram: no match)
  emits one bonus token; vLLM does not list those, so they are the tokens left over.
* The stream delivers each engine step's tokens in one chunk (several steps per chunk when the client falls
  behind). A step never straddles a chunk, which places the counted steps among the one-token ones; where a
  one-token chunk could be a drafting step whose drafts were all rejected or a step that drafted nothing, the
  drafting step is placed first and the finish event's ``vllm.alignment`` says how many such choices were made.
* ``logprobs`` / ``top_logprobs``: the target's p of every emitted token and its top alternatives
  (``dists[*].p_top``). These are vLLM's logprobs (``--logprobs-mode``, default the raw model distribution).
* Timing: each chunk's arrival time; a step's ``verify_ms`` is the time since the previous chunk (the whole
  engine step: drafting, the target pass, sampling and streaming), left null for steps that shared a chunk with
  an earlier one.

Not exposed by vLLM, so recorded as absent (``start.absent``) and never invented: the draft tokens that were
rejected (and those after them), q (drafter probabilities; an n-gram draft is a point mass anyway), the
uniforms u, the drafting time apart from the step.

``complete`` is the lean request (no stream, no logprobs) the benchmark and the batch measurement
(``engine.vllm.batch``) time. ``VllmBackend.info()`` says what the server reports: the served model, whether it
speculates and with which K (from ``/metrics``), its speculative config where readable (``/server_info`` in
vLLM's dev mode, or what the caller started it with).

One module on purpose: the HTTP client, the stream parsing and the alignment of vLLM's per-step counts with the
streamed tokens are one translation (a response into SpecLens events); the server manager and the batch
measurement live apart.
"""

from __future__ import annotations

import http.client
import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

from engine import config
from engine.events import TOP_N, rounded, step_record

__all__ = [
    "SERVER_STOPPED",
    "VllmStopped",
    "ABSENT",
    "ENV_URL",
    "VllmBackend",
    "VllmError",
    "align_steps",
    "parse_prometheus",
]

ENV_URL = "SPECLENS_VLLM_URL"
CONNECT_TIMEOUT_S = 3.0  # fail fast when nothing listens
READ_TIMEOUT_S = 600.0  # a long generation on a busy CPU server
# What a vLLM trace cannot contain; listed in every start event.
ABSENT = [
    "draft tokens that were rejected (and the drafts after them)",
    "q (drafter probabilities)",
    "u (the uniforms of the accept tests)",
    "drafting time apart from the engine step",
]


class VllmError(RuntimeError):
    """The server is unreachable or answered something unusable; the message says which."""


class VllmStopped(VllmError):
    """The server stopped answering in the middle of a streamed run (it died, or the connection dropped): the
    stream ended without its end marker, or reading it failed after it had begun."""


SERVER_STOPPED = "server_stopped"  # a finish event's stop_reason when the server stopped answering mid-run


def parse_prometheus(text: str) -> dict:
    """vLLM's speculative counters from a /metrics page: totals summed over engines, plus the
    per-position accepted counts ({position: count})."""
    out: dict = {"per_pos": {}}
    pattern = re.compile(r"^(vllm:spec_decode_[a-z_]+_total)(\{[^}]*\})?\s+([0-9.eE+-]+)$")
    for line in text.splitlines():
        match = pattern.match(line.strip())
        if not match:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        key = name.removeprefix("vllm:spec_decode_").removesuffix("_total")
        pos = re.search(r'position="(\d+)"', labels)
        if key == "num_accepted_tokens_per_pos" and pos:
            out["per_pos"][int(pos.group(1))] = out["per_pos"].get(int(pos.group(1)), 0) + int(value)
        else:
            out[key] = out.get(key, 0) + int(value)
    return out


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


class VllmBackend:
    """A vLLM deployment reached over HTTP (OpenAI-compatible API).

    url: base URL (``http://host:port``, with or without ``/v1``); None reads SPECLENS_VLLM_URL.
    speculative_config: what the caller started the server with (vLLM does not report it
    outside its dev mode); None = read it from the server where possible.
    tokenizer: optional object with ``decode([id])`` for token texts; else vLLM's /detokenize.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        model: str | None = None,
        speculative_config: dict | None = None,
        eos_ids: list[int] | None = None,
        dtype: str | None = None,
        tokenizer=None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
    ):
        url = url or config.vllm_url()
        if not url:
            raise VllmError(f"no vLLM URL: pass one (--vllm-url URL) or set {ENV_URL}")
        parsed = urlparse(url if "://" in url else "http://" + url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise VllmError(f"not an http(s) URL: {url!r}")
        self.scheme, self.host = parsed.scheme, parsed.hostname
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self.prefix = parsed.path.rstrip("/").removesuffix("/v1")
        self.url = f"{self.scheme}://{self.host}:{self.port}{self.prefix}"
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._model = model
        self._given_spec = speculative_config
        self._eos_ids = list(eos_ids) if eos_ids is not None else None
        self._dtype = dtype
        self._tokenizer = tokenizer
        self._info: dict | None = None
        self._texts: dict[int, str] = {}

    # ------------------------------------------------------------------ HTTP
    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.connect_timeout_s)
        try:
            conn.connect()
        except OSError as exc:
            raise VllmError(f"cannot reach vLLM at {self.url}: {exc.strerror or exc}") from None
        conn.sock.settimeout(timeout)
        return conn

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None):
        """(status, parsed JSON or text) of one request; VllmError when unreachable."""
        conn = self._conn(timeout or self.read_timeout_s)
        try:
            conn.request(
                method,
                self.prefix + path,
                body=json.dumps(body) if body is not None else None,
                headers={"Content-Type": "application/json"} if body is not None else {},
            )
            resp = conn.getresponse()
            raw = resp.read().decode("utf-8", "replace")
        except (OSError, http.client.HTTPException) as exc:
            raise VllmError(f"vLLM at {self.url}{path} failed: {exc}") from None
        finally:
            conn.close()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw

    def _json(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        status, data = self._request(method, path, body, timeout)
        if status != 200 or not isinstance(data, dict):
            raise VllmError(f"vLLM at {self.url}{path} answered {status}: {_error_text(data)}")
        return data

    # ------------------------------------------------------------------ server
    def info(self, refresh: bool = False) -> dict:
        """What the server reports: model, max_model_len, version, speculative (True/False/None
        = cannot tell), k, speculative_config and where it came from."""
        if self._info is not None and not refresh:
            return self._info
        models = self._json("GET", "/v1/models", timeout=10.0).get("data") or []
        if not models:
            raise VllmError(f"vLLM at {self.url} serves no model (/v1/models is empty)")
        entry = next((m for m in models if m.get("id") == self._model), models[0])
        if self._model and entry.get("id") != self._model:
            raise VllmError(f"vLLM at {self.url} does not serve {self._model!r} (it serves {entry.get('id')!r})")
        status, version = self._request("GET", "/version", timeout=10.0)
        counters = self.spec_counters()
        speculative = None if counters is None else "num_drafts" in counters
        k = len(counters["per_pos"]) if counters and counters.get("per_pos") else None
        config, source = self._given_spec, "given by the caller" if self._given_spec else None
        dtype = self._dtype
        if config is None or dtype is None:
            status_i, server_info = self._request("GET", "/server_info?config_format=json", timeout=10.0)
            vllm_config = server_info.get("vllm_config") if status_i == 200 and isinstance(server_info, dict) else None
            if isinstance(vllm_config, dict):  # dev mode only (VLLM_SERVER_DEV_MODE=1)
                if config is None:
                    config, source = vllm_config.get("speculative_config"), "/server_info"
                dtype = dtype or (vllm_config.get("model_config") or {}).get("dtype")
        if config is None and speculative:
            source = "not reported (vLLM shows its speculative config only in dev mode, /server_info)"
        if speculative is None and config is not None:
            speculative = bool(config)
        self._info = {
            "url": self.url,
            "model": entry.get("id"),
            "root": entry.get("root"),
            "max_model_len": entry.get("max_model_len"),
            "dtype": str(dtype).removeprefix("torch.") if dtype else None,
            "version": version.get("version") if status == 200 and isinstance(version, dict) else None,
            "speculative": speculative,
            "k": k or (config or {}).get("num_speculative_tokens"),
            "method": (config or {}).get("method"),
            "speculative_config": config,
            "speculative_config_source": source,
        }
        return self._info

    def spec_counters(self) -> dict | None:
        """vLLM's speculative counters from /metrics (parse_prometheus); only ``per_pos`` (empty)
        when the server has none (it does not speculate), None when /metrics is unavailable."""
        status, text = self._request("GET", "/metrics", timeout=10.0)
        if status != 200 or not isinstance(text, str):
            return None
        return parse_prometheus(text)

    def token_texts(self, ids) -> dict[int, str]:
        """Texts of single tokens (what the engine's token_text gives), cached per backend."""
        missing = sorted({int(i) for i in ids} - self._texts.keys())
        if missing and self._tokenizer is not None:
            for i in missing:
                self._texts[i] = self._tokenizer.decode([i])
        elif missing:
            model = self.info()["model"]

            def one(i: int) -> tuple[int, str]:
                return i, self._json("POST", "/detokenize", {"model": model, "tokens": [i]}, timeout=30.0)["prompt"]

            with ThreadPoolExecutor(max_workers=min(8, len(missing))) as pool:
                self._texts.update(pool.map(one, missing))
        return {int(i): self._texts[int(i)] for i in ids}

    def detokenize(self, ids: list[int]) -> str:
        return self._json("POST", "/detokenize", {"model": self.info()["model"], "tokens": list(ids)})["prompt"]

    # ------------------------------------------------------------- requests
    def _body(self, prompt, max_new_tokens, temperature, top_p, top_k, seed, chat, stream, top_n) -> tuple[str, dict]:
        info = self.info()
        body: dict = {
            "model": info["model"],
            "max_tokens": int(max_new_tokens),
            "temperature": float(temperature),
            "top_p": float(top_p),
            "return_token_ids": True,  # vLLM extension: prompt and completion token ids
        }
        if top_k:
            body["top_k"] = int(top_k)
        if seed is not None:
            body["seed"] = int(seed)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            path, body["messages"] = "/v1/chat/completions", prompt
        elif isinstance(prompt, str) and chat:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        elif isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            path, body["prompt"] = "/v1/completions", prompt
        else:
            raise ValueError("prompt must be text, a list of token ids or a list of chat messages")
        if isinstance(prompt, (str, list)) and not prompt:
            raise ValueError("prompt is empty")
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}  # the final chunk carries the metrics
        if stream and top_n is not None:  # None: no logprobs at all (payload "off": what a client pays)
            body["return_tokens_as_token_ids"] = True  # top alternatives as ids ("token_id:N")
            if path.endswith("chat/completions"):
                body["logprobs"], body["top_logprobs"] = True, top_n
            else:
                body["logprobs"] = top_n
        return path, body

    def complete(
        self,
        prompt,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        chat: bool = True,
        ignore_eos: bool = False,
    ) -> dict:
        """One request without streaming or logprobs (what a client pays): token_ids, text,
        wall_s, finish_reason and vLLM's speculative metrics (None without speculation)."""
        path, body = self._body(prompt, max_new_tokens, temperature, top_p, top_k, seed, chat, False, 0)
        if ignore_eos:
            body["ignore_eos"] = True
        t0 = time.perf_counter()
        data = self._json("POST", path, body)
        wall = time.perf_counter() - t0
        choice = (data.get("choices") or [{}])[0]
        text = choice["message"].get("content") if "message" in choice else choice.get("text")
        return {
            "token_ids": list(choice.get("token_ids") or []),
            "prompt_ids": list(data.get("prompt_token_ids") or choice.get("prompt_token_ids") or []),
            "text": text or "",
            "finish_reason": choice.get("finish_reason"),
            "wall_s": wall,
            "usage": data.get("usage") or {},
            "speculative_decoding": (data.get("metrics") or {}).get("speculative_decoding"),
        }

    def _stream(self, path: str, body: dict):
        """Yield (arrival perf_counter, chunk dict) for every data line of an SSE response."""
        conn = self._conn(self.read_timeout_s)
        try:
            conn.request(
                "POST", self.prefix + path, body=json.dumps(body), headers={"Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            if resp.status != 200:
                raw = resp.read().decode("utf-8", "replace")
                try:
                    raw = _error_text(json.loads(raw))
                except ValueError:
                    pass
                raise VllmError(f"vLLM at {self.url}{path} answered {resp.status}: {raw}")
            chunks = 0
            while True:
                try:
                    line = resp.readline()
                except (OSError, http.client.HTTPException) as exc:
                    raise VllmStopped(
                        f"vLLM at {self.url} stopped answering mid-run, after {chunks} streamed chunks ({exc}): "
                        "the server stopped or the connection dropped"
                    ) from None
                if not line:  # the connection closed before the stream's end marker
                    raise VllmStopped(
                        f"vLLM at {self.url} stopped answering mid-run: the stream ended after {chunks} chunks "
                        "without its end marker ([DONE]); the server stopped or the connection dropped"
                    )
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                try:
                    chunk = json.loads(payload)
                except ValueError:
                    raise VllmError(f"vLLM sent a stream line that is not JSON: {payload[:200]!r}") from None
                if "error" in chunk and "choices" not in chunk:
                    raise VllmError(f"vLLM reported an error mid-stream: {_error_text(chunk)}")
                chunks += 1
                yield time.perf_counter(), chunk
        except (OSError, http.client.HTTPException) as exc:
            raise VllmError(f"vLLM stream from {self.url}{path} failed: {exc}") from None
        finally:
            conn.close()

    def generate(
        self,
        prompt,
        settings=None,
        *,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        chat: bool | None = None,
        payload: str | None = None,
    ):
        """Yield start, step... and finish events for one request (see the module docstring).

        prompt: text (chat template applied by vLLM when chat), token ids (/v1/completions),
        or a list of chat messages. settings: an engine GenerationSettings (its sampling and
        length fields are used; K and the tree are the server's) or None; keywords override.
        The start event comes with the first streamed chunk, the steps when vLLM has reported
        its per-step counts (with the last chunk).
        """

        def pick(name, value, default):
            return value if value is not None else getattr(settings, name, default)

        max_new = int(pick("max_new_tokens", max_new_tokens, 64))
        temp = float(pick("temperature", temperature, 0.0))
        topp = float(pick("top_p", top_p, 1.0))
        topk = int(pick("top_k", top_k, 0))
        seed_v = pick("seed", seed, None)
        use_chat = bool(pick("chat", chat, True))
        pay = pick("payload", payload, "full")
        if pay not in ("full", "reduced", "off"):
            raise ValueError(f"payload must be 'full', 'reduced' or 'off', got {pay!r}")
        if not 1 <= max_new <= 4096:
            raise ValueError(f"max_new_tokens must be between 1 and 4096, got {max_new}")
        if temp < 0 or not 0 < topp <= 1 or topk < 0:
            raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got {temp}, {topp}, {topk}")
        info = self.info()
        # full: p and its top alternatives; reduced: p of each emitted token; off: no logprobs.
        top_n = {"full": TOP_N, "reduced": 0, "off": None}[pay]  # alternatives per position, as ours
        path, body = self._body(prompt, max_new, temp, topp, topk, seed_v, use_chat, True, top_n)
        return self._run(prompt, path, body, info, max_new, temp, topp, topk, seed_v, use_chat, pay)

    def _run(self, prompt, path, body, info, max_new, temp, topp, topk, seed, chat, payload):
        spec = info["speculative"]
        k = int(info["k"] or 0) if spec else 0
        run = self._run_record(info, k, max_new, temp, topp, topk, seed, chat, payload)
        text = prompt if isinstance(prompt, str) else None
        got = _Received()
        started = time.perf_counter()
        start_sent = False
        try:
            for arrived, chunk in self._stream(path, body):
                got.add(arrived, chunk)
                # payload "off" (the benchmark): nothing but the stream while it runs.
                if not start_sent and got.prompt_ids is not None and payload != "off":
                    start_sent = True
                    yield self._start(run, text, got.prompt_ids)
        except VllmStopped as exc:
            if not start_sent:  # nothing of the run arrived: the error alone says it
                raise
            # The run began: its trace keeps what was streamed, marked incomplete. vLLM reports its per-step
            # counts only with the last chunk, so no step can be rebuilt: the finish carries the tokens and says why.
            yield _stopped_finish(got, k, time.perf_counter() - started, started, str(exc))
            return
        wall_s = time.perf_counter() - started
        if got.prompt_ids is None:
            raise VllmError("vLLM's stream carried no prompt token ids (is return_token_ids supported? vLLM >= 0.10)")
        if not start_sent:
            yield self._start(run, text, got.prompt_ids)
        got.check(payload)
        tokens, logprobs, method = got.token_ids, got.logprobs, info.get("method")
        accepted, drafted = self._spec_counts(spec, got.spec_metrics)
        plan, choices = align_steps([n for _, n in got.chunks], accepted, len(tokens))
        texts = self.token_texts(set(tokens) | {i for _, top in logprobs for i, _ in top}) if payload == "full" else {}
        steps = self._steps(plan, accepted, drafted, tokens, logprobs, got.chunks, started, texts, payload, method)
        if payload != "off":
            yield from steps
        yield _finish(got, plan, choices, steps, k, wall_s, started)

    def _start(self, run: dict, text, prompt_ids: list[int]) -> dict:
        """The start event. Its prompt tail's texts come from the server (/detokenize) while the stream is open:
        when the server stops answering then, the run has begun all the same, so the start event says the texts
        are absent (``prompt_tail`` None) and the stream's next read tells whether the server stopped mid-run."""
        from engine.events import start_event

        try:
            return start_event(run, text, prompt_ids, self._text_of)
        except VllmError as exc:
            event = start_event(run, text, prompt_ids, str)
            event["prompt_tail"] = None
            event["absent"] = [*run["absent"], f"the prompt tail's texts ({exc})"]
            return event

    def _run_record(self, info, k, max_new, temp, topp, topk, seed, chat, payload) -> dict:
        """The start event's run: the server, its speculation (K from `info`) and the request's settings."""
        spec = info["speculative"]
        method = info.get("method")
        return {
            "mode": "speculative" if spec else "baseline",
            "target": info["model"],
            "drafter": ("vllm:" + (method or "unknown")) if spec else "none",
            "dtype": info.get("dtype"),  # None when the server does not say
            "device": "vllm",
            "backend": "vllm",
            "settings": {
                "max_new_tokens": max_new,
                "k": k,
                "topk": 1,
                "num_draft_tokens": k,
                "temperature": temp,
                "top_p": topp,
                "top_k": topk,
                "seed": seed,
                "chat": chat,
                "strict": False,
                "payload": payload,
            },
            "sampling": {"temperature": temp, "top_k": topk, "top_p": topp},
            "greedy": temp == 0.0,
            "tree": {"k": k, "topk": 1, "num_draft_tokens": k},
            "eos_ids": sorted(self._eos_ids or []),
            "max_new_tokens": max_new,
            "server": {key: info[key] for key in ("url", "model", "root", "max_model_len", "dtype", "version")},
            "speculative_config": info.get("speculative_config"),
            "speculative_config_source": info.get("speculative_config_source"),
            "absent": list(ABSENT) + ([] if self._eos_ids is not None else ["eos ids (vLLM does not report them)"]),
        }

    def _spec_counts(self, spec, spec_metrics) -> tuple[list[int], list[int]]:
        if spec_metrics is None:
            if spec is None:
                raise VllmError(
                    f"cannot tell whether vLLM at {self.url} speculates: /metrics is unavailable and the response "
                    "has no metrics.speculative_decoding (start it with --per-request-spec-decode-metrics detailed)"
                )
            if spec:
                raise VllmError(
                    f"vLLM at {self.url} speculates but did not report per-step counts: start it with "
                    "--per-request-spec-decode-metrics detailed"
                )
            return [], []
        accepted = spec_metrics.get("per_step_accepted")
        drafted = spec_metrics.get("per_step_drafted")
        if accepted is None or drafted is None:
            if spec_metrics.get("num_spec_steps", 0) == 0:
                return [], []  # detailed arrays are left out when no step drafted
            raise VllmError(
                f"vLLM at {self.url} reports speculative metrics without per-step counts: start it with "
                "--per-request-spec-decode-metrics detailed (not summary)"
            )
        if len(accepted) != len(drafted):
            raise VllmError("vLLM's per_step_accepted and per_step_drafted differ in length")
        return [int(a) for a in accepted], [int(d) for d in drafted]

    def _text_of(self, token_id: int) -> str:
        return self.token_texts([token_id])[token_id]

    def _steps(self, plan, accepted, drafted, token_ids, logprobs, chunks, started, texts, payload, method):
        full = payload == "full"
        chunk_end = []  # token index at which each chunk ends, with its arrival time
        at = 0
        for arrived, n in chunks:
            at += n
            chunk_end.append((at, arrived))
        steps = []
        pos = 0
        prev_time = started
        ci = 0
        for number, (size, index) in enumerate(plan, start=1):
            n_drafted = drafted[index] if index is not None else 0
            n_accepted = accepted[index] if index is not None else 0
            cut = size < n_accepted + 1
            emitted = []
            for offset in range(size):
                tid = token_ids[pos + offset]
                lp, top = logprobs[pos + offset]
                if offset < n_accepted:
                    item = {"token_id": tid, "kind": "accepted", "node": offset}
                else:
                    kind = "bonus" if n_accepted == n_drafted else "resampled"
                    item = {"token_id": tid, "kind": kind, "from_node": n_accepted - 1 if n_accepted else -1}
                item["p"] = _prob(lp)
                if full:
                    item["text"] = texts[tid]
                emitted.append(item)
            # Chunk bookkeeping: a step ends inside or at the end of chunk ci.
            while chunk_end[ci][0] < pos + size:
                ci += 1
            ends_chunk = chunk_end[ci][0] == pos + size
            first_in_chunk = (ci == 0 and pos == 0) or (ci > 0 and chunk_end[ci - 1][0] == pos)
            arrived = chunk_end[ci][1]
            dists = []
            if full:
                for offset in range(size):
                    _, top = logprobs[pos + offset]
                    dists.append(
                        {
                            "node": offset - 1,  # -1 = the root, then the accepted drafts (chain ids)
                            "p_top": [[i, texts[i], _prob(v)] for i, v in top],
                            "q_top": None,
                        }
                    )
            step = step_record(
                number=number,
                nodes=[],  # vLLM reports how many drafts, not which tokens were rejected
                point_mass=method == "ngram" if index is not None else False,
                dists=dists,
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
                truncated=cut,
            )
            steps.append(step)
            pos += size
            if ends_chunk:
                prev_time = arrived
        return steps


class _Received:
    """What one streamed response carried, chunk by chunk (VllmBackend._run)."""

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


def _finish(got: _Received, plan: list, choices: int, steps: list[dict], k: int, wall_s: float, started: float):
    """The finish event of a streamed run: the metrics of its steps, and what vLLM said (``vllm``)."""
    from engine.events import finish_event
    from engine.metrics import summarize_steps

    prefill_s = got.chunks[0][0] - started if got.chunks else 0.0
    metrics = summarize_steps(steps, k, wall_s, prefill_s)
    reason = got.finish_reason
    stop = {"stop": "eos", "length": "max_new_tokens"}.get(reason or "", reason or "unknown")
    finish = finish_event(stop, "".join(got.text_parts), got.token_ids, metrics)
    finish["vllm"] = {
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
    return finish


def _stopped_finish(got: _Received, k: int, wall_s: float, started: float, why: str) -> dict:
    """The finish event of a run whose server stopped answering mid-run: stop_reason SERVER_STOPPED, the tokens
    and text streamed before it stopped, metrics over no steps (vLLM sends its per-step counts at the end, which
    never came), ``incomplete`` and the ``error`` in words."""
    from engine.events import finish_event
    from engine.metrics import summarize_steps

    prefill_s = got.chunks[0][0] - started if got.chunks else 0.0
    finish = finish_event(
        SERVER_STOPPED, "".join(got.text_parts), got.token_ids, summarize_steps([], k, wall_s, prefill_s)
    )
    finish["incomplete"] = True
    finish["error"] = why
    finish["vllm"] = {
        "finish_reason": None,
        "usage": got.usage,
        "speculative_decoding": None,
        "streamed_chunks": len(got.chunks),
    }
    return finish


def _prob(logprob: float | None) -> float | None:
    if logprob is None or not math.isfinite(logprob):
        return None if logprob is None else 0.0
    return rounded(math.exp(logprob))


def _token_id(token: str) -> int:
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


def _error_text(data) -> str:
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:500]
        return str(err)[:500]
    return str(data)[:500]
