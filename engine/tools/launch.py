"""Turn it on in your engine: the launch command that gives a production engine the drafting SpecLens ran.

``launch_command(engine, drafter, k, topk, num_draft_tokens, ...)`` maps one SpecLens drafting setup onto the
flags of vLLM (``vllm serve --speculative-config``), SGLang (``python -m sglang.launch_server
--speculative-*``), llama.cpp (``llama-server`` draft flags) or transformers (``generate`` keyword arguments),
and says where an engine has no equivalent instead of printing something that would not do the same thing.

The flags were read from the engines' own sources (vLLM 0.32's ``config/speculative.py`` and
``engine/arg_utils.py``; SGLang's ``server_args.py``; llama.cpp's ``common/arg.cpp``; transformers'
``GenerationConfig``), and the vLLM command is parsed by vLLM's own argument parser in the tests
(tests/test_launch.py). Our n-gram lookup matches suffixes of 2 to 6 tokens; vLLM's ``prompt_lookup_min`` /
``prompt_lookup_max`` and transformers' ``max_matching_ngram_size`` say the same.
"""

from __future__ import annotations

import json
import shlex

from engine.drafters.spec import DrafterSpec, Serving, family, parse
from engine.model.loading import DEFAULT_GGUF_FILE, PRESETS, default_gguf_path
from engine.paths import DEFAULT_MODEL

__all__ = ["ENGINES", "launch_command"]

ENGINES = ("vllm", "sglang", "llama.cpp", "transformers")
NGRAM_MIN, NGRAM_MAX = 2, 6  # engine.drafters.ngram.NgramDrafter's defaults
EAGLE_HEAD = "PATH/TO/EAGLE3-HEAD-FOR-THIS-TARGET"
NO_TREE = "this method drafts a chain here: tree top-k and budget have no flag (the command drafts K in a row)"
VERIFY_RULES = ("token", "block")  # GenerationSettings.verify


def _copy_path(serving: Serving) -> str:
    """The placeholder where a command needs the quantised copy of the target as a checkpoint of its own."""
    return f"PATH/TO/{serving.bits}-BIT-COPY-OF-THIS-TARGET"


def _note(serving: Serving, engine: str) -> str:
    return serving.note.format(engine=engine)


def _hub_id(target: str) -> str:
    """The Hub id a production engine loads for a SpecLens target name (ours are presets of Hub models)."""
    return PRESETS.get(target, {}).get("hub_id", target)


