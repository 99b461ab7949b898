"""The wire to a vLLM server: HTTP requests to its OpenAI-compatible API and what its other endpoints report.

``VllmClient(url)`` holds one server's address and timeouts and speaks plain HTTP (``http.client``, no third-party
client, so that a client of a server loads nothing heavy): JSON requests, the server-sent-events stream of a
completion, ``/v1/models`` (the served model), ``/version``, ``/server_info`` (vLLM's config, in its dev mode
only), ``/metrics`` (the speculative counters, read by ``parse_prometheus``) and ``/detokenize``.
``request_body`` shapes a completion request: chat or plain completion, sampling, token ids back, and for a
stream the usage chunk that carries vLLM's per-request speculative metrics and the logprobs asked for.

Every failure is a ``VllmError`` whose message names the server and what went wrong; ``VllmStopped`` is the one
a stream raises when the server stops answering after the stream began, so that a caller can keep what arrived.

The client knows nothing of steps or events: ``engine.vllm.steps`` turns what a stream carried into steps, and
``engine.vllm.backend`` puts the two together.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from urllib.parse import urlparse

from engine import config

__all__ = [
    "CONNECT_TIMEOUT_S",
    "ENV_URL",
    "READ_TIMEOUT_S",
    "VllmClient",
    "VllmError",
    "VllmStopped",
    "parse_prometheus",
    "request_body",
]

ENV_URL = "SPECLENS_VLLM_URL"
CONNECT_TIMEOUT_S = 3.0  # fail fast when nothing listens
READ_TIMEOUT_S = 600.0  # a long generation on a busy CPU server
INFO_TIMEOUT_S = 10.0  # the small GET endpoints (/v1/models, /version, /server_info, /metrics)


class VllmError(RuntimeError):
    """The server is unreachable or answered something unusable; the message says which."""


class VllmStopped(VllmError):
    """The server stopped answering in the middle of a streamed run (it died, or the connection dropped): the
    stream ended without its end marker, or reading it failed after it had begun."""


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


def request_body(
    model: str, prompt, max_new_tokens, temperature, top_p, top_k, seed, chat, stream, top_n
) -> tuple[str, dict]:
    """(endpoint path, JSON body) of one completion request.

    prompt: chat messages, text (chat-templated by vLLM when chat) or token ids (plain completion).
    stream: ask for server-sent events, with a last chunk carrying usage and vLLM's metrics.
    top_n: alternatives per position in the stream's logprobs (0: the emitted token's alone; None: none)."""
    body: dict = {
        "model": model,
        "max_tokens": int(max_new_tokens),
        "temperature": float(temperature),
        "top_p": float(top_p),
        "return_token_ids": True,  # vLLM extension: prompt and completion token ids
    }
    if top_k:
        body["top_k"] = int(top_k)
    if seed is not None:
        body["seed"] = int(seed)
    path = _prompt_into(body, prompt, chat)
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


def _prompt_into(body: dict, prompt, chat: bool) -> str:
    """Put the prompt into the body as messages or as a plain prompt; the endpoint that takes it."""
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
    return path


class VllmClient:
    """One vLLM server over HTTP.

    url: base URL (``http://host:port``, with or without ``/v1``); None reads SPECLENS_VLLM_URL.
    ``url`` is the normalised base (scheme, host, port and any path prefix) that messages name.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
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

    # ------------------------------------------------------------------ HTTP
    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        """A connected connection (VllmError when nothing listens); reads time out after `timeout`."""
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.connect_timeout_s)
        try:
            conn.connect()
        except OSError as exc:
            raise VllmError(f"cannot reach vLLM at {self.url}: {exc.strerror or exc}") from None
        conn.sock.settimeout(timeout)
        return conn

    def request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None):
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

    def json(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        """The JSON object a request answers with; VllmError for any other status or answer."""
        status, data = self.request(method, path, body, timeout)
        if status != 200 or not isinstance(data, dict):
            raise VllmError(f"vLLM at {self.url}{path} answered {status}: {_error_text(data)}")
        return data

    def stream(self, path: str, body: dict):
        """Yield (arrival perf_counter, chunk dict) for every data line of an SSE response; VllmStopped when
        the server stops answering after the response began."""
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
            yield from self._events(resp)
        except (OSError, http.client.HTTPException) as exc:
            raise VllmError(f"vLLM stream from {self.url}{path} failed: {exc}") from None
        finally:
            conn.close()

    def _events(self, resp: http.client.HTTPResponse):
        """The stream's data lines as (arrival, chunk), up to its end marker ([DONE])."""
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
                return
            try:
                chunk = json.loads(payload)
            except ValueError:
                raise VllmError(f"vLLM sent a stream line that is not JSON: {payload[:200]!r}") from None
            if "error" in chunk and "choices" not in chunk:
                raise VllmError(f"vLLM reported an error mid-stream: {_error_text(chunk)}")
            chunks += 1
            yield time.perf_counter(), chunk

    # ------------------------------------------------------------ endpoints
    def model_entry(self, wanted: str | None = None) -> dict:
        """The /v1/models entry of `wanted` (None: the first served); VllmError when it is not served."""
        models = self.json("GET", "/v1/models", timeout=INFO_TIMEOUT_S).get("data") or []
        if not models:
            raise VllmError(f"vLLM at {self.url} serves no model (/v1/models is empty)")
        entry = next((m for m in models if m.get("id") == wanted), models[0])
        if wanted and entry.get("id") != wanted:
            raise VllmError(f"vLLM at {self.url} does not serve {wanted!r} (it serves {entry.get('id')!r})")
        return entry

    def version(self) -> str | None:
        """vLLM's version, None when /version does not say."""
        status, version = self.request("GET", "/version", timeout=INFO_TIMEOUT_S)
        return version.get("version") if status == 200 and isinstance(version, dict) else None

    def vllm_config(self) -> dict | None:
        """vLLM's whole config from /server_info, which answers in its dev mode only (VLLM_SERVER_DEV_MODE=1);
        None elsewhere."""
        status, server_info = self.request("GET", "/server_info?config_format=json", timeout=INFO_TIMEOUT_S)
        vllm_config = server_info.get("vllm_config") if status == 200 and isinstance(server_info, dict) else None
        return vllm_config if isinstance(vllm_config, dict) else None

    def spec_counters(self) -> dict | None:
        """vLLM's speculative counters from /metrics (parse_prometheus); only ``per_pos`` (empty)
        when the server has none (it does not speculate), None when /metrics is unavailable."""
        status, text = self.request("GET", "/metrics", timeout=INFO_TIMEOUT_S)
        if status != 200 or not isinstance(text, str):
            return None
        return parse_prometheus(text)

    def detokenize(self, model: str, ids: list[int], timeout: float | None = None) -> str:
        """The text of token ids, as the server's tokenizer decodes them."""
        return self.json("POST", "/detokenize", {"model": model, "tokens": list(ids)}, timeout=timeout)["prompt"]


def _error_text(data) -> str:
    """The message of an error answer (OpenAI's {"error": {"message": ...}} or whatever came), cut short."""
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            return str(err.get("message") or err)[:500]
        return str(err)[:500]
    return str(data)[:500]
