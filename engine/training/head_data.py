"""Training prompts for the EAGLE head, built offline from what is on this machine.

Three kinds, mirroring the benchmark workloads but never containing them (the
workloads in assets/workloads.json and the app's examples are held out):

- chat: instruction templates over many topics (written here);
- code: functions from Python's own standard library (``inspect.getsource``)
  with edit / explain instructions;
- summarize: paragraphs of the standard library's module docstrings.

Everything is deterministic for a seed. The answers are generated later by the
target itself (self-distillation: the head learns the target's own
distribution), see ``engine.training.train_head``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import textwrap

from engine import paths

__all__ = ["build_prompts", "clean_written_prompt", "held_out_texts", "write_requests"]

ASSETS = paths.ASSETS

TOPICS = """photosynthesis; black holes; the water cycle; volcanoes; the Roman Empire; the printing press;
compound interest; sourdough bread; composting; the immune system; sleep; honeybees; coral reefs; the moon landing;
electric cars; solar panels; wind turbines; recycling; the stock market; inflation; supply and demand; a budget;
learning a language; playing guitar; chess openings; marathon training; yoga; meditation; public speaking;
writing a resume; job interviews; remote work; time management; procrastination; habits; friendship; gardening;
houseplants; tomatoes; cats; dogs; birds; octopuses; dinosaurs; fossils; earthquakes; hurricanes; climate;
rainbows; lightning; magnets; electricity; batteries; the internet; email; passwords; encryption; databases;
spreadsheets; version control; unit testing; recursion; sorting algorithms; hash tables; binary search; Python lists;
Python dictionaries; regular expressions; the command line; web browsers; HTML; CSS; JavaScript; APIs; cloud computing;
machine learning; neural networks; chatbots; robots; 3D printing; drones; satellites; the solar system; Mars;
telescopes; microscopes; vaccines; bacteria; viruses; DNA; evolution; the human heart; the brain; nutrition; vitamins;
coffee; tea; chocolate; pizza; pasta; rice; spices; baking cookies; knitting; painting; photography; film cameras;
jazz; classical music; poetry; novels; libraries; museums; city parks; public transport; bicycles; trains; airplanes;
sailing; mountains; deserts; rivers; forests; oceans; penguins; elephants; whales; bees; ants; spiders; the seasons;
snow; rain; clouds; tides; maps; compasses; clocks; calendars; the Olympic Games; football; tennis; board games;
video games; birthdays; weddings; moving house; saving money; cooking for one; camping; hiking; road trips""".replace(
    "\n", " "
)

CHAT_TEMPLATES = [
    "Explain {t} in simple terms.",
    "Give me three interesting facts about {t}.",
    "Write a short poem about {t}.",
    "What are the pros and cons of {t}?",
    "How would you explain {t} to a ten-year-old?",
    "Give me five tips related to {t}.",
    "Write a short story that involves {t}.",
    "What is a common misconception about {t}?",
    "Describe {t} in one paragraph.",
    "List three questions a student might ask about {t}, with short answers.",
    "Why is {t} important?",
    "Write a haiku about {t}.",
    "Give me a step-by-step guide to getting started with {t}.",
    "Compare {t} and {u}.",
    "What do {t} and {u} have in common?",
    "Suggest a weekend plan that includes {t}.",
    "Write a friendly email to a colleague about {t}.",
    "Summarize the history of {t} in a few sentences.",
    "What should a beginner know about {t}?",
    "Create a short quiz with three questions about {t}.",
]

# What the target is asked to write, over the topic list (the GPU recipe: the target writes many of its own
# training instructions, so they read like what a user of this model types, beyond these templates' phrasing).
WRITE_REQUESTS = [
    "Write one question that someone might ask an AI assistant about {t}. Reply with the question only.",
    "Write one short task that a user could give an AI assistant about {t}. Reply with the task only.",
    "Write one request for advice about {t}, as a user would type it. Reply with the request only.",
    "Write one creative writing request that involves {t}. Reply with the request only.",
    "Write one question a student could ask about {t} and {u}. Reply with the question only.",
]

CODE_TEMPLATES = [
    "Add a docstring to this Python function. Reply with the full function only.\n\n```python\n{code}```",
    "Explain what this Python function does.\n\n```python\n{code}```",
    "Add type hints to this Python function. Reply with the full function only.\n\n```python\n{code}```",
    "Rename the variables of this function to clearer names. Reply with the full function only."
    "\n\n```python\n{code}```",
    "Write a unit test for this function.\n\n```python\n{code}```",
    "Rewrite this function with comments on each step.\n\n```python\n{code}```",
]

SUMMARY_TEMPLATES = [
    "Summarize this text in two sentences, reusing its wording:\n\n{text}",
    "Summarize this text in one sentence:\n\n{text}",
    "List the main points of this text:\n\n{text}",
    "Rewrite this text in simpler words:\n\n{text}",
]

STDLIB = """textwrap string json.encoder json.decoder collections heapq bisect statistics fractions
shlex fnmatch glob posixpath ntpath difflib calendar colorsys csv base64 quopri uu gettext locale
argparse optparse configparser html html.parser urllib.parse ipaddress email.utils email.header
functools operator copy pprint reprlib enum numbers decimal random dataclasses inspect ast tokenize
zipfile tarfile gzip shutil tempfile filecmp netrc mimetypes wave sched queue threading logging
logging.handlers unittest.case traceback linecache codecs getopt graphlib contextlib abc""".split()


# Functions another import rebinds (torch replaces inspect.getfile with its own wrapper): without
# this the prompt set would depend on what the process imported before building it.
REBOUND = {"inspect.getfile"}


def held_out_texts() -> set[str]:
    """Prompts the head is evaluated on (benchmark workloads, app examples): never trained on."""
    texts: set[str] = set()
    workloads = json.loads((ASSETS / "workloads.json").read_text())
    for prompts in workloads.values():
        texts.update(p if isinstance(p, str) else p.get("prompt", "") for p in prompts)
    examples = json.loads((ASSETS / "examples.json").read_text())
    for example in examples if isinstance(examples, list) else examples.get("examples", []):
        texts.add(example.get("prompt", ""))
    return {t.strip() for t in texts if t}


def _stdlib_modules():
    """The STDLIB modules this Python has, in a fixed order (a build may lack one)."""
    for name in STDLIB:
        try:
            yield importlib.import_module(name)
        except ImportError:
            continue


def _functions(rng: random.Random) -> list[str]:
    """Source of small standard-library functions (5 to 30 lines), in a fixed order."""
    found = []
    for module in _stdlib_modules():
        for _, obj in sorted(vars(module).items()):
            if not inspect.isfunction(obj) or getattr(obj, "__module__", None) != module.__name__:
                continue
            if f"{module.__name__}.{obj.__name__}" in REBOUND:
                continue
            try:
                src = textwrap.dedent(inspect.getsource(obj))
            except (OSError, TypeError):
                continue
            if 5 <= src.count("\n") <= 30 and len(src) < 1400:
                found.append(src)
    rng.shuffle(found)
    return found


def _paragraphs(rng: random.Random) -> list[str]:
    """Paragraphs of 200 to 900 characters from standard-library docstrings."""
    found = []
    for module in _stdlib_modules():
        docs = [module.__doc__ or ""] + [
            obj.__doc__ or ""
            for _, obj in sorted(vars(module).items())
            if inspect.isclass(obj) or inspect.isfunction(obj)
        ]
        for doc in docs:
            if not isinstance(doc, str):
                continue
            for para in inspect.cleandoc(doc).split("\n\n"):
                text = " ".join(para.split())
                if 200 <= len(text) <= 900 and ">>>" not in text:
                    found.append(text)
    found = sorted(set(found))
    rng.shuffle(found)
    return found


def write_requests(n: int, seed: int = 0) -> list[str]:
    """n requests asking the target to write a user prompt (WRITE_REQUESTS over the topics), deterministic."""
    rng = random.Random(seed + 7919)
    topics = [t.strip() for t in TOPICS.split(";") if t.strip()]
    out = []
    for _ in range(n):
        t, u = rng.sample(topics, 2)
        out.append(rng.choice(WRITE_REQUESTS).format(t=t, u=u))
    return out


def clean_written_prompt(reply: str) -> str | None:
    """The prompt in a reply of the target to a write request, or None when it is not one: its first
    non-empty line, without quotes or a "Question:" label, 12 to 300 characters. (Held-out prompts are
    the caller's to exclude: train_head passes them once, not read again per reply.)"""
    line = next((part.strip() for part in reply.splitlines() if part.strip()), "")
    for label in ("Question:", "Task:", "Request:", "User:"):
        if line.lower().startswith(label.lower()):
            line = line[len(label) :].strip()
    line = line.strip("\"'“”*` ").strip()
    if not 12 <= len(line) <= 300:
        return None
    return line


def build_prompts(n: int, seed: int = 0, mix: tuple[float, float, float] = (0.55, 0.3, 0.15)) -> list[dict]:
    """n prompts {"kind", "prompt"}: chat, code and summarize in proportions `mix`, deterministic for seed."""
    rng = random.Random(seed)
    topics = [t.strip() for t in TOPICS.split(";") if t.strip()]
    functions = _functions(rng)
    paragraphs = _paragraphs(rng)
    held_out = held_out_texts()
    counts = [round(n * share) for share in mix]
    counts[0] = n - counts[1] - counts[2]
    prompts: list[dict] = []
    seen: set[str] = set()

    def add(kind: str, text: str) -> None:
        if text not in seen and text.strip() not in held_out:
            seen.add(text)
            prompts.append({"kind": kind, "prompt": text})

    attempts = 0
    while len(prompts) < counts[0] and attempts < 50 * n:
        attempts += 1
        t, u = rng.sample(topics, 2)
        add("chat", rng.choice(CHAT_TEMPLATES).format(t=t, u=u))
    for i in range(counts[1]):
        add("code", CODE_TEMPLATES[i % len(CODE_TEMPLATES)].format(code=functions[i % len(functions)]))
    for i in range(counts[2]):
        add("summarize", SUMMARY_TEMPLATES[i % len(SUMMARY_TEMPLATES)].format(text=paragraphs[i % len(paragraphs)]))
    rng.shuffle(prompts)
    return prompts