def _join(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def _vllm(model: str, spec: DrafterSpec, k: int, topk: int, notes: list[str], verify: str = "token") -> str | None:
    argv = ["vllm", "serve", model]
    serving = family(spec.family).serving
    method = serving.method if serving else None
    if method == "none":
        return _join(argv)
    if method == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": NGRAM_MAX}
        config["prompt_lookup_min"] = NGRAM_MIN
    elif method == "suffix":
        config = {"method": "suffix", "num_speculative_tokens": k}
        notes.append(serving.note)
    elif method == "draft_model":
        config = {"method": "draft_model", "model": _hub_id(spec.model_id), "num_speculative_tokens": k}
    elif method == "quantised_copy":
        config = {"method": "draft_model", "model": _copy_path(serving), "num_speculative_tokens": k}
        notes.append(
            f"put a W{serving.bits}A16 checkpoint of the target where the command says (llm-compressor"
            f"{', AWQ' * (serving.bits == 4)} or GPTQ: vLLM reads the method from its config); "
            + _note(serving, "vLLM")
        )
    elif method == "eagle":
        config = {"method": "eagle3", "model": EAGLE_HEAD, "num_speculative_tokens": k}
        notes.append(_note(serving, "vLLM"))
    else:
        return None
    if topk > 1:
        notes.append(f"vLLM: {NO_TREE}")
    if verify == "block":
        config["rejection_sample_method"] = "block"
        if family(spec.family).kind == "copying":
            notes.append(
                f"vLLM's block verification needs the drafter's q: with {spec.text} (no q) it keeps drafts per token"
            )
    return _join(argv + ["--speculative-config", json.dumps(config)])


def _sglang(model: str, spec: DrafterSpec, k: int, topk: int, budget: int, notes: list[str]) -> str | None:
    argv = ["python", "-m", "sglang.launch_server", "--model-path", model]
    serving = family(spec.family).serving
    method = serving.method if serving else None
    if method == "none":
        return _join(argv)
    # SGLang counts the verified root in --speculative-num-draft-tokens: a chain of K drafts is K + 1 there.
    tree = ["--speculative-num-steps", str(k), "--speculative-eagle-topk", str(topk)]
    tree += ["--speculative-num-draft-tokens", str(budget + 1)]
    if method == "ngram":
        notes.append(
            "SGLang's NGRAM method runs on CUDA only and sizes its drafts with its own --speculative-ngram-* "
            "flags (their names changed between releases: see python -m sglang.launch_server --help)"
        )
        return _join(argv + ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(budget + 1)])
    if method in ("draft_model", "quantised_copy"):
        if method == "quantised_copy":
            notes.append(
                f"put a {serving.bits}-bit checkpoint of the target where the command says; " + _note(serving, "SGLang")
            )
        path = _hub_id(spec.model_id) if method == "draft_model" else _copy_path(serving)
        return _join(argv + ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", path] + tree)
    if method == "eagle":
        notes.append("SGLang needs an EAGLE-3 checkpoint trained for this target; SpecLens's head is its own format")
        return _join(argv + ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", EAGLE_HEAD] + tree)
    return None


def _llamacpp(target: str, spec: DrafterSpec, k: int, topk: int, notes: list[str]) -> str | None:
    gguf = f"{target}.gguf"
    if target == DEFAULT_MODEL:
        try:
            gguf = str(default_gguf_path())
        except (FileNotFoundError, ImportError, OSError):
            gguf = DEFAULT_GGUF_FILE
    argv = ["llama-server", "-m", gguf]
    serving = family(spec.family).serving
    method = serving.method if serving else None
    if method == "none":
        return _join(argv)
    if topk > 1:
        notes.append(f"llama.cpp: {NO_TREE}")
    renamed = "builds that renamed the draft flags take --spec-draft-n-max / --spec-draft-n-min instead"
    if method == "draft_model":
        notes.append(f"the draft model as a GGUF file of the same vocabulary; {renamed}")
        draft = f"{_hub_id(spec.model_id).split('/')[-1]}.gguf"
        return _join(argv + ["-md", draft, "--draft-max", str(k), "--draft-min", "0"])
    if method == "quantised_copy":
        name = _hub_id(target).split("/")[-1]
        draft = f"{name}.{serving.gguf_type}.gguf"
        if target == DEFAULT_MODEL and serving.own_gguf:  # the file SpecLens's drafter reads its blocks from
            draft = gguf
        argv[2] = f"{name}.bf16.gguf"
        notes.append(
            "the target as a bf16 GGUF (convert_hf_to_gguf.py --outtype bf16), the draft the same model in"
            f" {serving.gguf_type} (llama-quantize); {_note(serving, 'llama.cpp')}; {renamed}"
        )
        if target == DEFAULT_MODEL:
            notes.append(
                f"SpecLens's default target is {DEFAULT_GGUF_FILE}'s blocks widened to bf16; a bf16 GGUF converted"
                " from the Hub's model holds the original weights"
            )
        return _join(argv + ["-md", draft, "--draft-max", str(k), "--draft-min", "0"])
    if method == "ngram":
        notes.append(f"needs a llama-server with --spec-type (n-gram speculation, 2026); {renamed}")
        return _join(argv + ["--spec-type", "ngram-simple", "--draft-max", str(k)])
    return None


def _transformers(model: str, spec: DrafterSpec, k: int, temperature: float, adaptive: bool, notes: list[str]):
    sampling = f"do_sample=True, temperature={temperature}" if temperature > 0 else "do_sample=False"
    lines = [
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f"tokenizer = AutoTokenizer.from_pretrained({model!r})",
        f"model = AutoModelForCausalLM.from_pretrained({model!r})",
        'inputs = tokenizer.apply_chat_template([{"role": "user", "content": "..."}], add_generation_prompt=True, '
        'return_tensors="pt", return_dict=True)',
    ]
    serving = family(spec.family).serving
    method = serving.method if serving else None
    if method == "none":
        call = f"model.generate(**inputs, {sampling})"
    elif method == "ngram":
        call = (
            f"model.generate(**inputs, prompt_lookup_num_tokens={k}, max_matching_ngram_size={NGRAM_MAX}, {sampling})"
        )
    elif method in ("draft_model", "quantised_copy"):
        if method == "quantised_copy":
            lines[0] += ", BitsAndBytesConfig"
            lines.append(
                f"assistant = AutoModelForCausalLM.from_pretrained({model!r}, "
                f"quantization_config=BitsAndBytesConfig(load_in_{serving.bits}bit=True))"
            )
            notes.append(
                "bitsandbytes quantises the copy as it loads (pip install bitsandbytes; its kernels need a build "
                "for your device); " + _note(serving, "transformers")
            )
        else:
            lines.append(f"assistant = AutoModelForCausalLM.from_pretrained({_hub_id(spec.model_id)!r})")
        schedule = "heuristic" if adaptive else "constant"  # heuristic: K + 2 after a full accept, K - 1 otherwise
        call = (
            f"model.generate(**inputs, assistant_model=assistant, num_assistant_tokens={k}, "
            f'num_assistant_tokens_schedule="{schedule}", {sampling})'
        )
    else:
        return None
    notes.append("transformers drafts a chain for one sequence at a time (batch size 1)")
    return "\n".join(lines + [call])


def launch_command(
    engine: str,
    drafter: str = "ngram",
    k: int = 4,
    topk: int = 1,
    num_draft_tokens: int | None = None,
    target: str = DEFAULT_MODEL,
    temperature: float = 0.0,
    adaptive: bool = False,
    verify: str = "token",
) -> dict:
    """{"engine", "drafter", "command" (None where the engine has no equivalent), "equivalent", "notes"}.

    drafter: SpecLens's spec (none, ngram, suffix, int8, q4, eagle, model:<id>: int8 and q4 as a draft model that is
    the target quantised, a checkpoint of its own); k, topk, num_draft_tokens: the
    draft shape as generate takes it (num_draft_tokens None = K x topk); verify: the acceptance rule of sampled
    chains, "token" or "block" (vLLM's rejection_sample_method "block"; the other engines verify per token, said
    in the notes). Raises ValueError for an unknown engine, rule or a bad shape."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if verify not in VERIFY_RULES:
        raise ValueError(f"verify must be one of {', '.join(VERIFY_RULES)}, got {verify!r}")
    spec = parse(drafter or "none")
    for name, value in (("k", k), ("topk", topk)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    budget = num_draft_tokens or k * topk
    model = _hub_id(target)
    notes: list[str] = []
    if engine == "vllm":
        command = _vllm(model, spec, k, topk, notes, verify)
    elif engine == "sglang":
        command = _sglang(model, spec, k, topk, budget, notes)
    elif engine == "llama.cpp":
        command = _llamacpp(target, spec, k, topk, notes)
    else:
        command = _transformers(model, spec, k, temperature, adaptive, notes)
    if command is None:
        notes.insert(0, _no_equivalent(engine, spec))
    else:
        if adaptive and engine != "transformers":
            notes.append("adaptive depth has no flag here: the engine drafts K every step")
        if verify == "block" and engine != "vllm" and spec.drafts:
            notes.append(
                f"{engine} has no block verification: it keeps drafts per token (the same output distribution; "
                "block keeps at least as many tokens per pass in expectation)"
            )
    return {
        "engine": engine,
        "drafter": _short(spec),
        "command": command,
        "equivalent": command is not None,
        "notes": notes,
    }


def _short(spec: DrafterSpec) -> str:
    """The spec as the engines see it: a copying drafter without our lookup's sizes (they take their own)."""
    return spec.family if family(spec.family).kind == "copying" else spec.text


def _no_equivalent(engine: str, spec: DrafterSpec) -> str:
    own = family(spec.family)
    why = own.unserved or f"SpecLens's drafter {_short(spec)!r} has no counterpart here"
    return f"{engine}: no equivalent for {_short(spec)}: {why}"
