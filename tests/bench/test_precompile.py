"""bench/precompile.py: the carried cubin cache round-trips, and says when it misses."""
import sys
from pathlib import Path

from support.cudaemu import needs_nvrtc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import precompile  # noqa: E402

KERNEL = 'extern "C" __global__ void k(float* x) { x[0] = %s; }'


def _modules_of(value):
    return lambda archs, precisions: [(a, "f32", KERNEL % value) for a in archs]


@needs_nvrtc
def test_archive_fills_another_cache_with_the_keys_it_looks_up(tmp_path, monkeypatch, capsys):
    from toygraph.cuda import nvrtc
    monkeypatch.setattr(precompile, "_modules", _modules_of("1.f"))
    monkeypatch.setenv("TOYGRAPH_CACHE", str(tmp_path / "here"))
    m = precompile.build(tmp_path / "k.tar.xz", ["sm_80", "sm_90"], ["f32"])
    assert [e["arch"] for e in m["entries"]] == ["sm_80", "sm_90"] and m["archive_bytes"] > 0
    assert not (tmp_path / "here").exists()      # built in a temporary cache, not this one

    monkeypatch.setenv("TOYGRAPH_CACHE", str(tmp_path / "device"))
    assert precompile.unpack(tmp_path / "k.tar.xz", ["sm_90"], ["f32"]) == 0
    assert "1 of 1 modules cached" in capsys.readouterr().out
    before = nvrtc.compile_count
    nvrtc.compile_cubin(KERNEL % "1.f", arch="sm_90")   # what a session would load: a hit
    assert nvrtc.compile_count == before

    # kernels changed since the archive was made: reported as a miss (rc 1)
    monkeypatch.setattr(precompile, "_modules", _modules_of("2.f"))
    assert precompile.unpack(tmp_path / "k.tar.xz", ["sm_90"], ["f32"]) == 1
    assert "0 of 1 modules cached" in capsys.readouterr().out
