"""The API as MCP tools, through the real `mcp` Python client over Streamable HTTP.

`python app.py` starts as a Space runs it (its MCP server on by default), on the real default model; the
client lists the tools with their schemas, calls `generate` (the answer checked against the same call through
gradio_client: one queue, one function), `launch_command` and `analyze_metrics`, and sends bad arguments that
come back as clear errors. With SPECLENS_MCP_SERVER=0 no MCP endpoint is served and the page still is.
"""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import serve_app_py, stop_process_group

ROOT = Path(__file__).resolve().parent.parent
TOOLS = {"generate", "race", "launch_command", "analyze_metrics"}

pytestmark = [pytest.mark.slow, pytest.mark.real_model]


def _start(env_extra: dict) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **env_extra}
    proc, url, _, _ = serve_app_py(sys.executable, env, timeout_s=240)
    return proc, url


@pytest.fixture(scope="module")
def app_server():
    proc, url = _start({})
    try:
        yield url
    finally:
        stop_process_group(proc)


def _mcp(url: str, calls: list[tuple[str, dict]]) -> tuple[list, list]:
    """(tools, [CallToolResult per call]) from one MCP session with the app's server."""
    import anyio
    from mcp import ClientSession
    from mcp.client.streamable_http import streamablehttp_client

    async def session():
        async with streamablehttp_client(url + "gradio_api/mcp/") as (read, write, _):
            async with ClientSession(read, write) as client:
                await client.initialize()
                tools = (await client.list_tools()).tools
                results = [await client.call_tool(name, arguments) for name, arguments in calls]
                return tools, results

    return anyio.run(session)


def _answer(result) -> dict:
    """A tool's answer: Gradio's MCP server sends the function's dict as its text (a Python literal)."""
    assert not result.isError, result.content
    assert [c.type for c in result.content] == ["text"]
    return ast.literal_eval(result.content[0].text)


def _error(result) -> str:
    assert result.isError, result.content
    return " ".join(c.text for c in result.content)


def test_an_mcp_client_lists_the_tools_and_calls_them(app_server):
    from gradio_client import Client

    from app.config import MAX_NEW_TOKENS
    from app.tabs import api

    prompt = "Name three colours, one per line."
    tools, (generated, launch, analysed, too_long, bad_drafter, bad_source, bad_pairs) = _mcp(
        app_server,
        [
            ("generate", {"prompt": prompt, "drafter": "int8", "k": 3, "max_new_tokens": 24}),
            ("launch_command", {"engine": "vllm", "drafter": "ngram", "k": 8}),
            ("analyze_metrics", {"source": "code-edit"}),
            ("generate", {"prompt": prompt, "max_new_tokens": MAX_NEW_TOKENS + 1}),
            ("generate", {"prompt": prompt, "drafter": "nonsense"}),
            ("analyze_metrics", {"source": "not a window"}),
            ("race", {"prompt": prompt, "pairs": 1}),
        ],
    )

    # Listed with the schemas an agent needs: every parameter typed and described in full (one docstring line each).
    by_name = {tool.name: tool for tool in tools}
    assert set(by_name) == TOOLS
    for name in TOOLS:
        fn = getattr(api, name)
        schema = by_name[name].inputSchema
        assert set(schema["properties"]) == set(inspect.signature(fn).parameters)
        assert by_name[name].description.startswith(inspect.getdoc(fn).split("\n")[0])
        for param, spec in schema["properties"].items():
            assert spec.get("type") in {"string", "integer", "number", "boolean"}, (name, param, spec)
            line = next(li.strip() for li in inspect.getdoc(fn).splitlines() if li.strip().startswith(f"{param}: "))
            assert spec["description"] == line.split(": ", 1)[1], (name, param)
    assert by_name["generate"].inputSchema["required"] == ["prompt"]

    # generate: the run's text and tokens per pass, within the web UI's limits, the same as gradio_client's answer.
    answer = _answer(generated)
    metrics = answer["metrics"]
    assert answer["partial"] is False and answer["drafter"] == "int8" and answer["text"].strip()
    assert 1 <= metrics["new_tokens"] <= 24
    assert metrics["tokens_per_pass"] == pytest.approx(metrics["new_tokens"] / metrics["target_passes"])
    assert 1.0 <= metrics["tokens_per_pass"] <= 3 + 1
    same = Client(app_server, verbose=False).predict(prompt, "int8", 3, 0.0, 1.0, 0, 0, 24, api_name="/generate")
    assert (same["text"], same["metrics"]["tokens_per_pass"]) == (answer["text"], metrics["tokens_per_pass"])

    command = _answer(launch)
    assert command["equivalent"] is True and command["command"].startswith("vllm serve ")
    assert '"num_speculative_tokens": 8' in command["command"]

    window = _answer(analysed)
    assert 0 < window["acceptance_rate"] <= 1 and window["mean_acceptance_length"] >= 1
    assert window["recommendation"] and window["ticket"] and "recorded" in window["source"]
    assert window["recorded_on"]  # a recorded figure says where it was measured

    # Bad input: a clear error naming the field, the run never started.
    assert f"max_new_tokens must be between 1 and {MAX_NEW_TOKENS}" in _error(too_long)
    assert "nonsense" in _error(bad_drafter)
    assert "none of ['chat', 'code-edit']" in _error(bad_source)
    assert "pairs must be between" in _error(bad_pairs)


def test_the_mcp_server_can_be_turned_off():
    proc, url = _start({"SPECLENS_MCP_SERVER": "0", "SPECLENS_PRELOAD": "0"})
    try:
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(url + "gradio_api/mcp/schema", timeout=10)
        assert missing.value.code == 404
        with urllib.request.urlopen(url, timeout=10) as page:
            assert page.status == 200
    finally:
        stop_process_group(proc)
