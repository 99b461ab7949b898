"""'Turn it on in your engine' (engine/tools/launch.py, `python -m engine launch-command`): the commands, the
notes where an engine has no equivalent, and the vLLM command parsed by vLLM's own argument parser."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from engine.paths import VLLM_VENV
from engine.tools.launch import ENGINES, launch_command

ROOT = Path(__file__).resolve().parent.parent


def _vllm_spec(command: str) -> dict:
    argv = shlex.split(command)
    assert argv[:3] == ["vllm", "serve", "HuggingFaceTB/SmolLM2-135M-Instruct"]
    return json.loads(argv[argv.index("--speculative-config") + 1])


def test_vllm_gets_its_speculative_config():
    ngram = launch_command("vllm", "ngram", k=8)
    assert _vllm_spec(ngram["command"]) == {
        "method": "ngram",
        "num_speculative_tokens": 8,
        "prompt_lookup_max": 6,
        "prompt_lookup_min": 2,
    }
    draft = launch_command("vllm", "model:SmolLM2-135M-Instruct", k=3)
    assert _vllm_spec(draft["command"])["method"] == "draft_model"
    assert _vllm_spec(launch_command("vllm", "suffix", k=4)["command"])["method"] == "suffix"
    assert launch_command("vllm", "none")["command"] == "vllm serve HuggingFaceTB/SmolLM2-135M-Instruct"
    tree = launch_command("vllm", "ngram", k=4, topk=3)
    assert any("tree" in note for note in tree["notes"])


def test_sglang_counts_the_root_in_its_draft_tokens():
    """SGLang's --speculative-num-draft-tokens includes the verified root: K + 1 for a chain of K."""
    chain = shlex.split(launch_command("sglang", "eagle", k=4)["command"])
    assert chain[chain.index("--speculative-algorithm") + 1] == "EAGLE3"
    assert chain[chain.index("--speculative-num-draft-tokens") + 1] == "5"
    tree = shlex.split(
        launch_command("sglang", "model:SmolLM2-135M-Instruct", k=3, topk=2, num_draft_tokens=5)["command"]
    )
    assert tree[tree.index("--speculative-eagle-topk") + 1] == "2"
    assert tree[tree.index("--speculative-num-draft-tokens") + 1] == "6"


def test_llamacpp_and_transformers_take_their_own_flags():
    llama = shlex.split(launch_command("llama.cpp", "model:SmolLM2-135M-Instruct", k=6)["command"])
    assert llama[0] == "llama-server" and llama[llama.index("--draft-max") + 1] == "6" and "-md" in llama
    assert llama[2].endswith(".gguf")
    code = launch_command("transformers", "ngram", k=5, temperature=0.7)["command"]
    assert "prompt_lookup_num_tokens=5" in code and "do_sample=True, temperature=0.7" in code
    compile(code, "<launch>", "exec")  # valid Python
    adaptive = launch_command("transformers", "model:SmolLM2-135M-Instruct", adaptive=True)["command"]
    assert 'num_assistant_tokens_schedule="heuristic"' in adaptive


@pytest.mark.parametrize("engine", ENGINES)
def test_where_there_is_no_equivalent_it_says_so(engine):
    result = launch_command(engine, "q4+ngram")
    assert result["command"] is None and not result["equivalent"]
    assert "no equivalent for q4+ngram" in result["notes"][0]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("drafter,bits", [("q4", 4), ("int8", 8)])
def test_quantised_self_drafting_is_a_quantised_copy_of_the_target_as_draft_model(engine, drafter, bits):
    """int8 and q4 draft with the target's own weights in fewer bits: elsewhere, a draft model that is the target
    quantised, a checkpoint (or file) of its own; the notes say so and what differs."""
    result = launch_command(engine, drafter, k=6)
    assert result["equivalent"] and any(f"quantised to {bits} bits" in note for note in result["notes"])
    command = result["command"]
    if engine == "vllm":
        assert _vllm_spec(command) == {
            "method": "draft_model",
            "model": f"PATH/TO/{bits}-BIT-COPY-OF-THIS-TARGET",
            "num_speculative_tokens": 6,
        }
    elif engine == "sglang":
        argv = shlex.split(command)
        assert argv[argv.index("--speculative-algorithm") + 1] == "STANDALONE"
        assert argv[argv.index("--speculative-draft-model-path") + 1] == f"PATH/TO/{bits}-BIT-COPY-OF-THIS-TARGET"
    elif engine == "llama.cpp":
        argv = shlex.split(command)
        assert argv[:3] == ["llama-server", "-m", "SmolLM2-135M-Instruct.bf16.gguf"]
        draft = argv[argv.index("-md") + 1]
        # q4 of the default model: the very file SpecLens's q4 drafter reads its 4-bit blocks from
        assert draft.endswith("SmolLM2-135M-Instruct.Q4_1.gguf" if drafter == "q4" else ".Q8_0.gguf")
        assert argv[argv.index("--draft-max") + 1] == "6"
    else:
        assert f"BitsAndBytesConfig(load_in_{bits}bit=True)" in command and "assistant_model=assistant" in command
        compile(command, "<launch>", "exec")  # valid Python


