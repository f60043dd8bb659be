"""A roofline cost model of one LoRA training step on an H100 SXM / H200: toygraph's CUDA
plan launch by launch, against the same model applied to what PyTorch eager + PEFT
launches. Every figure it prints is MODELLED, not measured. A finished study: an H200 has
since measured the plan (bench/results/gpu-session-h200-2026-11-28.md), and its kernels ran
slower than the efficiencies assumed here, so the model is kept for its method, not its figures.

    python bench/studies/roofline.py --config smollm2-8x512
    python bench/studies/roofline.py --config llama1b-4x2048 --device h200 --json out.json
    python bench/studies/roofline.py --config smollm2-8x512 --before old.json --md after.md

``--before`` takes a ``--json`` this script wrote for the same config on an earlier commit
and adds a before/after table (launches and modelled ms per kernel class).

toygraph: bench/studies/roofline_plan.py builds the step (recipes.LoRA, AdamW, clip 1.0) and lowers
it to its kernel launches as the CUDA backend would, without a GPU; each launch's FLOPs by
unit and bytes come from its own shapes. PyTorch: bench/studies/roofline_torch.py records the aten
ops of the transformers + PEFT step on the meta device (what bench_lora.py runs as "torch").

Time of a launch = max(tensor-core FLOPs / (peak x eff), f32 FLOPs / (peak x eff),
SFU ops / (peak x eff), bytes / (bandwidth x memory eff)) + launch cost, with toygraph's
tensor-core GEMM tiles (128 x 128) charged whole waves: ceil(blocks / SMs) tile times, a
tile running at its SM's share of the peak (a lone block per SM is assumed to reach it:
occupancy -- two resident blocks hiding each other's latency -- is in the efficiency;
ptxas on sm_90, NVRTC 13.5: tg_tc_matmul_bf16 222 registers x 256 threads, one block per
SM; tg_tc_qmm_* 123-128 registers, two; tc_gemm.cu's tg_tcg_gemm_bf16, the bf16 dense
GEMM since issue 25's GEMM work, 126, two, its blocks counting the split-K splits). The
step is the sum of its
launches; PyTorch eager's step is the larger of that and its host time (one Python +
dispatcher op at a time). Tokens/s = batch x seq / step time.

Peaks (dense, no sparsity; NVIDIA H100 and H200 datasheets, Hopper whitepaper; the SFU
rate from the CUDA C++ Programming Guide's throughput table, 16 ops/clock/SM on cc 9.0 at
the 1.98 GHz boost clock of the SXM parts):

  =====================  ==================  ==================
  peak                   H100 SXM5 (80 GB)   H200 SXM (141 GB)
  =====================  ==================  ==================
  bf16 tensor dense      989 TFLOP/s         989 TFLOP/s
  tf32 tensor dense      495 TFLOP/s         495 TFLOP/s
  f32 CUDA cores         66.9 TFLOP/s        66.9 TFLOP/s
  SFU (exp, rsqrt...)    4.18 Top/s          4.18 Top/s
  HBM                    3.35 TB/s (HBM3)    4.8 TB/s (HBM3e)
  SMs                    132                 132
  =====================  ==================  ==================

Launch cost: toygraph replays each phase as a CUDA graph (cuda/backend.py, unless
TOYGRAPH_CUDA_GRAPHS=0): 1.0 us per kernel node (assumed GPU-side gap between dependent
nodes). PyTorch eager: 2.0 us GPU-side gap per kernel, and 8 us of host time per launching
aten op plus 1.5 us per view (Python, autograd, dispatcher; assumed), which bounds the step
from below when kernels are short.

Efficiencies (fractions of the peak a kernel class reaches; ASSUMED, to be replaced by
measurement when a GPU is lent) are in EFFICIENCY below, each with its reason. Bytes are
the compulsory global traffic (each tensor read or written once; tile re-reads assumed to
hit L2), for toygraph and PyTorch alike.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from math import ceil
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from roofline_plan import SHAPES, launch_cost, plan_launches  # noqa: E402


@dataclass(frozen=True)
class Device:
    name: str
    tc: dict          # tensor-core FLOP/s by operand type
    f32: float        # CUDA-core f32 FLOP/s (FMA = 2)
    sfu: float        # special-function ops/s
    bw: float         # HBM bytes/s
    sms: int


DEVICES = {
    "h100": Device("H100 SXM5 80 GB (modelled)", {"bf16": 989e12, "tf32": 495e12}, 66.9e12,
                   132 * 16 * 1.98e9, 3.35e12, 132),
    "h200": Device("H200 SXM 141 GB (modelled)", {"bf16": 989e12, "tf32": 495e12}, 66.9e12,
                   132 * 16 * 1.98e9, 4.8e12, 132),
}

#: kernel class -> (compute efficiency, memory efficiency), ASSUMED; why, for each:
EFFICIENCY = {
    # toygraph's tc_matmul.cu: f32 operands staged through registers with cvt and 2-byte
    # shared stores, no cp.async/ldmatrix/wgmma (issue 25's reading of the kernel); since
    # tc_gemm.cu, tf32 and the head's logits only
    "gemm tensor-core": (0.45, 0.70),
    # tc_gemm.cu (issue 25, bf16 dense): bf16 operand copies staged by cp.async, two stages,
    # ldmatrix fragments, mma.sync m16n8k16, two blocks per SM (126 registers). mma.sync
    # cannot reach Hopper's wgmma peak (published microbenchmarks put sm_90 mma.sync at about
    # two thirds of it), so 0.55 of the dense peak; 16-byte copies: 0.75 of the bandwidth
    "gemm tensor-core (cp.async + ldmatrix)": (0.55, 0.75),
    # the same with B decoded per element inside the tile with one-byte loads
    "gemm tensor-core (block-format B)": (0.30, 0.70),
    # matmul.cu's 64 x 64 register-tiled f32 SIMT tiles (--precision f32)
    "gemm f32 CUDA cores": (0.50, 0.70),
    # flash_attention.cu: f32 on CUDA cores, one shared-memory load per FMA: 32 of 128
    # FMA lanes per clock can be fed (issue 25)
    "attention": (0.25, 0.70),
    # tc_attention.cu (issue 25, bf16): FlashAttention-2's design (mma.sync, ldmatrix,
    # cp.async double buffering): FA2's efficiency, as for PyTorch below
    "attention tensor-core": (0.28, 0.60),
    # scalar loads, per-element div/mod of strided indexing (tg_binary with broadcasting,
    # tg_gather) or scalar loads of contiguous operands (tg_glu, tg_rope...)
    "elementwise": (0.50, 0.60),
    # elementwise.cu's tg_binary_vec / tg_scale_vec: float4 loads and stores of contiguous
    # operands, no index arithmetic: the kind of kernel PyTorch's vectorised elementwise
    # kernels are, so their efficiency below
    "elementwise vectorised": (0.60, 0.80),
    "norm (row reductions)": (0.50, 0.60),
    "loss (softmax rows)": (0.50, 0.60),
    "adamw + clip": (0.50, 0.60),
}
TORCH_EFFICIENCY = {
    # cuBLAS(Lt) bf16 GEMMs at these sizes: ~70% of dense peak is what H100 GEMM
    # benchmarks report for K, N >= 512 (lower for skinny ones: their bytes bound them here)
    "gemm cuBLAS bf16": (0.70, 0.80),
    "gemm cuBLAS f32 (CUDA cores)": (0.70, 0.80),   # PEFT's f32 adapters, "highest" precision
    # FlashAttention-2 on H100 (FlashAttention-3 paper, Shah et al. 2024, fig. 5-6: FA2 at
    # ~300-350 TFLOP/s forward and ~200-250 backward at head dim 64-128, less at short
    # sequences); one figure for the fwd and bwd kernels
    "attention": (0.28, 0.80),
    # PyTorch's vectorised elementwise and reduction kernels
    "elementwise": (0.60, 0.80),
    "norm (row reductions)": (0.60, 0.75),
    "loss (softmax rows)": (0.60, 0.75),
    "adamw + clip": (0.60, 0.80),    # multi-tensor apply
}
GRAPH_LAUNCH_S = 1.0e-6      # per kernel node of a replayed CUDA graph (toygraph)
EAGER_LAUNCH_S = 2.0e-6      # GPU-side gap per eagerly launched kernel (PyTorch)
EAGER_HOST_OP_S = 8.0e-6     # host time per launching aten op (PyTorch eager)
EAGER_HOST_VIEW_S = 1.5e-6   # host time per view op
TOYGRAPH_HOST_S = 100e-6     # graph launch, uploads, one loss read per step

CONFIGS = {
    # SmolLM2-135M-Instruct as toygraph ships it (Q4_1 GGUF), bench_lora.py's LoRA shape
    "smollm2-8x512": dict(model="smollm2", batch=8, seq=512, wtype="q4_1"),
    # Llama-3.2-1B-shaped, 32k vocabulary, f16 matrices (bench/random_model.py's LLAMA1B)
    "llama1b-4x2048": dict(model="llama1b", batch=4, seq=2048, wtype="f16"),
    # a small config for the tests (2 SmolLM2-wide layers)
    "tiny-2x64": dict(model="tiny", batch=2, seq=64, wtype="q8_0"),
}
SHAPES = dict(SHAPES, tiny=dict(SHAPES["smollm2"], n_layer=2, n_vocab=512))


def predict(cost, dev: Device, eff: dict, launch_s: float) -> float:
    """Seconds of one launch (see the module docstring)."""
    ce, me = eff[cost.kind]
    tc_peak = dev.tc[cost.tc_type] * ce
    if cost.blocks:   # whole waves of tiles: an SM's share of the peak per tile
        t_tc = ceil(cost.blocks / dev.sms) * cost.tile_flops / (tc_peak / dev.sms)
    else:
        t_tc = cost.tc / tc_peak
    return max(t_tc, cost.fma / (dev.f32 * ce), cost.sfu / (dev.sfu * ce),
               cost.bytes / (dev.bw * me)) + launch_s


def summarize(costs, dev: Device, eff: dict, launch_s: float) -> dict:
    """Per class and per kernel: launches, FLOPs, bytes, predicted seconds."""
    classes, kernels = defaultdict(lambda: defaultdict(float)), defaultdict(lambda: defaultdict(float))
    for c in costs:
        s = predict(c, dev, eff, launch_s)
        for row in (classes[c.kind], kernels[(c.kind, c.kernel)]):
            row["launches"] += 1
            row["tc_flops"] += c.tc
            row["f32_flops"] += c.fma
            row["sfu_ops"] += c.sfu
            row["useful_flops"] += c.useful
            row["bytes"] += c.bytes
            row["seconds"] += s
    return {"classes": {k: dict(v) for k, v in classes.items()},
            "kernels": {f"{k[1]} [{k[0]}]": dict(v) for k, v in kernels.items()}}


def model(config: str, device: str = "h100", precision: str = "bf16", wtype: str | None = None,
          targets=("q", "k", "v", "o", "gate", "up", "down"), rank: int = 16, alpha: float = 32,
          torch_side: bool = True) -> dict:
    """The modelled step of ``config`` on ``device``: toygraph's and PyTorch eager's."""
    c = CONFIGS[config]
    dims, dev, tokens = SHAPES[c["model"]], DEVICES[device], c["batch"] * c["seq"]
    launches, cfg, raw = plan_launches(dims, batch=c["batch"], seq=c["seq"],
                                       wtype=wtype or c["wtype"], precision=precision,
                                       targets=targets, rank=rank, alpha=alpha)
    costs = [launch_cost(node, launch, raw) for node, launch in launches]
    tg = summarize(costs, dev, EFFICIENCY, GRAPH_LAUNCH_S)
    tg_s = sum(r["seconds"] for r in tg["classes"].values()) + TOYGRAPH_HOST_S
    attn = [v for k, v in tg["classes"].items() if k.startswith("attention")]
    attn_tc = sum(v["tc_flops"] for v in attn)
    attn_flops = attn_tc + sum(v["f32_flops"] for v in attn)
    out = {"config": config, "device": dev.name, "precision": precision,
           "weights": wtype or c["wtype"], "tokens_per_step": tokens,
           "lora": {"targets": list(targets), "rank": rank, "alpha": alpha},
           "label": "modelled (bench/studies/roofline.py), not measured",
           "predicted_step_s": tg_s, "predicted_tokens_per_s": tokens / tg_s,
           "attention_tensor_core_fraction": attn_tc / attn_flops if attn_flops else 0.0,
           "launches": len(costs), "toygraph": tg,
           "total_useful_flops": sum(x.useful for x in costs if x.kind.startswith(("gemm", "attention"))),
           "six_n_t_flops": six_nt(cfg, tokens, c["seq"], targets, rank)}
    if torch_side:
        import roofline_torch as rt
        ops, sizes, _ = rt.trace(dims, batch=c["batch"], seq=c["seq"], targets=targets,
                                 rank=rank, alpha=alpha)
        tcosts, n_ops, n_views = rt.op_costs(ops)
        opt = rt.optimizer_launches(sizes)
        tcosts += opt
        th = summarize(tcosts, dev, TORCH_EFFICIENCY, EAGER_LAUNCH_S)
        gpu_s = sum(r["seconds"] for r in th["classes"].values())
        host_s = (n_ops + len(opt)) * EAGER_HOST_OP_S + n_views * EAGER_HOST_VIEW_S
        torch_s = max(gpu_s, host_s)
        out.update(torch_eager=dict(th, gpu_s=gpu_s, host_s=host_s, launches=len(tcosts)),
                   torch_eager_step_s=torch_s, torch_eager_estimate_tokens_per_s=tokens / torch_s,
                   speedup_vs_torch_eager=torch_s / tg_s)
    return out


def six_nt(cfg, tokens: int, seq: int, targets, rank: int) -> float:
    """The textbook count for a frozen-base LoRA step: 4 N_base T (forward + input
    gradients of every base matmul, head included) + 6 N_lora T + attention's
    12 L T^2 d_attn (causal: half of 4 fwd + 8 bwd T^2 d products per layer, FA2-style)."""
    from toygraph.models.decoder import TARGETS, weight_shape
    L, d = cfg.n_layer, cfg.n_embd
    n_base = L * sum(int(weight_shape(cfg, f"blk.0.{p}.weight")[0] * weight_shape(cfg, f"blk.0.{p}.weight")[1])
                     for p in TARGETS.values()) + cfg.n_vocab * d
    n_lora = 0
    for t in targets:
        out_, in_ = weight_shape(cfg, f"blk.0.{TARGETS[t]}.weight")
        n_lora += L * rank * (out_ + in_)
    attn = 12 * L * (tokens // seq) * seq * seq * cfg.n_head * cfg.head_dim / 2
    return 4.0 * n_base * tokens + 6.0 * n_lora * tokens + attn


# --- output ---------------------------------------------------------------------------------------
def _class_rows(summary: dict, step_s: float) -> list[str]:
    rows = []
    for kind, r in sorted(summary["classes"].items(), key=lambda kv: -kv[1]["seconds"]):
        rows.append(f"| {kind} | {int(r['launches'])} | {r['tc_flops'] / 1e9:.1f} | "
                    f"{r['f32_flops'] / 1e9:.1f} | {r['sfu_ops'] / 1e9:.2f} | {r['bytes'] / 2**20:.0f} | "
                    f"{1e3 * r['seconds']:.2f} | {100 * r['seconds'] / step_s:.0f}% |")
    return rows


def render(r: dict, top: int = 12) -> str:
    head = ("| class | launches | tensor-core GFLOP | f32 GFLOP | SFU Gop | MiB moved | "
            "modelled ms | share |", "|---|---:|---:|---:|---:|---:|---:|---:|")
    lines = [f"### Roofline (MODELLED): `{r['config']}` on {r['device']}", "",
             f"- toygraph: LoRA {','.join(r['lora']['targets'])} r={r['lora']['rank']} "
             f"alpha={r['lora']['alpha']:g}, precision {r['precision']}, base weights "
             f"{r['weights']}; {r['tokens_per_step']} tokens per step; {r['launches']} launches",
             f"- modelled step {1e3 * r['predicted_step_s']:.1f} ms = "
             f"**{r['predicted_tokens_per_s']:,.0f} tokens/s (modelled)**; attention FLOPs on "
             f"tensor cores: {100 * r['attention_tensor_core_fraction']:.0f}%",
             f"- FLOPs of the plan's GEMM + attention launches (useful, unpadded): "
             f"{r['total_useful_flops'] / 1e12:.3f} TFLOP; textbook 4·N_base·T + 6·N_lora·T + "
             f"attention: {r['six_n_t_flops'] / 1e12:.3f} TFLOP"]
    if "torch_eager" in r:
        t = r["torch_eager"]
        lines += [f"- PyTorch eager + PEFT (bf16 model, f32 adapters, SDPA FA2, fused AdamW): "
                  f"{t['launches']} launches, GPU {1e3 * t['gpu_s']:.1f} ms, host "
                  f"{1e3 * t['host_s']:.1f} ms -> **{r['torch_eager_estimate_tokens_per_s']:,.0f} "
                  f"tokens/s (modelled)**; toygraph / torch eager = "
                  f"**{r['speedup_vs_torch_eager']:.2f}x (modelled)**"]
    for x in r.get("also", []):
        lines.append(f"- on {x['device']}, precision {x['precision']}: toygraph "
                     f"{x['predicted_tokens_per_s']:,.0f} tokens/s (modelled)" +
                     (f", torch eager {x['torch_eager_estimate_tokens_per_s']:,.0f} tokens/s "
                      f"(modelled), ratio {x['speedup_vs_torch_eager']:.2f}x"
                      if "speedup_vs_torch_eager" in x else ""))
    lines += ["", "toygraph, per kernel class:", "", *head,
              *_class_rows(r["toygraph"], r["predicted_step_s"]), "",
              f"toygraph, top {top} kernels:", "",
              "| kernel [class] | launches | GFLOP issued | MiB moved | modelled ms |",
              "|---|---:|---:|---:|---:|"]
    ks = sorted(r["toygraph"]["kernels"].items(), key=lambda kv: -kv[1]["seconds"])[:top]
    lines += [f"| {k} | {int(v['launches'])} | {(v['tc_flops'] + v['f32_flops']) / 1e9:.1f} | "
              f"{v['bytes'] / 2**20:.0f} | {1e3 * v['seconds']:.2f} |" for k, v in ks]
    if "torch_eager" in r:
        lines += ["", "PyTorch eager + PEFT, per kernel class:", "", *head,
                  *_class_rows(r["torch_eager"], r["torch_eager"]["gpu_s"])]
    return "\n".join(lines) + "\n"


def compare(r: dict, before: dict, source: str) -> dict:
    """The before/after summary of ``r`` against an earlier run's JSON of the same config."""
    if before.get("config") != r["config"] or before.get("precision") != r["precision"]:
        raise SystemExit(f"--before {source}: config {before.get('config')}/"
                         f"{before.get('precision')} is not this run's "
                         f"{r['config']}/{r['precision']}")
    keys = ("launches", "predicted_step_s", "predicted_tokens_per_s", "speedup_vs_torch_eager")
    classes = {k: {"launches": v["launches"], "seconds": v["seconds"], "bytes": v["bytes"]}
               for k, v in before["toygraph"]["classes"].items()}
    return {"source": source, "command": before.get("command", ""), "date": before.get("date", ""),
            **{k: before[k] for k in keys if k in before}, "classes": classes}


