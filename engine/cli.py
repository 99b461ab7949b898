"""Command line: ``python -m engine {generate,parity,bench,train-head,launch-command,analyze,prepare,selfcheck}``.

Bad arguments exit with status 2 and a one-line message; model problems, a real mismatch in parity and a
failed selfcheck exit 1.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine import paths
from engine.settings import MAX_HISTORY_DOCS

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"error: {message}\n")


def _dtypes() -> tuple[str, ...]:
    from engine.model.loading import DTYPES

    return DTYPES


def _drafter(text: str) -> str:
    """argparse type of --drafter: the spec as engine.drafters.spec parses it (an unknown one is refused, with the
    forms there are)."""
    from engine.drafters.spec import parse

    try:
        return parse(text).text
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_drafter(p: argparse.ArgumentParser, what: str = "who drafts") -> None:
    """--drafter, its help listing every registered family's form."""
    from engine.drafters.spec import forms

    p.add_argument("--drafter", default="ngram", type=_drafter, help=f"{what}: {forms()} (default ngram)")


def _add_generation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="offline default, a preset, a Hub id or a local folder")
    _add_drafter(p)
    p.add_argument("--k", type=int, default=4, help="draft tokens per step (tree depth)")
    p.add_argument("--steps", type=int, default=None, help="tree depth (same as --k)")
    p.add_argument("--topk", type=int, default=1, help="tree branching per node (1 = chain)")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="tree budget: draft tokens kept per step")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="auto", choices=list(_dtypes()))
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.add_argument("--strict", action="store_true", help="shape-invariant target passes (bitwise greedy parity)")
    p.add_argument(
        "--verify",
        choices=["token", "block"],
        default="token",
        help="a sampled chain's acceptance rule: token (draft by draft) or block (the drafted prefix by its joint "
        "ratio: exact too, never fewer tokens on average); trees and greedy passes take the token rule",
    )
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="drafting that adapts: each pass drafts the depth in [1, --k] with the most expected tokens per "
        "measured ms (pass costs measured once, ~1 s), and a model drafter stops "
        "deeper when its best path's cumulative confidence (q calibrated by past acceptance) is below --adaptive-min-confidence",
    )
    p.add_argument(
        "--adaptive-min-confidence",
        type=float,
        default=0.3,
        metavar="P",
        help="with --adaptive: the confidence threshold, a cumulative probability in [0, 1] (default 0.3)",
    )


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text with speculative decoding")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompts-file", help='JSONL file, one {"prompt": ...} per line')
    _add_generation_args(g)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--events", help="write every event to this JSONL file")
    g.add_argument("--trace", help="write the run's JSON trace here (one prompt)")
    g.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    g.add_argument(
        "--history",
        action="append",
        default=[],
        metavar="TEXT",
        help="an earlier answer the suffix drafter may draft from (repeatable); with --prompts-file, each "
        "answer is also remembered for the prompts after it, as in a chat session",
    )
    g.add_argument(
        "--vllm-url",
        nargs="?",
        const="",
        default=None,
        metavar="URL",
        help="run on a vLLM server (OpenAI-compatible API) instead of our engine; without URL, "
        "$SPECLENS_VLLM_URL. The server's model and speculative config apply (--target, --drafter, --k ignored)",
    )


def _add_parity(sub) -> None:
    par = sub.add_parser("parity", help="greedy parity: speculative vs baseline, diagnosed")
    src = par.add_mutually_exclusive_group()
    src.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    src.add_argument("--prompts-file", help='JSONL file, one {"prompt": ...} per line')
    _add_generation_args(par)
    par.add_argument("--json", action="store_true")