def test_the_block_rule_is_vllms_rejection_sample_method_and_a_note_elsewhere():
    """--verify block: vLLM's speculative config says rejection_sample_method "block" (with n-gram, which has
    no q, vLLM keeps drafts per token: said); engines without block verification say they verify per token."""
    vllm = launch_command("vllm", "model:SmolLM2-135M-Instruct", k=4, verify="block")
    spec = json.loads(shlex.split(vllm["command"])[-1])
    assert spec["rejection_sample_method"] == "block" and not vllm["notes"]
    assert "rejection_sample_method" not in launch_command("vllm", "ngram", k=4)["command"]
    assert any("per token" in note for note in launch_command("vllm", "ngram", k=4, verify="block")["notes"])
    sglang = launch_command("sglang", "eagle", k=4, verify="block")
    assert sglang["command"] and any("no block verification" in note for note in sglang["notes"])
    with pytest.raises(ValueError, match="verify must be one of token, block"):
        launch_command("vllm", "ngram", verify="blocks")


def test_bad_input_gets_a_clear_message():
    with pytest.raises(ValueError, match="engine must be one of"):
        launch_command("tgi", "ngram")
    with pytest.raises(ValueError, match="k must be a positive integer"):
        launch_command("vllm", "ngram", k=0)


def test_the_cli_prints_the_command_and_exits_3_without_an_equivalent():
    run = [sys.executable, "-m", "engine", "launch-command", "--engine", "vllm", "--drafter", "ngram", "--k", "5"]
    out = subprocess.run(run, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.startswith("vllm serve ")
    assert _vllm_spec(out.stdout.strip())["num_speculative_tokens"] == 5
    none = subprocess.run(
        run[:5] + ["sglang", "--drafter", "q4+ngram"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert none.returncode == 3 and "no equivalent" in none.stdout


# Parses a `vllm serve` argv with vLLM's own parser (no model, no server) and builds the speculative config
# as `vllm serve` would for the methods that need no model; prints the config as JSON.
_VLLM_PARSE = """
import json, sys, typing
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.config.speculative import SpeculativeConfig, SpeculativeMethod

def methods(tp):
    out = []
    for a in typing.get_args(tp):
        out += methods(a) if typing.get_origin(a) is typing.Literal else [a]
    return out

args = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(json.loads(sys.argv[1]))
validate_parsed_serve_args(args)
args.model = args.model_tag  # as `vllm serve MODEL` does before it builds the engine arguments
spec = dict(AsyncEngineArgs.from_cli_args(args).speculative_config or {})
assert spec["method"] in methods(SpeculativeMethod), spec
assert not set(spec) - set(SpeculativeConfig.__dataclass_fields__), spec
if spec["method"] == "ngram":
    config = SpeculativeConfig(**spec)
    spec["built"] = [config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max]
print(json.dumps(spec))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "drafter,verify",
    [
        ("ngram", "token"),
        ("ngram", "block"),
        ("model:SmolLM2-135M-Instruct", "token"),
        ("q4", "token"),
        ("suffix", "token"),
        ("eagle", "token"),
    ],
)
def test_vllms_own_parser_takes_the_command(drafter, verify):
    """The printed vLLM command, parsed by vLLM 0.32's serve parser in .venv-vllm: the method is one vLLM
    accepts, every key a SpeculativeConfig field, and the n-gram config is built as vLLM builds it."""
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"{python} not found (scripts/setup.sh --dev builds it)")
    command = launch_command("vllm", drafter, k=6, verify=verify)["command"]
    argv = shlex.split(command)[2:]  # what `vllm serve` hands its parser
    argv[0] = str(ROOT)  # a local folder for the model: a Hub id would send the parser to the (unreachable) Hub
    out = subprocess.run(
        [str(python), "-c", _VLLM_PARSE, json.dumps(argv)], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    spec = json.loads(out.stdout.strip().splitlines()[-1])
    assert spec["num_speculative_tokens"] == 6
    if drafter == "ngram":
        assert spec["built"] == [6, 2, 6]
    assert spec.get("rejection_sample_method", "standard") == ("block" if verify == "block" else "standard")
