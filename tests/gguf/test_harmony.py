"""gpt-oss's chat template (OpenAI's "harmony" format) rendered by toygraph exactly as
transformers renders it, and trained on as the data layer intends: one row per assistant
turn (the template is not prefix-consistent: a last assistant turn shows its analysis and
ends with <|return|>, an earlier one shows only its final answer and ends with <|end|>),
the turn's reply alone a target, closed by <|return|> (or <|call|> for a tool call).

tests/support/files/templates/openai-gpt-oss-120b.jinja is llama.cpp's models/templates copy of the
chat template of openai/gpt-oss-120b (the same as gpt-oss-20b's; Apache-2.0), byte for byte
as vendored in llama-cpp-python 0.3.36's source distribution (the sdist
tests/support/moe_references.py takes the converter from), sha256
a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146.

The tokenizer is the tiny gpt-oss fixture's (tests/support/files/moe/gpt-oss) with the harmony
special tokens in place of its padding tokens, <|return|> its end of sequence, as
o200k_harmony's GGUFs have it."""
import hashlib
import re
from pathlib import Path

import pytest

from support.moe_references import gguf_path
from toygraph.data.encoding import encode_rows
from toygraph.data.examples import Example
from toygraph.gguf.tokenizer import Tokenizer

TEMPLATE_FILE = Path(__file__).resolve().parents[1] / "support" / "files" / "templates" / "openai-gpt-oss-120b.jinja"
TEMPLATE = TEMPLATE_FILE.read_text(encoding="utf-8")
HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
           "<|call|>", "<|startoftext|>"]