def _add_bench(sub) -> None:
    b = sub.add_parser("bench", help="benchmark suite: engine systems vs transformers, one table")
    b.add_argument("--quick", action="store_true", help="one prompt per workload, 32 tokens, 1 repeat (CI smoke)")
    b.add_argument("--repeats", type=int, default=None)
    b.add_argument("--max-new-tokens", type=int, default=None)
    b.add_argument("--systems", default=None, help="comma-separated subset of the systems")
    b.add_argument("--dtype", default="auto", choices=list(_dtypes()))
    b.add_argument("--device", default="auto", help="auto | cpu | cuda")
    b.add_argument("--target", default="default", help="target model (default, a preset, a Hub id or a local folder)")
    b.add_argument(
        "--workloads", default=None, help="comma-separated subset of chat, code-edit, summarize, chat-heldout"
    )
    b.add_argument("--no-events-check", action="store_true", help="skip the event-stream cost measurement")
    b.add_argument("--json", action="store_true", help="print the report as JSON")


def _add_train_head(sub) -> None:
    th = sub.add_parser(
        "train-head", help="train the EAGLE drafting head for a target, on the CPU or a GPU (resumable)"
    )
    th.add_argument("--target", default="default", help="the target the head drafts for")
    th.add_argument("--out", default=None, help="head folder (default assets/heads/<target>)")
    th.add_argument("--work", default=None, help="folder for the resumable intermediate files")
    th.add_argument("--prompts", type=int, default=None, help="training prompts (default 1200)")
    th.add_argument("--epochs", type=int, default=None, help="passes over the data (default 12)")
    th.add_argument("--vocab", type=int, default=None, help="reduced draft vocabulary size (default 8192)")
    th.add_argument("--unroll", type=int, default=None, help="training-time test steps (default 3)")
    th.add_argument(
        "--feature-layers",
        default=None,
        help="target layers the head reads, comma-separated, the last layer last; 'last' = the last "
        "layer alone (EAGLE-1); default: a low / middle / high mix as in EAGLE-3 (1,14,29 for the default model)",
    )
    th.add_argument("--seed", type=int, default=0)
    th.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda", "auto"],
        help="where every stage runs; cuda also sizes the recipe for one GPU run (16000 prompts, 6000 written by "
        "the target, 8 epochs) unless the options above say otherwise",
    )
    th.add_argument(
        "--written", type=int, default=None, help="how many of the prompts the target writes itself (default 0)"
    )
    th.add_argument(
        "--force", action="store_true", help="replace the head in --out even if it drafts better on held-out prompts"
    )
    th.add_argument("--quick", action="store_true", help="tiny random target, a few prompts: seconds (tests)")


def _add_launch_command(sub) -> None:
    lc = sub.add_parser(
        "launch-command", help="the command that turns this drafting on in vLLM, SGLang, llama.cpp or transformers"
    )
    lc.add_argument("--engine", required=True, choices=["vllm", "sglang", "llama.cpp", "transformers"])
    lc.add_argument("--target", default="default", help="the target model (default, a preset or a Hub id)")
    _add_drafter(lc)
    lc.add_argument("--k", type=int, default=4, help="draft tokens per step (tree depth)")
    lc.add_argument("--topk", type=int, default=1, help="tree branching per node (1 = chain)")
    lc.add_argument("--num-draft-tokens", type=int, default=None, help="tree budget: draft tokens per step")
    lc.add_argument("--temperature", type=float, default=0.0)
    lc.add_argument("--adaptive", action="store_true", help="drafting depth that adapts (where the engine has it)")
    lc.add_argument(
        "--verify", choices=["token", "block"], default="token", help="sampled chains' acceptance rule (vLLM: block)"
    )
    lc.add_argument("--json", action="store_true", help="print the result as JSON")