def render_comparison(r: dict) -> str:
    b = r["before"]
    now = r["toygraph"]["classes"]
    lines = ["", f"Before -> after (MODELLED, the same model; before: `{b['command']}`, {b['date']}):",
             "", f"- launches per step {b['launches']} -> {r['launches']}; modelled step "
             f"{1e3 * b['predicted_step_s']:.1f} -> {1e3 * r['predicted_step_s']:.1f} ms; "
             f"{b['predicted_tokens_per_s']:,.0f} -> {r['predicted_tokens_per_s']:,.0f} tokens/s "
             f"(modelled)" + (f"; vs torch eager {b['speedup_vs_torch_eager']:.2f}x -> "
                               f"{r['speedup_vs_torch_eager']:.2f}x" if "speedup_vs_torch_eager"
                               in b and "speedup_vs_torch_eager" in r else ""),
             "", "| class | launches before | after | MiB moved before | after | "
             "modelled ms before | after |", "|---|---:|---:|---:|---:|---:|---:|"]
    zero = {"launches": 0, "seconds": 0.0, "bytes": 0.0}
    for kind in sorted(set(b["classes"]) | set(now), key=lambda k: -b["classes"].get(k, zero)["seconds"]):
        x, y = b["classes"].get(kind, zero), now.get(kind, zero)
        lines.append(f"| {kind} | {int(x['launches'])} | {int(y['launches'])} | "
                     f"{x['bytes'] / 2**20:.0f} | {y['bytes'] / 2**20:.0f} | "
                     f"{1e3 * x['seconds']:.2f} | {1e3 * y['seconds']:.2f} |")
    return "\n".join(lines) + "\n"


