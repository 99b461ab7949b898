"""SpecLens on a production engine: a vLLM server's speculative decoding as SpecLens events.

``VllmBackend(url).generate(prompt)`` runs one prompt through vLLM's OpenAI-compatible API (streaming, logprobs,
and the per-request speculative metrics of ``--per-request-spec-decode-metrics detailed``) and yields the same
events as ``SpeculativeEngine.generate``: ``start``, one ``step`` per target pass, ``finish`` (docs/events.md),
so the trace validator, ``run_summary``, the visuals and downloads work on it unchanged.

The backend composes two parts and adds what a run needs on top of them:

* ``engine.vllm.client``: the HTTP wire (requests, the stream, /v1/models, /metrics, /detokenize, errors).
* ``engine.vllm.steps``: what a stream carried, and its steps placed among the streamed tokens
  (``align_steps``), with the finish event; its docstring says how vLLM's per-step counts become steps.
* Here: the settings of a request, the start event (the run record, the server's speculation, the prompt
  tail's texts), the token texts (cached per backend), and the order of a run's events: the start event with
  the first streamed chunk, the steps and the finish once vLLM has sent its per-step counts with the last one.

Not exposed by vLLM, so recorded as absent (``start.absent``) and never invented: the draft tokens that were
rejected (and those after them), q (drafter probabilities; an n-gram draft is a point mass anyway), the
uniforms u, the drafting time apart from the step.

``complete`` is the lean request (no stream, no logprobs) the benchmark and the batch measurement
(``engine.vllm.batch``) time. ``VllmBackend.info()`` says what the server reports: the served model, whether it
speculates and with which K (from ``/metrics``), its speculative config where readable (``/server_info`` in
vLLM's dev mode, or what the caller started it with).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from engine.events import TOP_N, start_event
from engine.vllm.client import CONNECT_TIMEOUT_S, READ_TIMEOUT_S, VllmClient, VllmError, VllmStopped, request_body
from engine.vllm.steps import Received, align_steps, build_steps, finish, spec_counts, stopped_finish

__all__ = ["ABSENT", "VllmBackend"]

# What a vLLM trace cannot contain; listed in every start event.
ABSENT = [
    "draft tokens that were rejected (and the drafts after them)",
    "q (drafter probabilities)",
    "u (the uniforms of the accept tests)",
    "drafting time apart from the engine step",
]
PAYLOADS = ("full", "reduced", "off")


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
        self.client = VllmClient(url, connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
        self.url = self.client.url
        self._model = model
        self._given_spec = speculative_config
        self._eos_ids = list(eos_ids) if eos_ids is not None else None
        self._dtype = dtype
        self._tokenizer = tokenizer
        self._info: dict | None = None
        self._texts: dict[int, str] = {}

    # ------------------------------------------------------------------ server
    def info(self, refresh: bool = False) -> dict:
        """What the server reports: model, max_model_len, version, speculative (True/False/None
        = cannot tell), k, speculative_config and where it came from."""
        if self._info is not None and not refresh:
            return self._info
        entry = self.client.model_entry(self._model)
        version = self.client.version()
        counters = self.spec_counters()
        speculative = None if counters is None else "num_drafts" in counters
        k = len(counters["per_pos"]) if counters and counters.get("per_pos") else None
        config, source = self._given_spec, "given by the caller" if self._given_spec else None
        dtype = self._dtype
        if config is None or dtype is None:
            vllm_config = self.client.vllm_config()
            if vllm_config is not None:  # dev mode only (VLLM_SERVER_DEV_MODE=1)
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
            "version": version,
            "speculative": speculative,
            "k": k or (config or {}).get("num_speculative_tokens"),
            "method": (config or {}).get("method"),
            "speculative_config": config,
            "speculative_config_source": source,
        }
        return self._info

    def spec_counters(self) -> dict | None:
        """vLLM's speculative counters from /metrics (``parse_prometheus``); only ``per_pos`` (empty)
        when the server has none (it does not speculate), None when /metrics is unavailable."""
        return self.client.spec_counters()

    def token_texts(self, ids) -> dict[int, str]:
        """Texts of single tokens (what the engine's token_text gives), cached per backend."""
        missing = sorted({int(i) for i in ids} - self._texts.keys())
        if missing and self._tokenizer is not None:
            for i in missing:
                self._texts[i] = self._tokenizer.decode([i])
        elif missing:
            model = self.info()["model"]

            def one(i: int) -> tuple[int, str]:
                return i, self.client.detokenize(model, [i], timeout=30.0)

            with ThreadPoolExecutor(max_workers=min(8, len(missing))) as pool:
                self._texts.update(pool.map(one, missing))
        return {int(i): self._texts[int(i)] for i in ids}

    def detokenize(self, ids: list[int]) -> str:
        return self.client.detokenize(self.info()["model"], ids)

    # ------------------------------------------------------------- requests
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
        model = self.info()["model"]
        path, body = request_body(model, prompt, max_new_tokens, temperature, top_p, top_k, seed, chat, False, 0)
        if ignore_eos:
            body["ignore_eos"] = True
        t0 = time.perf_counter()
        data = self.client.json("POST", path, body)
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
        _check_settings(max_new, temp, topp, topk, pay)
        info = self.info()
        # full: p and its top alternatives; reduced: p of each emitted token; off: no logprobs.
        top_n = {"full": TOP_N, "reduced": 0, "off": None}[pay]  # alternatives per position, as ours
        path, body = request_body(info["model"], prompt, max_new, temp, topp, topk, seed_v, use_chat, True, top_n)
        return self._run(prompt, path, body, info, max_new, temp, topp, topk, seed_v, use_chat, pay)

    def _run(self, prompt, path, body, info, max_new, temp, topp, topk, seed, chat, payload):
        """The events of one streamed request: start with the first chunk that names the prompt, then, once
        the stream has ended, the steps and the finish (or, when the server stopped mid-run, a finish alone)."""
        spec = info["speculative"]
        k = int(info["k"] or 0) if spec else 0
        run = self._run_record(info, k, max_new, temp, topp, topk, seed, chat, payload)
        text = prompt if isinstance(prompt, str) else None
        got = Received()
        started = time.perf_counter()
        start_sent = False
        try:
            for arrived, chunk in self.client.stream(path, body):
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
            yield stopped_finish(got, k, time.perf_counter() - started, started, str(exc))
            return
        wall_s = time.perf_counter() - started
        if got.prompt_ids is None:
            raise VllmError("vLLM's stream carried no prompt token ids (is return_token_ids supported? vLLM >= 0.10)")
        if not start_sent:
            yield self._start(run, text, got.prompt_ids)
        yield from self._steps_and_finish(got, info, spec, k, payload, started, wall_s)

    def _steps_and_finish(self, got: Received, info, spec, k, payload, started, wall_s):
        """A complete stream's steps (left out for payload "off") and its finish event."""
        got.check(payload)
        tokens, logprobs = got.token_ids, got.logprobs
        accepted, drafted = spec_counts(spec, got.spec_metrics, self.url)
        plan, choices = align_steps([n for _, n in got.chunks], accepted, len(tokens))
        texts = self.token_texts(set(tokens) | {i for _, top in logprobs for i, _ in top}) if payload == "full" else {}
        steps = build_steps(
            plan, accepted, drafted, tokens, logprobs, got.chunks, started, texts, payload, info.get("method")
        )
        if payload != "off":
            yield from steps
        yield finish(got, plan, choices, steps, k, wall_s, started)

    def _start(self, run: dict, text, prompt_ids: list[int]) -> dict:
        """The start event. Its prompt tail's texts come from the server (/detokenize) while the stream is open:
        when the server stops answering then, the run has begun all the same, so the start event says the texts
        are absent (``prompt_tail`` None) and the stream's next read tells whether the server stopped mid-run."""
        try:
            return start_event(run, text, prompt_ids, self._text_of)
        except VllmError as exc:
            event = start_event(run, text, prompt_ids, str)
            event["prompt_tail"] = None
            event["absent"] = [*run["absent"], f"the prompt tail's texts ({exc})"]
            return event

    def _text_of(self, token_id: int) -> str:
        return self.token_texts([token_id])[token_id]

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


def _check_settings(max_new: int, temp: float, topp: float, topk: int, payload: str) -> None:
    """ValueError for settings vLLM would refuse or that SpecLens does not know."""
    if payload not in PAYLOADS:
        raise ValueError(f"payload must be 'full', 'reduced' or 'off', got {payload!r}")
    if not 1 <= max_new <= 4096:
        raise ValueError(f"max_new_tokens must be between 1 and 4096, got {max_new}")
    if temp < 0 or not 0 < topp <= 1 or topk < 0:
        raise ValueError(f"need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got {temp}, {topp}, {topk}")