def _add_analyze(sub) -> None:
    an = sub.add_parser("analyze", help="does speculation pay on your server? two scrapes of its /metrics")
    # argparse: one add_argument per flag, so the flags below are alike by design
    an.add_argument(
        "source",
        nargs="?",
        default=None,
        help="a server's URL (vLLM, llama.cpp or SpecLens) or a file saved with --save (optional with --requests)",
    )
    an.add_argument(
        "--requests",
        default=None,
        metavar="FILE.jsonl",
        help="responses with per-request speculative metrics (vLLM --per-request-spec-decode-metrics), one per line: "
        "which requests speculation pays for",
    )
    an.add_argument(
        "--break-even",
        type=float,
        default=None,
        metavar="TAU",
        help="the τ a request needs to pay (a speculative pass's cost ÷ a plain one's); default: from the pass costs",
    )
    an.add_argument("--interval", type=float, default=60.0, help="seconds between the two scrapes (default 60)")
    an.add_argument(
        "--pass-ms",
        default=None,
        metavar="B:PLAIN/SPEC,...",
        help="the server's pass costs in ms by batch size, plain / speculative at its K, e.g. 1:60/81,4:77/128",
    )
    an.add_argument(
        "--probe",
        default=None,
        metavar="URL|same",
        help="time the pass costs through the server's OpenAI API (same = the source URL)",
    )
    an.add_argument("--max-batch", type=int, default=16, help="largest batch the probe times (default 16)")
    an.add_argument(
        "--probe-baseline",
        default=None,
        metavar="URL",
        help="the same model served without speculation: its plain passes are what speculation is weighed against",
    )
    an.add_argument("--model", default=None, help="only this model_name's counters")
    _add_drafter(an, "the method the server drafts with (its counters do not say), for the ticket's launch line")
    an.add_argument(
        "--what-if",
        action="store_true",
        help="measure what the window's acceptance by position (or --tau) buys by batch size: the same model served "
        "with vLLM's synthetic rejection against one without speculation (engine/tools/what_if.py)",
    )
    an.add_argument("--tau", type=float, default=None, help="what-if for a drafter of this mean acceptance length")
    an.add_argument(
        "--what-if-k", type=int, default=None, help="drafts per pass of the what-if (default: the window's K, else 4)"
    )
    an.add_argument(
        "--what-if-url",
        default=None,
        metavar="URL",
        help="a what-if server you started (the printed line); default: start one here",
    )
    an.add_argument(
        "--baseline-url", default=None, metavar="URL", help="the same model without speculation, beside --what-if-url"
    )
    an.add_argument(
        "--what-if-batches", default="1,2,4,8,16", metavar="B,B,...", help="batch sizes of the what-if sweep"
    )
    an.add_argument("--what-if-repeats", type=int, default=2, help="repeats of each batch size (default 2)")
    an.add_argument("--save", default=None, metavar="FILE", help="also save the two scrapes (for offline use)")
    an.add_argument("--json", action="store_true", help="print the analysis as JSON")


def _add_selfcheck(sub) -> None:
    sc = sub.add_parser(
        "selfcheck", help="trust your install: greedy parity and a chi-square test with its control (<60 s)"
    )
    sc.add_argument("--dtype", default="auto", choices=list(_dtypes()), help="the default model's dtype (default auto)")
    sc.add_argument(
        "--seed", type=int, default=0, help="the samplers' seed (default 0; rerun with another if the exact rule fails)"
    )
    sc.add_argument("--json", action="store_true", help="print the result as JSON")


def _add_prepare(sub) -> None:
    prep = sub.add_parser("prepare", help="build the default model cache (once) and report its timing")
    prep.add_argument("--dtype", default="auto", choices=list(_dtypes()))


# The subcommands, in the order --help lists them.
_SUBCOMMANDS = (
    _add_generate,
    _add_parity,
    _add_bench,
    _add_train_head,
    _add_launch_command,
    _add_analyze,
    _add_prepare,
    _add_selfcheck,
)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m engine", description="SpecLens speculative decoding engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in _SUBCOMMANDS:
        add(sub)
    return parser


def _read_prompts(path: str) -> list[str]:
    prompts = []
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            raise ValueError(f"{path}:{number}: not valid JSON") from None
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ValueError(f'{path}:{number}: expected {{"prompt": "..."}}')
        prompts.append(item["prompt"])
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts


