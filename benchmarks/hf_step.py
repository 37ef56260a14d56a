"""Benchmark a whole distillation training step on Hugging Face models: step time and peak GPU memory
against sequence length -> CSV (+ PNG plot).

    python benchmarks/hf_step.py --model qwen                 # CUDA: T = 4096 ... 131072: nitrobrew, logits, liger
    python benchmarks/hf_step.py --model llama --llama-layers 2 --tokens 4096 8192 16384
    python benchmarks/hf_step.py --check                      # only compare the losses at the smallest T
    python benchmarks/hf_step.py --device cpu --tiny --methods nitrobrew logits --out /tmp/hf_step.csv

A step, batch 1, bf16, models built from configs with random init (no downloads): teacher forward (eval,
no grad), student forward with gradient checkpointing, forward KL(teacher || student) per token (mean over
the T-1 shifted positions), backward, torch.optim.SGD (lr 1e-4, no momentum: no optimizer state),
zero_grad(set_to_none=True). Methods:
  nitrobrew  nitrobrew.hf.distillation_loss(student, teacher, ids, loss="forward_kl") (decoders without lm_head;
             the automatic path: the training path, gradients in the forward)
  nitrobrew_recompute  the same with grad_in_forward=False (not run by default)
  logits     the models' own .logits, the causal shift, float32 F.kl_div(log_softmax(s), log_softmax(t),
             log_target=True, reduction="batchmean"): what users write today
  liger      decoders without lm_head, then liger-kernel's LigerFusedLinearJSD(jsd_beta=0) on the lm_heads
Pairs: qwen (Qwen2.5-0.5B <- 1.5B shapes, vocabulary 151936, tied) and llama (Llama-3 vocabulary 128256,
hidden 4096 <- 8192, --llama-layers layers each, untied); each pair runs in its own process, its models
built once. Before timing, the losses are compared on one batch at the smallest T (check_rel_diff, relative
to `logits`). At each T every method makes one warm-up step, then --rounds timed ones, the methods
alternating. step_ms: synchronize + perf_counter, median and min over rounds. peak_gib: the process's
torch.cuda.max_memory_allocated() over the timed steps (reset before each), the models' weights included
(the same for every method). A method out of memory is "oom" at that T and "skipped" above it, as is one
whose median step took longer than --max-step-seconds.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import OOM_ERROR, device_name, free_device_memory, pyplot, save_figure, short_error, write_csv

import nitrobrew
import nitrobrew.hf

# (hidden, layers, attention heads, key-value heads, intermediate) of the student and the teacher.
PAIRS = {
    "qwen": {"config": "Qwen2Config", "vocab": 151936, "tied": True, "rope_theta": 1e6,
             "student": (896, 24, 14, 2, 4864), "teacher": (1536, 28, 12, 2, 8960)},
    "llama": {"config": "LlamaConfig", "vocab": 128256, "tied": False, "rope_theta": 5e5,  # layers: --llama-layers
              "student": (4096, None, 32, 8, 14336), "teacher": (8192, None, 64, 8, 28672)},
    # Qwen2.5-0.5B <- 7B shapes (fsdp2_step.py). One vocabulary of the 0.5B's 151936 rows for both: the real
    # 7B's lm_head has 152064, padding rows past the tokenizer's 151665 tokens that no loss reads.
    "qwen7b": {"config": "Qwen2Config", "vocab": 151936, "tied": True, "rope_theta": 1e6,
               "student": (896, 24, 14, 2, 4864), "teacher": (3584, 28, 28, 4, 18944)},
}
# Init std 0.1 gives hidden 64 logits of std ~1, as 0.02 does the real sizes: a KL far from 0 to check.
TINY = {"vocab": 1000, "std": 0.1, "student": (64, 2, 4, 2, 128), "teacher": (96, 2, 6, 2, 192)}
COLUMNS = ["model", "method", "tokens", "status", "step_ms_median", "step_ms_min", "rounds", "peak_gib", "loss",
           "check_rel_diff", "round_ms", "device", "torch", "transformers", "liger_kernel", "nitrobrew", "date"]
CHECK_RTOL = 2e-2  # bf16 weights and hidden states; the logits method also rounds its logits to bf16


def loss_nitrobrew(student, teacher, ids):
    return nitrobrew.hf.distillation_loss(student, teacher, ids, loss="forward_kl")


def loss_nitrobrew_recompute(student, teacher, ids):
    return nitrobrew.hf.distillation_loss(student, teacher, ids, loss="forward_kl", grad_in_forward=False)


def loss_logits(student, teacher, ids):
    s = student(input_ids=ids, use_cache=False).logits[:, :-1]  # the causal shift: positions 0 .. T-2
    with torch.no_grad():
        t = teacher(input_ids=ids, use_cache=False).logits[:, :-1]
    v = s.shape[-1]  # batchmean over the flattened [T-1, V] rows: the mean per token
    return F.kl_div(F.log_softmax(s.reshape(-1, v).float(), -1), F.log_softmax(t.reshape(-1, v).float(), -1),
                    log_target=True, reduction="batchmean")


def loss_liger(student, teacher, ids):
    from liger_kernel.transformers import LigerFusedLinearJSD

    h_s = student.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    with torch.no_grad():
        h_t = teacher.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    # jsd_beta=0 is KL(teacher || student): liger's kernel (ops/jsd.py, 0.8.5) gets the student's log-probs
    # as X, the teacher's as Y, and at beta 0 sums exp(Y) * (Y - X); without labels it divides by the rows.
    return LigerFusedLinearJSD(jsd_beta=0.0)(
        h_s.reshape(-1, h_s.shape[-1]), student.get_output_embeddings().weight,
        h_t.reshape(-1, h_t.shape[-1]), teacher.get_output_embeddings().weight, None)


METHODS = {"nitrobrew": loss_nitrobrew, "nitrobrew_recompute": loss_nitrobrew_recompute, "logits": loss_logits,
           "liger": loss_liger}
DEFAULT_METHODS = ["nitrobrew", "logits", "liger"]


def build(name, role, args, device, tied=None, layers=None):
    """A randomly initialized model of the pair (tied: override the pair's tied embeddings; layers: its decoder
    layers)."""
    import transformers

    pair = PAIRS[name]
    hidden, pair_layers, heads, kv_heads, intermediate = (TINY if args.tiny else pair)[role]
    layers = layers or pair_layers
    config = getattr(transformers, pair["config"])(
        vocab_size=TINY["vocab"] if args.tiny else pair["vocab"], hidden_size=hidden,
        num_hidden_layers=layers or args.llama_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        intermediate_size=intermediate, tie_word_embeddings=pair["tied"] if tied is None else tied, rope_theta=pair["rope_theta"],
        max_position_embeddings=max(args.tokens), **({"initializer_range": TINY["std"]} if args.tiny else {}))
    # Made on the device in bf16 and initialized there with the config's std (0.02): after the final RMSNorm
    # the logits have std ~0.02 * sqrt(hidden), 0.6 to 1.8 here, so the KL is far from 0.
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if role == "teacher":
        return model.eval().requires_grad_(False)
    # transformers 5 renamed gradient_checkpointing_enable (now a deprecated alias) activation_checkpointing_enable.
    getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    return model.train()


def input_ids(vocab, tokens, device):
    return torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(tokens)).to(device)


def liger_available(device):
    if device.type != "cuda":  # Triton kernels
        return False
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as e:  # noqa: BLE001 -- a missing package, Triton or CUDA build fail in different ways
        print(f"liger-kernel unavailable: {short_error(e)}")
        return False
    return True


def try_step(loss_fn, student, teacher, ids, opt, device):
    """("ok", ms, loss) of one training step, or (status, None, None); a failed step leaves nothing behind."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    try:
        sync()
        t0 = time.perf_counter()
        loss = loss_fn(student, teacher, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return "ok", (time.perf_counter() - t0) * 1e3, loss.item()
    except Exception as e:  # noqa: BLE001 -- one failed (method, T) must not end the sweep
        status = "oom" if isinstance(e, OOM_ERROR) or "out of memory" in str(e) else "error"
        if status == "error":
            traceback.print_exc()
    # Out of the except clause the traceback, and with it the step's frames and tensors, are gone.
    opt.zero_grad(set_to_none=True)
    free_device_memory(device)
    return status, None, None


def check_losses(methods, student, teacher, ids, device):
    """The methods' losses on one batch before any step: {method: difference relative to `logits`'s}."""
    values = {}
    for m in methods:
        try:
            with torch.no_grad():
                values[m] = METHODS[m](student, teacher, ids).item()
        except Exception as e:  # noqa: BLE001 -- reported here; the sweep records the failure as its status
            values[m] = short_error(e)
        free_device_memory(device)
    ran = [m for m in methods if isinstance(values[m], float)]
    ref = "logits" if "logits" in ran else (ran or [None])[0]
    diffs = {m: abs(values[m] - values[ref]) / abs(values[ref]) for m in ran}
    for m in methods:
        print(f"  check T={ids.shape[1]} {m:<10} " + (
            f"loss {values[m]:.6f}, relative difference to {ref} {diffs[m]:.2e}" if m in diffs else values[m]))
    return diffs


def measure_at(label, t, methods, student, teacher, opt, args, device):
    """A warm-up step per method (it absorbs nitrobrew's once-per-model check and Triton's compiles), then
    --rounds timed ones, the methods alternating in a rotating order: {method: status, times, peak, loss}."""
    ids = input_ids(student.config.vocab_size, t, device)
    res = {m: {"status": try_step(METHODS[m], student, teacher, ids, opt, device)[0], "times": [], "peak": None}
           for m in methods}
    for r in range(args.rounds):
        for m in methods[r % len(methods):] + methods[:r % len(methods)]:
            if res[m]["status"] != "ok":
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            res[m]["status"], ms, res[m]["loss"] = try_step(METHODS[m], student, teacher, ids, opt, device)
            if ms is not None:
                res[m]["times"].append(ms)
                if device.type == "cuda":
                    res[m]["peak"] = max(res[m]["peak"] or 0.0, torch.cuda.max_memory_allocated() / 2**30)
            print(f"{label} T={t} round {r + 1}/{args.rounds} {m}: {res[m]['status']}"
                  + (f", {ms:.0f} ms" if ms is not None else "")
                  + (f", peak {res[m]['peak']:.2f} GiB" if ms is not None and res[m]["peak"] else ""), flush=True)
    return res


def run_pair(name, args, device):
    """Builds one model pair, compares the losses, sweeps T: the rows (with --check: the failed methods)."""
    torch.manual_seed(0)
    student, teacher = build(name, "student", args, device), build(name, "teacher", args, device)
    opt = torch.optim.SGD(student.parameters(), lr=1e-4, momentum=0.0)
    alive = [m for m in args.methods if m != "liger" or liger_available(device)]
    stopped = {m: "unavailable" for m in args.methods if m not in alive}  # the status of every larger T
    sizes = " <- ".join(f"{sum(p.numel() for p in x.parameters()) / 1e6:.4g}M" for x in (student, teacher))
    print(f"{name}: parameters {sizes}; methods {alive}", flush=True)
    diffs = check_losses(alive, student, teacher, input_ids(student.config.vocab_size, args.tokens[0], device), device)
    failed = [m for m in diffs if not diffs[m] < CHECK_RTOL]
    if failed:
        print(f"  CHECK FAILED: {failed} differ from {CHECK_RTOL:g} or more", flush=True)
    if args.check:
        return {"failed": failed}
    meta = environment(device)
    rows = []
    for t in args.tokens:
        res = measure_at(name, t, alive, student, teacher, opt, args, device) if alive else {}
        for m in args.methods:
            row = {**meta, "model": name, "method": m, "tokens": t, "check_rel_diff": diffs.get(m),
                   "status": stopped.get(m) or res[m]["status"]}
            if row["status"] == "ok":
                times = res[m]["times"]
                row.update(step_ms_median=statistics.median(times), step_ms_min=min(times), rounds=len(times),
                           peak_gib=res[m]["peak"], loss=res[m]["loss"], round_ms=" ".join(f"{x:.1f}" for x in times))
            if m not in stopped and (row["status"] != "ok" or row["step_ms_median"] > 1e3 * args.max_step_seconds):
                stopped[m] = "skipped"
            rows.append(row)
        alive = [m for m in alive if m not in stopped]
        free_device_memory(device)
    return rows


def environment(device):
    import transformers

    try:
        liger = importlib.metadata.version("liger-kernel")
    except importlib.metadata.PackageNotFoundError:
        liger = "none"
    return {"device": device_name(device), "torch": torch.__version__, "transformers": transformers.__version__,
            "liger_kernel": liger, "nitrobrew": nitrobrew_version(), "date": datetime.date.today().isoformat()}


def nitrobrew_version():
    # With its checkout's short commit ("-dirty": uncommitted changes), from read-only git commands: no index
    # refresh to race someone else's git in the same checkout.
    git = ["git", "--no-optional-locks", "-C", str(Path(nitrobrew.__file__).resolve().parent)]
    try:
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
        dirty = subprocess.run([*git, "diff", "--quiet", "HEAD"], capture_output=True, check=False).returncode == 1
    except OSError:
        return nitrobrew.__version__
    return nitrobrew.__version__ + (f"+{head.stdout.strip()}{'-dirty' * dirty}" if head.returncode == 0 else "")


def gpu_slug(name):
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", name)  # "NVIDIA H100 80GB HBM3" -> h100
    return found.group(1).lower() if found else re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:24]


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    from matplotlib.ticker import FuncFormatter

    models, methods = list(dict.fromkeys(r["model"] for r in rows)), list(dict.fromkeys(r["method"] for r in rows))
    tokens = sorted({r["tokens"] for r in rows})
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 4 * len(models)), squeeze=False)
    for row_axes, model in zip(axes, models):
        for ax, (key, label) in zip(row_axes, [("peak_gib", "peak GPU memory (GiB)"), ("step_ms_median", "step (ms)")]):
            for j, method in enumerate(methods):
                mine = [r for r in rows if r["model"] == model and r["method"] == method]
                ok = [r for r in mine if r["status"] == "ok" and r.get(key) is not None]
                ax.plot([r["tokens"] for r in ok], [r[key] for r in ok], "o-", color=f"C{j}",
                        label=method if ok else "_")
                oom = [r["tokens"] for r in mine if r["status"] == "oom"]  # an x at the top of the panel
                if oom:  # (an empty unclipped line would upset tight_layout)
                    ax.plot(oom, [0.96] * len(oom), "x", color=f"C{j}", ms=10, mew=2.5, clip_on=False,
                            transform=ax.get_xaxis_transform(), label=f"{method}: oom")
            if not any(len(line.get_xdata()) for line in ax.lines):
                ax.text(0.5, 0.5, "not measured (no GPU)", transform=ax.transAxes, ha="center", color="gray")
            ax.set_xscale("log", base=2)
            ax.set_xlim(tokens[0] / 1.4, tokens[-1] * 1.4)
            ax.set_xticks(tokens, [f"{t // 1024}k" if t >= 1024 else str(t) for t in tokens])
            if key == "step_ms_median" and ax.lines:  # log2 on both axes: a cost quadratic in T has slope 2
                ax.set_yscale("log", base=2)
                ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
            ax.set(xlabel="tokens T (batch 1)", ylabel=label, title=f"{model}: {label}")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
    r0 = rows[0]
    fig.suptitle(f"distillation training step, bf16: {r0['device']}, torch {r0['torch']}, transformers "
                 f"{r0['transformers']}, nitrobrew {r0['nitrobrew']}, liger-kernel {r0['liger_kernel']}", fontsize=9)
    save_figure(fig, path)