HEADLINE = ("device", "precision", "predicted_step_s", "predicted_tokens_per_s",
            "attention_tensor_core_fraction", "torch_eager_estimate_tokens_per_s",
            "speedup_vs_torch_eager")


def headline(r: dict) -> dict:
    return {k: r[k] for k in HEADLINE if k in r}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="smollm2-8x512", choices=sorted(CONFIGS))
    ap.add_argument("--device", default="h100",
                    help=f"comma list of {', '.join(DEVICES)}; the first gets the tables")
    ap.add_argument("--also-precision", default="", help="comma list of toygraph "
                    "precisions to model as well (one line each)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "tf32", "f32"],
                    help="toygraph's matmul precision (the torch side is always bf16)")
    ap.add_argument("--wtype", help="base weight storage (default: the config's)")
    ap.add_argument("--targets", default="q,k,v,o,gate,up,down")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=32)
    ap.add_argument("--no-torch", action="store_true", help="toygraph's side only")
    ap.add_argument("--json", help="write the model's numbers here")
    ap.add_argument("--md", help="write the table here")
    ap.add_argument("--before", help="a --json of this config from an earlier commit: add a "
                    "before/after table")
    a = ap.parse_args(argv)
    a.also_precision = [x for x in a.also_precision.split(",") if x]
    devices = a.device.split(",")
    r = model(a.config, devices[0], a.precision, a.wtype, tuple(a.targets.split(",")), a.rank,
              a.alpha, torch_side=not a.no_torch)
    r["command"] = "python bench/studies/roofline.py " + " ".join(sys.argv[1:] if argv is None else argv)
    r["date"] = f"{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d %H:%M} UTC"
    # the same step on the other devices, and toygraph at its other matmul precisions
    r["also"] = [headline(model(a.config, dev, prec, a.wtype, tuple(a.targets.split(",")),
                                a.rank, a.alpha, torch_side=not a.no_torch and prec == a.precision))
                 for dev in devices for prec in [a.precision] + a.also_precision
                 if (dev, prec) != (devices[0], a.precision)]
    text = render(r)
    if a.before:
        r["before"] = compare(r, json.loads(Path(a.before).read_text()), a.before)
        text += render_comparison(r)
    print(text)
    if a.md:
        Path(a.md).write_text(text)
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
