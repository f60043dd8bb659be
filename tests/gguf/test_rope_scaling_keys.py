"""Every ``<arch>.rope.scaling.*`` key read as llama.cpp reads it (llama-model.cpp's
load_hparams and llama-context.cpp's context parameters), one test per key:

- ``type``: absent means "linear"; "none" never scales (``rope_freq_scale = 1`` whatever
  the factor); a name llama.cpp does not know is refused (its assert);
- ``factor``: ``rope_freq_scale = 1 / factor``, 0 meaning 1; the older ``rope.scale_linear``
  is read only when ``factor`` is absent;
- ``original_context_length``: YaRN's ``n_ctx_orig_yarn``, 0 or absent meaning the
  training context;
- ``yarn_beta_fast`` / ``yarn_beta_slow``: 32 and 1 when absent;
- ``attn_factor``: multiplies the cos and sin of every rotation (ggml's rope_yarn takes it
  as mscale); built for YaRN, refused where it would be ignored;
- ``yarn_ext_factor``, ``yarn_attn_factor``, ``yarn_log_multiplier``: only their defaults;
- ``finetuned``: read, changes nothing; ``alpha`` (not read for these families) refused.
"""
import pytest

from toygraph.errors import GGUFError
from toygraph.fixtures.tiny_models import write_tiny_llama
from toygraph.models import readers
from toygraph.models.families import FAMILIES
from toygraph.models.model import GGUFModel

LLAMA, YARN = FAMILIES["llama"], FAMILIES["gpt-oss"]


def meta(arch="llama", **keys):
    """A file's metadata holding ``<arch>.rope.scaling.<key>`` for each keyword (``__`` for
    a dot: ``scale_linear`` is ``rope.scale_linear``)."""
    table = {f"{arch}.rope.scaling.{k}": v for k, v in keys.items() if k != "scale_linear"}
    if "scale_linear" in keys:
        table[f"{arch}.rope.scale_linear"] = keys["scale_linear"]
    return readers.Metadata(table.get, arch, "m.gguf")


def freq_scale(**keys) -> float:
    return readers.rope_scale(meta(**keys), LLAMA)[1]


def test_type_none_never_scales():
    assert freq_scale(type="none", factor=4.0) == 1.0


def test_an_absent_type_is_linear():
    assert freq_scale(factor=4.0) == 0.25 == freq_scale(type="linear", factor=4.0)


def test_an_unknown_type_is_refused():
    with pytest.raises(GGUFError, match=r"llama\.rope\.scaling\.type = 'longrope' is not supported"):
        freq_scale(type="longrope", factor=4.0)


def test_a_zero_factor_is_no_scaling_and_hides_the_older_key():
    assert freq_scale(factor=0.0) == 1.0
    assert freq_scale(factor=0.0, scale_linear=2.0) == 1.0


def test_the_older_scale_linear_is_read_only_without_a_factor():
    assert freq_scale(scale_linear=2.0) == 0.5
    assert freq_scale(factor=4.0, scale_linear=2.0) == 0.25


def yarn(n_ctx=4096, **keys):
    return readers.yarn(meta("gpt-oss", type="yarn", factor=8.0, **keys), 1 / 8.0, 150000.0,
                        64, 64, n_ctx)


def test_original_context_length_zero_or_absent_is_the_training_context():
    assert yarn(original_context_length=0) == yarn() == yarn(original_context_length=4096)
    assert yarn(original_context_length=1024) != yarn()


def test_the_yarn_betas_default_to_32_and_1():
    assert yarn() == yarn(yarn_beta_fast=32.0, yarn_beta_slow=1.0)
    assert yarn(yarn_beta_fast=16.0) != yarn()


def test_attn_factor_scales_yarn_and_is_refused_where_it_would_be_ignored(tmp_path):
    (_, one), (_, half) = yarn(), yarn(attn_factor=0.5)
    assert half == pytest.approx(one * 0.5)
    path = write_tiny_llama(tmp_path / "m.gguf", rope_scale=4.0,
                            extra_kv={"llama.rope.scaling.attn_factor": 0.5})
    with pytest.raises(GGUFError, match=r"llama\.rope\.scaling\.attn_factor = 0\.5 is not "
                                         r"supported without YaRN"):
        GGUFModel(path).config
    plain = write_tiny_llama(tmp_path / "one.gguf", extra_kv={"llama.rope.scaling.attn_factor": 1.0})
    assert GGUFModel(plain).config.attention[0].rope.scale == 1.0


@pytest.mark.parametrize("key", ["yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier"])
def test_the_other_yarn_keys_take_only_their_defaults(key):
    with pytest.raises(GGUFError, match=rf"gpt-oss\.rope\.scaling\.{key} = 2\.0 is not supported"):
        yarn(**{key: 2.0})


def test_finetuned_changes_nothing_and_alpha_is_refused(tmp_path):
    base = GGUFModel(write_tiny_llama(tmp_path / "a.gguf", rope_scale=4.0)).config
    tuned = GGUFModel(write_tiny_llama(tmp_path / "b.gguf", rope_scale=4.0, extra_kv={
        "llama.rope.scaling.finetuned": True})).config
    assert tuned.attention == base.attention
    with pytest.raises(GGUFError, match=r"'llama\.rope\.scaling\.alpha' is not understood"):
        GGUFModel(write_tiny_llama(tmp_path / "c.gguf", extra_kv={
            "llama.rope.scaling.alpha": 1000.0})).config


def test_type_none_in_a_file_leaves_the_rope_unscaled(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", extra_kv={
        "llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0})
    assert GGUFModel(path).config.attention[0].rope.scale == 1.0
