"""Write toygraph/demo/general.jsonl: the base model's own answers to general prompts.

Mixed into the demo's fine-tune beside capitals.jsonl, these rows keep what the model does
outside the task: trained on capitals alone, the adapter answered a haiku request in the
capitals JSON (issue 47). Each row is SmolLM2-135M-Instruct's own greedy reply (chat
template, at most MAX_NEW_TOKENS tokens) up to its last full sentence (whole_sentences),
so learning it pulls the adapter back towards the base, not towards new text. None of
these prompts is one bench/demo_recipe.py asks (its OFF_TASK list): those stay held out.
The replies are greedy on the CPU engine, so another machine or engine version can round
them differently: regenerated on 2026-12-07 at 4f8bec4's engine (the whole step and the
generation replayed in it; AMD EPYC, Zen 5), twice with the same bytes; of the 98 rows
02c73f2 wrote (before the engine replay), 42 came out the same, 55 differ and 1 has no
full sentence now ("three tips for sleeping better").

    TOYGRAPH_SMOLLM2=/path/to/SmolLM2-135M-Instruct.Q4_1.gguf python toygraph/demo/make_general.py
"""
from __future__ import annotations

import json
import re
from pathlib import Path

PROMPTS = [
    "Write a short poem about autumn leaves.",
    "Give me three tips for sleeping better.",
    "What is photosynthesis?",
    "Explain what a black hole is in simple words.",
    "How do I make a cup of tea?",
    "Write a Python function that adds two numbers.",
    "What does HTML stand for?",
    "Hello! How are you?",
    "Good morning!",
    "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate?",
    "Suggest a name for a pet goldfish.",
    "How many days are in a leap year?",
    "What is 12 times 7?",
    "Translate 'thank you' into Spanish.",
    "Write one sentence describing a rainy day.",
    "Why is the sky blue?",
    "What is a prime number?",
    "Can you recommend a good book for a long trip?",
    "How do I boil an egg?",
    "What is the boiling point of water in Celsius?",
    "Explain recursion to a beginner.",
    "What is a noun?",
    "Give me a synonym for happy.",
    "Write a limerick about a cat.",
    "What should I pack for a day at the beach?",
    "How does a bicycle work?",
    "What is the largest planet in our solar system?",
    "What is a healthy breakfast?",
    "How do I write a for loop in JavaScript?",
    "Thanks for your help!",
    "What is your name?",
    "Describe the color green to someone.",
    "What are the three states of matter?",
    "How can I stay motivated while studying?",
    "What is the Pythagorean theorem?",
    "Tell me a joke about computers.",
    "What is an API?",
    "How do plants drink water?",
    "Write a two-line rhyme about the moon.",
    "What is the chemical symbol for gold?",
    "How do I say goodbye politely in an email?",
    "What is machine learning?",
    "Name three fruits that are red.",
    "What is the speed of light?",
    "How do I sort a list of numbers in Python?",
    "What makes a good friend?",
    "Summarize the story of Cinderella in one sentence.",
    # geography and facts that are not a capital: answered in prose, not the capitals JSON
    "What is the longest river in the world?",
    "How many continents are there?",
    "What is the largest ocean on Earth?",
    "Which country has the most people?",
    "What language is spoken in Brazil?",
    "What is the biggest desert in the world?",
    "How deep is the ocean?",
    "What is the population of Tokyo?",
    "Where do penguins live?",
    "What is the currency of Japan?",
    "Which river flows through Paris?",
    "What is the highest waterfall?",
    "What is the smallest country in the world?",
    "What is a volcano?",
    "Why do we have seasons?",
    "What is the equator?",
    # more of everything else
    "Write a short poem about the stars.",
    "Write a haiku about winter.",
    "Write a function in Python that checks if a number is even.",
    "What is a dictionary in Python?",
    "How do I center a div in CSS?",
    "What is the difference between a list and a tuple?",
    "Hey, what's up?",
    "Nice to meet you!",
    "Can you help me with my homework?",
    "I feel tired today.",
    "What time is it?",
    "Tell me something interesting.",
    "What is 100 divided by 4?",
    "What is the square root of 81?",
    "How many legs does a spider have?",
    "What do bees make?",
    "Give me a tip for learning a new language.",
    "How do I make my plants grow faster?",
    "What is a good way to start a story?",
    "Describe a sunset in one sentence.",
    "What is gravity?",
    "What is the opposite of cold?",
    "How do airplanes fly?",
    "Recommend a movie for a family night.",
    "What are vitamins?",
    "How do I write a thank-you note?",
    "What is the first letter of the alphabet?",
    "What is a verb?",
    "Explain what an operating system does.",
    "What is a cloud in computing?",
    "How often should I drink water?",
    "What is your favourite food?",
    # "capital" in its other senses: answered in prose, not as a capitals record (without
    # these, every seed answered OFF_TASK's capital-letter prompt as a record)
    "What is a capital letter?",
    "Write the word 'hello' in capital letters.",
    "When do I use a capital letter in a sentence?",
    "What does capital mean in business?",
    "Is the letter Q a capital letter or a small letter in the word 'Queen'?",
    "What is capital punishment?",
    # more of them (seed 1 with the base decoded still answered the capital-letter prompt as
    # a record with the six above): letters, money, words; none of OFF_TASK's wording
    "Should a sentence start with a capital letter?",
    "What is the lowercase form of the capital letter M?",
    "Which words in 'the river Thames' need a capital letter?",
    "What does it mean to capitalize a word?",
    "What is a capital gain?",
    "Do days of the week start with a capital letter in English?",
    "Which letter comes after C in the alphabet?",
    "What is the capital of a column in architecture?",
    "How do I type a capital letter on a keyboard?",
]
MAX_NEW_TOKENS = 48
#: Where a sentence ends: . ! or ? and any closing quote or bracket, before a space or the
#: reply's end.
SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s|$)")
CODE_FENCE = re.compile(r"```")


def whole_sentences(reply: str) -> str | None:
    """``reply`` up to the end of its last full sentence or closed code block; None when it
    has neither.

    Most replies run to MAX_NEW_TOKENS and stop mid-sentence, and a row teaches the
    end-of-turn token after its reply: the demo packs whole rows, so a cut reply would teach
    the adapter to stop mid-sentence. A reply with no full sentence is a loop or a run-on
    ("1. **1.1.1.1...": a list's "1." ends nothing), not behaviour worth keeping: None, and
    the row is left out."""
    reply = reply.strip()
    ends = [m.end() for m in SENTENCE_END.finditer(reply)
            if not reply[:m.start()].rpartition("\n")[2].strip().isdigit()]
    ends += [m.end() for m in CODE_FENCE.finditer(reply)][1::2]   # each block's closing fence
    return reply[:max(ends)].strip() if ends else None


def main() -> None:
    from toygraph.inference.language_model import LanguageModel
    from toygraph.models.catalog import smollm2_path
    base = LanguageModel(str(smollm2_path()))
    out = Path(__file__).resolve().with_name("general.jsonl")
    replies = {p: whole_sentences(base.generate(p, chat=True, max_new_tokens=MAX_NEW_TOKENS))
               for p in PROMPTS}
    rows = [{"instruction": p, "response": r} for p, r in replies.items() if r]
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                   encoding="utf-8")
    print(f"wrote {len(rows)} rows to {out} ({len(PROMPTS) - len(rows)} prompts left out: "
          "no full sentence in the reply)")


if __name__ == "__main__":
    main()