def _default_parity_prompts() -> list[str]:
    path = paths.ASSETS / "parity_prompts.jsonl"
    return _read_prompts(str(path))


def settings_from_args(args):
    """The run's GenerationSettings from generate's or parity's arguments (the one place they are built)."""
    from engine.settings import GenerationSettings

    return GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        k=args.steps or args.k,
        topk=args.topk,
        num_draft_tokens=args.num_draft_tokens,
        temperature=getattr(args, "temperature", 0.0),
        top_p=getattr(args, "top_p", 1.0),
        top_k=getattr(args, "top_k", 0),
        seed=getattr(args, "seed", None),
        chat=not args.no_chat,
        strict=args.strict,
        adaptive=args.adaptive,
        adaptive_min_confidence=args.adaptive_min_confidence,
        verify=getattr(args, "verify", "token"),
    )


def _generate(args, engine, backend=None) -> int:
    """engine: our SpeculativeEngine; backend: a VllmBackend instead (same events, same output)."""
    from engine import trace as trace_io

    prompts = [args.prompt] if args.prompt is not None else _read_prompts(args.prompts_file)
    settings = settings_from_args(args)
    answers = list(args.history)  # the session's answers so far (the suffix drafter reads them)
    events_out = open(args.events, "w", encoding="utf-8") if args.events else None
    try:
        for prompt in prompts:
            events = []
            settings.history = tuple(answers[-MAX_HISTORY_DOCS:])
            run = backend.generate(prompt, settings) if backend else engine.generate(prompt, args.drafter, settings)
            for event in run:
                events.append(event)
                if events_out:
                    events_out.write(json.dumps(event, ensure_ascii=False) + "\n")
                if not args.json and event["type"] == "step":
                    eos = set(events[0]["eos_ids"])
                    sys.stdout.write("".join(i.get("text", "") for i in event["emitted"] if i["token_id"] not in eos))
                    sys.stdout.flush()
            finish = events[-1]
            metrics = finish["metrics"]
            answers.append(finish["text"])
            if args.trace:
                trace_io.save(events, args.trace)
            if finish.get("incomplete"):  # a vLLM server that stopped answering mid-run (engine.vllm.backend)
                kept = " (kept in --trace/--events, marked incomplete)" if args.trace or args.events else ""
                print(
                    f"\nerror: {finish.get('error')}. {len(finish['token_ids'])} tokens had been streamed{kept}.",
                    file=sys.stderr,
                )
                return 1
            if args.json:
                out = {
                    "prompt": prompt,
                    "text": finish["text"],
                    "token_ids": finish["token_ids"],
                    "stop_reason": finish["stop_reason"],
                    "drafter": events[0]["drafter"] if backend else args.drafter,
                    "seed": events[0]["settings"]["seed"],
                    **{key: metrics[key] for key in metrics},
                }
                print(json.dumps(out, ensure_ascii=False))
            else:
                length = metrics.get("mean_acceptance_length")
                print(
                    f"\n-- {metrics['new_tokens']} tokens in {metrics['target_passes']} target passes "
                    f"({metrics['tokens_per_pass']:.2f} per pass), acceptance rate {metrics['acceptance_rate']:.2f}"
                    + (f" beside mean acceptance length {length:.2f}" if length is not None else "")
                    + f", {metrics['tokens_per_s']:.1f} tok/s, {metrics['wall_s']:.2f} s",
                    file=sys.stderr,
                )
    finally:
        if events_out:
            events_out.close()
    return 0