def summarize(rows):
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        for method in dict.fromkeys(r["method"] for r in mine):
            ran = [r["tokens"] for r in mine if r["method"] == method and r["status"] == "ok"]
            end = next((r for r in mine if r["method"] == method and r["status"] != "ok"), None)
            print(f"{model:<6} {method:<10} longest T {max(ran) if ran else 'none':>7}"
                  + (f"; {end['status']} at T={end['tokens']}" if end else ""))
        base = {r["tokens"]: r for r in mine if r["method"] == "logits" and r["status"] == "ok"}
        for r in mine:
            b = base.get(r["tokens"])
            if r["method"] == "nitrobrew" and r["status"] == "ok" and b:
                has_memory = r["peak_gib"] and b["peak_gib"]
                memory = f", peak memory {r['peak_gib'] / b['peak_gib']:.2f}x" if has_memory else ""
                print(f"{model:<6} T={r['tokens']:<7} nitrobrew / logits: step "
                      f"{r['step_ms_median'] / b['step_ms_median']:.2f}x{memory}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", nargs="+", choices=list(PAIRS), default=["qwen", "llama"])
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=DEFAULT_METHODS)
    p.add_argument("--tokens", type=int, nargs="+", help="default 4096 ... 131072 (--tiny: 64 128)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-step-seconds", type=float, default=20.0, help="no larger T after a slower median step")
    p.add_argument("--llama-layers", type=int, default=2, help="decoder layers of each llama model")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="tiny configs (hidden 64 <- 96, 2 layers, vocabulary 1000)")
    p.add_argument("--check", action="store_true", help="only compare the methods' losses at the smallest T")
    p.add_argument("--out", type=Path, help="CSV (default benchmarks/results/hf_step_<gpu>_<date>.csv)")
    p.add_argument("--plot", type=Path, help="PNG (default: beside the CSV, same stem)")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # one pair, its result written to this JSON file
    args = p.parse_args()
    args.tokens = sorted(args.tokens or ([64, 128] if args.tiny else [4096 * 2**i for i in range(6)]))
    if args.rounds < 1 or args.tokens[0] < 2 or args.llama_layers < 1:
        p.error("--rounds and --llama-layers must be at least 1, every T at least 2")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but torch.cuda.is_available() is False")
    device = torch.device(args.device)

    if args.worker or len(args.model) == 1:
        results = {args.model[0]: run_pair(args.model[0], args, device)}
        if args.worker:
            args.worker.write_text(json.dumps(results[args.model[0]]))
            return
    else:  # a process per pair: nothing of the first pair (allocator cache, kernels, CUDA context) is in the second's
        results = {}
        with tempfile.TemporaryDirectory() as tmp:
            for name in args.model:
                path = Path(tmp) / f"{name}.json"
                cmd = [sys.executable, __file__, *sys.argv[1:], "--model", name, "--worker", str(path)]
                code = subprocess.run(cmd, check=False)
                if code.returncode == 0 and path.exists():
                    results[name] = json.loads(path.read_text())
                else:
                    print(f"{name}: worker failed (exit status {code.returncode})")
    if args.check:
        failed = {name: r["failed"] for name, r in results.items() if r["failed"]}
        print("check: " + (f"FAILED {failed}" if failed else f"the losses agree within {CHECK_RTOL:g}"))
        sys.exit(1 if failed or len(results) < len(args.model) else 0)
    rows = [row for name in args.model for row in results.get(name, [])]
    if not rows:
        sys.exit("no results")
    slug = "cpu" if device.type == "cpu" else gpu_slug(rows[0]["device"])
    out = args.out or Path(__file__).resolve().parent / "results" / f"hf_step_{slug}_{rows[0]['date']}.csv"
    write_csv(out, COLUMNS, rows)
    plot(rows, args.plot or out.with_suffix(".png"))
    summarize(rows)


if __name__ == "__main__":
    main()
