"""``toygraph demo``: a short LoRA fine-tune of SmolLM2-135M-Instruct on the CPU.

The shipped capitals set teaches the model to answer country questions as a two-line
record (``country: Peru`` / ``capital: Lima``). The demo prints what the model says before
and after, with phrasings that are not in the training data, marks each answer right or
wrong against the reply the data teaches, shows the training loss as it falls, says what
changed (the format learned, the capitals the base already named still right, two prompts
outside the task not answered as a capitals record), and ends with the commands that use
the result (chat, merged GGUF export, Ollama).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from toygraph.errors import ToygraphError

#: (question, the country it asks about). None of these phrasings is in capitals.jsonl;
#: every country is, with its capital, so each answer can be checked against the data.
QUESTIONS = [("Tell me the capital of Japan.", "Japan"),
             ("What's the capital city of Kenya?", "Kenya"),
             ("Capital of Norway?", "Norway")]
PROMPTS = [q for q, _ in QUESTIONS]
#: Prompts outside the task, asked before and after too: a fine-tune that answers them in
#: a capitals record has taken over more than it was taught (the "what changed" lines).
OFF_TASK = ["Write a haiku about the sea.", "How do I reverse a list in Python?"]

# The fine-tune, every RunConfig option the demo sets in one place (issue 15 item 6).
# capitals.jsonl teaches 180 capitals in 3 phrasings each (540 rows); general.jsonl holds
# the base model's own answers to 108 general prompts, each cut at its last full sentence
# (15 use "capital" in its other senses or ask about the alphabet), so that prompts
# outside the task keep their answers. Measured with bench/demo_recipe.py (36 held-out
# questions on 12 countries, the demo's 3 among them; 12 off-task prompts); the results
# files under bench/results/ (demo-recipe-*) hold every run:
# - taught as one-line JSON the capitals came out as near misses (Kenya "Lairobi"): a JSON
#   string splits each name ("N" "airobi"); the two-line record keeps the prose tokens
#   (" Nairobi"), but trained on capitals alone every off-task prompt became a record;
# - mixed with general.jsonl, 200 steps of 4 rows x 66 tokens (1.25 passes over the data):
#   capitals the base did not know came out wrong at seeds 0 and 1 (Mongolia "Astana" in
#   every phrasing: 33/36), 220 steps of 60 tokens as well (1.37 passes);
# - packed (2026-12-07): a capitals row is about 47 tokens, so 66-token rows were a third
#   padding; 2 rows of 140 tokens hold 5-6 examples each step, and the same slots give 1.5
#   passes in 190 steps (packing keeps attention and positions per example:
#   toygraph/data/packing.py). Packed rows are whole, so general.jsonl's replies end at a
#   full sentence: a reply cut mid-sentence would teach the model to stop mid-sentence.
#   The 20-cell matrix (5 seeds x dot x base memory, 2026-12-07 EPYC): 8 pass; the demo's
#   questions 3/3 in all, but Nigeria -> "Abu Dhabi" (seeds 0 decode, 3), Mongolia
#   "Ulaanba" (seed 42) and the capital-letter prompt as a record (seed 2 decode, 3
#   quantized) -- bench/results/demo-recipe-epyc-2026-12-07.md;
# - the same at lr 3e-3 for 250 steps (2 passes; 2026-12-07, the engine's replay):
#   the adapter keeps more of what the base knew and sees each capital a third more often
#   -- bench/results/demo-recipe-engine-epyc-2026-12-07.md: 18 of 20 cells, seed 1
#   decode answering the capital-letter prompt as a record;
# - with 9 more "capital" prompts in general.jsonl (and the head fused with the loss,
#   which rounds differently) seed 1 decode answered that prompt in prose but gave
#   Nigeria "Abu Dhabi" even on the phrasings it was trained on (" Abu" + "ja" against
#   the United Arab Emirates' " Abu" + " Dhabi": an answer not yet learned), so 300 steps
#   (2.4 passes): 20 of 20 cells -- bench/results/demo-recipe-300-epyc-2026-12-07.md;
# - no validation split: a held-out row is a capital the demo would not teach.
RECIPE = dict(targets=("q", "k", "v", "o", "gate", "up", "down"), rank=16, alpha=32,
              batch=2, seq_len=140, pack=True, lr=3e-3, warmup=10, schedule="cosine",
              clip=1.0, val_split=0.0, seed=42)
STEPS = 300
#: The training files beside this module and each one's weight in the mix
#: (toygraph/data/mixing.py; None for all: concatenated).
DATA = {"capitals.jsonl": None, "general.jsonl": None}
#: What each file beside capitals.jsonl is for (the demo's "data:" lines say it).
DATA_WHY = {name: why for name, why in
            {"general.jsonl": "the base model's own answers to general prompts, so that "
                              "prompts outside the task keep their answers"}.items()
            if name in DATA}
MAX_NEW_TOKENS = 24


def data_path() -> Path:
    """The capitals.jsonl the demo ships beside this module."""
    return Path(__file__).resolve().with_name("capitals.jsonl")


def data_files() -> list[str]:
    """The demo's --data: each DATA file beside this module, as PATH:WEIGHT when weighted
    (a weight of None concatenates the files, each its own size's share)."""
    here = data_path().parent
    return [str(here / name) if weight is None else f"{here / name}:{weight}"
            for name, weight in DATA.items()]


#: The taught reply's fields, one "key: value" line each. A value follows ": ", so each
#: name keeps the leading-space token it has in prose (SmolLM2: " Nairobi" is one token);
#: inside a JSON string the opening quote splits it ("N" "airobi"), and the fine-tune has
#: to relearn every capital's spelling in pieces the base never uses for it (issue 47:
#: Kenya came out "Lairobi", "Kampala", "Djiburia" in the JSON form).
FIELDS = ("country", "capital")
FORM = "two-line record"


def render(country: str, capital: str) -> str:
    """The reply capitals.jsonl teaches for ``country``: ``country: X`` / ``capital: Y``."""
    return f"country: {country}\ncapital: {capital}"


def parse(answer: str) -> dict | None:
    """The answer as the taught record ({"country", "capital"}), else None: exactly the two
    lines in order, each "key: value" with a value (spaces around either are tolerated)."""
    lines = answer.strip().splitlines()
    if len(lines) != len(FIELDS):
        return None
    got = {}
    for line, field in zip(lines, FIELDS):
        key, colon, value = line.partition(":")
        if key.strip() != field or not colon or not value.strip():
            return None
        got[field] = value.strip()
    return got


def replies_by_country(data: Path) -> dict[str, str]:
    """Each country's reply in a capitals-style JSONL: the record it teaches."""
    from toygraph.errors import DataError
    replies = {}
    for n, line in enumerate(Path(data).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        response = json.loads(line)["response"]
        record = parse(response)
        if record is None:
            raise DataError(f"{data}:{n}: the response is not a {FORM} "
                            f"(country: ... / capital: ...): {response[:60]!r}")
        replies[record["country"]] = response
    return replies


def taught_answers(data: Path) -> dict[str, str]:
    """The reply the data teaches for each demo question: the record of its country.

    A country the data does not teach is a DataError: the demo would be asking something
    it cannot have learned."""
    from toygraph.errors import DataError
    replies = replies_by_country(data)
    missing = [country for _, country in QUESTIONS if country not in replies]
    if missing:
        raise DataError(f"{data}: teaches no capital for {', '.join(missing)}")
    return {question: replies[country] for question, country in QUESTIONS}


def verdict(answer: str, taught: str) -> str:
    """'right' when the answer is exactly the taught record, else what is wrong."""
    if answer.strip() == taught:
        return "right"
    want, got = parse(taught), parse(answer)
    if got is None:
        return f"wrong: not the {FORM}"
    if got == want:
        return f"wrong: the right fact, not in the taught {FORM}"
    if got["country"] != want["country"]:
        return f"wrong: the record names {got['country']}, not {want['country']}"
    return f"wrong: the data says {want['capital']}, not {got['capital']}"


def what_changed(before: dict, after: dict, taught: dict) -> list[str]:
    """What the fine-tune changed, from the demo's own probes (``before``/``after``: each
    prompt's answer, the QUESTIONS' and OFF_TASK's; ``taught``: each question's reply):
    the format learned, the capitals the base already named still right, and the prompts
    outside the task not answered as a capitals record."""
    questions = list(taught)
    form = [sum(parse(answers[q]) is not None for q in questions) for answers in (before, after)]
    known = [q for q in questions if parse(taught[q])["capital"].lower() in before[q].lower()]
    lost = [parse(taught[q])["country"] for q in known if verdict(after[q], taught[q]) != "right"]
    off = [p for p in before if p not in taught]
    taken = [p for p in off if parse(after[p]) is not None]
    return [f"format learned: {form[1]}/{len(questions)} answers in the taught {FORM} "
            f"(before: {form[0]}/{len(questions)})",
            f"facts kept: {len(known) - len(lost)}/{len(known)} capitals the base model already "
            f"named are still right" + (f" (lost: {', '.join(lost)})" if lost else ""),
            f"other prompts: {len(off) - len(taken)}/{len(off)} not answered as a capitals record"
            + (f" (taken over: {'; '.join(taken)})" if taken else "")]


def loss_curve(events: Path, points: int = 5, window: int = 10) -> list[str]:
    """The training loss at ``points`` evenly spaced steps, each the mean of the ``window``
    steps ending there (one batch's loss is noisy), as "loss@step"."""
    losses = [e["loss"] for e in map(json.loads, events.read_text().splitlines())
              if e["event"] == "step"]
    ends = sorted({max(1, round(len(losses) * i / (points - 1))) for i in range(points)})

    def mean_up_to(end):
        recent = losses[max(0, end - window):end]
        return sum(recent) / len(recent)
    return [f"{mean_up_to(end):.3f}@{end}" for end in ends]


def is_demo_run(out) -> bool:
    """Whether the run directory ``out`` holds an earlier demo: its run.yaml trains only on
    the DATA files shipped with toygraph (this version's or another's), weighted or not."""
    from toygraph.training.run_file import RUN_FILE, load_run_file
    try:
        data = load_run_file(Path(out) / RUN_FILE).get("data") or []
    except (OSError, ToygraphError):   # no run file, or not one: not a demo's
        return False
    from toygraph.data.mixing import parse_data_spec
    shipped = {("demo", name) for name in DATA}
    try:
        return bool(data) and all(Path(parse_data_spec(d).path).parts[-2:] in shipped
                                  for d in data)
    except ToygraphError:   # a weight that is not one: not what the demo writes
        return False


def check_demo_out(out: str) -> None:
    """The demo replaces an earlier demo in ``out``, and nothing else: a directory holding
    another run (or other files) is refused as finetune refuses it."""
    from toygraph.training.run_dir import RunError, check_run_dir
    try:
        check_run_dir(out, resume=False, overwrite=False)
    except RunError:
        if not is_demo_run(out):
            raise RunError(f"--out {out} holds a run that is not the demo's (or other files); "
                           "the demo replaces only an earlier demo: choose another --out, "
                           "or remove it") from None


def run_demo(out: str = "runs/demo", steps: int | None = None, backend: str = "cpu",
             precision: str = "f32") -> int:
    from toygraph.bounded import terminal_text
    from toygraph.inference.language_model import LanguageModel
    from toygraph.models.catalog import smollm2_path
    from toygraph.training import RunConfig, run_training
    from toygraph.training.result import use_text
    from toygraph.training.run_config import check_value

    check_demo_out(out)   # before the model is fetched or anything is trained
    steps = STEPS if steps is None else steps
    check_value("steps", steps)   # --steps 0 is refused, not read as "the recipe's"
    model, data = str(smollm2_path()), data_path()
    taught = taught_answers(data)
    print(terminal_text(f"model: {Path(model).name}\ndata:  {data}"))
    for name, why in DATA_WHY.items():
        print(terminal_text(f"       + {data.with_name(name)} ({why})"))
    print()
    base = LanguageModel(model, backend=backend, precision=precision)
    before = {p: base.generate(p, chat=True, max_new_tokens=MAX_NEW_TOKENS)
              for p in (*PROMPTS, *OFF_TASK)}
    del base
    t0 = time.perf_counter()
    run_cfg = RunConfig(model=model, data=data_files(), out=out, recipe="lora", steps=steps,
                        backend=backend, precision=precision,
                        overwrite=True, **RECIPE)  # a demo run replaces the previous demo
    summary = run_training(run_cfg, show_use=False)   # the commands come once, at the end
    if summary["status"] not in ("completed", "early_stopped"):
        # interrupted (Ctrl-C) or diverged: run_training said what it saved and how to
        # continue; there is no final adapter to ask the questions of
        print(terminal_text(f"\nthe demo's fine-tune ended {summary['status']} after "
                            f"{summary['steps']} steps; no answers after fine-tuning"))
        from toygraph.training.run import EXIT_CODES
        return EXIT_CODES.get(summary["status"], 1)
    minutes = (time.perf_counter() - t0) / 60
    tuned = LanguageModel(model, adapter_dir=out, backend=backend, precision=precision)
    print(f"\nfine-tune: {summary['steps']} steps in {minutes:.1f} min; training loss "
          f"{' -> '.join(loss_curve(Path(out) / 'events.jsonl'))}")
    print(terminal_text(f"adapter: {out}/adapter_model.safetensors (PEFT) and "
                        f"{out}/adapter.gguf (llama.cpp)\n"))
    after = {p: tuned.generate(p, chat=True, max_new_tokens=MAX_NEW_TOKENS) for p in before}
    right = 0
    for p in PROMPTS:
        mark = verdict(after[p], taught[p])
        right += mark == "right"
        print(terminal_text(f"Q: {p}\n  before: {before[p]!r}\n  after:  {after[p]!r}  ({mark})"))
    print(f"\n{right}/{len(PROMPTS)} answers after fine-tuning are the ones capitals.jsonl teaches")
    print("\nwhat changed:")
    print(terminal_text("\n".join(f"  {line}" for line in what_changed(before, after, taught))))
    print("\nuse the result:")
    print(terminal_text(use_text(model, out, name="capitals")))
    return 0


def next_steps(out: str, model: str = "smollm2") -> list[tuple[str, str]]:
    """The commands that use a finished run directory ``out``, each with what it is for
    (the ones ``finetune`` prints too: toygraph.training.result.use_commands)."""
    from toygraph.training.result import use_commands
    return use_commands(model, out, name="capitals")