def _analyze(args) -> int:
    import os

    from engine.tools.analyze import AnalyzeError, analyze, load_recording, record, ticket
    from engine.tools.analyze_report import format_distribution, format_report
    from engine.tools.pass_costs import parse_pass_costs, probe_pass_costs

    try:
        requests = None
        if args.requests:
            from engine.tools.per_request import read_requests, request_distribution

            try:
                with open(args.requests, encoding="utf-8") as fh:
                    requests = read_requests(fh.read(20_000_001)[:20_000_000])
            except OSError as exc:
                raise AnalyzeError(f"cannot read {args.requests}: {exc.strerror or exc}") from None
        if args.source is None:
            if requests is None:
                raise AnalyzeError("give a server's URL, a saved window, or --requests FILE.jsonl")
            dist = request_distribution(requests, args.break_even)
            print(json.dumps({"per_request": dist}) if args.json else format_distribution(dist))
            return 0
        if os.path.isfile(args.source):
            window = load_recording(args.source)
        else:
            if not 0 < args.interval <= 3600:
                raise ValueError("--interval must be between 0 and 3600 seconds")
            print(f"scraping {args.source} twice, {args.interval:g} s apart…", file=sys.stderr)
            window = record(args.source, args.interval)
        costs = window.get("pass_costs")
        if not 1 <= args.max_batch <= 256:
            raise ValueError("--max-batch must be between 1 and 256")
        if args.pass_ms:
            costs = parse_pass_costs(args.pass_ms)
        elif args.probe:
            url = args.source if args.probe == "same" else args.probe
            print(f"timing plain and speculative passes of {url} up to batch {args.max_batch}…", file=sys.stderr)
            costs = probe_pass_costs(url, model=args.model, max_batch=args.max_batch, baseline_url=args.probe_baseline)
        if args.save:
            with open(args.save, "w", encoding="utf-8") as fh:
                json.dump({**window, "pass_costs": costs}, fh)
        result = analyze(window["before"], window["after"], window.get("interval_s"), costs, args.model)
        if args.what_if or args.tau is not None:
            result["what_if"] = _what_if(args, window, result)
        if not result.get("gauges_only"):
            result["ticket"] = ticket(result, args.drafter, result.get("what_if"))
        if requests is not None:
            from engine.tools.per_request import break_even_of

            result["per_request"] = request_distribution(requests, args.break_even or break_even_of(result))
    except AnalyzeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        for name, line in (getattr(exc, "lines", None) or {}).items():
            print(f"  {name}: {line}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else format_report(result))
    return 0


def _what_if(args, window: dict, result: dict) -> dict:
    """engine/tools/what_if.py from the CLI: the rates (the window's, or --tau's), the servers (given, or started
    here), the sweep."""
    from engine.tools.analyze import AnalyzeError
    from engine.tools.what_if import measure_what_if, rates_for, start_what_if_servers, window_shape

    try:
        batches = [int(b) for b in args.what_if_batches.split(",") if b.strip()]
    except ValueError:
        raise AnalyzeError(
            f"--what-if-batches is a list of batch sizes such as 1,2,4,8,16, got {args.what_if_batches!r}"
        ) from None
    if not batches or any(not 1 <= b <= 64 for b in batches):
        raise AnalyzeError("--what-if-batches must hold batch sizes between 1 and 64")
    if not 1 <= args.what_if_repeats <= 10:
        raise AnalyzeError("--what-if-repeats must be between 1 and 10")
    if bool(args.what_if_url) != bool(args.baseline_url):
        raise AnalyzeError(
            "--what-if-url and --baseline-url go together (the what-if server and one without speculation)"
        )
    k = args.what_if_k or result.get("k") or 4
    if args.tau is not None:
        rates = rates_for(k, tau=args.tau)
    elif result.get("acceptance_by_position"):
        rates = rates_for(k, rates=result["acceptance_by_position"])
    else:
        raise AnalyzeError("the window has no acceptance by position: give --tau")
    shape = window_shape(window["before"], window["after"])
    print(
        f"what-if: rates {', '.join(f'{r:.2f}' for r in rates)} (τ = {1 + sum(rates):.2f}) at K = {k}, requests of "
        f"{shape['prompt_tokens']:.0f} prompt and {shape['output_tokens']:.0f} output tokens (the window's means)…",
        file=sys.stderr,
    )
    servers = None
    if args.what_if_url:
        urls = (args.what_if_url, args.baseline_url)
    else:
        servers = start_what_if_servers(rates, model=args.model)
        urls = (servers[0].url, servers[1].url)
    try:
        return measure_what_if(*urls, shape, rates, batch_sizes=batches, repeats=args.what_if_repeats, window=result)
    finally:
        for server in servers or ():
            server.stop()


def _launch_command(args) -> int:
    from engine.paths import DEFAULT_MODEL
    from engine.tools.launch import launch_command

    target = DEFAULT_MODEL if args.target == "default" else args.target
    result = launch_command(
        args.engine,
        args.drafter,
        args.k,
        args.topk,
        args.num_draft_tokens,
        target,
        args.temperature,
        args.adaptive,
        args.verify,
    )
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
        return 0
    if result["command"] is not None:
        print(result["command"])
    for note in result["notes"]:
        print(f"# {note}", file=sys.stderr if result["command"] is not None else sys.stdout)
    return 0 if result["equivalent"] else 3


def _parity(args, engine) -> int:
    from engine.tools.parity import parity_check

    if args.prompt:
        prompts = args.prompt
    elif args.prompts_file:
        prompts = _read_prompts(args.prompts_file)
    else:
        prompts = _default_parity_prompts()
    results = []
    for result in parity_check(
        engine,
        prompts,
        drafter=args.drafter,
        settings=settings_from_args(args),
    ):
        results.append(result)
        if args.json:
            print(json.dumps(result, ensure_ascii=False))
        else:
            line = f"[{result['index']:2d}] {result['verdict']:<20}"
            if not result["identical"]:
                line += (
                    f" at token {result['position']}: baseline {result['baseline_token']!r} vs "
                    f"speculative {result['speculative_token']!r}, top-2 margin {result['margin']:.4f}"
                )
            print(line + f"  | {result['prompt'][:50]!r}")
    same = sum(r["identical"] for r in results)
    bugs = sum(r["verdict"] == "real mismatch" for r in results)
    print(f"{same}/{len(results)} identical, {bugs} real mismatches", file=sys.stderr)
    return 1 if bugs else 0


def _train_head(args) -> int:
    import subprocess

    from engine.training.train_head import TrainConfig, sized_for_device, train_head

    cfg = TrainConfig(
        target=args.target,
        out=args.out,
        work=args.work,
        seed=args.seed,
        quick=args.quick,
        device=args.device,
        force=args.force,
    )
    given = set()
    limits = (
        ("prompts", 8, 100_000),
        ("epochs", 1, 50),
        ("vocab", 256, 262_144),
        ("unroll", 1, 8),
        ("written", 0, 100_000),
    )
    for name, low, high in limits:
        value = getattr(args, name)
        if value is not None:
            if not low <= value <= high:
                raise ValueError(f"--{name} must be between {low} and {high}")
            setattr(cfg, name, value)
            given.add(name)
    sized_for_device(cfg, given)
    if args.feature_layers == "last":
        cfg.feature_layers = ()
    elif args.feature_layers:
        try:
            cfg.feature_layers = tuple(int(x) for x in args.feature_layers.split(","))
        except ValueError:
            raise ValueError(
                f"--feature-layers takes layer numbers separated by commas (e.g. 1,14,29) or 'last'; "
                f"got {args.feature_layers!r}"
            ) from None
    cfg.command = "python -m engine " + " ".join(sys.argv[1:] if sys.argv[1:2] == ["train-head"] else ["train-head"])
    result = train_head(cfg)
    held = result["held_out"]
    decision = result.get("decision")
    where = "head written to" if not decision or decision["replaced"] else "new head kept aside; the head in"
    print(
        f"{where} {result['folder']} ({result['total_minutes']:.1f} min); held-out greedy K=4: "
        f"{held['tokens_per_pass']} tokens per pass, acceptance by depth {held['acceptance_by_depth']}"
    )
    # The curves' HTML is drawn by visuals (plotly), in its own process: the engine never imports it.
    subprocess.run([sys.executable, "-m", "visuals", "training-curves", f"{result['folder']}/training-curves.json"])
    return 0


def _selfcheck(args) -> int:
    from engine.tools.selfcheck import format_report, run_selfcheck

    if not 0 <= args.seed < 2**63:
        raise ValueError(f"--seed must be between 0 and 2**63 - 1, got {args.seed}")
    result = run_selfcheck(args.dtype, args.seed, log=lambda line: print(f"selfcheck: {line}…", file=sys.stderr))
    print(json.dumps(result, ensure_ascii=False) if args.json else format_report(result))
    return 0 if result["passed"] else 1


def _check_adaptive(args) -> None:
    from engine.drafters.adaptive import check_min_confidence

    try:
        check_min_confidence(args.adaptive_min_confidence)
    except ValueError as exc:
        raise ValueError(f"--adaptive-min-confidence: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    from engine.model.loading import ModelLoadError, load_model

    try:
        if args.command == "prepare":
            import time

            t0 = time.perf_counter()
            first = load_model("default", args.dtype)
            t1 = time.perf_counter()
            load_model("default", args.dtype)
            t2 = time.perf_counter()
            print(
                f"default model ready ({'cache hit' if first.from_cache else 'cache built'} in {t1 - t0:.1f} s, "
                f"reload {t2 - t1:.1f} s), weights {first.weight_kind}, cache {first.source.get('cache')}"
            )
            from engine.kernels import cpu_build

            kernel = cpu_build.describe()
            print(f"CPU kernel: {kernel['variant'] or 'none'} ({kernel['reason']}); {kernel['label']}")
            return 0
        if args.command == "train-head":
            return _train_head(args)
        if args.command == "launch-command":
            return _launch_command(args)
        if args.command == "analyze":
            return _analyze(args)
        if args.command == "selfcheck":
            return _selfcheck(args)
        if args.command in ("generate", "parity"):
            _check_adaptive(args)  # before any model loads: a bad threshold fails in a moment
        from engine.decode import SpeculativeEngine

        if args.command == "bench":
            from engine.tools.bench import SYSTEMS, format_table, run_bench

            systems = args.systems.split(",") if args.systems else None
            if systems and any(s not in SYSTEMS for s in systems):
                raise ValueError(f"unknown system in --systems; choose from {', '.join(SYSTEMS)}")
            if args.repeats is not None and not 1 <= args.repeats <= 20:
                raise ValueError("--repeats must be between 1 and 20")
            if args.max_new_tokens is not None and not 1 <= args.max_new_tokens <= 2048:
                raise ValueError("--max-new-tokens must be between 1 and 2048")
            report = run_bench(
                SpeculativeEngine(load_model(args.target, args.dtype, device=args.device)),
                args.quick,
                args.repeats,
                args.max_new_tokens,
                systems,
                workloads_subset=args.workloads.split(",") if args.workloads else None,
                events_check=not args.no_events_check,
            )
            print(json.dumps(report, indent=2) if args.json else format_table(report))
            return 0
        if args.command == "generate" and args.prompt is not None and not args.prompt.strip():
            raise ValueError("prompt is empty")
        if args.command == "generate" and args.vllm_url is not None:
            from engine.vllm.backend import VllmBackend
            from engine.vllm.client import VllmError

            try:
                return _generate(args, None, VllmBackend(args.vllm_url or None))
            except VllmError as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
        engine = SpeculativeEngine(load_model(args.target, args.dtype))
        if args.command == "generate":
            return _generate(args, engine)
        return _parity(args, engine)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