SYSTEM = {"role": "system", "content": "Answer in one word."}
DEVELOPER = {"role": "developer", "content": "Be terse."}
USER_1 = {"role": "user", "content": "Colour of the sky?"}
USER_2 = {"role": "user", "content": "And the grass?"}
REPLY_1 = {"role": "assistant", "content": "Blue.", "thinking": "Daytime sky: blue."}
REPLY_2 = {"role": "assistant", "content": "Green."}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "the city"},
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"}}}}}]
CALL = {"role": "assistant", "thinking": "Need the weather.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                         "arguments": {"city": "Oslo"}}}]}
RESULT = {"role": "tool", "content": '{"temp": 3}'}
ANSWER = {"role": "assistant", "content": "3 degrees."}

#: (messages, add_generation_prompt, template variables)
CASES = [
    ([USER_1], True, {}),
    ([SYSTEM, USER_1, REPLY_2], False, {}),
    ([DEVELOPER, USER_1, REPLY_1], False, {"reasoning_effort": "high"}),
    ([SYSTEM, USER_1, REPLY_1, USER_2, REPLY_2], False, {}),
    ([SYSTEM, USER_1, REPLY_1, USER_2], True, {"model_identity": "You are a test."}),
    ([USER_1, CALL, RESULT, ANSWER], False, {"tools": TOOLS}),
    ([USER_1, CALL, RESULT], True, {"tools": TOOLS, "builtin_tools": ["browser", "python"]}),
]


def test_the_template_fixture_is_the_file_it_names():
    assert hashlib.sha256(TEMPLATE_FILE.read_bytes()).hexdigest() == \
        "a4c9919cbbd4acdd51ccffe22da049264b1b73e59055fa58811a99efbd7c8146"


@pytest.fixture(scope="module")
def harmony_file(tmp_path_factory):
    """The gpt-oss fixture's tokenizer, harmony specials in its padding slots, the template
    in tokenizer.chat_template (a tokenizer-only GGUF)."""
    import gguf
    reader = gguf.GGUFReader(gguf_path("gpt-oss"))
    fields = {f.name: f.contents() for f in reader.fields.values()}
    tokens, types = list(fields["tokenizer.ggml.tokens"]), list(fields["tokenizer.ggml.token_type"])
    first = tokens.index("[PAD265]")
    for i, t in enumerate(HARMONY):
        tokens[first + i], types[first + i] = t, 3   # control tokens
    path = tmp_path_factory.mktemp("harmony") / "harmony.gguf"
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(fields["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(fields["tokenizer.ggml.merges"]))
    w.add_eos_token_id(tokens.index("<|return|>"))
    w.add_chat_template(TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def harmony(harmony_file):
    return Tokenizer.from_gguf(harmony_file)


@pytest.fixture(scope="module")
def reference():
    """transformers' tokenizer of the fixture with the harmony specials added (the same ids)."""
    transformers = pytest.importorskip("transformers")
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(gguf_path("gpt-oss").parent))
    tok.add_special_tokens({"additional_special_tokens": HARMONY})
    return tok


def _undated(text: str) -> str:
    """The rendering with its "Current date:" (strftime_now at render time) taken out."""
    dated = re.subn(r"Current date: \d{4}-\d{2}-\d{2}\n", "Current date: DATE\n", text)
    assert dated[1] == 1
    return dated[0]


@pytest.mark.reference
@pytest.mark.parametrize("case", range(len(CASES)))
def test_rendering_matches_transformers(harmony, reference, case):
    messages, gen, variables = CASES[case]
    assert harmony.template_name == "gguf"
    mine = harmony.apply_chat_template(messages, add_generation_prompt=gen, **variables)
    ref = reference.apply_chat_template(messages, chat_template=TEMPLATE, tokenize=False,
                                        add_generation_prompt=gen, **variables)
    assert _undated(mine) == _undated(ref)
    assert mine.startswith("<|start|>system<|message|>")


@pytest.mark.reference
def test_reasoning_under_any_name_reaches_the_templates_thinking(harmony, reference):
    """Data rows spell reasoning "reasoning_content" (or "reasoning"): it renders as
    transformers renders the same reasoning given as "thinking", the field harmony reads."""
    given = [USER_1, {"role": "assistant", "content": "Blue.", "reasoning_content": "Sky: blue."}]
    mine = harmony.apply_chat_template(given)
    ref = reference.apply_chat_template(
        [USER_1, {"role": "assistant", "content": "Blue.", "thinking": "Sky: blue."}],
        chat_template=TEMPLATE, tokenize=False)
    assert _undated(mine) == _undated(ref) and "<|channel|>analysis<|message|>Sky: blue." in mine


def test_harmony_turns_end_on_return_and_call_not_end(harmony):
    """<|end|> closes the analysis inside a reply; generation and training end a turn on
    <|return|> and <|call|> (llama.cpp's rule for o200k_harmony vocabularies)."""
    names = {harmony.id_to_token(i) for i in harmony.end_of_turn_ids}
    assert {"<|return|>", "<|call|>"} <= names and "<|end|>" not in names


TRAINED = [CASES[3][:1] + CASES[3][2:], ([SYSTEM, USER_1, CALL], {"tools": TOOLS})]


@pytest.mark.reference
@pytest.mark.parametrize("case", range(len(TRAINED)))
def test_training_rows_target_each_assistant_reply_alone(harmony, reference, case):
    """One row per assistant turn: its ids are transformers' tokenization of the rendering
    of the conversation before it with the generation prompt, then of the reply (its
    analysis when it has one, the final answer or tool call, through <|return|> or
    <|call|>), the reply alone a target; system, developer, user and tool text and the
    earlier turns never are."""
    messages, variables = TRAINED[case]
    rows = encode_rows(Example(messages=messages, line=1, tools=variables.get("tools")),
                       harmony, 1024)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    assert [r.turn for r in rows] == (turns if len(turns) > 1 else [None])  # one row: no split
    for row, i in zip(rows, turns):
        prompt = reference.apply_chat_template(messages[:i], chat_template=TEMPLATE, tokenize=False,
                                               add_generation_prompt=True, **variables)
        full = reference.apply_chat_template(messages[:i + 1], chat_template=TEMPLATE,
                                             tokenize=False, **variables)
        assert _undated(full).startswith(_undated(prompt))
        prompt_ids = reference.encode(prompt, add_special_tokens=False)
        reply_ids = reference.encode(full[len(prompt):], add_special_tokens=False)
        assert [int(t) for t in row.tokens] == prompt_ids + reply_ids
        assert [bool(m) for m in row.target_mask] == [False] * len(prompt_ids) + [True] * len(reply_ids)
        reply = harmony.decode(reply_ids)
        end = "<|call|>" if "tool_calls" in messages[i] else "<|return|>"
        assert reply.endswith(end) and reply.count(end) == 1
        assert "<|start|>user" not in reply and "<|start|>system" not in reply
        if "thinking" in messages[i]:   # this turn's analysis, then its answer or call
            assert reply.startswith("<|channel|>analysis<|message|>" + messages[i]["thinking"])
        else:
            assert reply == "<|channel|>final<|message|>" + messages[i]["content"] + "<|return|>"


def test_a_final_answer_after_a_tool_call_is_refused_in_one_line(harmony):
    """Harmony shows a tool call's analysis while the call is the last assistant message
    (what the model sees when it writes the answer) and drops it once a final answer
    follows, so the answer's turn is not where its prompt's rendering ends: the data layer
    cannot place the loss mask and says so, naming the line, rather than guess."""
    from toygraph.errors import DataError
    with pytest.raises(DataError, match=r"^rows.jsonl:7: the chat template renders the "
                                        r"conversation before messages\[3\]"):
        encode_rows(Example(messages=[USER_1, CALL, RESULT, ANSWER], line=7, path="rows.jsonl",
                            tools=TOOLS), harmony, 1024)
